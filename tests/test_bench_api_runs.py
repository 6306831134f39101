"""``load_tests/bench_api.py`` still runs against the code it measures.

The benchmark builds a checkpoint with an in-process embedding server and, with ``--source
workers``, serves it from launched roles: both take a checkpoint root, and when the roles
became root-confined the benchmark failed at its first step while every unit test passed.
This runs it at the smallest size (a fraction of a second per measurement, no figure
checked: a speed is never asserted in a unit test) and checks only that it completes with
every request answered.
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
@pytest.mark.parametrize("source", ["local", "workers"])
def test_bench_api_completes(tmp_path, source):
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "load_tests" / "bench_api.py"), "--seconds", "0.3",
         "--batch-sizes", "1", "--repeats", "1", "--source", source, "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    cases = json.loads(out.read_text())["cases"]
    assert cases["batch_1"]["errors"] == 0, cases
    assert cases["batch_1"]["rps"] > 0, cases
