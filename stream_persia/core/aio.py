"""Event-loop helpers: uvloop when available, and a loop thread for synchronous callers.

Every asyncio role (embedding worker, embedding server, API) runs on uvloop when it is
importable; :func:`new_event_loop` and :func:`run` make that choice in one place. Set
``STREAM_PERSIA_NO_UVLOOP=1`` (or true) to force the standard loop (e.g. to rule uvloop out while
debugging).

NN workers run synchronous PyTorch code, but talk to the other roles over asyncio RPC.
:class:`LoopThread` owns one event loop in a background thread and lets sync code run
coroutines on it::

    with LoopThread(name="nn-worker-rpc") as lt:
        client = RpcClient("127.0.0.1:7000")     # used only from coroutines run on lt
        result = lt.run(client.call("health"), timeout=5)
        lt.run(client.close())
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import sys
import threading
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

from stream_persia.core.switches import env_switch
from stream_persia.errors import Misuse

__all__ = ["LoopThread", "cancel_and_wait", "install_uvloop", "new_event_loop", "run",
           "run_until", "uvloop_available"]

T = TypeVar("T")
log = logging.getLogger(__name__)


async def cancel_and_wait(*tasks: asyncio.Task | None) -> None:
    """Cancel the background ``tasks`` (None: skipped) and wait until each has ended. A
    task that had failed instead is logged, not raised: stopping must go on."""
    live = [t for t in tasks if t is not None]
    for t in live:
        t.cancel()
    for t in live:
        try:
            await t
        except asyncio.CancelledError:
            pass
        except Exception:
            logging.getLogger(__name__).exception("background task %s had failed",
                                                  t.get_name())


def _uvloop():
    if env_switch("STREAM_PERSIA_NO_UVLOOP", False):
        return None
    try:
        import uvloop
    except ImportError:  # e.g. Windows, where uvloop does not exist
        return None
    return uvloop


def uvloop_available() -> bool:
    """Whether :func:`new_event_loop` returns a uvloop loop in this process."""
    return _uvloop() is not None


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop: uvloop's when available, else the standard one."""
    uvloop = _uvloop()
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def install_uvloop() -> bool:
    """Make uvloop the default for loops created by ``asyncio`` itself.

    Prefer :func:`run` / :func:`new_event_loop`, which do not change process-wide state;
    this is for code that calls ``asyncio.run`` directly (e.g. uvicorn's own startup).

    Returns:
        True when uvloop was installed, False when it is not available.
    """
    uvloop = _uvloop()
    if uvloop is None:
        return False
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return True


def run(main: Coroutine[Any, Any, T], *, debug: bool | None = None) -> T:
    """Run ``main`` to completion on a fresh loop (uvloop when available), like asyncio.run.

    Tasks still running when ``main`` returns are cancelled and awaited before the loop
    closes.
    """
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=new_event_loop, debug=debug) as runner:
            return runner.run(main)
    loop = new_event_loop()  # pragma: no cover - Python 3.10 only
    try:
        asyncio.set_event_loop(loop)
        if debug is not None:
            loop.set_debug(debug)
        return loop.run_until_complete(main)
    finally:
        _cancel_all(loop)
        asyncio.set_event_loop(None)
        loop.close()


if sys.version_info >= (3, 11):
    async def run_until(aw: Awaitable[T], deadline: float) -> T:
        """Await ``aw``, raising :class:`TimeoutError` at ``deadline`` (``loop.time()`` clock)."""
        async with asyncio.timeout_at(deadline):
            return await aw
else:  # pragma: no cover - Python 3.10 only
    async def run_until(aw: Awaitable[T], deadline: float) -> T:
        """Await ``aw``, raising :class:`TimeoutError` at ``deadline`` (``loop.time()`` clock)."""
        remaining = deadline - asyncio.get_running_loop().time()
        try:
            return await asyncio.wait_for(aw, max(0.0, remaining))
        except asyncio.TimeoutError as exc:
            raise TimeoutError() from exc


def _cancel_all(loop: asyncio.AbstractEventLoop) -> None:
    tasks = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            log.error("task %r failed while its loop shut down", task,
                      exc_info=task.exception())
    loop.run_until_complete(loop.shutdown_asyncgens())


class LoopThread:
    """A background thread owning one event loop, for running coroutines from sync code.

    The loop is uvloop's when available. Objects bound to a loop (an ``RpcClient``, an
    ``RpcServer``) must only be used from coroutines run on this thread's loop.

    Args:
        name: thread name (shows in stack dumps and logs).
        debug: asyncio debug mode for the loop.

    Raises:
        Misuse: from :meth:`run`/:meth:`submit` after :meth:`close`, or from :meth:`run`
            called on the loop thread itself (it would deadlock).
    """

    def __init__(self, name: str = "stream-persia-loop", *, debug: bool = False):
        self.name = name
        self._ready = threading.Event()
        self._closed = False
        self._close_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(debug,), name=name,
                                        daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._startup_error is not None:
            raise self._startup_error

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop this thread runs (for ``call_soon_threadsafe`` and friends)."""
        assert self._loop is not None
        return self._loop

    def _main(self, debug: bool) -> None:
        try:
            loop = new_event_loop()
            loop.set_debug(debug)
            asyncio.set_event_loop(loop)
            self._loop = loop
        except BaseException as exc:  # surfaced to the constructor's caller
            self._startup_error = exc
            self._ready.set()
            return
        self._ready.set()
        try:
            loop.run_forever()
        finally:
            try:
                _cancel_all(loop)
            finally:
                asyncio.set_event_loop(None)
                loop.close()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the loop; returns a thread-safe future of its result.

        Cancelling the returned future cancels the coroutine's task.
        """
        if self._closed:
            coro.close()
            raise Misuse(f"LoopThread {self.name!r} is closed; cannot submit {coro!r}",
                         hint="create a new LoopThread, or submit before close()")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block until it returns (or raises).

        Args:
            coro: the coroutine to run.
            timeout: seconds to wait; on expiry the coroutine is cancelled and
                :class:`TimeoutError` is raised. None waits forever.
        """
        if threading.current_thread() is self._thread:
            coro.close()
            raise Misuse(f"LoopThread.run() called from the loop thread {self.name!r} itself",
                         hint="inside the loop, `await` the coroutine instead")
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            # On 3.11+ concurrent.futures.TimeoutError is the builtin TimeoutError, which
            # the coroutine itself may raise (RemoteTimeout): that is its result, not ours.
            if fut.done():
                raise
            fut.cancel()
            raise TimeoutError(
                f"coroutine did not finish within {timeout} s on LoopThread {self.name!r}; "
                "it was cancelled") from None

    def close(self, timeout: float | None = 10.0) -> None:
        """Cancel what still runs on the loop, stop it and join the thread. Idempotent."""
        if threading.current_thread() is self._thread:
            raise Misuse("LoopThread.close() called from the loop thread itself",
                         hint="call close() from the thread that created the LoopThread")
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        with contextlib.suppress(RuntimeError):  # loop already stopped and closed
            self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("LoopThread %r did not stop within %s s", self.name, timeout)

    def __enter__(self) -> LoopThread:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
