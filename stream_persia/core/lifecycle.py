"""How role processes stop: a drain requested by a signal, and children that never
outlive their parent.

**Drain requests** (:data:`drain`, one per process). An NN rank stops at a step boundary
when a stop is requested: the ``DataLoader`` over the stream ends its iteration there (with
several ranks, at the same step on every rank: they all-reduce whether to go on before each
step), hands its prefetched but untrained batches back to their workers and waits for
every pending gradient push; the script's own code then leaves its ``TrainCtx`` as at the
end of the stream. A stop is requested by

- SIGTERM, while :meth:`Drain.install` (the rank entry :mod:`stream_persia.launch.rank`, for the
  whole process) or a ``TrainCtx`` (for its lifetime, where SIGTERM had its default action)
  holds the handler. Before a ``TrainCtx`` there is nothing to drain: the handler raises
  :class:`StopRequested` (the rank entry exits 0). After one was left, training is over
  (perhaps on another rank's stop, which every rank agrees on at each step) and the
  script finishes its own work (evaluating, saving) undisturbed. A second SIGTERM takes the default
  action (the process dies): that is how ``torchrun`` ends ranks that did not drain in time;
- the stop file: ``stream-persia launch nn-worker`` creates it (on SIGTERM or SIGINT) to
  ask every rank of its node to drain, since ``torchrun`` passes signals on only to kill
  its ranks (and then fails with a traceback); the ranks look for it every
  :data:`POLL_S`;
- the parent process disappearing (see below).

**Children die with their parent.** ``stream-persia run`` and the tests start roles in
their own sessions (:class:`~stream_persia.launch.processes.RoleProcess`), so nothing stops them when
the starter dies, not even ``kill -9``. A role started with ``PERSIA_PARENT_PID`` in its
environment (``RoleProcess`` sets it) watches its parent process (:class:`ParentWatch`,
one thread, every :data:`POLL_S`): once its parent pid is no longer that one (the starter
died; the role was re-parented), the role sends itself SIGTERM and drains as usual. A
watch on the parent pid (not ``PR_SET_PDEATHSIG``) because the kernel's death signal
follows the *thread* that forked the child, and starters fork from worker threads
(``asyncio.to_thread`` in the tests) that end long before the starter does.
``launch nn-worker`` gives ``torchrun`` ``PR_SET_PDEATHSIG`` (:func:`die_with_parent`; it
forks it from its main thread), and each rank watches ``torchrun``.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["PARENT_PID_ENV", "POLL_S", "STOP_FILE_ENV", "Drain", "ParentWatch",
           "StopRequested", "descendants", "die_with_parent", "drain"]

log = logging.getLogger(__name__)

#: The pid of the process that started a role; the role stops when that parent is gone.
PARENT_PID_ENV = "PERSIA_PARENT_PID"
#: The file whose existence asks the NN ranks of a node to drain (set by launch nn-worker).
STOP_FILE_ENV = "PERSIA_NN_STOP_FILE"
#: How often the watches look (seconds): the delay between a cause and the drain request.
POLL_S = 0.25


class StopRequested(BaseException):
    """A stop was requested where there is nothing to drain (outside a ``TrainCtx``): it
    unwinds the script, as KeyboardInterrupt would, and the rank exits 0."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Drain:
    """The process's stop request (module docstring). Thread-safe; the signal handler runs
    in the main thread."""

    def __init__(self) -> None:
        self._requested = threading.Event()
        self._lock = threading.Lock()
        self.reason: str | None = None
        self._training = 0
        self._trained = False      # a TrainCtx was entered and left in this process
        self._installed = False
        self._pid = os.getpid()
        self._watches: list[Any] = []

    @property
    def requested(self) -> bool:
        return self._requested.is_set()

    def request(self, reason: str) -> bool:
        """Ask for a drain; True the first time (later requests change nothing)."""
        with self._lock:
            if self._requested.is_set():
                return False
            self.reason = reason
            self._requested.set()
        log.warning("stop requested (%s): training stops at the next step boundary, "
                    "untrained batches go back to their workers", reason)
        return True

    # ------------------------------------------------------------------ signal handler
    def install(self, *, stop_file: str | None = None, watch_parent: int | None = None) -> None:
        """Handle SIGTERM for the rest of the process (main thread only), and start the
        watches: ``stop_file`` (a drain once it exists) and ``watch_parent`` (a drain once
        the parent pid is no longer this one)."""
        self._pid = os.getpid()
        signal.signal(signal.SIGTERM, self._on_signal)
        self._installed = True
        if stop_file:
            self._watch(_StopFileWatch(Path(stop_file), self._from_watch))
        if watch_parent is not None:
            self._watch(ParentWatch(watch_parent, lambda: self._from_watch(
                f"parent process {watch_parent} is gone")))

    def _watch(self, watch: Any) -> None:
        self._watches.append(watch)
        watch.start()

    def _from_watch(self, reason: str) -> None:
        # Through the signal handler, in the main thread: outside training it must raise
        # there (StopRequested), which no other thread can do.
        if not self.requested:
            self.reason = reason
            os.kill(os.getpid(), signal.SIGTERM)

    def _on_signal(self, signum: int, _frame: Any) -> None:
        reason = self.reason if self.reason and not self.requested else \
            signal.Signals(signum).name
        if os.getpid() != self._pid or not self.request(reason):
            # A forked child (a torch DataLoader worker) inherits the handler but has
            # nothing to drain; in this process, the second signal is a hard stop
            # (torchrun ending a rank that did not drain in time).
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self._training:
            return
        if self._trained:
            # Training is over (it may have ended on another rank's stop: the ranks agree
            # each step): the script is on its own way out, saving what it trained; a stop
            # must not unwind that. A second signal still stops the process at once.
            log.warning("stop requested (%s) after training: the script finishes its own "
                        "work (a second SIGTERM stops it at once)", reason)
            return
        raise StopRequested(reason)

    # ------------------------------------------------------------------ TrainCtx
    def enter_training(self) -> Callable[[], None]:
        """A ``TrainCtx`` was entered: a stop request drains it from now on instead of
        unwinding. Where nothing handles SIGTERM yet (a script run without the rank entry)
        the handler is installed until the returned function is called (the context
        exits)."""
        restore: Any = None
        if not self._installed and threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            self._pid = os.getpid()
            signal.signal(signal.SIGTERM, self._on_signal)
            restore = signal.SIG_DFL
        with self._lock:
            self._training += 1

        def leave() -> None:
            with self._lock:
                self._training -= 1
                self._trained = True
            if restore is not None and signal.getsignal(signal.SIGTERM) == self._on_signal:
                signal.signal(signal.SIGTERM, restore)

        return leave

    def reset(self) -> None:
        """Forget a request and stop the watches (tests that run TrainCtx in-process)."""
        for w in self._watches:
            w.stop()
        self._watches.clear()
        self._requested.clear()
        self.reason = None
        self._trained = False


#: The process's drain request.
drain = Drain()


class _Poller:
    """A daemon thread that calls ``check`` every :data:`POLL_S` until it returns True."""

    name = "watch"

    def __init__(self) -> None:
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> bool:
        raise NotImplementedError

    def start(self) -> None:
        if self.check():
            return
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            if self.check():
                return

    def stop(self) -> None:
        self._stop.set()


class ParentWatch(_Poller):
    """Calls ``on_gone`` once when this process's parent is no longer ``parent_pid``
    (default: send SIGTERM to this process, which drains every role)."""

    name = "parent-watch"

    def __init__(self, parent_pid: int, on_gone: Callable[[], None] | None = None):
        super().__init__()
        self.parent_pid = parent_pid
        self.on_gone = on_gone or self._terminate
        self.gone = False

    def _terminate(self) -> None:
        log.warning("parent process %d is gone: stopping as on SIGTERM", self.parent_pid)
        os.kill(os.getpid(), signal.SIGTERM)

    def check(self) -> bool:
        if os.getppid() == self.parent_pid:
            return False
        self.gone = True
        self.on_gone()
        return True

    @classmethod
    def from_env(cls, environ: dict[str, str] | Any = None) -> ParentWatch | None:
        """The watch :data:`PARENT_PID_ENV` asks for, not started (None without it). The
        variable is removed from ``environ`` (default ``os.environ``): it names this
        process's parent, not that of the processes it starts."""
        env = os.environ if environ is None else environ
        raw = env.pop(PARENT_PID_ENV, "").strip()
        if not raw:
            return None
        try:
            pid = int(raw)
        except ValueError:
            from stream_persia.errors import ConfigError

            raise ConfigError(f"{PARENT_PID_ENV}={raw!r} is not a process id",
                              field=PARENT_PID_ENV, hint="unset it") from None
        return cls(pid)


class _StopFileWatch(_Poller):
    name = "stop-file-watch"

    def __init__(self, path: Path, on_found: Callable[[str], None]):
        super().__init__()
        self.path = path
        self.on_found = on_found

    def check(self) -> bool:
        if not self.path.exists():
            return False
        self.on_found("stream-persia launch nn-worker was asked to stop")
        return True


# ---------------------------------------------------------------------- process trees
_PR_SET_PDEATHSIG = 1


def die_with_parent(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """A ``preexec_fn`` that has the kernel send ``sig`` to the child when the thread that
    forks it ends (Linux ``PR_SET_PDEATHSIG``); None elsewhere. Fork from a thread that
    lives as long as the parent (the main thread)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:      # the parent died before the call
            os.kill(os.getpid(), int(sig))

    return preexec


def _parents() -> dict[int, int]:
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        try:
            text = Path(f"/proc/{name}/stat").read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2:].split()
        if fields[0] != "Z":
            found[int(name)] = int(fields[1])
    return found


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (Linux ``/proc``; empty elsewhere), children
    first. Processes in sessions of their own (torchrun's ranks) are included."""
    parents = _parents()
    found: list[int] = []
    frontier = {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - set(found)
        found += sorted(frontier)
    return found
