"""Roles never outlive the process that started them, even one killed with SIGKILL.

Roles run in sessions of their own (:class:`~stream_persia.launch.processes.RoleProcess`), so no
signal for their starter reaches them; a starter killed with ``kill -9`` cannot stop them
either. Each role watches its parent instead (``PERSIA_PARENT_PID``) and drains once it is
gone; ``launch nn-worker`` takes torchrun and its ranks (sessions of their own again) with
it. The test starts roles from a starter process, SIGKILLs the starter, and checks through
``/proc`` that every process below it is gone in bounded time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from stream_persia.core.lifecycle import PARENT_PID_ENV, ParentWatch, descendants
from stream_persia.errors import ConfigError
from stream_persia.launch.processes import RoleProcess
from stream_persia.testing.proxy import free_port
from stream_persia.testing.samples import EMBEDDING_YAML

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

GONE_WITHIN_S = 30.0

STARTER = textwrap.dedent('''\
    import sys, time

    from stream_persia.launch.processes import RoleProcess

    out = sys.argv[1]
    server = RoleProcess("embedding-server", ["--checkpoint-root", out],
                         log_path=out + "/server.log").start()
    server.wait_ready()
    nn = RoleProcess("nn-worker", [out + "/idle_train.py", "--nproc-per-node", "2"],
                     log_path=out + "/nn.log").start()
    print("started", flush=True)
    time.sleep(600)
''')

# A training script that never trains: it waits, as a rank waits for its peers.
IDLE_TRAIN = textwrap.dedent('''\
    import pathlib, os, sys, time
    pathlib.Path(sys.argv[0]).with_name(f"rank{os.environ['RANK']}.up").write_text("1")
    time.sleep(600)
''')


def _alive(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return text[text.rindex(")") + 2:].split()[0] != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:160]
    except OSError:
        return "?"


@pytest.mark.timeout(120)
def test_roles_torchrun_and_ranks_go_when_their_starter_is_killed(tmp_path):
    (tmp_path / "idle_train.py").write_text(IDLE_TRAIN)
    log = tmp_path / "starter.log"
    with open(log, "w") as f:
        starter = subprocess.Popen([sys.executable, "-c", STARTER, str(tmp_path)],
                                   stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    tree: list[int] = []
    try:
        deadline = time.monotonic() + 90
        while not all((tmp_path / f"rank{r}.up").exists() for r in (0, 1)):
            assert starter.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text() + (
                tmp_path / "nn.log").read_text(errors="replace")
            time.sleep(0.1)
        tree = descendants(starter.pid)
        names = " | ".join(_cmdline(p) for p in tree)
        # the server, launch nn-worker, torchrun and its two ranks
        assert len(tree) >= 5, names
        assert "stream_persia.launch.torchrun" in names, names
        os.kill(starter.pid, signal.SIGKILL)
        starter.wait()
        deadline = time.monotonic() + GONE_WITHIN_S
        while any(_alive(p) for p in tree) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [_cmdline(p) for p in tree if _alive(p)]
        assert not left, left
        nn_log = (tmp_path / "nn.log").read_text(errors="replace")
        assert "Traceback" not in nn_log, nn_log[-3000:]
        assert "nothing to drain" in nn_log, nn_log[-3000:]
    finally:
        if starter.poll() is None:
            starter.kill()
        for pid in tree:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_the_parent_pid_setting_is_checked():
    env = {PARENT_PID_ENV: "nonsense"}
    with pytest.raises(ConfigError) as err:
        ParentWatch.from_env(env)
    assert err.value.field == PARENT_PID_ENV
    assert PARENT_PID_ENV not in env
    assert ParentWatch.from_env({}) is None


def test_a_watch_on_a_live_parent_stays_quiet_and_fires_once_it_changes():
    calls: list[int] = []
    watch = ParentWatch(os.getppid(), lambda: calls.append(1))
    watch.start()
    time.sleep(0.6)
    watch.stop()
    assert calls == [] and not watch.gone
    gone = ParentWatch(os.getppid() + 1_000_000, lambda: calls.append(1))
    gone.start()      # checks at once: not our parent
    assert calls == [1] and gone.gone


@pytest.mark.timeout(120)
def test_sigterm_while_a_worker_waits_for_its_broker_exits_0(tmp_path):
    """An embedding worker started before Kafka waits for it (kafka.startup_timeout_ms);
    SIGTERM meanwhile stops it at once with exit 0 (nothing to drain), not by the signal."""
    (tmp_path / "embedding_config.yml").write_text(EMBEDDING_YAML)
    (tmp_path / "global_config.yml").write_text("kafka:\n  startup_timeout_ms: 60000\n")
    nowhere = f"127.0.0.1:{free_port()}"
    worker = RoleProcess("embedding-worker", [
        "--embedding-config", str(tmp_path / "embedding_config.yml"),
        "--global-config", str(tmp_path / "global_config.yml"),
        "--embedding-servers", f"127.0.0.1:{free_port()}", "--kafka", nowhere,
        "--topic", "samples"])
    try:
        worker.start()
        deadline = time.monotonic() + 60
        while "not reachable yet" not in worker.log_tail(20_000):
            assert worker.alive() and time.monotonic() < deadline, worker.log_tail()
            time.sleep(0.1)
        t0 = time.monotonic()
        code = worker.stop(grace_s=30)
        assert code == 0, worker.log_tail()
        assert time.monotonic() - t0 < 10, worker.log_tail()
    finally:
        worker.stop()
