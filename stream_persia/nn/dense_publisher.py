"""NN rank 0 publishes the dense model to embedding server 0 for serving replicas (issue 18).

``TrainCtx`` builds a :class:`DensePublisher` on rank 0 when ``model_updates.enabled``
(the job's global config, or ``TrainCtx(model_updates=...)``). After every training step
(``backward``'s step boundary, where the checkpoint poller also runs) it looks whether a
publication is due: ``dense_every_steps`` steps or ``dense_interval_ms`` milliseconds
since the last one, whichever comes first. When due:

1. on the training thread, the model's ``state_dict()`` is copied to CPU tensors (a
   device-to-host copy on CUDA): nothing else. No RNG is drawn and neither the model nor
   the optimizer is touched, so training results are bit-identical with publishing on or
   off;
2. on the context's loop thread, in the background, the copy is serialized
   (``torch.save``, on a worker thread), hashed and sent to embedding server 0 as
   ``put_dense`` chunks (:mod:`stream_persia.server.dense_hub`: the schema, the chunk
   size, what the server keeps). The training thread never waits for the network.

The version is the context's step count (``TrainCtx.steps``, which a restored checkpoint
sets to its step), the event time the newest ``PersiaTrainingBatch.event_time`` trained
so far (None while no batch carried one). At most one publication is in flight: one due
while the previous one is still being sent is skipped and counted (``skipped``), and the
next is due a full period later. A failed publication (server 0 unreachable, refusing the
version because it holds a newer one of the same lineage, or the lineage because a newer
publisher replaced it, a blob over ``max_dense_bytes``) is counted (``failed``,
``too_large``) and logged once per streak of failures, never raised into training. A
clean exit of the context publishes the final model once more (waiting a bounded time for
it); an exit on an error does not wait for anything in flight.

Every publication also names the publisher's **lineage** (``put_dense``'s ``lineage``), a
random id in ``[1, MAX_LINEAGE]`` drawn when the publisher is created and drawn again when
its context restores a checkpoint (:meth:`DensePublisher.restored`; the restored model is
published at the next step boundary due, or when the stream idles): a step count starts
again from 0 or from a checkpoint's step, so versions order only the publications of one
lineage. Server 0 takes the first publication of a new lineage whatever its version, and
from then on refuses the replaced lineage's (:mod:`stream_persia.server.dense_hub`): a job
restarted from scratch, or restored to an earlier step, against a running embedding
server has its model served from its first publication on, not once its step passes the
crashed run's (its rows are served from the start: the old dense model with the new rows
would be wrong), and a stale trainer still running cannot publish over it. A random id,
not a clock: the clocks of two hosts do not order two incarnations, and the id needs no
round trip; two ids collide with probability about 2**-63. ``dump_checkpoint`` records
the lineage (``extra["dense_lineage"]``) for the replicas restored from the checkpoint.

A stream that pauses (ingest paused through the control plane, or only slow) has no step
boundary for as long as it lasts: the steps since the last publication would stay
unpublished, and replicas would serve an older model than training holds, with no end.
So while the DataLoader waits for a batch it calls :meth:`DensePublisher.idle` (through
``TrainCtx.stream_idle``) every :data:`~stream_persia.core.lifecycle.POLL_S` without
one: the model at the current step is published unless that step is the last one
started or a publication is still in flight (then at the next call). Nothing changed,
nothing is sent: an idle call costs a comparison. A publication of that step that failed
is tried again, at most every ``dense_interval_ms`` (as training would), so a pause that
begins with server 0 briefly unreachable does not leave replicas behind either.

A context without a model (or with ``model_updates.enabled: false``) publishes nothing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import hashlib
import io
import logging
import os
import secrets
import time
from collections.abc import Callable
from typing import Any

import torch

from stream_persia.config import ModelUpdatesConfig
from stream_persia.nn.cluster import Cluster
from stream_persia.server.dense_hub import (
    DENSE_CHUNK_BYTES,
    MAX_LINEAGE,
    LineageCalls,
    chunk_count,
)

__all__ = ["DensePublisher", "model_updates_config", "new_lineage", "serialize", "snapshot"]

log = logging.getLogger(__name__)


def model_updates_config() -> ModelUpdatesConfig:
    """The job's ``model_updates`` section: from the global config file
    ``PERSIA_GLOBAL_CONFIG`` names, else the defaults."""
    path = os.environ.get("PERSIA_GLOBAL_CONFIG")
    if not path:
        return ModelUpdatesConfig()
    from stream_persia.config import load_global_config

    return load_global_config(path).model_updates


def new_lineage() -> int:
    """A fresh publisher lineage: a random int in ``[1, MAX_LINEAGE]`` (0 is the legacy
    lineage of a publication that names none)."""
    return 1 + secrets.randbelow(MAX_LINEAGE)


def snapshot(model: torch.nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` as CPU copies that training cannot change afterwards."""
    return {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor)
            else copy.deepcopy(v) for k, v in model.state_dict().items()}


def serialize(state: dict[str, Any]) -> bytes:
    """The blob a replica ``torch.load``s: ``torch.save`` of the state dict."""
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getvalue()


class DensePublisher:
    """Rank 0's publisher of the dense model (module docstring).

    Args:
        model: the dense model itself (not a DDP wrapper: its keys are the model's).
        cluster: the context's clients and loop thread; publishes to ``servers[0]``.
        cfg: ``model_updates`` (``dense_every_steps``, ``dense_interval_ms``,
            ``max_dense_bytes``).
        step: the context's step count now (the first publication is due
            ``dense_every_steps`` after it).
        timeout_s: the longest one ``put_dense`` call may take, and how long a clean exit
            waits for the publication in flight and then for the final one.
        clock: monotonic seconds (tests).
    """

    def __init__(self, model: torch.nn.Module, cluster: Cluster, cfg: ModelUpdatesConfig, *,
                 step: int = 0, timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.model = model
        self.cluster = cluster
        self.every_steps = cfg.dense_every_steps
        self.interval_s = cfg.dense_interval_ms / 1000
        self.max_bytes = cfg.max_dense_bytes
        self.timeout_s = timeout_s
        self._clock = clock
        self._last_step = step
        self._last_time = clock()
        # the step of the last publication started (or the step it starts from); None
        # after a restore
        self._started: int | None = step
        self._inflight: concurrent.futures.Future[bool] | None = None
        self._failing = False
        # Whether this lineage has a model of its own to publish: a step trained, or a
        # checkpoint restored (into the servers too). A context that trains nothing (a
        # run that found no data, a smoke test) must not replace the live trainer's model
        # with its untrained one when it exits or idles.
        self._publishable = False
        # without the lineage field once a server 0 from before it refused it
        self._calls = LineageCalls("dense model publications")
        #: the id of this publisher's publications (module docstring)
        self.lineage = new_lineage()
        log.info("dense model publications: lineage %d from step %d", self.lineage, step)
        #: the newest version embedding server 0 took from this publisher (this lineage)
        self.last_version: int | None = None
        self.published = 0
        self.skipped = 0
        self.failed = 0
        self.too_large = 0
        self.bytes_sent = 0

    def stats(self) -> dict[str, int]:
        """Counters: ``published``, ``skipped`` (one still in flight), ``failed`` (of which
        ``too_large``), ``bytes_sent``."""
        return {"published": self.published, "skipped": self.skipped, "failed": self.failed,
                "too_large": self.too_large, "bytes_sent": self.bytes_sent}

    def restored(self, step: int) -> None:
        """The context restored a checkpoint at ``step`` (maybe below steps published):
        a new lineage from here, so server 0 takes this model's publications whatever
        versions it holds. The next publication is due ``dense_every_steps`` after
        ``step``, or at the next :meth:`idle` (the restored model itself)."""
        old, self.lineage = self.lineage, new_lineage()
        self._last_step, self._last_time = step, self._clock()
        self._started = None        # the restored model is not published: idle() sends it
        self._publishable = True
        self.last_version = None
        log.info("dense model publications: lineage %d from step %d (restored; was %d)",
                 self.lineage, step, old)

    # ------------------------------------------------------------------ training thread
    def step_boundary(self, step: int, event_time: float | None) -> None:
        """After a training step: publish the model at ``step`` when due (cheap when not:
        a clock read)."""
        self._publishable = True
        now = self._clock()
        if step - self._last_step < self.every_steps \
                and now - self._last_time < self.interval_s:
            return
        self._last_step, self._last_time = step, now
        if self._inflight is not None and not self._inflight.done():
            self.skipped += 1
            return
        self._start(step, event_time)

    def idle(self, step: int, event_time: float | None) -> None:
        """The stream has no batch for now (the DataLoader waits): publish the model at
        ``step`` unless that step is the last one started (or restored) or a publication
        is still in flight; the next due one counts from here. The last one started is
        sent again when it failed, ``dense_interval_ms`` after the try."""
        fut = self._inflight
        if not self._publishable or (fut is not None and not fut.done()):
            return
        now = self._clock()
        if step == self._started:   # sent already (or restored): again only if it failed
            failed = fut is not None and not fut.cancelled() and not fut.result()
            if not failed or now - self._last_time < self.interval_s:
                return
        self._last_step, self._last_time = step, now
        self._start(step, event_time)

    def _start(self, step: int, event_time: float | None) -> None:
        state = snapshot(self.model)   # synchronous: the model at exactly this step
        self._started = step
        self._inflight = self.cluster.loop.submit(
            self._publish(state, step, event_time, self.lineage))

    def close(self, final: tuple[int, float | None] | None) -> None:
        """The context exits: with ``final`` (its step and event time; a clean exit),
        wait for the publication in flight and publish the final model unless it is the
        one published last, waiting at most ``timeout_s`` for each; without, cancel what
        is in flight. Never raises."""
        fut, self._inflight = self._inflight, None
        if final is None:
            if fut is not None:
                fut.cancel()
            return
        try:
            if fut is not None:
                fut.result(self.timeout_s)
            step, event_time = final
            if self._publishable and step != self.last_version:
                self._start(step, event_time)
                fut, self._inflight = self._inflight, None
                if fut is not None:
                    fut.result(self.timeout_s)
        except Exception as e:   # a timeout; the publication's own errors are counted
            log.warning("the final dense model was not published within %g s: %r",
                        self.timeout_s, e)

    # ------------------------------------------------------------------ loop thread
    async def _publish(self, state: dict[str, Any], version: int,
                       event_time: float | None, lineage: int) -> bool:
        try:
            blob, sha = await asyncio.to_thread(_blob_and_digest, state)
            del state
            if len(blob) > self.max_bytes:
                self.too_large += 1
                raise ValueError(f"the serialized dense model has {len(blob)} bytes, over "
                                 f"model_updates.max_dense_bytes={self.max_bytes}")
            server = self.cluster.servers[0]
            n = chunk_count(len(blob))
            view = memoryview(blob)
            for i in range(n):
                await self._calls.call(
                    lambda p: server.call("put_dense", p, timeout_ms=self.timeout_s * 1000),
                    {"version": version, "event_time": event_time, "chunk": i, "chunks": n,
                     "data": view[i * DENSE_CHUNK_BYTES:(i + 1) * DENSE_CHUNK_BYTES],
                     "sha256": sha}, lineage)
        except Exception as e:
            self.failed += 1
            if not self._failing:
                self._failing = True
                log.warning("publishing dense version %d to embedding server 0 failed (%s); "
                            "training goes on, and this is logged again only after a "
                            "publication succeeds", version, getattr(e, "message", None)
                            or repr(e))
            return False
        if self._failing:
            self._failing = False
            log.info("published dense version %d again after %d failed publication(s)",
                     version, self.failed)
        self.published += 1
        self.bytes_sent += len(blob)
        if lineage == self.lineage:   # (not one from before a restore)
            self.last_version = version
        return True


def _blob_and_digest(state: dict[str, Any]) -> tuple[bytes, str]:
    blob = serialize(state)
    return blob, hashlib.sha256(blob).hexdigest()
