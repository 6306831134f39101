"""``load_tests/bench_train.py`` still runs against the code it measures.

It runs at its smallest size (no figure checked: a speed is never asserted in a unit test)
and must complete with ``hybrid_vs_sync`` (issue 22) and the NN worker's torch threads in
its ``--json``.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from bench_runs import ROOT, run_bench

pytestmark = pytest.mark.slow


@pytest.mark.timeout(180)
def test_bench_train_completes(tmp_path):
    got = run_bench("bench_train.py", ["--batches", "4", "--warmup", "2", "--vocab", "1000",
                                       "--repeat", "1", "--nn-threads", "1"],
                    tmp_path / "bench.json")
    assert got["hybrid_vs_sync"] > 0, got
    assert got["nn_threads"] == 1, got
    assert [r["embedding_staleness"] for r in got["runs"]] == [1, 8], got["runs"]


def test_bench_train_rejects_negative_threads():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "load_tests" / "bench_train.py"), "--nn-threads", "-1"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "--nn-threads" in proc.stderr
