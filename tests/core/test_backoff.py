"""stream_persia.core.backoff: bounded start-up retries, and a wait that never loses a cancel."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest

from stream_persia.core.backoff import retry_startup, wait_bounded
from stream_persia.errors import PeerUnavailable

pytestmark = pytest.mark.timeout(30)


async def test_wait_bounded_never_loses_a_cancellation():
    """asyncio.wait_for (3.10, 3.11) returns the result when the awaited future completes
    in the loop iteration its caller is cancelled in: the task then runs on, and whoever
    cancelled it to stop it waits for ever (KafkaIngest.stop did)."""
    waits = [wait_bounded] + ([asyncio.wait_for] if sys.version_info < (3, 12) else [])
    for wait in waits:
        inner = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(wait(inner, 10))
        await asyncio.sleep(0)            # the task waits on inner
        inner.set_result("done")
        task.cancel()                     # in the same iteration
        if wait is wait_bounded:
            with pytest.raises(asyncio.CancelledError):
                await task
        else:   # what the standard one does here before 3.12: the cancel is gone
            assert await task == "done"


async def test_wait_bounded_times_out_and_cancels_what_it_waited_for():
    inner = asyncio.ensure_future(asyncio.sleep(10))
    with pytest.raises(TimeoutError):
        await wait_bounded(inner, 0.05)
    assert inner.cancelled()
    assert await wait_bounded(asyncio.sleep(0, "x"), 1) == "x"


def give_up(e: BaseException, attempts: int, spent: float) -> PeerUnavailable:
    return PeerUnavailable(f"gave up after {attempts} attempts: {e}", field="peer")


async def test_retry_startup_retries_with_backoff_until_the_peer_answers(caplog):
    calls = []

    async def attempt() -> str:
        calls.append(time.monotonic())
        if len(calls) < 3:
            raise ConnectionRefusedError("not yet")
        return "up"

    assert await retry_startup(attempt, what="peer", timeout_s=10,
                               retry_on=(OSError,), give_up=give_up) == "up"
    gaps = [b - a for a, b in zip(calls, calls[1:], strict=False)]
    assert gaps[0] >= 0.2 and gaps[1] >= 0.45           # 0.25 s, then 0.5 s
    assert sum("not reachable yet" in r.message for r in caplog.records) == 2


async def test_retry_startup_gives_up_after_the_bound_and_not_on_other_errors():
    async def refused() -> None:
        raise ConnectionRefusedError("refused")

    t0 = time.monotonic()
    with pytest.raises(PeerUnavailable, match="gave up after .* attempts: refused"):
        await retry_startup(refused, what="peer", timeout_s=1, retry_on=(OSError,),
                            give_up=give_up)
    assert 1 <= time.monotonic() - t0 < 3

    async def broken() -> None:
        raise ValueError("bad credentials")

    t0 = time.monotonic()
    with pytest.raises(ValueError):
        await retry_startup(broken, what="peer", timeout_s=10, retry_on=(OSError,),
                            give_up=give_up)
    assert time.monotonic() - t0 < 1
