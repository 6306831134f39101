"""``load_tests/bench_policies.py`` still runs against the store it measures.

It runs at a small size (about a second; no figure is held to its target: a unit test never
asserts a benchmark's result) and checks the JSON the lead reads: the issue's four keys,
the table of every configuration, and that the model learned something (test AUC above
chance, below the Bayes-optimal AUC of the stream), and that every policy configuration
ran: frequency admission and TTL hold fewer rows, float16 rows as many in fewer bytes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from stream_persia.server.store import CEmbeddingStore

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("freq2_rows_vs_unbounded", "freq2_auc_loss", "fp16_rows_per_gib_vs_fp32",
        "fp16_auc_loss")


@pytest.mark.timeout(120)
@pytest.mark.skipif(CEmbeddingStore is None, reason="the benchmark measures the Cython store")
def test_bench_policies_small_run_reports_every_configuration(tmp_path):
    out = tmp_path / "policies.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "load_tests" / "bench_policies.py"), "--samples", "20000",
         "--test-samples", "5000", "--vocab", "2000", "--batch", "1024", "--ttl-steps", "5",
         "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    res = json.loads(out.read_text())
    for key in KEYS:
        assert key in res, key
    table = res["table"]
    assert set(table) == {"unbounded", "lru", "freq2", "ttl", "fp16"}
    ref = table["unbounded"]
    assert ref["rows"] == res["distinct_train_ids"]   # unbounded: every id it saw
    assert 0.6 < ref["auc"] < res["bayes_auc"] + 0.01, (ref["auc"], res["bayes_auc"])
    assert table["lru"]["rows"] == ref["rows"] // 2   # --lru-fraction 0.5 of unbounded
    for name in ("freq2", "ttl"):
        assert 0 < table[name]["rows"] < ref["rows"], (name, table[name])
    assert table["fp16"]["rows"] == ref["rows"]       # compact rows, none dropped
    assert table["fp16"]["bytes"] < ref["bytes"], table["fp16"]
    assert all(res[k] is not None for k in KEYS), res
