"""``load_tests/bench_checkpoint.py`` still runs against the code it measures.

It runs at its smallest size (no figure checked: a speed is never asserted in a unit test)
and must complete with every key of its ``--json`` present and its patches being patches.
"""

from __future__ import annotations

import pytest
from bench_runs import run_bench

pytestmark = pytest.mark.slow


@pytest.mark.timeout(180)
def test_bench_checkpoint_completes(tmp_path):
    got = run_bench("bench_checkpoint.py", ["--rows", "20000", "--rounds", "1", "--repeat",
                                            "1", "--train-s", "1.5", "--every-s", "0.5"],
                    tmp_path / "bench.json")
    for key in ("patch_bytes_vs_full", "patch_seconds_vs_full",
                "train_while_checkpointing_vs_off"):
        assert got[key] > 0, got
    assert got["rounds"][0]["patch_rows"] == 200, got["rounds"]
    assert got["training"][0]["on"]["checkpoints"] >= 1, got["training"]
