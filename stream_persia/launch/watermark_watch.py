"""The job's stage watermarks over a ``stream-persia run``, watched from the launcher.

While the job trains, :class:`WatermarkWatch` asks the job API's ``GET /v1/status`` every
``every_s`` (2 s) for its ``watermarks`` (and the serving replica's, for the ``served`` stage
only the replica knows) (:mod:`stream_persia.core.stages`: per stage the
slowest role's event time and lag; the Kafka lag per partition) and keeps a bounded
series: past :data:`MAX_SAMPLES` samples it drops every other one and polls half as often,
so a run of any length keeps its whole span in bounded memory. :meth:`summary` is
report.json's ``watermarks``; :meth:`curve` the per-stage lag the run's PNG plots.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

__all__ = ["WatermarkWatch", "MAX_SAMPLES", "summarize_watermarks"]

#: Samples kept at most (then every other one is dropped and the interval doubles).
MAX_SAMPLES = 1024
_STAGES = ("produced", "ingested", "trained", "applied", "served")


def summarize_watermarks(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """report.json's ``watermarks`` from the samples (:meth:`WatermarkWatch.poll`'s):
    per stage ``{"event_time": last, "lag_s": {"p50", "max"}}`` over the run, and
    ``kafka_lag``: ``{"messages_max", "seconds_max"}``, the largest partition lag seen
    (None where never known)."""
    out: dict[str, Any] = {}
    for stage in _STAGES:
        lags = [s["lags"][stage] for s in samples if s["lags"].get(stage) is not None]
        last = next((s["marks"][stage] for s in reversed(samples)
                     if s["marks"].get(stage) is not None), None)
        if lags or last is not None:
            out[stage] = {"event_time": last, "lag_s": {
                "p50": round(float(np.median(lags)), 3) if lags else None,
                "max": round(float(max(lags)), 3) if lags else None}}
    msgs = [s["kafka_messages"] for s in samples if s["kafka_messages"] is not None]
    secs = [s["kafka_seconds"] for s in samples if s["kafka_seconds"] is not None]
    if msgs or secs:
        out["kafka_lag"] = {"messages_max": max(msgs) if msgs else None,
                            "seconds_max": round(max(secs), 3) if secs else None}
    return out


class WatermarkWatch:
    """Polls ``GET /v1/status`` of the job API at ``address``.

    Args:
        address: the API's host:port.
        token: its bearer token.
        replica: the serving replica's host:port (same token), whose ``served`` stage joins
            each sample; None: no replica.
        every_s: seconds between two polls (doubles each time the series is thinned).
        max_samples: samples kept at most.
    """

    def __init__(self, address: str, token: str, *, replica: str | None = None,
                 every_s: float = 2.0, max_samples: int = MAX_SAMPLES):
        self.address, self.token, self.replica = address, token, replica
        self.every_s = every_s
        self.max_samples = max(2, max_samples)
        self.samples: list[dict[str, Any]] = []
        self.errors = 0
        self._t0 = time.monotonic()
        self._last = -float("inf")

    def poll(self) -> None:
        """Take a sample if ``every_s`` passed since the last one (never raises)."""
        now = time.monotonic()
        if now - self._last < self.every_s:
            return
        self._last = now
        marks = self._get(self.address)
        if marks is None:
            self.errors += 1
            return
        if self.replica is not None:
            served = (self._get(self.replica) or {}).get("served")
            if isinstance(served, dict):
                marks = {**marks, "served": served}
        self.add(now - self._t0, marks)

    def _get(self, address: str) -> dict[str, Any] | None:
        """``watermarks`` of ``GET /v1/status`` at ``address``; None if it does not answer."""
        import httpx

        try:
            r = httpx.get(f"http://{address}/v1/status",
                          headers={"Authorization": f"Bearer {self.token}"}, timeout=2)
            marks = r.json().get("watermarks") if r.status_code == 200 else None
        except Exception:   # the API not up yet, or busy: the next poll may do
            marks = None
        return marks if isinstance(marks, dict) else None

    def add(self, t: float, marks: dict[str, Any]) -> None:
        """Record one ``watermarks`` object of ``/v1/status`` taken ``t`` s into the run."""
        sample: dict[str, Any] = {"t": round(t, 3), "marks": {}, "lags": {}}
        for stage in _STAGES:
            mark = marks.get(stage)
            if isinstance(mark, dict):
                sample["marks"][stage] = mark.get("event_time")
                sample["lags"][stage] = mark.get("lag_s")
        rows = [r for r in marks.get("kafka_lag") or () if isinstance(r, dict)]
        msgs = [r["messages"] for r in rows if isinstance(r.get("messages"), int)]
        secs = [r["seconds"] for r in rows if isinstance(r.get("seconds"), (int, float))]
        sample["kafka_messages"] = max(msgs) if msgs else None
        sample["kafka_seconds"] = max(secs) if secs else None
        self.samples.append(sample)
        if len(self.samples) > self.max_samples:
            self.samples = self.samples[::2]
            self.every_s *= 2

    def summary(self) -> dict[str, Any]:
        """report.json's ``watermarks`` (:func:`summarize_watermarks`)."""
        return summarize_watermarks(self.samples)

    def curve(self) -> dict[str, list[list[float]]]:
        """Per stage, ``[[seconds into the run, lag_s], ...]`` (for the PNG)."""
        out: dict[str, list[list[float]]] = {}
        for s in self.samples:
            for stage, lag in s["lags"].items():
                if lag is not None:
                    out.setdefault(stage, []).append([s["t"], lag])
        return out
