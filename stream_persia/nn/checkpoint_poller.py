"""NN side of the checkpoint mailbox (:mod:`stream_persia.worker.mailbox`, which documents
the RPC methods and the liveness rule): :class:`NnCheckpointPoller`, built into
``TrainCtx``, takes a checkpoint requested over HTTP at a step boundary on every rank.

Rank 0's heartbeat also relays the ``trained`` watermark (``TrainCtx.trained_through``) and
rank 0's own progressive figures (:mod:`stream_persia.worker.nn_relay` says why rank 0's
and not the merged ones) for embedding worker 0 to export. Their cost stays off the
training step: the training thread only copies rank 0's progressive state (its window
arrays and sums, well under a millisecond) at most every :data:`PROGRESSIVE_EVERY_S`; the
figures (a sort of the window) are computed on a worker thread of the RPC loop, and each
heartbeat carries the latest ones."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from typing import Any

from stream_persia.errors import BadInput, Misuse, PersiaError
from stream_persia.nn import checkpointing, periodic
from stream_persia.nn.progressive import summarize
from stream_persia.nn.seams import TrainerSeam
from stream_persia.worker.mailbox import KEEPALIVES_PER_TIMEOUT, REPORT_TIMEOUT_S
from stream_persia.worker.nn_relay import FIGURES

__all__ = ["NnCheckpointPoller"]

log = logging.getLogger(__name__)

#: Seconds between two liveness heartbeats of rank 0 while no step sends one (a paused
#: stream, evaluation, a slow step): well inside the mailbox's attached window (10 s).
LIVENESS_EVERY_S = 2.0

#: Least seconds between two reads of rank 0's progressive figures for the heartbeat.
PROGRESSIVE_EVERY_S = 2.0


#: The per-task counts a worker 0 of an older release refuses (it knows window, samples).
NEWER_COUNTS = ("skipped", "not_probabilities")


def progressive_figures(state: list[dict[str, Any]], window: int,
                        counts: bool = True) -> dict[str, Any]:
    """Rank 0's progressive figures per task (the heartbeat's ``progressive``) from its
    ``ProgressiveValidation.state()``; without :data:`NEWER_COUNTS` unless ``counts``."""
    out: dict[str, Any] = {}
    for task in state:
        merged = summarize([task])
        fig = {k: (float(merged[k]) if merged.get(k) is not None
                   and math.isfinite(merged[k]) else None) for k in FIGURES}
        out[task["name"]] = {"window": int(window), "samples": int(merged["samples"]),
                             **({key: int(merged[key]) for key in NEWER_COUNTS}
                                if counts else {}), **fig}
    return out


class NnCheckpointPoller:
    """NN side: take checkpoints requested over HTTP at a step boundary (built into
    ``TrainCtx``).

    :meth:`step_boundary` runs after every ``backward`` on every rank. Rank 0 sends
    ``nn_heartbeat`` in the background (at most every ``min_interval_s``; the training
    thread never waits for it) and remembers the request its reply offers. With one rank
    the offer is looked at after every step; with several, every ``every_steps`` steps
    rank 0 broadcasts it so that all ranks agree. Then every rank runs the checkpoint at
    that same step (``dump_checkpoint``: the consistent cut) and rank 0 reports progress
    and the outcome. :meth:`detach` (context exit) serves a request still pending when
    the exit is clean and tells the mailbox the ranks are gone, so the API never waits
    for a rank that stopped training. From the claim until the outcome, rank 0's loop
    thread sends a keepalive report every ``report_every_s`` of the offer, so the mailbox
    tells a slow dump from a dead rank 0 (module docstring, liveness).

    Args:
        ctx: an entered ``TrainCtx``.
        every_steps: with several ranks, how often (in steps) they agree on a request.
        min_interval_s: the least time between two heartbeats of rank 0.
        dump_kwargs: for :func:`stream_persia.nn.checkpointing.dump_checkpoint` (default:
            the TorchScript model too when the model can be scripted, so the API can serve
            the checkpoint without the model class).
        periodic: rank 0's periodic checkpoint figures (:mod:`stream_persia.nn.periodic`),
            relayed in each heartbeat; None: periodic checkpoints are off.
    """

    def __init__(self, ctx: TrainerSeam, *, every_steps: int = 10, min_interval_s: float = 0.5,
                 dump_kwargs: dict[str, Any] | None = None,
                 periodic: Callable[[], dict[str, Any]] | None = None):
        self.ctx = ctx
        self.periodic = periodic
        self.every_steps = max(1, int(every_steps))
        self.min_interval_s = float(min_interval_s)
        self.dump_kwargs = dict(dump_kwargs) if dump_kwargs is not None else {
            "with_jit_model": "if_possible"}
        self.enabled = True            # rank 0: False once worker 0 turned out mailbox-less
        self.taken: list[str] = []     # ids of the checkpoints taken here, in order
        self._seen: set[str] = set()   # ids claimed or refused: a late offer is ignored
        self._offer: dict[str, Any] | None = None    # written by the loop thread
        self._sent = -math.inf
        self._inflight: Any = None     # the heartbeat future in flight, if any
        self._keepalive: Any = None    # rank 0: the keepalive future while a checkpoint runs
        self._liveness: Any = None     # rank 0: the liveness heartbeats' future while attached
        self._attached = False         # rank 0: between attach() and detach()
        self._figures: dict[str, Any] | None = None   # rank 0's last progressive figures
        self._figures_at = -math.inf
        self._relay_figures = True     # rank 0: False once worker 0 refused the figures
        self._relay_counts = True      # False once an older worker 0 refused NEWER_COUNTS

    @property
    def _rank0(self) -> bool:
        return self.ctx.rank == 0

    # ------------------------------------------------------------------ heartbeats
    def attach(self) -> None:
        """Tell the mailbox (rank 0, in the background) that the ranks are training, and
        keep telling it while no step does (:meth:`_keep_attached`)."""
        if self._rank0:
            self._attached = True
            self._send_heartbeat()
            cluster = self.ctx.require_cluster()
            self._liveness = cluster.loop.submit(self._keep_attached(cluster))

    async def _keep_attached(self, cluster: Any) -> None:
        """Rank 0's liveness, from its RPC loop thread: a ``waiting`` heartbeat every
        :data:`LIVENESS_EVERY_S` that the training thread sent none (evaluation, user code
        between loops, a slow step). Heartbeats came only from steps, so a rank doing
        anything else for longer than the mailbox's attached window looked gone, and the
        API restored a checkpoint under it: it trained on with its own dense model over
        the restored rows. A ``waiting`` heartbeat says the process is alive but not at a
        step boundary: restores stay refused, while checkpoints are cut by the API at
        once (nothing trains) instead of waiting for a step. It relays nothing (the
        freshness figures and ``persia_nn_heartbeat_age_seconds`` stay those of the
        training thread: a stuck step still ages them) and never attaches a rank the
        mailbox marked detached."""
        known = False   # whether worker 0's mailbox tells waiting heartbeats apart
        while self._attached and self.enabled:
            await asyncio.sleep(LIVENESS_EVERY_S)
            if not self._attached or not self.enabled \
                    or time.monotonic() - self._sent < LIVENESS_EVERY_S \
                    or (self._inflight is not None and not self._inflight.done()):
                continue
            try:
                if not known:
                    # A mailbox from before them (a rolling upgrade) would take one as a
                    # step's heartbeat that relays nothing: the trained watermark and the
                    # figures blanked, a stuck step's heartbeat age kept fresh. Its
                    # nn_status has no alive_s: then none is sent (as before them).
                    status = await cluster.workers[0].call("nn_status", None)
                    if not isinstance(status, dict):
                        continue
                    if "alive_s" not in status:
                        log.info("embedding worker 0's checkpoint mailbox is older than "
                                 "liveness heartbeats: a rank busy between steps for over "
                                 "10 s looks detached to it")
                        return
                    known = True
                await cluster.workers[0].call("nn_heartbeat", {
                    "rank": 0, "world_size": int(self.ctx.world_size),
                    "step": int(self.ctx.steps), "waiting": True})
            except PersiaError as e:   # the next one may get through; training decides
                log.debug("checkpoint mailbox liveness heartbeat failed: %r", e)

    def _stop_liveness(self) -> None:
        self._attached = False
        if self._liveness is not None:
            self._liveness.cancel()
            self._liveness = None

    def _heartbeat_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {"rank": 0, "world_size": int(self.ctx.world_size),
                                  "step": int(self.ctx.steps),
                                  "trained": self.ctx.trained_through}
        if self._figures is not None:
            params["progressive"] = self._figures
        if self.periodic is not None:
            params["periodic"] = self.periodic()
        return params

    def _progressive_state(self) -> tuple[list[dict[str, Any]], int] | None:
        """A copy of rank 0's progressive state, at most every PROGRESSIVE_EVERY_S."""
        pv = self.ctx.progressive_validation
        now = time.monotonic()
        if pv is None or not self._relay_figures \
                or now - self._figures_at < PROGRESSIVE_EVERY_S:
            return None
        self._figures_at = now
        return pv.state(), pv.window_samples

    def _send_heartbeat(self, *, at_step: bool = True) -> None:
        self._sent = time.monotonic()
        cluster = self.ctx.require_cluster()
        params = self._heartbeat_params()
        if not at_step:
            params["at_step"] = False
        self._inflight = cluster.loop.submit(self._heartbeat(
            cluster, params, self._progressive_state()))

    async def _heartbeat(self, cluster: Any, params: dict[str, Any],
                         state: tuple[list[dict[str, Any]], int] | None = None) -> None:
        if state is not None:   # off the training thread (and off the loop: a sort)
            try:
                self._figures = await asyncio.get_running_loop().run_in_executor(
                    None, progressive_figures, *state, self._relay_counts)
                params["progressive"] = self._figures
            except Exception as e:   # never stops training nor the heartbeat
                log.debug("progressive figures for the heartbeat: %r", e)
        try:
            try:
                reply = await cluster.workers[0].call("nn_heartbeat", params)
            except BadInput as e:
                if not self._refused_figures(e, params):
                    raise
                reply = await cluster.workers[0].call("nn_heartbeat", params)
        except Misuse as e:
            if "no RPC method" in e.message:
                self.enabled = False
                log.warning("embedding worker 0 has no checkpoint mailbox (%s): checkpoints "
                            "started over HTTP cannot reach this job's NN ranks", e.message)
            else:
                log.debug("checkpoint mailbox heartbeat failed: %r", e)
            return
        except PersiaError as e:   # training reports a worker that is really gone
            log.debug("checkpoint mailbox heartbeat failed: %r", e)
            return
        offer = reply.get("checkpoint") if isinstance(reply, dict) else None
        # A reply sent before our "running" report may offer a request taken already.
        if isinstance(offer, dict) and offer.get("id") not in self._seen:
            self._offer = offer
        else:
            self._offer = None

    def _refused_figures(self, err: BadInput, params: dict[str, Any]) -> bool:
        """Worker 0 refused the heartbeat for its progressive figures (more tasks, or a
        longer task name, than :mod:`stream_persia.worker.nn_relay` takes): relay them no
        more and drop them from ``params``, so the heartbeat, sent again, keeps the
        mailbox (checkpoints over HTTP) and the ``trained`` watermark working. False for
        any other refusal."""
        if "progressive" not in params or not (err.field or "").startswith("progressive"):
            return False
        if self._relay_counts and (err.field or "").endswith(
                tuple(f".{key}" for key in NEWER_COUNTS)):
            # A worker 0 of an older release: the figures go on without the new counts.
            self._relay_counts = False
            self._figures = {task: {k: v for k, v in fig.items() if k not in NEWER_COUNTS}
                             for task, fig in params["progressive"].items()}
            params["progressive"] = self._figures
            log.info("embedding worker 0 does not take the skipped-sample counts of the "
                     "progressive figures (an older release): the figures go without them")
            return True
        if self._relay_figures:
            log.warning("embedding worker 0 refuses rank 0's progressive figures (%s): "
                        "they are not relayed to /metrics for the rest of the run; "
                        "TrainCtx.progressive() and report.json still have them", err.message)
        self._relay_figures = False
        self._figures = None
        del params["progressive"]
        return True

    def _wait_heartbeat(self, timeout_s: float = 5.0) -> None:
        fut = self._inflight
        if fut is not None:
            try:
                fut.result(timeout_s)
            except Exception as e:
                log.debug("checkpoint mailbox heartbeat: %r", e)

    def _call(self, method: str, params: Any, timeout_s: float = 10.0) -> Any:
        cluster = self.ctx.require_cluster()
        return cluster.run(cluster.workers[0].call(method, params, timeout_s * 1000))

    def _report(self, params: dict[str, Any], *, wait: bool) -> None:
        """Rank 0's report to the mailbox; never raises (the API times out instead)."""
        try:
            if wait:
                self._call("checkpoint_report", params)
            else:
                cluster = self.ctx.require_cluster()
                cluster.loop.submit(self._report_quietly(cluster, params))
        except Exception as e:
            log.warning("could not report checkpoint %s to the mailbox: %r", params["id"], e)

    @staticmethod
    async def _report_quietly(cluster: Any, params: dict[str, Any]) -> None:
        try:
            await cluster.workers[0].call("checkpoint_report", params)
        except PersiaError as e:
            log.debug("checkpoint progress report failed: %r", e)

    def _start_keepalive(self, ident: str, every_s: float) -> None:
        cluster = self.ctx.require_cluster()
        self._keepalive = cluster.loop.submit(self._keep_alive(cluster, ident, every_s))

    def _stop_keepalive(self) -> None:
        if self._keepalive is not None:
            self._keepalive.cancel()
            self._keepalive = None

    @staticmethod
    async def _keep_alive(cluster: Any, ident: str, every_s: float) -> None:
        """Report ``running`` (nothing else) every ``every_s`` until cancelled."""
        while True:
            await asyncio.sleep(every_s)
            try:
                await cluster.workers[0].call("checkpoint_report",
                                              {"id": ident, "state": "running"})
            except Misuse as e:    # the record ended (the mailbox gave up on us): stop
                log.warning("checkpoint %s: keepalive refused: %s", ident, e.message)
                return
            except PersiaError as e:   # the next one may get through; the limit decides
                log.debug("checkpoint %s keepalive failed: %r", ident, e)

    # ------------------------------------------------------------------ polling
    def _agree(self, request: dict[str, Any] | None) -> dict[str, Any] | None:
        if self.ctx.world_size <= 1:
            return request
        import torch.distributed as dist

        box = [request]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def _parent(self, dst: str, rank0: bool) -> str | None:
        """With ``enable_incremental_update``, the checkpoint a requested one patches
        (rank 0 writes; :func:`stream_persia.nn.periodic.latest_parent`)."""
        if not rank0 or not periodic.incremental_enabled():
            return None
        try:
            return periodic.latest_parent(dst, periodic.checkpointing_config().full_every,
                                          checkpointing.job_name())
        except (BadInput, OSError) as e:   # a full base then
            log.warning("checkpoint %s: no parent to patch (%s): a full base", dst, e)
            return None

    def step_boundary(self) -> str | None:
        """Poll; returns the id of a checkpoint taken now (every rank calls this)."""
        multi = self.ctx.world_size > 1
        if multi and self.ctx.steps % self.every_steps:
            return None
        request = None
        if self._rank0:
            if self.enabled and time.monotonic() - self._sent >= self.min_interval_s and (
                    self._inflight is None or self._inflight.done()):
                self._send_heartbeat()
            if self._offer is not None:
                request = self._claim(self._offer)
        try:
            if multi:
                request = self._agree(request)
            return self._take(request) if request is not None else None
        finally:
            self._stop_keepalive()

    def idle(self) -> None:
        """The DataLoader waits for a batch (``TrainCtx.stream_idle``, every ``POLL_S``
        without one). With one rank this is a step boundary too (the last batch's
        ``backward`` is done and untrained ones were given back): rank 0 heartbeats as at
        a step and a request is taken now, dense model included, not when the stream
        resumes. With several, the ranks are not at a point where they agree: rank 0's
        heartbeat says so (``at_step: false``), and the API cuts a checkpoint asked for
        meanwhile itself."""
        if self.ctx.world_size <= 1:
            self.step_boundary()
        elif self._rank0 and self.enabled and time.monotonic() - self._sent >= \
                self.min_interval_s and (self._inflight is None or self._inflight.done()):
            self._send_heartbeat(at_step=False)

    def _claim(self, request: dict[str, Any]) -> dict[str, Any] | None:
        """Rank 0: report the request running, which makes it ours; None when the mailbox
        refuses (it expired meanwhile, and the API may be taking it itself)."""
        ident = request["id"]
        self._seen.add(ident)
        self._offer = None
        try:
            self._call("checkpoint_report", {"id": ident, "state": "running",
                                             "step": int(self.ctx.steps),
                                             "progress": {"phase": "quiescing"}})
        except PersiaError as e:
            log.warning("checkpoint %s requested over HTTP is not taken: %s", ident, e)
            return None
        every_s = request.get("report_every_s")
        if isinstance(every_s, bool) or not isinstance(every_s, (int, float)) or every_s <= 0:
            every_s = REPORT_TIMEOUT_S / KEEPALIVES_PER_TIMEOUT   # an older mailbox
        self._start_keepalive(ident, float(every_s))
        return request

    def _take(self, request: dict[str, Any]) -> str:
        ident, dst = request["id"], request["dst"]
        self.taken.append(ident)
        self._seen.add(ident)
        step = int(self.ctx.steps)
        rank0 = self._rank0
        if rank0:
            log.info("taking checkpoint %s requested over HTTP at step %d into %s",
                     ident, step, dst)

        def progress(phase: str, **extra: Any) -> None:
            self._report({"id": ident, "state": "running",
                          "progress": {"phase": phase, **extra}}, wait=False)

        try:
            try:
                manifest = checkpointing.dump_checkpoint(
                    self.ctx, dst, opt_filename="opt.pt", progress=progress if rank0 else None,
                    extra={"id": ident, "by": "nn"}, parent=self._parent(dst, rank0),
                    **self.dump_kwargs)
            finally:   # before the outcome, which a late keepalive would only contradict
                self._stop_keepalive()
        except (PersiaError, OSError) as e:
            # The cut's collectives completed (checkpointing reaches its last barrier on
            # every rank), so training goes on; the API reports the failure.
            log.error("checkpoint %s requested over HTTP failed: %s", ident, e)
            if rank0:
                self._report({"id": ident, "state": "failed",
                              "error": f"{type(e).__name__}: {e}"}, wait=True)
            return ident
        except BaseException as e:
            if rank0:
                self._report({"id": ident, "state": "failed",
                              "error": f"{type(e).__name__}: {e}"}, wait=True)
            raise
        if rank0:
            self._report({"id": ident, "state": "done", "step": step,
                          "progress": {"phase": "committed"},
                          "manifest": manifest.to_dict() if manifest is not None else None},
                         wait=True)
        return ident

    def serve_pending(self) -> str | None:
        """Ask the mailbox now (waiting for the reply) and take a pending request; every
        rank calls this at the same point (the stream ended, the context exits)."""
        request = None
        if self._rank0 and self.enabled:
            self._wait_heartbeat()
            self._sent = time.monotonic()
            pv = self.ctx.progressive_validation
            if pv is not None and self._relay_figures:   # the final figures
                try:
                    self._figures = progressive_figures(pv.state(), pv.window_samples,
                                                        self._relay_counts)
                except Exception as e:
                    log.debug("progressive figures for the heartbeat: %r", e)
            try:
                params = self._heartbeat_params()
                try:
                    reply = self._call("nn_heartbeat", params, timeout_s=5)
                except BadInput as e:
                    if not self._refused_figures(e, params):
                        raise
                    reply = self._call("nn_heartbeat", params, timeout_s=5)
                offer = reply.get("checkpoint") if isinstance(reply, dict) else None
                if isinstance(offer, dict) and offer.get("id") not in self._seen:
                    request = self._claim(offer)
            except PersiaError as e:
                log.debug("checkpoint mailbox heartbeat: %r", e)
        try:
            request = self._agree(request)
            return self._take(request) if request is not None else None
        finally:
            self._stop_keepalive()

    def detach(self, clean: bool) -> None:
        """The context exits: serve a pending request (clean exit), then say goodbye."""
        if clean:
            self.serve_pending()
        self._stop_liveness()
        if self._rank0 and self.enabled:
            self._wait_heartbeat()
            reason = ("the NN ranks finished training" if clean
                      else "the NN ranks stopped on an error")
            try:
                self._call("nn_detach", {"rank": 0, "step": int(self.ctx.steps),
                                         "reason": reason}, timeout_s=5)
            except PersiaError as e:
                log.debug("checkpoint mailbox detach: %r", e)
