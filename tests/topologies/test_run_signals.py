"""``stream-persia run`` stopped by a signal: every role stops with it, none is orphaned.

The roles run in their own sessions (so that one Ctrl-C in a terminal does not hit them
all at once), which also means a signal sent to ``run`` alone never reaches them: the run
must stop them itself. The tests start a real run of ``topologies/synthetic_ctr``, send
the signal once every role is up, and check by process group that nothing is left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, process group) of a live process, None once it is gone (or a zombie)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[2])


def _all_pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def descendants(root: int) -> set[int]:
    """Every live process below ``root`` (children, their children, ...)."""
    parents = {pid: st[0] for pid in _all_pids() if (st := _stat(pid)) is not None}
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def alive_in_groups(groups: set[int]) -> list[int]:
    return [pid for pid in _all_pids() if (st := _stat(pid)) is not None and st[1] in groups]


def wait_for(path: Path, text: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if text in path.read_text(errors="replace"):
            return
        assert proc.poll() is None, f"run exited with {proc.returncode}:\n{path.read_text()}"
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} after {timeout_s} s:\n{path.read_text()}")


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("sig", "times", "checkpoint"), [
    (signal.SIGTERM, 1, "taken"),        # as Ctrl-C: a checkpoint first, then the roles
    (signal.SIGHUP, 2, "skipped"),       # the second signal cuts the checkpoint short
])
def test_a_stop_signal_stops_every_role_of_the_run(tmp_path, sig, times, checkpoint):
    out, log = tmp_path / "run", tmp_path / "run.err"
    cmd = [sys.executable, "-m", "stream_persia.launch.cli", "run", "topologies/synthetic_ctr",
           "--output-dir", str(out), "--samples", "2e6", "--eval-samples", "1000",
           "--predict-samples", "0", "--no-gates", "--stop-checkpoint-s", "60"]
    groups: set[int] = set()
    with open(log, "w") as err:
        env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, env=env)
    try:
        wait_for(log, "roles up after", proc, 150)
        # The NN worker is training: it takes the checkpoint at a step boundary. Frozen
        # before it attached, the API would take the cut itself at once (nothing in flight)
        # and the second signal would come too late to skip it on a slow machine. The
        # "training N steps" line comes before TrainCtx attaches (its first heartbeat to the
        # mailbox: CI once froze it in between); a progress line ("... samples .../s loss")
        # comes after steps, so after the heartbeat.
        wait_for(out / "logs" / "nn-worker.log", "/s loss ", proc, 120)
        roles = descendants(proc.pid)
        groups = {st[1] for pid in roles if (st := _stat(pid)) is not None} - {
            os.getpgid(proc.pid)}
        # server, worker, API, NN worker (torchrun), data loader: each its own group (and
        # torchrun may put its ranks in groups of their own)
        assert len(groups) >= 5, (groups, log.read_text())
        if checkpoint == "skipped":
            # Freeze the NN worker (torchrun and its ranks): the checkpoint, taken at an NN
            # step boundary, cannot finish before the second signal, however fast it is.
            # Every process of the NN worker by pid as well as by group: torchrun may put
            # its rank in a group of its own, and a rank left running took the cut (CI).
            tags = (b"nn-worker", b"stream_persia.launch.rank", b"stream_persia.launch.torchrun")
            nn_pids = {pid for pid in roles if _stat(pid) is not None
                       and any(t in Path(f"/proc/{pid}/cmdline").read_bytes() for t in tags)}
            nn_groups = {st[1] for pid in nn_pids if (st := _stat(pid)) is not None}
            assert nn_groups, log.read_text()
            for group in nn_groups:
                os.killpg(group, signal.SIGSTOP)
            for pid in nn_pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGSTOP)
        for i in range(times):
            if i:
                wait_for(log, "checkpointing before stopping", proc, 30)
                time.sleep(0.5)
            proc.send_signal(sig)
        code = proc.wait(timeout=120)
        text = log.read_text()
        assert code == 128 + sig, f"exit {code}:\n{text}"
        assert f"{signal.Signals(sig).name}: checkpointing before stopping" in text
        if checkpoint == "taken":
            assert "checkpoint ckpt-" in text, text
        else:
            assert "checkpoint not taken" in text, text
        # Nothing of any role is left: not the roles, not their children (torchrun's ranks).
        deadline = time.monotonic() + 5
        while alive_in_groups(groups) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive_in_groups(groups), [
            Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")[:200]
            for p in alive_in_groups(groups)]
        assert not [p for p in roles if _stat(p) is not None]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for group in groups:   # what an old `run` would have orphaned
            try:
                os.killpg(group, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.timeout(240)
def test_roles_do_not_outlive_a_run_killed_with_sigkill(tmp_path):
    """``kill -9`` of ``run`` itself: it cannot stop its roles, so each role notices that
    its parent is gone and stops (``PERSIA_PARENT_PID``), torchrun and its ranks too."""
    out, log = tmp_path / "run", tmp_path / "run.err"
    cmd = [sys.executable, "-m", "stream_persia.launch.cli", "run", "topologies/synthetic_ctr",
           "--output-dir", str(out), "--samples", "2e6", "--eval-samples", "1000",
           "--predict-samples", "0", "--no-gates"]
    roles: set[int] = set()
    with open(log, "w") as err:
        env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, env=env)
    try:
        wait_for(log, "roles up after", proc, 150)
        wait_for(out / "logs" / "nn-worker.log", "training ", proc, 120)
        roles = descendants(proc.pid)
        names = [Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ") for p in roles
                 if _stat(p) is not None]
        for role in ("embedding-server", "embedding-worker", "launch api", "nn-worker",
                     "data-loader", "stream_persia.launch.torchrun"):
            assert any(role in n for n in names), (role, names)
        proc.kill()
        proc.wait()
        # Each role drains on SIGTERM, bounded (a data loader's flush: 10 s, its RPC
        # clients' closes after); on a loaded 2-core machine once past 30 s in all.
        deadline = time.monotonic() + 60
        while [p for p in roles if _stat(p) is not None] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in roles if _stat(p) is not None], [
            Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")[:200]
            for p in roles if _stat(p) is not None]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in roles:   # what a run killed before this fix orphaned
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
