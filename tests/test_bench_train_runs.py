"""``load_tests/bench_train.py`` still runs against the code it measures.

It runs at its smallest size (no figure checked: a speed is never asserted in a unit test)
and must complete with ``hybrid_vs_sync`` (issue 22) and the NN worker's torch threads in
its ``--json``.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.mark.timeout(180)
def test_bench_train_completes(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "load_tests" / "bench_train.py"), "--batches", "4",
         "--warmup", "2", "--vocab", "1000", "--repeat", "1", "--nn-threads", "1",
         "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    got = json.loads(out.read_text())
    assert got["hybrid_vs_sync"] > 0, got
    assert got["nn_threads"] == 1, got
    assert [r["embedding_staleness"] for r in got["runs"]] == [1, 8], got["runs"]


def test_bench_train_rejects_negative_threads():
    proc = subprocess.run(
        [sys.executable, str(ROOT / "load_tests" / "bench_train.py"), "--nn-threads", "-1"],
        cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "--nn-threads" in proc.stderr
