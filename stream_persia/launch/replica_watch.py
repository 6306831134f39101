"""The serving replica of ``stream-persia run``, watched from the launcher.

The run starts one API process in replica mode (``PERSIA_API_EMBEDDINGS=replica``,
:mod:`stream_persia.api.replica`): it restores the first checkpoint (which the launcher
asks the job for as soon as training runs), then follows the servers' updates and the
dense model NN rank 0 publishes. While the job trains, :class:`ReplicaWatch` collects the
replica's advances of ``trained_through`` (``GET /v1/model``) and scores held-out rows on
it every few seconds (the served AUC during the run); after training it waits for the
replica to apply the last updates and compares its predictions with the training job's
own (``served_max_abs_diff``).

Freshness of a sample = when the replica applied the updates that include it (the sparse
rows of every server and a dense model trained after it) minus its event time.
:func:`freshness_of` computes it from the advances ``(applied_at, trained_through)``: a
sample of event time ``e`` is served from the first advance with ``trained_through >= e``.
Samples are taken as spread evenly over event time (the stream's rate is steady), on a
10 ms grid between the first and the last advance.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from stream_persia.launch.report import auc_of, predict_over_http

__all__ = ["ReplicaWatch", "freshness_of", "training_started",
           "log_ends", "STEADY_AFTER_S"]

#: Held-out rows the replica scores every ``auc_every_s`` while training runs (at most).
IN_RUN_ROWS = 4096

#: Seconds of event time after the replica's first advance left out of the steady figures.
STEADY_AFTER_S = 10.0


def training_started(api_address: str, token: str) -> bool:
    """Whether the job's NN ranks have trained a step (``GET /v1/status``)."""
    import httpx

    try:
        r = httpx.get(f"http://{api_address}/v1/status",
                      headers={"Authorization": f"Bearer {token}"}, timeout=5)
        return r.status_code == 200 and bool((r.json().get("training") or {}).get("step"))
    except Exception:   # not up yet: asked again on the next tick
        return False


def log_ends(servers: str, secret: str) -> list[int] | None:
    """Each embedding server's update log end (the next sequence number), in replica order;
    None when one cannot be asked."""
    from stream_persia.core import aio
    from stream_persia.rpc import RpcClient
    from stream_persia.rpc.auth import RoleSecret

    async def ask() -> list[int]:
        out = []
        for address in [a for a in servers.split(",") if a]:
            async with RpcClient(address, timeout_ms=5000, name="embedding-server",
                                 secret=RoleSecret(secret)) as c:
                out.append(int((await c.call("model_updates", {"from_seq": 1 << 62}))
                               ["next_seq"]))
        return out

    time.sleep(0.5)   # a server's last pass after training ended (every 200 ms by default)
    try:
        return aio.run(ask())
    except Exception:  # a server gone: the drain then waits for the replica to settle
        return None


def freshness_of(advances: list[tuple[float, float]], grid_s: float = 0.01,
                 skip_s: float = 0.0) -> np.ndarray:
    """Freshness (s) of samples spread evenly over the event times the advances cover
    (after the first ``skip_s`` seconds of them: the replica catching up as it starts)."""
    if len(advances) < 2:
        return np.zeros(0)
    a = np.asarray(sorted(advances, key=lambda x: x[1]), dtype=np.float64)
    applied, through = a[:, 0], a[:, 1]
    events = np.arange(through[0] + grid_s + skip_s, through[-1] + grid_s / 2, grid_s)
    events = events[events <= through[-1]]
    j = np.searchsorted(through, events, side="left")
    return applied[j] - events


class ReplicaWatch:
    """Polls the run's replica (see the module docstring).

    Args:
        address: the replica's ``host:port``.
        token: the API token.
        batches: labelled held-out batches (may be empty: no served AUC then).
        tasks: the topology's tasks (head order).
        auc_every_s: how often the held-out rows are scored during the run (the first
            ``IN_RUN_ROWS`` of them; the final score after the drain takes them all).
    """

    def __init__(self, address: str, token: str, batches: list | None, tasks: list[str],
                 *, auc_every_s: float = 10.0, probe: dict[str, Any] | None = None,
                 probe_every_s: float = 0.25):
        import httpx

        self.client = httpx.Client(base_url=f"http://{address}", timeout=30)
        self.auth = {"Authorization": f"Bearer {token}"}
        self.batches = list(batches or [])
        # during the run, the first IN_RUN_ROWS of them: scoring costs the replica's CPU,
        # which training shares on one machine; the final score takes them all
        self.run_batches, rows = [], 0
        for b in self.batches:
            if rows >= IN_RUN_ROWS:
                break
            self.run_batches.append(b)
            rows += b.batch_size
        self.tasks = tasks
        self.auc_every_s = auc_every_s
        self.advances: dict[float, float] = {}
        self.auc_curve: list[dict[str, Any]] = []
        self.t0 = time.time()
        self._last_auc = 0.0
        self.error: str | None = None
        self.update_bytes = 0
        self.first_seen: float | None = None
        self.last_seen: float | None = None
        self.probe = probe
        self.probe_every_s = probe_every_s
        self.probe_curve: list[tuple[float, float]] = []
        self._last_probe = 0.0

    def close(self) -> None:
        self.client.close()

    def _model(self) -> dict[str, Any] | None:
        try:
            r = self.client.get("/v1/model", headers=self.auth)
        except Exception as e:   # the replica restarting: the gap shows in freshness
            self.error = f"{type(e).__name__}: {e}"
            return None
        return r.json() if r.status_code == 200 else None

    def poll(self) -> None:
        """Collect advances; score the held-out rows when due."""
        info = self._model()
        if info is None:
            return
        rep = info.get("replica") or {}
        for applied, through in rep.get("advances") or []:
            self.advances[float(applied)] = float(through)
        now = time.time()
        if rep:
            self.update_bytes = int((rep.get("counts") or {}).get("bytes", 0))
            self.first_seen = self.first_seen or now
            self.last_seen = now
        if self.probe is not None and now - self._last_probe >= self.probe_every_s:
            self._last_probe = now
            result = predict_over_http(self.client, self.auth, self.probe["batches"],
                                       self.tasks[:1])
            if "error" not in result:
                self.probe_curve.append((now, float(np.mean(result["preds"][self.tasks[0]]))))
        if self.run_batches and now - self._last_auc >= self.auc_every_s:
            self._last_auc = now
            result = predict_over_http(self.client, self.auth, self.run_batches, self.tasks)
            if "error" not in result:
                self.auc_curve.append({"t": round(now - self.t0, 2),
                                       "model_version": result["model_version"],
                                       "trained_through": result["trained_through"],
                                       "auc": auc_of(result, self.tasks)})

    def drain(self, log_ends: list[int] | None, final_step: int | None,
              timeout_s: float = 60.0, settle_s: float = 1.0) -> dict[str, Any] | None:
        """Wait until the replica has applied every server's log up to ``log_ends`` (each
        log's next sequence number once training ended), a dense model of at least
        ``final_step``, and then stopped changing; then predict the held-out rows on it.
        None when it never served."""
        deadline = time.monotonic() + timeout_s
        last, since = None, time.monotonic()
        while time.monotonic() < deadline:
            info = self._model()
            if info is not None:
                self.poll()
                shards = (info.get("replica") or {}).get("shards", [])
                state = (info.get("model_version"), [s.get("next_seq") for s in shards])
                caught_up = ((final_step is None or (state[0] or -1) >= final_step)
                             and (log_ends is None or (len(shards) == len(log_ends) and all(
                                 (s.get("next_seq") or 0) >= end
                                 for s, end in zip(shards, log_ends, strict=True)))))
                if state != last:
                    last, since = state, time.monotonic()
                elif caught_up and time.monotonic() - since >= settle_s:
                    break
            time.sleep(0.2)
        else:
            self.error = "the replica did not catch up with training within " \
                         f"{timeout_s:g} s after it ended"
        if last is None or not self.batches:
            return None
        result = predict_over_http(self.client, self.auth, self.batches, self.tasks)
        return None if "error" in result else result

    def concept_shift(self, marker: Path) -> dict[str, Any] | None:
        """How long the served predictions of the probe's samples took to cross halfway
        from where they were at the shift to their new Bayes value (None: no shift)."""
        if self.probe is None or not marker.is_file():
            return None
        sent_at = float(json.loads(marker.read_text())["sent_at"])
        before = [p for t, p in self.probe_curve if t <= sent_at]
        out: dict[str, Any] = {"sample": self.probe["sample"], "sent_at": sent_at,
                               "bayes_before": self.probe["bayes_before"],
                               "bayes_after": self.probe["bayes_after"], "follow_s": None,
                               "curve": [(round(t - sent_at, 3), round(p, 5))
                                         for t, p in self.probe_curve]}
        if not before:
            return out
        baseline = before[-1]
        half = baseline + (self.probe["bayes_after"] - baseline) / 2
        up = self.probe["bayes_after"] >= baseline
        out.update(served_at_shift=baseline, halfway=half)
        for t, p in self.probe_curve:
            if t > sent_at and (p >= half if up else p <= half):
                out["follow_s"] = round(t - sent_at, 3)
                break
        return out

    def summary(self, final: dict[str, Any] | None,
                trained: dict[str, np.ndarray] | None,
                shift_marker: Path | None = None) -> dict[str, Any]:
        """What ``report.json`` gets under ``replica``."""
        adv = sorted(self.advances.items())
        fresh = freshness_of(adv)
        steady = freshness_of(adv, skip_s=STEADY_AFTER_S)

        def pct(a: np.ndarray, q: float) -> float | None:
            return round(float(np.percentile(a, q)), 3) if a.size else None

        out: dict[str, Any] = {
            "advances": len(adv),
            # the event time the advances cover; freshness is None when it is under the
            # 10 ms grid (every advance trained through the same sample: nothing to time)
            "freshness_span_s": round(max(t for _, t in adv) - min(t for _, t in adv), 3)
            if adv else None,
            "freshness_p50_s": pct(fresh, 50), "freshness_p99_s": pct(fresh, 99),
            "freshness_max_s": pct(fresh, 100),
            # without the first STEADY_AFTER_S of event time, when the replica catches up
            # from the checkpoint it started from
            "freshness_steady_p50_s": pct(steady, 50), "freshness_steady_p99_s": pct(steady, 99),
            "freshness_curve": [(round(t, 2), round(f, 3)) for t, f in self.curve()[::4]],
            "served_auc_during_run": self.auc_curve,
            "update_bytes": self.update_bytes,
            "following_s": round(self.last_seen - self.first_seen, 2)
            if self.first_seen is not None and self.last_seen is not None else None,
        }
        if final is not None:
            out["served_auc_final"] = auc_of(final, self.tasks)
            out["model_version"] = final["model_version"]
            if trained is not None:
                diffs = [float(np.nanmax(np.abs(final["preds"][t] - trained[t])))
                         for t in self.tasks if t in trained and len(trained[t])]
                out["served_max_abs_diff"] = max(diffs) if diffs else None
        if self.error and not adv:
            out["error"] = self.error
        if shift_marker is not None:
            out["concept_shift"] = self.concept_shift(shift_marker)
        return out

    def curve(self) -> list[tuple[float, float]]:
        """(seconds into the run, freshness of the newest sample) at each advance."""
        return [(a - self.t0, a - t) for a, t in sorted(self.advances.items())]
