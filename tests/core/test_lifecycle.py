"""The drain request of :mod:`stream_persia.core.lifecycle`, in a fresh process each (it
handles signals for the whole process): SIGTERM outside a ``TrainCtx`` unwinds, inside it
only asks for a drain, a second one is a hard stop, and the stop file and a vanished
parent ask for a drain too. (Whole NN workers: tests/nn/test_nn_drain.py.)"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")


def run(code: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args],
                          capture_output=True, text=True, timeout=60)


def test_sigterm_outside_training_unwinds_the_script():
    out = run('''
        import os, signal, time
        from stream_persia.core.lifecycle import StopRequested, drain
        drain.install()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except StopRequested as e:
            print("unwound:", e.reason, drain.requested)
    ''')
    assert out.stdout.strip() == "unwound: SIGTERM True", out.stderr


def test_sigterm_while_training_asks_for_a_drain_and_a_second_one_kills():
    out = run('''
        import os, signal, sys, time
        from stream_persia.core.lifecycle import drain
        drain.install()
        leave = drain.enter_training()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.1)
        print("still training, drain requested:", drain.requested, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        print("not reached")
    ''')
    assert out.stdout.strip() == "still training, drain requested: True", out.stderr
    assert out.returncode == -signal.SIGTERM


def test_a_stop_after_training_lets_the_script_finish_its_work():
    """Two DDP ranks: rank 1's stop ends both ranks' loops at the same step, and rank 0's
    own stop (its poll of the stop file) can come only after it left its TrainCtx, while it
    saves what it trained: that must not unwind the script (it did, once, in CI)."""
    out = run('''
        import os, signal, time
        from stream_persia.core.lifecycle import drain
        drain.install()
        leave = drain.enter_training()
        leave()                                # the loop ended on another rank's stop
        os.kill(os.getpid(), signal.SIGTERM)   # this rank's stop comes now
        time.sleep(0.1)
        print("saved after the stop; requested:", drain.requested, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)   # a second one still stops it at once
        time.sleep(5)
        print("not reached")
    ''')
    assert out.stdout.strip() == "saved after the stop; requested: True", out.stderr
    assert out.returncode == -signal.SIGTERM


def test_a_train_context_handles_sigterm_only_while_entered():
    out = run('''
        import signal
        from stream_persia.core.lifecycle import drain
        leave = drain.enter_training()
        print(signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL)
        leave()
        print(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
    ''')
    assert out.stdout.split() == ["True", "True"], out.stderr


def test_the_stop_file_asks_for_a_drain(tmp_path):
    stop = tmp_path / "stop"
    out = run('''
        import pathlib, sys, time
        from stream_persia.core.lifecycle import drain
        drain.install(stop_file=sys.argv[1])
        leave = drain.enter_training()
        pathlib.Path(sys.argv[1]).touch()
        deadline = time.monotonic() + 10
        while not drain.requested and time.monotonic() < deadline:
            time.sleep(0.05)
        print(drain.requested, drain.reason)
    ''', str(stop))
    assert out.stdout.strip() == "True stream-persia launch nn-worker was asked to stop", \
        out.stderr


def test_a_forked_child_takes_the_default_action():
    out = run('''
        import os, signal, time
        from stream_persia.core.lifecycle import drain
        drain.install()
        leave = drain.enter_training()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.write(w, b"1")      # a signal before the child runs is lost (CPython)
            time.sleep(10)
            os._exit(0)
        os.read(r, 1)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
        print(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM,
              drain.requested)
    ''')
    assert out.stdout.split() == ["True", "False"], out.stderr
