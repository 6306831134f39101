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
    assert buf.clear() == [b"x" * 500, b"y" * 80] and buf.bytes == 0


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
