"""Run roles as local child processes (``stream-persia run`` and the integration tests).

Each role is started as ``python -m stream_persia.launch.cli launch <role> ... --ready-file F``
and is ready when F holds its ``host:port``. Children are put in their own process group
and stopped with SIGTERM (then SIGKILL after a grace period, for the role's whole process
tree: torchrun's ranks run in sessions of their own), so nothing outlives its owner. Nor
does a role outlive this process when it dies without stopping them, ``kill -9``
included: each role gets ``PERSIA_PARENT_PID`` and drains once its parent is gone
(:mod:`stream_persia.core.lifecycle`).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from stream_persia.core.lifecycle import PARENT_PID_ENV, descendants
from stream_persia.errors import RemoteTimeout

__all__ = ["RoleProcess", "QUIET_ROLES"]

#: Roles that listen on no port (no ``--ready-file``; ready as soon as they run).
QUIET_ROLES = frozenset({"data-loader", "nn-worker"})
#: Roles that listen on a well-known local port without ``--port``
#: (:mod:`stream_persia.rpc.local_ports`): started here, they get ``--port 0`` unless
#: ``args`` name one (whoever starts them learns the port from the ready file).
PORT_ROLES = frozenset({"embedding-server", "embedding-parameter-server", "embedding-worker"})


class RoleProcess:
    """One role in a child process.

    Args:
        role: ``embedding-server``, ``embedding-worker``, ...
        args: extra CLI arguments for ``launch <role>``.
        env: extra environment variables.
        log_path: where stdout/stderr go (default: a temp file, shown on failure).
        nice: CPU priority below the launcher's (``nice(1)``; 0: the same). A consumer
            sharing the machine with training (``stream-persia run``'s serving replica)
            takes the CPU the training roles leave.
    """

    def __init__(self, role: str, args: list[str] | tuple[str, ...] = (), *,
                 env: dict[str, str] | None = None, log_path: str | os.PathLike | None = None,
                 name: str | None = None, listens: bool | None = None, nice: int = 0):
        if isinstance(nice, bool) or not isinstance(nice, int) or not 0 <= nice <= 19:
            raise ValueError(f"nice must be an int in 0..19, got {nice!r}")
        self.role = role
        self.nice = nice
        self.name = name or role
        self.args = list(args)
        self.env = dict(env or {})
        # Roles that serve RPC report their address through a ready file; the NN worker
        # and data loaders listen on nothing and take no --ready-file (None: by role).
        self.listens = role not in QUIET_ROLES if listens is None else listens
        self._dir = tempfile.mkdtemp(prefix=f"persia-{self.name}-")
        self.ready_file = Path(self._dir) / "ready"
        self.log_path = Path(log_path) if log_path else Path(self._dir) / "log"
        self.proc: subprocess.Popen | None = None
        self.address: str | None = None

    def start(self) -> RoleProcess:
        # The role drains once this process is gone (env={PARENT_PID_ENV: ""}: never).
        env = {**os.environ, PARENT_PID_ENV: str(os.getpid()), **self.env,
               "PYTHONUNBUFFERED": "1"}
        Path(self._dir).mkdir(parents=True, exist_ok=True)   # again after a stop()
        self.ready_file.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "stream_persia.launch.cli", "launch", self.role, *self.args]
        if self.listens:
            cmd += ["--ready-file", str(self.ready_file)]
            if self.role in PORT_ROLES and not any(a == "--port" or a.startswith("--port=")
                                                   for a in self.args):
                cmd += ["--port", "0"]   # the ready file says where: no well-known port
        if self.nice and (nice_bin := shutil.which("nice")):
            cmd = [nice_bin, "-n", str(self.nice), *cmd]   # exec's the role: same pid
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        return self

    def wait_ready(self, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                self.address = self.ready_file.read_text().strip()
                return self.address
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.05)
        raise RemoteTimeout(f"{self.name} was not ready after {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self, limit: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-limit:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL the role (its whole process tree), as a crash would."""
        if self.alive():
            self._kill_tree()
        self._cleanup(killed=True)   # a killed role is often replaced, never stopped

    def _kill_tree(self) -> None:
        assert self.proc is not None
        tree = descendants(self.proc.pid)   # before the kill: then they are re-parented
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def stop(self, grace_s: float = 10.0) -> int | None:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL the role's process tree; returns
        the exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self._kill_tree()
            except ProcessLookupError:
                pass
        self._cleanup()
        return self.proc.returncode

    def _cleanup(self, killed: bool = False) -> None:
        """Remove the temp dir, keeping it only when it holds the log of a role that
        failed (not one killed on purpose)."""
        log_inside = self.log_path.parent == Path(self._dir)
        if (log_inside and not killed and self.proc is not None
                and self.proc.returncode not in (0, None)):
            return
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> RoleProcess:
        self.start()
        self.wait_ready()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
