"""Roles keep freed heap memory for reuse (launch.memory.keep_freed_memory): a per-batch
buffer of a megabyte or more stops costing fresh page faults every round."""

from __future__ import annotations

import subprocess
import sys

import pytest

from stream_persia.errors import ConfigError
from stream_persia.launch import memory as launch

ROUNDS = """
import resource, sys
import numpy as np
from stream_persia.launch import memory as launch
print(launch.keep_freed_memory(int(sys.argv[1])))
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):  # warm-up rounds: the heap grows once
    del [np.ones(1_700_000, np.uint8) for _ in range(8)][:]
before = faults()
for _ in range(20):  # what a role does per batch: a few MB-sized buffers, freed soon after
    batch = [np.ones(1_700_000, np.uint8) for _ in range(8)]
    del batch
print(faults() - before)
"""


def _faults(keep_mb: int) -> tuple[str, int]:
    out = subprocess.run([sys.executable, "-c", ROUNDS, str(keep_mb)], check=True,
                         capture_output=True, text=True, timeout=60).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
def test_freed_buffers_are_reused_without_page_faults():
    took, faults = _faults(256)
    assert took == str(256 << 20)
    assert faults < 1_000
    took, faults = _faults(0)  # glibc's defaults: every round maps and faults in anew
    assert took == "0"
    assert faults > 20 * 8 * 1_700_000 // 4096 // 2


def test_bad_setting_names_the_variable(monkeypatch):
    monkeypatch.setenv(launch.KEEP_FREED_ENV, "lots")
    with pytest.raises(ConfigError) as err:
        launch.keep_freed_memory()
    assert err.value.field == launch.KEEP_FREED_ENV
    with pytest.raises(ConfigError):
        launch.keep_freed_memory(-1)
    monkeypatch.setenv(launch.KEEP_FREED_ENV, "0")
    assert launch.keep_freed_memory() == 0
