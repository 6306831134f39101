"""The inference micro-batcher on its own (no HTTP, no model): what concurrent requests see.

``run`` here is a small async function standing in for the model's forward pass; the
batcher itself (queue, collector task, grouping, error fan-out, stop) is the real one.
"""

from __future__ import annotations

import asyncio

import pytest
from stream_persia.api.batcher import Job, MicroBatcher

from stream_persia.errors import Backpressure, InternalError, Misuse

pytestmark = pytest.mark.timeout(20)


class Model:
    """A forward pass that records the groups it was given and can be held or made to
    fail; each job's result is ``(key, payload)``."""

    def __init__(self) -> None:
        self.calls: list[list[Job]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.entered = asyncio.Event()
        self.fail_keys: set = set()

    async def __call__(self, jobs: list[Job]) -> None:
        self.calls.append(jobs)
        self.entered.set()
        await self.gate.wait()
        if jobs[0].key in self.fail_keys:
            raise ValueError(f"model broke on {jobs[0].key}")
        for j in jobs:
            j.future.set_result((j.key, j.payload))

    def hold(self) -> None:
        self.gate.clear()
        self.entered.clear()

    def payloads(self) -> list[list]:
        return [[j.payload for j in call] for call in self.calls]


async def started(model: Model, **kw) -> MicroBatcher:
    b = MicroBatcher(model, **kw)
    await b.start()
    return b


async def test_a_lone_request_on_an_idle_batcher_is_not_held_for_stragglers():
    model = Model()
    b = await started(model, max_wait_s=60)
    try:
        # With the straggler wait applied to a lone request this would take 60 s.
        assert await asyncio.wait_for(b.submit(Job("k", 1, "a")), 5) == ("k", "a")
        assert model.payloads() == [["a"]]
    finally:
        await b.stop()


async def test_requests_queued_during_a_forward_share_one_and_are_grouped_by_key():
    model = Model()
    b = await started(model, max_wait_s=0.01)
    try:
        model.hold()
        first = b.submit(Job("x", 1, "first"))
        await asyncio.wait_for(model.entered.wait(), 5)     # the forward of 'first' runs
        later = [b.submit(Job(k, 1, p)) for k, p in
                 [("x", "x1"), ("y", "y1"), ("x", "x2"), ("y", "y2")]]
        model.gate.set()
        results = await asyncio.wait_for(asyncio.gather(first, *later), 5)
        assert results == [("x", "first"), ("x", "x1"), ("y", "y1"), ("x", "x2"),
                           ("y", "y2")]
        # One micro-batch after the first, one forward per key, queue order kept inside.
        assert model.payloads() == [["first"], ["x1", "x2"], ["y1", "y2"]]
        assert b.stats == {"batches": 3, "requests": 5, "rows": 5}
    finally:
        await b.stop()


async def test_max_rows_closes_a_micro_batch():
    model = Model()
    b = await started(model, max_rows=5)
    try:
        model.hold()
        b.submit(Job("k", 1, "held"))
        await asyncio.wait_for(model.entered.wait(), 5)
        futures = [b.submit(Job("k", 2, f"r{i}")) for i in range(5)]
        model.gate.set()
        await asyncio.wait_for(asyncio.gather(*futures), 5)
        # Rows 2+2+2 reach max_rows=5 at the third request: it closes the batch.
        assert model.payloads() == [["held"], ["r0", "r1", "r2"], ["r3", "r4"]]
    finally:
        await b.stop()


async def test_a_full_queue_is_backpressure_and_takes_requests_again_once_drained():
    model = Model()
    b = await started(model, max_queue=2)
    try:
        model.hold()
        b.submit(Job("k", 1, "running"))
        await asyncio.wait_for(model.entered.wait(), 5)    # taken off the queue
        waiting = [b.submit(Job("k", 1, "q1")), b.submit(Job("k", 1, "q2"))]
        with pytest.raises(Backpressure) as err:
            b.submit(Job("k", 1, "refused"))
        assert "2 inference requests are already waiting" in str(err.value)
        model.gate.set()
        await asyncio.wait_for(asyncio.gather(*waiting), 5)
        assert await asyncio.wait_for(b.submit(Job("k", 1, "again")), 5) == ("k", "again")
        assert "refused" not in [p for call in model.payloads() for p in call]
    finally:
        await b.stop()


async def test_a_model_error_fails_every_request_of_its_group_and_the_batcher_goes_on():
    model = Model()
    model.fail_keys = {"bad"}
    b = await started(model, max_wait_s=0.01)
    try:
        model.hold()
        b.submit(Job("ok", 1, "warm"))
        await asyncio.wait_for(model.entered.wait(), 5)
        bad = [b.submit(Job("bad", 1, f"b{i}")) for i in range(3)]
        good = b.submit(Job("ok", 1, "g"))   # same micro-batch, another signature
        model.gate.set()
        outcomes = await asyncio.wait_for(
            asyncio.gather(*bad, good, return_exceptions=True), 5)
        assert all(isinstance(o, ValueError) and "model broke on bad" in str(o)
                   for o in outcomes[:3]), outcomes
        assert outcomes[3] == ("ok", "g")
        # The collector survived the error: later requests, even of the failing key's
        # neighbours, are served.
        assert await asyncio.wait_for(b.submit(Job("ok", 1, "after")), 5) == ("ok", "after")
        assert b.task is not None and not b.task.done()
    finally:
        await b.stop()


async def test_a_run_that_raises_half_way_fails_only_the_requests_it_left_unresolved():
    """run() must resolve every future; when it raises half-way, those it did not resolve
    get its error, and those it did keep their result."""
    gate = asyncio.Event()

    async def half(jobs: list[Job]) -> None:
        await gate.wait()
        jobs[0].future.set_result("done")
        raise RuntimeError("after the first")

    b = MicroBatcher(half, max_wait_s=0.05)
    await b.start()
    try:
        first = b.submit(Job("k", 1, 0))
        await asyncio.sleep(0.05)           # its forward waits at the gate
        rest = [b.submit(Job("k", 1, i)) for i in (1, 2)]
        gate.set()
        out = await asyncio.wait_for(asyncio.gather(first, *rest, return_exceptions=True), 5)
        assert out[0] == "done" and out[1] == "done"
        assert isinstance(out[2], RuntimeError) and "after the first" in str(out[2])
    finally:
        await b.stop()


async def test_a_request_cancelled_by_its_client_is_not_run():
    model = Model()
    b = await started(model, max_wait_s=0.01)
    try:
        model.hold()
        b.submit(Job("k", 1, "held"))
        await asyncio.wait_for(model.entered.wait(), 5)
        gone = b.submit(Job("k", 1, "gone"))
        kept = b.submit(Job("k", 1, "kept"))
        gone.cancel()                       # its HTTP client went away
        model.gate.set()
        assert await asyncio.wait_for(kept, 5) == ("k", "kept")
        assert model.payloads() == [["held"], ["kept"]]
        assert b.stats["requests"] == 2
    finally:
        await b.stop()


async def test_stop_finishes_queued_requests_then_refuses_new_ones():
    model = Model()
    b = await started(model)
    model.hold()
    running = b.submit(Job("k", 1, "running"))
    await asyncio.wait_for(model.entered.wait(), 5)
    queued = b.submit(Job("k", 1, "queued"))
    stopping = asyncio.ensure_future(b.stop(drain_timeout_s=10))
    await asyncio.sleep(0.02)
    with pytest.raises(Backpressure):      # refused as soon as the stop began
        b.submit(Job("k", 1, "late"))
    model.gate.set()
    await asyncio.wait_for(stopping, 5)
    assert (running.result(), queued.result()) == (("k", "running"), ("k", "queued"))
    assert b.task is None


async def test_stop_past_its_drain_timeout_fails_what_is_left_instead_of_hanging():
    model = Model()
    b = await started(model)
    model.hold()                            # the forward never ends
    running = b.submit(Job("k", 1, "running"))
    await asyncio.wait_for(model.entered.wait(), 5)
    queued = b.submit(Job("k", 1, "queued"))
    await asyncio.wait_for(b.stop(drain_timeout_s=0.1), 5)
    for fut in (running, queued):
        assert isinstance(fut.exception(), Backpressure)
        assert "shutting down" in str(fut.exception())


async def test_submit_before_start_and_a_second_start_are_refused():
    b = MicroBatcher(Model())
    with pytest.raises(Backpressure):
        b.submit(Job("k", 1, "early"))
    await b.start()
    try:
        with pytest.raises(Misuse):
            await b.start()
    finally:
        await b.stop()


async def test_a_crashed_collector_fails_every_request_it_held_and_refuses_new_ones():
    """A bug in the collector (here a job whose row count is not a number) ends its task;
    every request waiting on it fails with InternalError at once, including those the
    collector had already taken off the queue, rather than waiting out their timeout."""
    model = Model()
    b = await started(model, max_wait_s=0.01)
    model.hold()
    b.submit(Job("k", 1, "held"))
    await asyncio.wait_for(model.entered.wait(), 5)
    poisoned = b.submit(Job("k", None, "poison"))   # type: ignore[arg-type]
    queued = b.submit(Job("k", 1, "queued"))
    model.gate.set()
    done, _ = await asyncio.wait({poisoned, queued}, timeout=5)
    assert done == {poisoned, queued}, "a request held by the crashed collector hangs"
    for fut in (poisoned, queued):
        assert isinstance(fut.exception(), InternalError)
    assert b.task is not None and b.task.done()
    with pytest.raises(Backpressure):
        b.submit(Job("k", 1, "after"))
    with pytest.raises(TypeError):          # stop() awaits the task: its error is raised
        await b.stop()
