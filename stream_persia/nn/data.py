"""Data loading on NN workers (PERSIA's ``persia.data``).

- ``DataLoader(StreamingDataset(buffer_size))``: the training stream. Batches come from
  the embedding workers with their embeddings looked up, under the staleness bound
  (:mod:`stream_persia.nn.loader`). Needs an active :class:`~stream_persia.ctx.TrainCtx`.
- ``DataLoader(IterableDataset)``: your own iterator of ``PersiaBatch`` (a test set);
  each batch is looked up directly (``lookup_batch``: never inserts, unknown ids give
  zeros), up to ``forward_buffer_size`` at once, in order. Works in any context
  (``eval_ctx``, ``InferCtx``, ``TrainCtx``) and is what evaluation uses.

Stopping. The stream has no end: iteration stops when no batch arrived for
``timeout_ms`` (PERSIA's semantics), after ``max_batches``, or when a stop is requested
(SIGTERM to the rank or to ``stream-persia launch nn-worker``:
:mod:`stream_persia.core.lifecycle`), before the next step. With several NN ranks
(DDP), every rank must take the same number of steps or the all-reduce of a rank that
took one more step hangs; so before each step the ranks all-reduce (MIN) whether each
has a batch and no stop request (one tiny all-reduce per step), and all stop as soon as
one has none. Batches a rank holds when it stops go back, untrained, to their workers,
and the iteration ends once every gradient push it sent was answered.

Waiting. While no batch comes, the trainer's ``stream_idle`` is called every
:data:`~stream_persia.core.lifecycle.POLL_S`: rank 0 publishes the dense model of the
last step to serving replicas if it has not yet (a paused stream would keep it back),
and with one rank a checkpoint requested over HTTP is taken there (the time it takes
does not count against ``timeout_ms``).

A batch whose ``backward`` was not called by the time the next batch is taken is
released without an embedding update (logged once, counted in the trainer's
``stats()["released_untrained"]``): otherwise it would keep its
staleness permit forever. If its embeddings got gradients all the same (the script ran
``loss.backward()`` instead of ``ctx.backward(loss)``), taking the next batch raises
``Misuse`` instead: the embeddings would never be trained.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from stream_persia.core.data import PersiaBatch
from stream_persia.core.lifecycle import POLL_S, drain
from stream_persia.errors import Misuse, RemoteTimeout
from stream_persia.nn.batch import PersiaTrainingBatch
from stream_persia.nn.embedding_ctx import EmbeddingCtx, current_ctx
from stream_persia.nn.loader import HELD, StreamPrefetcher
from stream_persia.nn.seams import TrainerSeam

__all__ = ["DataLoader", "Dataloder", "IterableDataset", "IterableDatasetBase", "PersiaDataset",
           "StreamingDataset"]

log = logging.getLogger(__name__)


def _positive_int(name: str, value: Any, *, allow_none: bool = False, minimum: int = 1) -> Any:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise Misuse(f"{name} must be an int >= {minimum}, got {value!r}", field=name)
    return value


class IterableDatasetBase:
    """Base of the datasets a :class:`DataLoader` accepts.

    Args:
        buffer_size: batches received ahead of the training loop, at most.
    """

    def __init__(self, buffer_size: int = 10):
        self.buffer_size = _positive_int("buffer_size", buffer_size)


class StreamingDataset(IterableDatasetBase):
    """The job's stream: batches served by the embedding workers (training).

    Args:
        buffer_size: batches ready on the NN worker ahead of training, at most (the
            smaller of this and the loader's ``forward_buffer_size`` applies).
    """


class IterableDataset(IterableDatasetBase):
    """Batches from your own iterator, looked up directly (evaluation, inference).

    Subclass and implement ``__iter__`` yielding :class:`PersiaBatch` (PERSIA's way), or
    pass ``iterable``.

    Args:
        buffer_size: lookups in flight ahead of the loop, at most.
        iterable: an iterable of ``PersiaBatch`` (extension; instead of subclassing).
    """

    def __init__(self, buffer_size: int = 10, iterable: Iterable[PersiaBatch] | None = None):
        super().__init__(buffer_size)
        self.iterable = iterable

    def __iter__(self) -> Iterator[PersiaBatch]:
        if self.iterable is None:
            raise Misuse("IterableDataset needs batches: subclass it and implement __iter__, "
                         "or pass iterable=...", field="iterable")
        return iter(self.iterable)


class DataLoader:
    """Iterate ``PersiaTrainingBatch``es for ``ctx.forward`` (PERSIA's DataLoader).

    Args:
        dataset: :class:`StreamingDataset` (training) or :class:`IterableDataset`.
        forward_buffer_size: batches ready on this NN worker ahead of the loop, at most.
        timeout_ms: stop when no batch arrived for this long (stream); the limit for one
            lookup (IterableDataset).
        num_workers: PERSIA's decoding threads; accepted for compatibility (decoding
            runs on the context's loop thread).
        reproducible: fetch one batch at a time in strict round-robin order over the
            embedding workers, so that with ``embedding_staleness=1`` and a fixed input
            order a run repeats exactly.
        embedding_staleness: batches this rank may hold looked up but not yet applied
            (>= 1; 1 is fully synchronous). None: ``forward_buffer_size``. (PERSIA's None
            meant unbounded, which bounds nothing; a bound keeps the accuracy of the
            synchronous mode.)
        max_batches: extension: stop after this many batches.
    """

    def __init__(self, dataset: IterableDatasetBase, forward_buffer_size: int = 10,
                 timeout_ms: int = 1000 * 60 * 10, num_workers: int = 10,
                 reproducible: bool = False, embedding_staleness: int | None = None, *,
                 max_batches: int | None = None):
        if not isinstance(dataset, IterableDatasetBase):
            raise Misuse(f"dataset must be a StreamingDataset or an IterableDataset, got "
                         f"{type(dataset).__name__}", field="dataset",
                         hint="wrap your iterator: IterableDataset(iterable=...)")
        self.dataset = dataset
        self.forward_buffer_size = _positive_int("forward_buffer_size", forward_buffer_size)
        self.timeout_ms = _positive_int("timeout_ms", timeout_ms)
        self.num_workers = _positive_int("num_workers", num_workers)
        # bool() would read a string such as "false" (an env variable passed on) as True.
        if reproducible not in (True, False):   # bool, numpy bool, 0 or 1
            raise Misuse(f"reproducible must be True or False, got {reproducible!r}",
                         field="reproducible")
        self.reproducible = bool(reproducible)
        self.embedding_staleness = _positive_int("embedding_staleness", embedding_staleness,
                                                 allow_none=True)
        self.max_batches = _positive_int("max_batches", max_batches, allow_none=True,
                                         minimum=0)
        self._prefetcher: StreamPrefetcher | None = None

    @property
    def staleness(self) -> int:
        return self.embedding_staleness or self.forward_buffer_size

    def __iter__(self) -> Iterator[PersiaTrainingBatch]:
        ctx = current_ctx()
        if isinstance(self.dataset, StreamingDataset):
            return self._stream(ctx)
        return self._lookups(ctx)

    # ------------------------------------------------------------------ stream
    def _stream(self, ctx: EmbeddingCtx) -> Iterator[PersiaTrainingBatch]:
        trainer = ctx.as_trainer()
        if trainer is None:
            raise Misuse("DataLoader(StreamingDataset) trains: it needs an active TrainCtx",
                         hint="for evaluation, iterate DataLoader(IterableDataset(...)) "
                              "inside eval_ctx()")
        cluster = trainer.require_cluster()
        pf = self._prefetcher
        if pf is None or pf.cluster is not cluster:
            pf = StreamPrefetcher(
                cluster, staleness=self.staleness,
                buffer_size=min(self.forward_buffer_size, self.dataset.buffer_size),
                reproducible=self.reproducible, pin=trainer.device.type == "cuda",
                first_worker=trainer.rank)
            trainer.register_prefetcher(pf)
            self._prefetcher = pf
        return self._stream_batches(trainer, pf)

    def _stream_batches(self, ctx: TrainerSeam, pf: StreamPrefetcher
                        ) -> Iterator[PersiaTrainingBatch]:
        cluster = ctx.require_cluster()
        cluster.run(pf.start())
        timeout_s = self.timeout_ms / 1000.0
        count = 0
        try:
            while self.max_batches is None or count < self.max_batches:
                for prev in pf.taken:
                    ctx.release_untrained(prev)
                batch = None if drain.requested else self._next_batch(
                    pf, timeout_s, ctx.stream_idle)
                # every rank votes (a collective), and agrees only with a batch of its own
                agreed = ctx.all_ranks_agree(batch is not None and not drain.requested)
                if not agreed or batch is None:
                    if drain.requested:
                        log.warning("stop requested (%s): the DataLoader stops after step %d",
                                    drain.reason, ctx.steps)
                    elif batch is None:
                        log.info("no batch for %d ms: the DataLoader stops", self.timeout_ms)
                    else:
                        log.info("another rank has no batch or was asked to stop: the "
                                 "DataLoader stops after step %d", ctx.steps)
                    ctx.stream_ended()   # serve a pending HTTP checkpoint request now
                    break
                count += 1
                yield batch
        finally:
            if ctx.cluster is cluster:      # not after the context is gone
                left = cluster.run(pf.pause())
                left += [b for b in pf.taken if b.ticket is not None and b.ticket.state == HELD]
                if left:
                    cluster.run(pf.give_back(left))
                # Every update of this iteration is applied when the loop ends.
                cluster.run(pf.wait_idle(cluster.rpc_timeout_ms / 1000 + 30))
                ctx.raise_async_errors()

    @staticmethod
    def _next_batch(pf: StreamPrefetcher, timeout_s: float, idle: Callable[[], None]
                    ) -> PersiaTrainingBatch | None:
        """The next ready batch, None after ``timeout_s`` without one or once a stop is
        requested (looked at every :data:`~stream_persia.core.lifecycle.POLL_S`). Each
        slice that brings no batch calls ``idle`` (the trainer's ``stream_idle``), whose
        time does not count as waiting: a checkpoint it takes pauses the stream."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            batch = pf.get(max(0.0, min(left, POLL_S)))
            if batch is not None or left <= POLL_S or drain.requested:
                return batch
            began = time.monotonic()
            idle()
            deadline += time.monotonic() - began

    # ------------------------------------------------------------------ lookups
    def _lookups(self, ctx: EmbeddingCtx) -> Iterator[PersiaTrainingBatch]:
        depth = min(self.forward_buffer_size, self.dataset.buffer_size)
        window: collections.deque = collections.deque()
        if not isinstance(self.dataset, Iterable):
            raise Misuse(f"{type(self.dataset).__name__} yields no batches", field="dataset",
                         hint="subclass IterableDataset and implement __iter__")
        source = iter(self.dataset)
        exhausted = False
        count = 0
        try:
            while self.max_batches is None or count < self.max_batches:
                while not exhausted and len(window) < depth:
                    try:
                        batch = next(source)
                    except StopIteration:
                        exhausted = True
                        break
                    window.append(ctx.submit_lookup(batch))
                if not window:
                    return
                fut = window.popleft()
                try:
                    result = fut.result(self.timeout_ms / 1000.0)
                except TimeoutError:
                    raise RemoteTimeout(f"an embedding lookup took over {self.timeout_ms} ms",
                                        field="timeout_ms") from None
                count += 1
                yield result
        finally:
            for fut in window:
                fut.cancel()   # lookups only read: cancelling one loses nothing


# Names from PERSIA's earlier releases, which its own guides still use.
Dataloder = DataLoader
PersiaDataset = IterableDataset
