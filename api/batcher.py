"""Micro-batching of concurrent inference requests.

Requests wait in one bounded queue. A single collector task takes the first waiting
request, then everything else already queued, up to ``max_rows`` samples; only when the
load is concurrent (the previous micro-batch held several requests, or more requests were
already waiting) does it also wait up to ``max_wait_s`` for stragglers, so a lone request
on an idle server is never delayed. Requests of one signature (same slots, same non-ID
feature shapes) share one forward pass; the caller's ``run`` gets each such group.

While ``run`` works (the forward happens on a thread), new requests queue up, which is
what makes batches grow with load. A full queue is :class:`Backpressure` (503).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from stream_persia.errors import Backpressure, InternalError, Misuse

__all__ = ["Job", "MicroBatcher"]

log = logging.getLogger(__name__)


@dataclass(eq=False)
class Job:
    """One request waiting for its share of a forward pass."""

    key: Hashable
    rows: int
    payload: Any
    future: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop()
                                   .create_future())


class MicroBatcher:
    """Collects :class:`Job` s and hands same-key groups to ``run``.

    Args:
        run: ``async run(jobs)``; must resolve every job's future (result or exception).
        max_rows: stop collecting once this many samples are in the micro-batch.
        max_wait_s: longest wait for more requests under concurrent load.
        max_queue: requests allowed to wait; beyond it ``submit`` raises Backpressure.
    """

    def __init__(self, run: Callable[[list[Job]], Awaitable[None]], *, max_rows: int = 1024,
                 max_wait_s: float = 0.002, max_queue: int = 4096):
        self._run = run
        self.max_rows = max_rows
        self.max_wait_s = max_wait_s
        self._queue: asyncio.Queue[Job | None] = asyncio.Queue(max_queue)  # None: stop
        self._task: asyncio.Task | None = None
        self._last_size = 1
        self._held: list[Job] = []   # taken off the queue by the collector, not yet resolved
        self._closed = False
        self.stats = {"batches": 0, "requests": 0, "rows": 0}

    @property
    def task(self) -> asyncio.Task | None:
        """The collector task while running (the API's supervisor watches it)."""
        return self._task

    async def start(self) -> None:
        if self._task is not None:
            raise Misuse("the micro-batcher is already started")
        self._task = asyncio.create_task(self._loop(), name="predict-batcher")
        self._task.add_done_callback(self._loop_ended)

    def _loop_ended(self, task: asyncio.Task) -> None:
        """A collector that died (a bug) fails the requests waiting on it and refuses new
        ones, instead of leaving them to hang; the API's supervisor reports it."""
        if task.cancelled() or task.exception() is None or self._closed:
            return
        self._closed = True
        err = InternalError(f"the inference micro-batcher stopped: {task.exception()!r}")
        held: list[Job | None] = list(self._held)
        self._held = []
        while not self._queue.empty():
            held.append(self._queue.get_nowait())
        for job in held:
            if job is not None and not job.future.done():
                job.future.set_exception(err)

    async def stop(self, drain_timeout_s: float = 30.0) -> None:
        """Refuse new requests, finish the queued ones, then end the collector."""
        self._closed = True
        task, self._task = self._task, None
        if task is None:
            return
        await self._queue.put(None)
        try:
            await asyncio.wait_for(asyncio.shield(task), drain_timeout_s)
        except TimeoutError:
            log.warning("inference requests still queued after %.0f s: cancelling them",
                        drain_timeout_s)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        while not self._queue.empty():
            job = self._queue.get_nowait()
            if job is not None and not job.future.done():
                job.future.set_exception(Backpressure("the API is shutting down"))

    def submit(self, job: Job) -> asyncio.Future:
        """Queue ``job``; await the returned future for its result."""
        if self._closed or self._task is None:
            raise Backpressure("the inference queue is not running (starting or shutting "
                               "down)", hint="retry shortly")
        try:
            self._queue.put_nowait(job)
        except asyncio.QueueFull:
            raise Backpressure(f"{self._queue.maxsize} inference requests are already "
                               f"waiting", hint="retry shortly, or add API replicas") from None
        return job.future

    async def _collect(self) -> tuple[list[Job], bool]:
        """The next micro-batch, and whether the stop sentinel was reached."""
        first = await self._queue.get()
        if first is None:
            return [], True
        jobs = self._held = [first]
        rows = first.rows
        concurrent = self._last_size > 1 or not self._queue.empty()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait_s
        while rows < self.max_rows:
            try:
                job = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                remaining = deadline - loop.time()
                if not concurrent or remaining <= 0:
                    break
                try:
                    job = await asyncio.wait_for(self._queue.get(), remaining)
                except TimeoutError:
                    break
            if job is None:
                return jobs, True
            jobs.append(job)
            rows += job.rows
        self._last_size = len(jobs)
        return jobs, False

    async def _loop(self) -> None:
        stop = False
        while not stop:
            jobs, stop = await self._collect()
            groups: dict[Hashable, list[Job]] = {}
            for job in jobs:
                groups.setdefault(job.key, []).append(job)
            for group in groups.values():
                live = [j for j in group if not j.future.done()]   # cancelled by their clients
                if not live:
                    continue
                self.stats["batches"] += 1
                self.stats["requests"] += len(live)
                self.stats["rows"] += sum(j.rows for j in live)
                try:
                    await self._run(live)
                except asyncio.CancelledError:
                    for j in live:
                        if not j.future.done():
                            j.future.set_exception(Backpressure("the API is shutting down"))
                    raise
                except Exception as e:  # run() must resolve futures; never leave one hanging
                    log.exception("micro-batch failed")
                    for j in live:
                        if not j.future.done():
                            j.future.set_exception(e)
            self._held = []
