"""How launched processes stop on a signal.

- ``stream-persia run`` (:mod:`stream_persia.launch.run`), in its main thread:
  :class:`StopSignals` turns SIGINT, SIGTERM and SIGHUP alike into :class:`Stopped`, so
  each one stops every role as Ctrl-C does.
- Each role (:mod:`stream_persia.launch.roles`), on its event loop: :func:`stop_signals`
  gives the event SIGTERM and SIGINT set, :func:`until_signal` waits for it (or for a
  supervised task's failure) and :func:`unless_stopped` runs a start-up step that a signal
  cuts short; the role then drains.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Iterator
from typing import Any

__all__ = ["STOP_SIGNALS", "StopSignals", "Stopped", "stop_signals", "unless_stopped",
           "until_signal"]

log = logging.getLogger(__name__)


class Stopped(BaseException):
    """A stop signal (SIGINT, SIGTERM, SIGHUP) arrived; the run exits ``128 + signum``."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopSignals:
    """Turns SIGINT, SIGTERM and SIGHUP into :class:`Stopped` in the main thread while
    installed (a context manager), so that every one of them stops the roles as Ctrl-C does.

    The roles run in their own sessions (:class:`~stream_persia.launch.processes.RoleProcess`), so a
    signal for this process never reaches them by itself: without this, SIGTERM would end
    ``run`` and leave them running. Inside :meth:`deferred` (while a role is spawned, so
    none can escape unrecorded) a signal is raised on leaving it. Once one was raised,
    the run is stopping: a later signal is raised only inside :meth:`interruptible` (it
    cuts the wait for the final checkpoint short) and ignored elsewhere, and inside
    :meth:`shielded` (while the roles are stopped) every signal is ignored.
    """

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._defer = 0
        self._shield = False
        self._stopping = False
        self._interruptible = False
        self._pending: int | None = None

    def __enter__(self) -> StopSignals:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: Any) -> None:
        if self._shield or (self._stopping and not self._interruptible):
            return
        if self._defer:
            self._pending = self._pending or signum
            return
        self._stopping = True
        raise Stopped(signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._defer += 1
        try:
            yield
        finally:
            self._defer -= 1
        if not self._defer and self._pending is not None:
            signum, self._pending = self._pending, None
            self._stopping = True
            raise Stopped(signum)

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    @contextlib.contextmanager
    def shielded(self) -> Iterator[None]:
        self._shield = True
        try:
            yield
        finally:
            self._shield = False


def stop_signals() -> asyncio.Event:
    """An event that SIGTERM and SIGINT set from now on (on the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    return stop


async def unless_stopped(step: Awaitable[object], stop: asyncio.Event) -> bool:
    """Run a start-up step (an embedding worker waiting for its broker: up to
    ``kafka.startup_timeout_ms``; or for its servers' well-known ports); False, with the
    step cancelled, if SIGTERM/SIGINT came first."""
    task = asyncio.ensure_future(step)
    waiting = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait([task, waiting], return_when=asyncio.FIRST_COMPLETED)
    finally:
        waiting.cancel()
    if task.done():
        task.result()
        return True
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    log.info("signal received while starting: stopping")
    return False


async def until_signal(failed: asyncio.Event | None = None,
                        stop: asyncio.Event | None = None) -> bool:
    """Wait for SIGTERM/SIGINT (``stop``, from :func:`stop_signals`), or for ``failed`` (a
    supervised task of the role failed); True in the second case."""
    if stop is None:
        stop = stop_signals()
    waits = [asyncio.ensure_future(stop.wait())]
    if failed is not None:
        waits.append(asyncio.ensure_future(failed.wait()))
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waits:
            w.cancel()
    if stop.is_set():
        log.info("signal received: draining")
        return False
    return True
