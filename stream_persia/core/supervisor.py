"""Supervision of a role's long-running background tasks (STYLE.md habit 11).

A role owns a :class:`Supervisor` and registers with :meth:`Supervisor.watch` every task
meant to run as long as the role does (the embedding worker's Kafka ingest loop). The
task's done-callback turns any end other than a cancellation (its owner stopped or
replaced it) into a recorded failure: the task raised, whatever the exception, or it
returned although it should run until cancelled. A failure

- is logged with its traceback, naming the task;
- is counted: ``persia_<role>_background_task_failures_total{task}``;
- makes the role unhealthy: its ``health`` answers ``ok: false`` with :attr:`error`
  ("the background task 'kafka-ingest' failed: ..."), so the API's ``/readyz`` and
  anything else probing it see why;
- sets :attr:`failed`, which the role's main loop (:func:`stream_persia.launch.roles._serve`)
  waits on beside SIGTERM and SIGINT. The role keeps answering for
  :data:`EXIT_GRACE_S` (so a probe polling it can read the reason), then drains and stops
  as on SIGTERM and exits with status 1; ``stream-persia run`` sees a role exit and fails
  the run naming it, an orchestrator restarts the process.

The role is not restarted in-process: a failed ingest loop may have left the worker's
stream position (its checkpoint frontier) in any state, and a fresh process resumes from
the last checkpoint cleanly.

A role can also :meth:`Supervisor.report` a condition it cannot work on that is no task's
failure (the embedding worker: an embedding server restarted and lost its table,
:mod:`stream_persia.worker.router`). It has the same effects but the count, and it is
withdrawn by :meth:`Supervisor.resolve` once the cause is gone (a restore replaced the
table); a launched role whose failures were all resolved within :data:`EXIT_GRACE_S`
serves on.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, NamedTuple

__all__ = ["EXIT_GRACE_S", "UNHEALTHY_MARK", "Supervisor", "TaskFailure"]

log = logging.getLogger(__name__)

#: the words a failed role's log line ends with (``stream-persia run`` quotes that line)
UNHEALTHY_MARK = "the role is unhealthy and exits with status 1"

#: How long a role whose background task failed keeps answering (``health`` not ok)
#: before it stops and exits with status 1.
EXIT_GRACE_S = 2.0


class TaskFailure(NamedTuple):
    """A watched task that ended other than by cancellation."""

    task: str
    error: BaseException | None   # None: it returned
    at: float                     # time.time() when it ended
    reported: bool = False        # a condition the role reported (Supervisor.report)

    def describe(self) -> str:
        if self.reported:
            return str(getattr(self.error, "message", self.error))
        if self.error is None:
            return f"the background task {self.task!r} stopped (it should run until the " \
                   "role stops)"
        return f"the background task {self.task!r} failed: {type(self.error).__name__}: " \
               f"{self.error}"


class Supervisor:
    """Watches a role's long-running tasks; see the module docstring.

    Args:
        role: the role's name for messages, e.g. ``"embedding worker 0"``.
        metrics: the role's :class:`~stream_persia.core.metrics.RoleMetrics`, to count failures.
    """

    def __init__(self, role: str, metrics: Any = None):
        self.role = role
        self.failures: list[TaskFailure] = []
        self._failed = asyncio.Event()
        self._counter = (metrics.counter("background_task_failures_total",
                                         "long-running tasks that failed (the role exits 1)",
                                         ("task",)) if metrics is not None else None)

    def watch(self, task: asyncio.Task, name: str, *, forever: bool = True) -> asyncio.Task:
        """Supervise ``task``; returns it. ``forever``: it runs until cancelled, so
        returning is a failure too; otherwise only an exception is (a task its owner ends
        by letting it return, like the API's micro-batcher on shutdown)."""
        task.add_done_callback(lambda t: self._done(t, name, forever))
        return task

    def _done(self, task: asyncio.Task, name: str, forever: bool) -> None:
        if task.cancelled():
            return
        error = task.exception()
        if error is not None or forever:
            self.fail(name, error)

    def fail(self, name: str, error: BaseException | None) -> None:
        """Record that the task ``name`` failed with ``error`` (None: it returned)."""
        failure = TaskFailure(name, error, time.time())
        self.failures.append(failure)
        if self._counter is not None:
            self._counter.labels(name).inc()
        log.error("%s: %s; " + UNHEALTHY_MARK, self.role,
                  failure.describe(), exc_info=error)
        self._failed.set()

    def report(self, name: str, error: BaseException) -> None:
        """Record a condition ``name`` the role cannot work on (it logged it already):
        health not ok with ``error``'s message, the launched role exits 1, unless
        :meth:`resolve` withdraws it first. A second report of ``name`` replaces the
        first."""
        self.failures = [f for f in self.failures if not (f.reported and f.task == name)]
        self.failures.append(TaskFailure(name, error, time.time(), reported=True))
        self._failed.set()

    def resolve(self, name: str) -> None:
        """Withdraw the condition ``name`` (its cause is gone); the role is healthy again
        once nothing else failed."""
        self.failures = [f for f in self.failures if not (f.reported and f.task == name)]
        if not self.failures:
            self._failed.clear()

    @property
    def failed(self) -> asyncio.Event:
        """Set once any watched task failed (or a condition was reported, until resolved)."""
        return self._failed

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def error(self) -> str | None:
        """What failed, for ``health`` and logs (None while every task is fine)."""
        if not self.failures:
            return None
        return "; ".join(f.describe() for f in self.failures)
