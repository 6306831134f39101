"""Running a benchmark of ``load_tests/`` at its smallest size from a test.

The ``tests/test_bench_*_runs.py`` files check that each benchmark still runs against the
code it measures and writes the keys its issue names; they never hold a figure to a target
(a speed is never asserted in a unit test).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def run_bench(script: str, args: list[str], out: Path, timeout: float = 170) -> dict[str, Any]:
    """Run ``load_tests/<script>`` with ``args`` and ``--json out``; its JSON (the test
    fails with the end of its output when it exits non-zero)."""
    proc = subprocess.run([sys.executable, str(ROOT / "load_tests" / script), *args,
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return json.loads(out.read_text())
