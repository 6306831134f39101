"""One flag picks every pure-Python twin (stream_persia.kernels.twins)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from stream_persia.core.switches import env_switch
from stream_persia.kernels import segments, twins
from stream_persia.server import store

ROOT = Path(__file__).resolve().parents[2]
PROBE = ("from stream_persia.kernels import segments;"
         "from stream_persia.server import store;"
         "print(store.IMPLEMENTATION, segments.IMPLEMENTATION,"
         " segments.SEGMENT_SUM_IMPLEMENTATION)")


@pytest.mark.parametrize("flag, expected", [
    ("1", ["python", "python", "numpy"]),
    ("true", ["python", "python", "numpy"]),   # read as off when only "1" counted
    ("", ["cython", "cython", "torch"]),
    ("0", ["cython", "cython", "torch"]),
    ("off", ["cython", "cython", "torch"])])
def test_the_flag_picks_every_twin_at_once(flag, expected):
    if flag not in ("1", "true") and (store.CEmbeddingStore is None or segments._c is None):
        pytest.skip("the Cython extensions are not built")
    env = {**os.environ, twins.ENV: flag}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                         text=True, check=True, timeout=120).stdout.split()
    assert out == expected


def test_this_process_runs_what_the_flag_says():
    forced = env_switch("STREAM_PERSIA_PURE_PYTHON", False)   # 1, true, yes, on
    assert twins.PURE_PYTHON is forced
    if forced:
        assert (store.IMPLEMENTATION, segments.IMPLEMENTATION,
                segments.SEGMENT_SUM_IMPLEMENTATION) == ("python", "python", "numpy")


def test_the_environment_is_read_in_one_place_and_the_old_switch_is_gone():
    sources = [p for d in ("stream_persia", "api") for p in (ROOT / d).rglob("*.py")
               if p.resolve().is_relative_to(ROOT / d)]
    readers = sorted(str(p.relative_to(ROOT)) for p in sources
                     if "STREAM_PERSIA_PURE_PYTHON" in p.read_text()
                     and ("os.environ" in p.read_text() or "getenv" in p.read_text()
                          or "env_switch(" in p.read_text()))
    assert readers == ["stream_persia/kernels/twins.py"]
    assert not [p for p in sources if "STREAM_PERSIA_SEGMENT_SUM" in p.read_text()]
