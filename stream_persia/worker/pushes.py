"""An embedding worker's gradient pushes: idempotent per (batch, server), retried, and
failed loudly (:class:`GradientPushes`).

The first ``push_gradients`` of a batch reduces its gradients and splits them per owning
server once, under a token unique to the batch and this worker process (``<incarnation>-
<batch id>``: batch ids restart with the process, the random incarnation does not repeat).
The update runs in a task this component owns (a caller that goes away does not cut it
short): the servers that fail with a retryable error (unreachable, timed out, busy) are
asked again, and only they, with backoff for up to ``push_retry_ms`` (or the request's
``timeout_ms``, if smaller); a server that applied a request whose reply was lost
recognises the token and answers with its first reply (:mod:`stream_persia.worker.router`,
:mod:`stream_persia.server.service`). A second push of a batch whose push is under way
waits for that push's outcome; one of a batch applied recently (the last
:data:`PUSHED_MEMORY` batches) gets the first reply again, so an NN worker may retry a push
whose reply it lost.

A push that cannot complete in that time fails **loudly and never silently pinned**: the
caller gets :class:`~stream_persia.errors.PushFailed` (field ``batch_id``) naming the batch,
its Kafka partition and offset, and the servers that did and did not apply it. Its
gradients may now be on some servers and not others, so the batch is kept *failed*
(:meth:`GradientPushes.failed`): the worker keeps it in flight (its frontier offset is not
passed, so no checkpoint can claim it), lists it in ``frontier``/``status``, answers
``health`` with ``ok: false`` naming it, and refuses to serve it again; it is counted in
``persia_embedding_worker_batches_push_failed_total``. It leaves that state when a push of
its ``batch_id`` completes (the update first reduced is sent again, to the servers that
have not applied it; the new gradients are ignored), or when the worker's stream is reset
(:meth:`GradientPushes.reset`, a restore).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from stream_persia.core.metrics import RoleMetrics
from stream_persia.core.replies import FailedPush, PushReply
from stream_persia.core.watermarks import Source
from stream_persia.errors import BadInput, PersiaError, PushFailed, ServerRestarted, StreamReplay
from stream_persia.worker.batchplan import BatchPlan, reduce_gradients
from stream_persia.worker.router import PendingUpdate, ShardRouter, Table
from stream_persia.worker.shards import UpdateGroup

__all__ = ["GradientPushes", "FailedPush", "PUSHED_MEMORY"]

log = logging.getLogger(__name__)

#: Replies of recently applied batches a worker keeps, to answer a repeated push.
PUSHED_MEMORY = 1024


@dataclass(eq=False)
class _Push:
    """One pushed batch's update and where its push stands."""

    update: PendingUpdate
    source: tuple[int, int] | None      # (partition, offset) when from Kafka
    skipped: list[str] = field(default_factory=list)   # slots with non-finite gradients
    task: asyncio.Task | None = None    # the push under way
    failure: FailedPush | None = None   # why its last push could not complete


class GradientPushes:
    """The gradient pushes of one embedding worker (module docstring).

    Args:
        router: the worker's embedding servers.
        metrics: the worker's metrics (the push counters are registered on them).
        name: the worker as messages name it (``embedding worker 0``).
        on_applied: called with a batch's id once every server applied its update, so
            that the worker releases it.
    """

    def __init__(self, router: ShardRouter, metrics: RoleMetrics, *, name: str,
                 on_applied: Callable[[int], None],
                 on_replay: Callable[[StreamReplay], None] | None = None):
        self.router = router
        self._on_replay = on_replay
        self.name = name
        self._on_applied = on_applied
        # Tokens of this process's updates start with it: batch ids restart with a process.
        self.incarnation = secrets.token_hex(8)
        self._pushes: dict[int, _Push] = {}                    # pushed, not yet applied
        self._pushed: OrderedDict[int, PushReply] = OrderedDict()   # recent replies (bounded)
        self._tasks: set[asyncio.Task] = set()
        m = metrics
        self.m_applied = m.counter("batches_applied_total", "batches whose gradients applied")
        self.m_failed = m.counter("batches_push_failed_total",
                                  "gradient pushes that could not complete on every "
                                  "server within push_retry_ms (the batch stays failed)")
        self.m_repeated = m.counter("push_repeated_total",
                                    "pushes of a batch already applied or being pushed, "
                                    "answered without applying again")
        self.m_nonfinite = m.counter("nonfinite_gradient_slots_total",
                                     "slot gradients skipped for NaN/Inf", ("slot",))
        self.m_nonfinite_ids = m.counter("nonfinite_gradient_ids_total",
                                         "ids left out of an update: their finite gradients "
                                         "summed to inf or NaN in float32")
        self.m_update_s = m.histogram("update_seconds", "gradient apply latency",
                                      buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, 1))

    def recent(self, batch_id: int) -> PushReply | None:
        """The reply of ``batch_id``'s push if it was applied recently (a repeated push,
        whose first reply was lost on the way), else None."""
        first = self._pushed.get(batch_id)
        if first is None:
            return None
        self.m_repeated.inc()
        return {**first, "duplicate": True}

    def started(self, batch_id: int) -> bool:
        """Whether ``batch_id`` has been pushed and not applied yet (pushing or failed):
        some servers may hold its gradients."""
        return batch_id in self._pushes

    async def push(self, batch_id: int, plan: BatchPlan, source: tuple[int, int] | None,
                   grads: Any, retry_s: float,
                   stream: tuple[str, str] | None = None,
                   event_time: float | None = None,
                   tables: dict[int, Table] | None = None) -> PushReply:
        """Apply a served batch's gradients on every server, retrying those that fail for
        up to ``retry_s``; the reply once all did.

        Raises:
            BadInput: (``grads``) not a map of slot name to gradient.
            PushFailed: the update could not complete within ``retry_s`` (module docstring).
            StreamReplay: the servers refused it: another stream applied that offset.

        ``stream`` is the batch's Kafka ``(topic, writer)``: with ``source`` it goes with
        the update, for the servers' watermarks. ``event_time``, the batch's, goes with
        it too (the servers' ``trained_through``). ``tables``: the server tables the batch's
        rows were looked up in; the update reaches those or none
        (:meth:`~stream_persia.worker.router.ShardRouter.split_update`).
        """
        p = self._pushes.get(batch_id)
        if p is None:
            p = self._pushes[batch_id] = self._reduce(batch_id, plan, source, grads, stream,
                                                      event_time, tables)
        # else: pushing (this push shares its outcome), or failed (the update first
        # reduced is sent again; grads are ignored)
        if p.task is not None:
            self.m_repeated.inc()   # a retry overtook the push
        else:
            p.task = asyncio.get_running_loop().create_task(
                self._apply(batch_id, p, retry_s), name=f"push-{batch_id}")
            self._tasks.add(p.task)
            p.task.add_done_callback(self._done)
        return await asyncio.shield(p.task)

    def _done(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()   # retrieved: every waiter got it already

    def _reduce(self, batch_id: int, plan: BatchPlan, source: tuple[int, int] | None,
                grads: Any, stream: tuple[str, str] | None,
                event_time: float | None = None,
                tables: dict[int, Table] | None = None) -> _Push:
        """Reduce a batch's gradients per unique id and split them per server, once."""
        if not isinstance(grads, dict):
            raise BadInput("grads must be a map of slot name -> gradient (None: no gradient)",
                           field="grads", hint=f"slots: {sorted(plan.names)}")
        reduced = reduce_gradients(plan, grads)
        for name in reduced.skipped:
            self.m_nonfinite.labels(name).inc()
        if reduced.nonfinite_ids:
            self.m_nonfinite_ids.inc(reduced.nonfinite_ids)
            log.warning("%s: batch %d: %d id(s) left out of its update: their gradients "
                        "summed to inf or NaN in float32 (counted in "
                        "nonfinite_gradient_ids_total)", self.name, batch_id,
                        reduced.nonfinite_ids)
        groups = [UpdateGroup(dim, ids, rows) for dim, (ids, rows) in reduced.by_dim.items()]
        mark = None
        if stream is not None and source is not None:   # the servers' watermarks
            mark = Source(stream[0], source[0], source[1], stream[1]).to_wire()
        update = self.router.split_update(groups, f"{self.incarnation}-{batch_id}", mark,
                                          event_time, tables)
        return _Push(update, source, skipped=list(reduced.skipped))

    async def _apply(self, batch_id: int, p: _Push, retry_s: float) -> PushReply:
        """Apply ``p`` on every server that has not yet, then release its batch; on
        failure mark it failed and raise PushFailed."""
        t0 = time.perf_counter()
        try:
            applied, dropped = await self.router.push(p.update, retry_s)
        except Exception as e:   # a bug too: the batch must fail, never stay pinned quietly
            raise self._failed(batch_id, p, e, retry_s) from e
        finally:
            p.task = None
        self.m_update_s.observe(time.perf_counter() - t0)
        if p.failure is not None:
            log.warning("%s: batch %d failed earlier is now applied on every server",
                        self.name, batch_id)
        del self._pushes[batch_id]
        self._on_applied(batch_id)
        self.m_applied.inc()
        reply: PushReply = {"applied": applied, "dropped": dropped, "skipped_slots": p.skipped}
        self._pushed[batch_id] = reply
        if len(self._pushed) > PUSHED_MEMORY:
            self._pushed.popitem(last=False)
        return reply

    def _failed(self, batch_id: int, p: _Push, err: Exception, retry_s: float
                ) -> PushFailed | ServerRestarted | StreamReplay:
        upd = p.update
        addresses = self.router.addresses
        why = err.message if isinstance(err, PersiaError) else repr(err)
        p.failure = {
            "batch_id": batch_id,
            "partition": p.source[0] if p.source is not None else None,
            "offset": p.source[1] if p.source is not None else None,
            "servers": [addresses[s] for s in upd.missing()],
            "applied_on": [addresses[s] for s in sorted(upd.replies)],
            "error": why,
        }
        self.m_failed.inc()
        where = (f" (partition {p.source[0]} offset {p.source[1]})"
                 if p.source is not None else "")
        restarted = isinstance(err, (ServerRestarted, StreamReplay))
        msg = (f"{self.name}: the gradients of batch {batch_id}{where} could not be applied "
               f"on embedding server(s) {', '.join(p.failure['servers'])}"
               + ("" if restarted else f" within {retry_s * 1000:g} ms")
               + f" ({len(upd.replies)} of {len(upd.parts)} servers applied them): {why}")
        log.error("%s; the batch stays in flight, failed: checkpoints refuse until a push of "
                  "it completes or a restore resets the stream", msg)
        if isinstance(err, StreamReplay):   # another stream applied it: restore
            replay = StreamReplay(msg, field="batch_id", hint=err.hint)
            if self._on_replay is not None:
                self._on_replay(replay)
            return replay
        if isinstance(err, ServerRestarted):   # the server lost its table: restore
            return ServerRestarted(msg, field="batch_id", hint=err.hint)
        return PushFailed(msg, field="batch_id",
                          hint="bring the server back and push the batch again (its "
                               "gradients are kept; only the servers missing them get "
                               "them), or restore the last checkpoint")

    def failed(self) -> list[FailedPush]:
        """The batches whose last push could not complete, oldest push first."""
        return [p.failure for p in self._pushes.values() if p.failure is not None]

    @staticmethod
    def summary(failed: list[FailedPush], limit: int = 3) -> str:
        """``failed`` in a line for logs and ``health`` (the first ``limit`` named)."""
        shown = "; ".join(f"batch {f['batch_id']}"
                          + (f" (partition {f['partition']} offset {f['offset']})"
                             if f["partition"] is not None else "")
                          + f" missing on {', '.join(f['servers'])}" for f in failed[:limit])
        return shown + (f"; and {len(failed) - limit} more" if len(failed) > limit else "")

    async def reset(self) -> list[FailedPush]:
        """Cancel the pushes under way and forget every batch pushed and not applied (the
        worker drops its in-flight batches: a restore, or it stops); returns the failed
        ones dropped."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        failed = self.failed()
        self._pushes.clear()
        return failed
