"""The broker-less path of :class:`~stream_persia.loader.data_ctx.DataCtx`: pipelined ``ingest``
RPCs to the embedding workers, round-robin, with at most ``max_inflight`` unacknowledged.

A synchronous caller thread submits batches; the RPCs run on a
:class:`~stream_persia.core.aio.LoopThread`. Each send offers its batch to the workers in turn
(a worker acknowledges once the batch is in its ready buffer, waiting while that buffer is
full) until one takes it or ``timeout_ms`` passes. A send whose connection drops or times
out is retried on the next worker, so a batch may be ingested twice (at least once).
With one worker, batches reach its ready buffer in the order they were submitted (a
resend after a dropped connection aside); with several, each worker's share keeps its
order unless a full worker's batch moves on to the next one.
:meth:`DirectSender.submit` copies the batch's arrays (:func:`snapshot`), so what is sent
is the batch as it was when submitted, as on the Kafka path, which encodes it at once.

Before the first batch is offered, every worker must answer (:meth:`DirectSender.
wait_for_workers`: bounded by ``startup_timeout_s``, with backoff and each failure logged,
:mod:`stream_persia.core.backoff`), so a data loader started before its embedding workers
waits for them, and one whose workers never come fails naming them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time

import numpy as np

from stream_persia.core.aio import LoopThread
from stream_persia.core.backoff import retry_startup
from stream_persia.core.data import PersiaBatch
from stream_persia.errors import Backpressure, Misuse, PeerUnavailable, PersiaError, RemoteTimeout
from stream_persia.rpc import RpcClient

log = logging.getLogger(__name__)

__all__ = ["DirectSender"]

RPC_MARGIN_MS = 10_000      # an ingest call's timeout beyond the worker-side wait


def snapshot(batch: PersiaBatch) -> dict:
    """The batch's wire dict with every array copied (C-ordered, so encoding copies no
    more): the batch as it is now. The RPC encodes it later, on the loop thread, and
    again for each retry; without the copy a caller that refills its arrays for the next
    batch (PERSIA's batches are copies, so its loaders may) would send the new data."""
    d = batch.to_wire()
    d["id_type_features"] = [
        {**f, "values": f["values"].copy(),
         "offsets": None if f["offsets"] is None else f["offsets"].copy()}
        for f in d["id_type_features"]]
    for key in ("non_id_type_features", "labels"):
        d[key] = [{**f, "data": np.array(f["data"], order="C")} for f in d[key]]
    return d


def payload_nbytes(batch: PersiaBatch) -> int:
    """Bytes of the batch's arrays (what the wire carries, give or take the framing)."""
    n = sum(f.values.nbytes + f.offsets.nbytes for f in batch.id_type_features)
    return n + sum(f.data.nbytes for f in (*batch.non_id_type_features, *batch.labels))


class DirectSender:
    """Sends batches to embedding workers over RPC (see the module doc).

    Args:
        workers: ``host:port`` of every embedding worker.
        loop: the loop thread the RPCs run on (the caller owns it).
        max_inflight: sends not yet acknowledged before :meth:`submit` waits.
        timeout_ms: how long one batch may be offered before it fails.
        first_worker: where the round-robin starts (the data loader's replica index).
        startup_timeout_s: how long the first batch waits for every worker to answer.

    :meth:`submit`, :meth:`flush` and :meth:`stats` are called from one caller thread.
    """

    def __init__(self, workers: list[str], loop: LoopThread, *, max_inflight: int,
                 timeout_ms: int, first_worker: int = 0, startup_timeout_s: float = 60.0):
        self.workers = workers
        self.max_inflight = max_inflight
        self.timeout_ms = timeout_ms
        self._loop = loop
        self._clients = [RpcClient(a, timeout_ms=RPC_MARGIN_MS, name="embedding-worker")
                         for a in workers]
        self._next = first_worker
        self.startup_timeout_s = startup_timeout_s
        self._ready: asyncio.Future | None = None   # the workers answered (loop thread)
        self._pending: dict[concurrent.futures.Future, None] = {}  # caller thread only
        self._room = threading.BoundedSemaphore(max_inflight)
        # Updated on the loop thread; read (whole ints) by stats().
        self._counts = dict(acked=0, failed=0, bytes=0, retries=0)
        self._active = 0
        self._peak = 0

    async def wait_for_workers(self, timeout_s: float) -> None:
        """Wait until every embedding worker answers ``health``, for up to ``timeout_s``
        (retries with backoff, each failure logged); run on the loop.

        Raises:
            PeerUnavailable: some worker did not answer in time; names them.
        """
        pending = list(range(len(self._clients)))

        async def attempt() -> None:
            nonlocal pending
            replies = await asyncio.gather(
                *(self._clients[i].call("health", timeout_ms=RPC_MARGIN_MS) for i in pending),
                return_exceptions=True)
            failed = [(i, r) for i, r in zip(pending, replies, strict=True)
                      if isinstance(r, BaseException)]
            for _, err in failed:
                if not isinstance(err, (PeerUnavailable, RemoteTimeout)):
                    raise err
            pending = [i for i, _ in failed]
            if failed:
                raise PeerUnavailable(
                    f"embedding workers {[self.workers[i] for i in pending]} do not answer "
                    f"({failed[0][1]})", field="embedding_workers")

        def give_up(err: BaseException, attempts: int, spent: float) -> PeerUnavailable:
            return PeerUnavailable(
                f"{err} after {attempts} attempts in {spent:.1f} s", field="embedding_workers",
                hint="are the embedding workers running at these addresses? DataCtx's "
                     "startup_timeout_ms bounds the wait")

        await retry_startup(attempt, what="DataCtx (broker-less)",
                            timeout_s=timeout_s,
                            retry_on=(PeerUnavailable, RemoteTimeout, TimeoutError),
                            give_up=give_up)

    @property
    def _give_up_s(self) -> float:
        # Each send gives up by itself after timeout_ms; the margin covers its last call.
        return (self.timeout_ms + 2 * RPC_MARGIN_MS) / 1000

    def submit(self, batch: PersiaBatch, seq: int) -> None:
        """Queue a copy of one batch (``seq`` names it in a later error); blocks while
        ``max_inflight`` sends are unacknowledged; raises an earlier send's failure. A
        batch without an ``event_time`` is sent with this process's clock (now)."""
        batch = batch.stamped(time.time())
        self._collect()
        if not self._room.acquire(timeout=self._give_up_s):
            # Only a bug could keep a slot taken this long: sends time out by themselves.
            raise Backpressure(f"{self.max_inflight} batches stayed unacknowledged for "
                               f"{self.timeout_ms} ms", field="max_inflight")
        try:
            self._collect()  # the slot may have come free because a send failed
            fut = self._loop.submit(self._deliver(snapshot(batch), payload_nbytes(batch), seq))
        except BaseException:
            self._room.release()
            raise
        self._pending[fut] = None
        fut.add_done_callback(lambda _: self._room.release())

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait for every submitted batch; raise the first failure."""
        timeout_s = self._give_up_s if timeout_s is None else timeout_s
        _, not_done = concurrent.futures.wait(list(self._pending), timeout=timeout_s)
        if not_done:
            raise RemoteTimeout(f"{len(not_done)} batches were still unacknowledged after "
                                f"{timeout_s:g} s", field="timeout_ms")
        self._collect()

    async def close(self) -> None:
        """Close the connections (run on the loop; unfinished sends are cancelled with
        the loop)."""
        if self._ready is not None and not self._ready.done():
            self._ready.cancel()
        for client in self._clients:
            await client.close()

    def stats(self) -> dict[str, int]:
        return {**self._counts, "in_flight": self._active, "peak_in_flight": self._peak}

    def _collect(self) -> None:
        """Forget finished sends; raise the first failure, log the others."""
        first: BaseException | None = None
        for fut in [f for f in self._pending if f.done()]:
            del self._pending[fut]
            exc = fut.exception() if not fut.cancelled() else Misuse("send was cancelled")
            if exc is None:
                continue
            if first is None:
                first = exc
            else:
                log.error("DataCtx: another batch failed too: %s", exc)
        if first is not None:
            raise first

    async def _workers_ready(self) -> None:
        """Wait (once, shared by the sends in flight) until every worker answered; a
        failure fails the waiting sends, and the next send waits again."""
        ready = self._ready
        if ready is None:
            ready = self._ready = asyncio.ensure_future(
                self.wait_for_workers(self.startup_timeout_s))
        elif ready.done() and not ready.cancelled() and ready.exception() is None:
            return
        try:
            await asyncio.shield(ready)
        except PersiaError:
            if self._ready is ready:
                self._ready = None
            raise

    async def _deliver(self, wire_batch: dict, nbytes: int, seq: int) -> None:
        self._active += 1
        self._peak = max(self._peak, self._active)
        try:
            await self._workers_ready()
            await self._offer(wire_batch)
        except PersiaError as e:
            self._counts["failed"] += 1
            # Raised by a later call, so say which batch it was.
            raise type(e)(f"batch {seq} (counting send_data calls from 0): {e.message}",
                          field=e.field, hint=e.hint) from e
        except BaseException:
            self._counts["failed"] += 1
            raise
        finally:
            self._active -= 1
        self._counts["acked"] += 1
        self._counts["bytes"] += nbytes

    async def _offer(self, wire_batch: dict) -> None:
        """Offer the batch to the workers in turn until one takes it or time runs out."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_ms / 1000.0
        n = len(self._clients)
        # A lone worker is asked to wait the whole time: its ready buffer takes waiting
        # batches in the order they came, so pipelined sends keep theirs (re-offering a
        # batch after a shorter wait put it behind later ones). With several, a short wait
        # on a full one lets the next one take the batch.
        wait_ms = self.timeout_ms if n == 1 else 500
        delay = 0.05
        tried = 0
        while True:
            client = self._clients[self._next % n]
            self._next += 1
            wait = max(1, int(min(wait_ms, (deadline - loop.time()) * 1000)))
            try:
                await client.call("ingest", {"batch": wire_batch, "timeout_ms": wait},
                                  timeout_ms=wait + RPC_MARGIN_MS)
                return
            except (Backpressure, PeerUnavailable, RemoteTimeout) as e:
                last: PersiaError = e
            tried += 1
            self._counts["retries"] += 1
            if loop.time() >= deadline:
                break
            if tried % n == 0 and not isinstance(last, Backpressure):
                # Every worker unreachable: back off (a full one already waited).
                await asyncio.sleep(min(delay, max(0.0, deadline - loop.time())))
                delay = min(delay * 2, 1.0)
        if isinstance(last, Backpressure):
            raise Backpressure(f"no embedding worker had room for a batch within "
                               f"{self.timeout_ms} ms (last: {last.message})",
                               field="timeout_ms",
                               hint="the NN workers are not pulling batches fast enough, "
                                    "or raise timeout_ms") from last
        raise PeerUnavailable(f"no embedding worker of {self.workers} took a batch within "
                              f"{self.timeout_ms} ms (last: {last.message})",
                              field="embedding_workers",
                              hint="are the embedding workers running at these "
                                   "addresses?") from last
