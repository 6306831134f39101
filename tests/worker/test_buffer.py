"""The ready buffer's bounds: items and bytes (no sockets)."""

from __future__ import annotations

import asyncio

import pytest

from stream_persia.errors import Backpressure, Misuse
from stream_persia.worker.buffer import BoundedBuffer


def sized(max_bytes: int, maxsize: int = 10) -> BoundedBuffer[bytes]:
    return BoundedBuffer(maxsize, "ready buffer", max_bytes=max_bytes, size_of=len)


async def test_put_waits_while_the_item_would_pass_the_byte_budget():
    buf = sized(100)
    await buf.put(b"a" * 60)
    assert not buf.full() and buf.full(b"b" * 50) and not buf.full(b"b" * 40)
    with pytest.raises(Backpressure) as err:
        await buf.put(b"b" * 50, timeout=0.05)
    assert "60 bytes" in str(err.value)
    waiting = asyncio.ensure_future(buf.put(b"b" * 50))
    await asyncio.sleep(0.01)
    assert not waiting.done() and len(buf) == 1
    assert await buf.get() == b"a" * 60
    await asyncio.wait_for(waiting, 1)
    assert (len(buf), buf.bytes) == (1, 50)


async def test_one_item_always_fits_an_empty_buffer_and_put_front_may_exceed():
    buf = sized(100)
    await buf.put(b"x" * 500, timeout=0.05)   # larger than the budget, alone: let in
    assert buf.full() and buf.bytes == 500
    item = await buf.get()
    await buf.put(b"y" * 80)
    await buf.put_front(item)                 # a served batch returned: never refused
    assert (len(buf), buf.bytes) == (2, 580)
    assert await buf.clear() == [b"x" * 500, b"y" * 80] and buf.bytes == 0


async def test_the_count_still_bounds_small_items():
    buf = sized(1 << 20, maxsize=2)
    await buf.put(b"a")
    await buf.put(b"b")
    assert buf.full() and buf.full(b"c")
    with pytest.raises(Backpressure):
        await buf.put(b"c", timeout=0.01)


def test_a_byte_budget_needs_a_size():
    with pytest.raises(Misuse) as err:
        BoundedBuffer(4, max_bytes=100)
    assert err.value.field == "max_bytes"
    with pytest.raises(Misuse):
        BoundedBuffer(4, max_bytes=0, size_of=len)


def test_the_byte_budget_is_a_validated_config_key():
    from stream_persia.config import GlobalConfig
    from stream_persia.errors import ConfigError

    assert GlobalConfig.from_dict({}).embedding_worker_config.ready_buffer_bytes == 32 << 20
    with pytest.raises(ConfigError) as err:
        GlobalConfig.from_dict({"embedding_worker_config": {"ready_buffer_bytes": 1000}})
    assert "ready_buffer_bytes" in str(err.value)


async def test_a_wait_cancelled_as_it_ends_neither_takes_nor_adds_an_item():
    """The worker's RPC handlers wait in get/put and are cancelled when it stops; an item
    (or room) arriving in the loop iteration of the cancel must not be taken (or filled)
    by a caller that is gone: asyncio.wait_for, before 3.12, returned and lost the cancel."""
    buf: BoundedBuffer[str] = BoundedBuffer(1, "ready buffer")
    getter = asyncio.ensure_future(buf.get(timeout=10))
    for _ in range(3):
        await asyncio.sleep(0)            # the getter waits for an item
    await buf.put("batch")                # wakes it ...
    getter.cancel()                       # ... in the iteration it is cancelled in
    with pytest.raises(asyncio.CancelledError):
        await getter
    assert len(buf) == 1, "a cancelled get took the item"

    putter = asyncio.ensure_future(buf.put("late", timeout=10))
    for _ in range(3):
        await asyncio.sleep(0)            # the putter waits for room
    assert await buf.get() == "batch"     # makes room ...
    putter.cancel()                       # ... in the iteration it is cancelled in
    with pytest.raises(asyncio.CancelledError):
        await putter
    assert len(buf) == 0, "a cancelled put added its item"


# ------------------------------------------------------------------ put_front
async def test_put_front_returns_an_item_ahead_of_everything_queued():
    buf: BoundedBuffer[str] = BoundedBuffer(8, "ready buffer")
    for item in ("a", "b", "c"):
        await buf.put(item)
    taken = [await buf.get(), await buf.get()]
    assert taken == ["a", "b"]
    # The worker returns served batches newest first, so the oldest ends up at the head.
    for item in reversed(taken):
        await buf.put_front(item)
    await buf.put("d")
    assert [await buf.get(timeout=0) for _ in range(4)] == ["a", "b", "c", "d"]
    assert await buf.get(timeout=0) is None


async def test_put_front_into_a_full_buffer_never_waits_and_a_put_waits_below_the_bound():
    """The docstring's promise: a returned item goes in even when the buffer is full,
    exceeding the bound by that item; it does not take the room a waiting put wants."""
    buf: BoundedBuffer[str] = BoundedBuffer(2, "ready buffer")
    await buf.put("a")
    await buf.put("b")
    taken = await buf.get()
    await buf.put("c")                                  # full again: b, c
    await asyncio.wait_for(buf.put_front(taken), 1)     # never refused nor held
    assert len(buf) == 3 and buf.full()
    waiting = asyncio.ensure_future(buf.put("d"))
    assert await buf.get() == "a"                       # 2 left: still at the bound
    await asyncio.sleep(0.01)
    assert not waiting.done(), "a put went past maxsize after a put_front"
    assert await buf.get() == "b"                       # 1 left: room
    await asyncio.wait_for(waiting, 1)
    assert await buf.clear() == ["c", "d"]


async def test_put_front_counts_its_bytes_and_may_pass_the_byte_budget():
    buf = sized(100)
    await buf.put(b"a" * 70)
    await buf.put(b"b" * 30)
    assert buf.full() and buf.bytes == 100
    item = await buf.get()
    await buf.put(b"c" * 60)                            # 30 + 60 fits
    await buf.put_front(item)
    assert (len(buf), buf.bytes) == (3, 160)
    with pytest.raises(Backpressure) as err:
        await buf.put(b"d", timeout=0.02)
    assert "160 bytes" in str(err.value)
    for _ in range(3):
        await buf.get()
    assert (len(buf), buf.bytes) == (0, 0)              # what put_front added came off


async def test_put_front_wakes_a_waiting_get():
    buf: BoundedBuffer[str] = BoundedBuffer(1, "ready buffer")
    getter = asyncio.ensure_future(buf.get(timeout=10))
    await asyncio.sleep(0.01)
    assert not getter.done()
    await buf.put_front("returned")
    assert await asyncio.wait_for(getter, 1) == "returned"


async def test_a_put_arriving_as_room_comes_free_goes_behind_the_waiting_one():
    """Room freed by a get wakes the waiting put, but a put already scheduled in that loop
    iteration (an ingest frame read just before) ran first and took the room: pipelined
    sends from one data loader reached the ready buffer out of order."""
    buf: BoundedBuffer[str] = BoundedBuffer(1, "ready buffer")
    await buf.put("a")
    waiting = asyncio.ensure_future(buf.put("b"))
    await asyncio.sleep(0.01)
    assert not waiting.done() and buf.full() and buf.full("c")
    newcomer = asyncio.ensure_future(buf.put("c"))   # scheduled before the get wakes "b"
    assert await buf.get() == "a"
    await asyncio.wait_for(waiting, 1)
    assert not newcomer.done() and len(buf) == 1
    assert [await buf.get(), await buf.get()] == ["b", "c"]
    await asyncio.wait_for(newcomer, 1)


async def test_a_smaller_item_that_fits_waits_behind_a_larger_one_that_does_not():
    buf = sized(100)
    await buf.put(b"a" * 60)
    big = asyncio.ensure_future(buf.put(b"b" * 50))
    await asyncio.sleep(0.01)
    small = asyncio.ensure_future(buf.put(b"c" * 30))   # would fit on its own
    await asyncio.sleep(0.01)
    assert not big.done() and not small.done() and buf.full(b"d")
    got = [await buf.get(1) for _ in range(3)]
    assert got == [b"a" * 60, b"b" * 50, b"c" * 30]
    await asyncio.wait_for(asyncio.gather(big, small), 1)


async def test_a_waiting_put_that_times_out_lets_the_next_one_in():
    buf: BoundedBuffer[str] = BoundedBuffer(1, "ready buffer")
    await buf.put("a")
    first = asyncio.ensure_future(buf.put("b", timeout=0.05))
    await asyncio.sleep(0.01)
    second = asyncio.ensure_future(buf.put("c"))
    with pytest.raises(Backpressure):
        await first
    assert not second.done()
    assert await buf.get() == "a"
    await asyncio.wait_for(second, 1)
    assert await buf.get() == "c" and not buf.full("d")


async def test_a_clear_lets_the_waiting_puts_in_at_once():
    """A restore clears the ready buffer: the puts waiting for room go in at once (they
    waited, each behind the one before, for a wake-up the clear did not give, and a new
    put queued behind them for the whole of their timeouts)."""
    buf: BoundedBuffer[str] = BoundedBuffer(1, "ready buffer")
    await buf.put("a")
    waiting = asyncio.ensure_future(buf.put("b", timeout=5))
    await asyncio.sleep(0.01)
    assert await buf.clear() == ["a"]
    await asyncio.wait_for(waiting, 1)
    newcomer = asyncio.ensure_future(buf.put("c", timeout=5))
    assert await buf.get(1) == "b"
    await asyncio.wait_for(newcomer, 1)
    assert await buf.get(1) == "c"
