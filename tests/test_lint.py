"""Lint runs with the tests (STYLE.md habit 10): a lint error fails the suite."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_clean():
    if shutil.which("ruff") is None:  # installed by the [test] extra; absent only in odd setups
        pytest.skip("ruff is not installed; `pip install -e '.[test]'` installs it")
    paths = [p for p in ("stream_persia", "api", "tests", "load_tests", "topologies")
             if (ROOT / p).exists()]
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", *paths],
                          cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
