"""``stream-persia run`` gives each role's torch a share of the machine's cores.

torch's intra-op threads spin while they wait for each other: with two of them on a
two-core machine, any other role's CPU stalls the NN rank (a serving replica's 12% of a
core cut training by 14%). Each NN rank gets an equal part of the cores but one, an API
process one thread, unless the user set ``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import pytest

from stream_persia.launch import run


@pytest.mark.parametrize(("cpus", "nproc", "want"), [
    (2, 1, "1"), (16, 1, "15"), (16, 2, "7"), (2, 2, "1"), (1, 1, "1"), (8, None, "1")])
def test_threads_per_role(monkeypatch, cpus, nproc, want):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(run.os, "cpu_count", lambda: cpus)
    assert run.torch_threads(nproc) == {"OMP_NUM_THREADS": want}


def test_the_users_setting_wins(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert run.torch_threads(1) == {} and run.torch_threads(None) == {}
