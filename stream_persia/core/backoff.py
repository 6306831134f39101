"""Bounded start-up retries with exponential backoff, for a role whose peers come up later.

A role started by an orchestrator (Kubernetes, docker-compose, ``stream-persia run``) may
start before the peers it needs at start: the Kafka brokers, or, for a broker-less data
loader, the embedding workers. :func:`retry_startup` tries to reach them until a total
time has passed, waiting 0.25 s, 0.5 s, 1 s, ... (at most 5 s) between attempts and
logging each failure with the time left, then gives up with the error its caller builds
(which names the peer and the setting that bounds the wait).

Only the failures the caller names as "not there yet" are retried (a refused or timed-out
connection); anything else (bad credentials, a missing topic) fails at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["retry_startup", "wait_bounded", "FIRST_DELAY_S", "MAX_DELAY_S"]

T = TypeVar("T")
log = logging.getLogger(__name__)

FIRST_DELAY_S = 0.25
MAX_DELAY_S = 5.0
MIN_ATTEMPT_S = 2.0   # the least one attempt gets, even when less of the total is left
_CLEANUP_S = 5.0      # how long a cancelled inner awaitable may take to clean up


async def wait_bounded(aw: Awaitable[T], timeout_s: float | None) -> T:
    """``await aw`` for at most ``timeout_s`` (then ``TimeoutError``; None: no bound), like
    ``asyncio.wait_for``, except that a cancellation of the caller is never lost:
    Python 3.10/3.11's ``wait_for`` returns the result instead of raising
    ``CancelledError`` when the inner awaitable finished in the same loop iteration as
    the cancel, and a task stopped that way runs on. The inner awaitable is cancelled
    either way, and given up to 5 s to clean up.

    A result the inner awaitable produced as its caller was cancelled is dropped, so do
    not wrap one that takes something a caller must give back (``Semaphore.acquire``:
    that permit would leak); wait for the condition, then take the thing.
    """
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout_s)
    except BaseException:
        task.cancel()
        await asyncio.wait({task}, timeout=_CLEANUP_S)
        raise
    if not done:
        task.cancel()
        await asyncio.wait({task}, timeout=_CLEANUP_S)
        if not task.cancelled() and task.done() and task.exception() is None:
            return task.result()   # it finished as it was cancelled
        raise TimeoutError
    return task.result()


async def retry_startup(attempt: Callable[[], Awaitable[T]], *, what: str, timeout_s: float,
                        retry_on: tuple[type[BaseException], ...],
                        give_up: Callable[[BaseException, int, float], BaseException]) -> T:
    """Run ``attempt()`` until it succeeds or ``timeout_s`` have passed.

    Args:
        attempt: one try; it must clean up after itself when it fails (or is cancelled:
            an attempt that hangs is cancelled once the time left, but at least
            ``MIN_ATTEMPT_S``, has passed).
        what: the peer, for the log ("Kafka at host:9092").
        timeout_s: the total time to keep trying (0: one attempt).
        retry_on: the exceptions that mean "not reachable yet".
        give_up: builds the error raised after the last failure, from that failure, the
            number of attempts and the seconds spent.

    Returns:
        What the successful attempt returned.
    """
    start = time.monotonic()
    deadline = start + max(0.0, timeout_s)
    delay = FIRST_DELAY_S
    attempts = 0
    while True:
        attempts += 1
        try:
            result = await wait_bounded(
                attempt(), max(MIN_ATTEMPT_S, deadline - time.monotonic()))
        except retry_on as e:
            left = deadline - time.monotonic()
            if left <= 0:
                raise give_up(e, attempts, time.monotonic() - start) from e
            wait = min(delay, left)
            log.warning("%s: not reachable yet (%s); retrying in %.2f s, giving up in "
                        "%.1f s", what, _reason(e), wait, left)
            await asyncio.sleep(wait)
            delay = min(delay * 2, MAX_DELAY_S)
            continue
        if attempts > 1:
            log.info("%s reached after %d attempts (%.1f s)", what, attempts,
                     time.monotonic() - start)
        return result


def _reason(e: BaseException) -> str:
    return str(e) or type(e).__name__
