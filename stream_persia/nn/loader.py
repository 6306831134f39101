"""Prefetching served batches under the staleness bound (the NN side of the hybrid algorithm).

An NN rank may hold at most ``embedding_staleness`` batches that an embedding worker
looked up for it but whose gradients the servers have not applied yet. Each such batch
holds a :class:`Ticket` (a permit): taken before the ``next_batch`` call, given back when
the ``push_gradients`` reply arrives (the worker replies after every server applied the
update), or when the batch is returned unapplied (``return_batches``). With staleness 1
the next lookup waits for the previous update: the job is synchronous and deterministic.

The :class:`StreamPrefetcher` runs on the context's loop thread. Its main task takes a
permit and a slot of the forward buffer (``forward_buffer_size``: batches ready on the NN
side), then starts a fetch: ``next_batch`` on one worker, round-robin, polled with a short
timeout and moved on to the next worker when one has nothing. With ``reproducible=True``
one fetch runs at a time, in strict round-robin order, and never moves on. The training
thread takes ready batches from a thread-safe queue.

A fetch in flight is never cancelled: the worker would count the batch as served with
nobody to train it. Pausing (for a checkpoint, at the end of iteration, on close) stops
issuing fetches, lets those in flight finish, and hands every batch not yet trained back
to its worker, which puts it first in line again; forward-only batches
(``requires_grad=False``, settled by the worker when served) stay on the NN side instead,
first in line for the next iteration. If the main task crashes (a bug), its
error is raised to the training thread by the next :meth:`StreamPrefetcher.get`.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import queue
from typing import Any

from stream_persia.core.served import ServedBatch
from stream_persia.errors import Misuse, PersiaError
from stream_persia.nn.batch import PersiaTrainingBatch, from_served

__all__ = ["StreamPrefetcher", "Ticket"]

log = logging.getLogger(__name__)

HELD, PUSHING, RELEASED = "held", "pushing", "released"


class Ticket:
    """The staleness permit of one served training batch."""

    __slots__ = ("prefetcher", "worker", "batch_id", "state")

    def __init__(self, prefetcher: StreamPrefetcher, worker: int, batch_id: int):
        self.prefetcher = prefetcher
        self.worker = worker
        self.batch_id = batch_id
        self.state = HELD

    def release(self) -> None:
        """Give the permit back (loop thread only). Idempotent."""
        if self.state != RELEASED:
            self.state = RELEASED
            self.prefetcher._permit_released(self)

    def __repr__(self) -> str:
        return f"Ticket(worker={self.worker}, batch_id={self.batch_id}, {self.state})"


class StreamPrefetcher:
    """Pulls served batches from the embedding workers ahead of the training loop.

    Args:
        cluster: the context's :class:`~stream_persia.nn.cluster.Cluster`.
        staleness: permits: batches looked up but not yet applied, at most.
        buffer_size: batches ready on the NN side, at most.
        reproducible: one fetch at a time in strict round-robin order.
        pin: copy tensors into page-locked memory (CUDA).
        poll_ms: how long one ``next_batch`` call waits on the worker.
        first_worker: where the round-robin starts (ranks start at different workers).
    """

    def __init__(self, cluster: Any, *, staleness: int, buffer_size: int,
                 reproducible: bool = False, pin: bool = False, poll_ms: int = 200,
                 first_worker: int = 0):
        self.cluster = cluster
        self.staleness = staleness
        self.buffer_size = buffer_size
        self.reproducible = reproducible
        self.pin = pin
        self.poll_ms = poll_ms
        self._next_worker = first_worker % len(cluster.workers)
        self._ready: queue.Queue[PersiaTrainingBatch | BaseException] = queue.Queue()
        self.outstanding: dict[tuple[int, int], Ticket] = {}
        self._permits: asyncio.Semaphore | None = None
        self._room: asyncio.Semaphore | None = None
        self._idle: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._fetches: set[asyncio.Task] = set()
        self._stopping = False
        self.served = 0
        self.returned = 0
        self.last_taken: PersiaTrainingBatch | None = None
        # what pause() took out of the ready queue but could not give back (see there)
        self._kept: collections.deque[PersiaTrainingBatch | BaseException] = \
            collections.deque()

    @property
    def running(self) -> bool:
        return self._task is not None

    @property
    def taken(self) -> list[PersiaTrainingBatch]:
        """The batch most recently handed to the training loop (it may still hold its
        permit if its backward has not run)."""
        return [self.last_taken] if self.last_taken is not None else []

    # ------------------------------------------------------------------ loop thread
    async def start(self) -> None:
        if self._permits is None:
            self._permits = asyncio.Semaphore(self.staleness)
            self._room = asyncio.Semaphore(self.buffer_size)
            self._idle = asyncio.Event()
            self._idle.set()
        if self._task is None:
            self._stopping = False
            self._task = asyncio.get_running_loop().create_task(self._run(), name="prefetch")
            self._task.add_done_callback(self._run_ended)

    def _run_ended(self, task: asyncio.Task) -> None:
        """Supervision of the main task (STYLE.md habit 11): a crash reaches the training
        thread, whose next :meth:`get` raises it, instead of looking like a stream that
        ran dry (the DataLoader would stop after its timeout as if it had ended)."""
        err = None if task.cancelled() else task.exception()
        if err is None:
            return
        log.error("the prefetch task stopped: %r", err, exc_info=err)
        self._stopping = True
        self._task = None
        self._ready.put(err)

    async def _run(self) -> None:
        assert self._permits is not None and self._room is not None
        n = len(self.cluster.workers)
        while not self._stopping:
            await self._permits.acquire()
            try:
                await self._room.acquire()
            except BaseException:
                self._permits.release()
                raise
            wi = self._next_worker
            self._next_worker = (wi + 1) % n
            task = asyncio.get_running_loop().create_task(self._fetch(wi))
            self._fetches.add(task)
            task.add_done_callback(self._fetches.discard)
            if self.reproducible:
                # asyncio.wait does not cancel the fetch if this task is cancelled.
                await asyncio.wait({task})

    async def _fetch(self, wi: int) -> None:
        assert self._permits is not None and self._room is not None and self._idle is not None
        n = len(self.cluster.workers)
        kept_permit = kept_room = False
        restored = False
        try:
            while not self._stopping:
                params: dict[str, Any] = {"timeout_ms": self.poll_ms}
                if self.cluster.server_config is not None:
                    params["config"] = self.cluster.server_config["digest"]
                try:
                    served = await self.cluster.workers[wi].call(
                        "next_batch", params,
                        timeout_ms=self.poll_ms + self.cluster.rpc_timeout_ms)
                except Misuse as e:
                    # Every embedding server lost the configuration and the worker goes on
                    # (on_server_restart: continue; by default it answers ServerRestarted,
                    # raised to the training loop): put it back once, then ask again.
                    if e.field != "config" or restored:
                        raise
                    await self.cluster.restore_server_config()
                    restored = True
                    continue
                if served is None:
                    if not self.reproducible:
                        wi = (wi + 1) % n
                    continue
                served = ServedBatch.from_wire(served)   # BadInput naming a bad field
                known = self.cluster.server_config
                if known is not None and served.config not in (None, known["digest"]):
                    await self.cluster.learn_server_config()   # configured since (the API)
                batch = from_served(served, wi, pin=self.pin)
                self.served += 1
                if batch.requires_grad and batch.batch_id is not None:
                    ticket = Ticket(self, wi, batch.batch_id)
                    batch.ticket = ticket
                    self.outstanding[(wi, batch.batch_id)] = ticket
                    self._idle.clear()
                    kept_permit = True
                # else: the worker settled it at once (evaluation batch): nothing to release
                self._ready.put(batch)
                kept_room = True
                return
        except Exception as e:
            if not isinstance(e, PersiaError):
                log.exception("fetching a batch from embedding worker %d failed", wi)
            self._stopping = True     # the stream is broken: surface it, stop fetching
            self._ready.put(e)
            kept_room = True
        finally:
            if not kept_permit:
                self._permits.release()
            if not kept_room:
                self._room.release()

    def _permit_released(self, ticket: Ticket) -> None:
        assert self._permits is not None and self._idle is not None
        self.outstanding.pop((ticket.worker, ticket.batch_id), None)
        self._permits.release()
        if not self.outstanding:
            self._idle.set()

    async def pause(self) -> list[PersiaTrainingBatch]:
        """Stop fetching, let fetches in flight finish; returns the training batches never
        taken (for :meth:`give_back`).

        What cannot go back is kept, in order, for the next :meth:`get`: forward-only
        batches (``requires_grad=False``: their worker settled them when it served them,
        so a handed-back one would be lost, silently, at every checkpoint cut or end of a
        loop) and a fetch's error (a ``ServerRestarted`` dropped here would let training
        go on past the restart)."""
        self._stopping = True
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        while self._fetches:
            await asyncio.gather(*list(self._fetches), return_exceptions=True)
        left = []
        while True:
            try:
                item = self._ready.get_nowait()
            except queue.Empty:
                break
            if self._room is not None:
                self._room.release()
            if isinstance(item, PersiaTrainingBatch) and item.ticket is not None:
                left.append(item)
            else:
                self._kept.append(item)
        return left

    @property
    def kept(self) -> int:
        """Forward-only batches :meth:`pause` kept that no :meth:`get` took yet."""
        return sum(isinstance(item, PersiaTrainingBatch) for item in self._kept)

    def drop_kept(self) -> int:
        """Forget what :meth:`pause` kept (after a restore: those forward-only batches
        carry embeddings looked up before it, and a Kafka replay serves them again; a
        kept error is one the restore dealt with). Returns the batches dropped."""
        dropped = self.kept
        self._kept.clear()
        return dropped

    def adopt(self, other: StreamPrefetcher) -> None:
        """Take over what ``other`` (paused: an earlier DataLoader of the same context)
        kept, ahead of anything else: a new DataLoader serves it first."""
        if other is not self:
            self._kept.extend(other._kept)
            other._kept.clear()

    async def give_back(self, batches: list[PersiaTrainingBatch]) -> None:
        """Return served, untrained batches to their workers (unapplied, first in line)."""
        by_worker: dict[int, list[Ticket]] = {}
        for b in batches:
            t = b.ticket
            if t is not None and t.state == HELD:
                by_worker.setdefault(t.worker, []).append(t)
        try:
            await asyncio.gather(*(
                self.cluster.workers[w].call("return_batches",
                                             {"batch_ids": [t.batch_id for t in ts]})
                for w, ts in by_worker.items()))
        finally:
            for ts in by_worker.values():
                for t in ts:
                    t.release()
                    self.returned += 1

    async def wait_idle(self, timeout_s: float) -> None:
        """Wait until no permit is held (every push answered, every batch returned)."""
        if self._idle is not None:
            await asyncio.wait_for(self._idle.wait(), timeout_s)

    # ------------------------------------------------------------------ training thread
    def get(self, timeout_s: float) -> PersiaTrainingBatch | None:
        """The next ready batch, or None when none arrived within ``timeout_s``.

        Raises:
            PersiaError: fetching failed (a worker is unreachable, ...).
        """
        if self._kept:   # kept by pause(), ahead of what was fetched since; no room held
            item = self._kept.popleft()
        else:
            try:
                item = self._ready.get(timeout=timeout_s)
            except queue.Empty:
                return None
            room = self._room
            if room is not None:
                self.cluster.loop.loop.call_soon_threadsafe(room.release)
        if isinstance(item, BaseException):
            raise item
        self.last_taken = item
        return item
