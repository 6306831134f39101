"""``load_tests/bench_vs_torchrec.py`` and ``load_tests/bench_store_scaling.py`` still run,
and their JSON has the keys the issue names.

At the smallest sizes (no figure is held to its target: a unit test never asserts a
speed). stream-persia's side is the real job (``stream-persia run``, every role a process);
the TorchRec side needs the TorchRec environment, which is never the project's
(``python3 load_tests/bench_vs_torchrec.py --make-torchrec-venv DIR`` creates it): that
test is skipped, naming the command, where ``STREAM_PERSIA_TORCHREC_PYTHON`` (or the
benchmark's default path) names no such python.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from stream_persia.server.store import CEmbeddingStore

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "load_tests" / "bench_vs_torchrec.py"
SCALING = ROOT / "load_tests" / "bench_store_scaling.py"
TINY = ["--samples", "8192", "--eval-samples", "2048", "--vocab", "1000", "--warmup", "1",
        "--repeat", "1"]
DEFAULT_PYTHON = Path.home() / ".cache" / "stream-persia" / "torchrec-venv" / "bin" / "python"
TORCHREC_PYTHON = os.environ.get("STREAM_PERSIA_TORCHREC_PYTHON") or str(DEFAULT_PYTHON)


def run(args: list[str], timeout: float = 170) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_without_the_torchrec_environment_it_says_how_to_make_one(tmp_path):
    proc = run([BENCH, "--torchrec-python", tmp_path / "none" / "python", *TINY], timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--make-torchrec-venv" in proc.stderr and "--persia-only" in proc.stderr


@pytest.mark.parametrize("flag, value", [("--torchrec-configs", "fbgemm:1"),
                                         ("--samples", "0"), ("--emb-lr", "-1")])
def test_bad_flags_are_refused_naming_the_flag(flag, value):
    proc = run([BENCH, flag, value], timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert flag in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_persia_side_runs_the_job_and_counts_every_role(tmp_path):
    out = tmp_path / "vs.json"
    proc = run([BENCH, "--persia-only", *TINY, "--json", out])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    res = json.loads(out.read_text())
    assert "samples_per_s_vs_torchrec" not in res      # no baseline, no ratio
    side = res["persia"]
    assert side["samples_per_s"] > 0 and side["cpu_us_per_sample"] > 0
    assert 0.5 < side["auc"] <= 1.0 and 0.5 < res["bayes_auc"] <= 1.0
    # the CPU of the whole job, not of one rank (the data loader of so short a run may be
    # done before the timed window)
    roles = side["runs"][0]["cpu_s_by_role"]
    for role in ("run", "embedding-server", "embedding-worker", "nn-worker", "torchrun",
                 "nn-rank"):
        assert role in roles, roles


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path(TORCHREC_PYTHON).exists(),
                    reason=f"no TorchRec environment at {TORCHREC_PYTHON}: create it with "
                           f"python3 load_tests/bench_vs_torchrec.py --make-torchrec-venv DIR "
                           f"and set STREAM_PERSIA_TORCHREC_PYTHON=DIR/bin/python")
def test_both_sides_give_the_issue_keys(tmp_path):
    out = tmp_path / "vs.json"
    proc = run([BENCH, *TINY, "--torchrec-python", TORCHREC_PYTHON, "--torchrec-configs",
                "tbe:1", "torchrec:1", "mlp:1", "--json", out])
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    res = json.loads(out.read_text())
    for key in ("samples_per_s_vs_torchrec", "cpu_per_sample_vs_torchrec", "auc_gap"):
        assert isinstance(res[key], float) and res[key] >= 0, (key, res.get(key))
    assert set(res["torchrec"]) == {"tbe:1", "torchrec:1", "mlp:1"}
    # the MLP alone is a reference (the NN rank's ceiling), never the baseline
    assert res["torchrec_baseline"] in ("tbe:1", "torchrec:1")
    assert res["torchrec_cpu_baseline"] in ("tbe:1", "torchrec:1")
    floor = res["mlp_floor"]
    assert floor["samples_per_s"] == res["torchrec"]["mlp:1"]["samples_per_s"] > 0
    for key in ("cpu_us_per_sample", "vs_torchrec", "persia_vs_floor"):
        assert floor[key] > 0, (key, floor)
    assert "the NN rank's ceiling" in proc.stderr
    for name in ("tbe:1", "torchrec:1"):
        assert 0.5 < res["torchrec"][name]["auc"] <= 1.0, res["torchrec"][name]


@pytest.mark.skipif(CEmbeddingStore is None, reason="the benchmark measures the Cython store")
def test_store_scaling_curve_and_its_memory_cap(tmp_path):
    out = tmp_path / "scaling.json"
    proc = run([SCALING, "--sizes", "20000", "60000", "300000", "--max-rows", "100000",
                "--batch", "4096", "--batches", "2", "--rounds", "1", "--json", out],
               timeout=100)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    res = json.loads(out.read_text())
    assert [c["rows"] for c in res["curve"]] == [20000, 60000]
    assert res["skipped"] == [{"rows": 300000, "why": "--max-rows 100000"}]
    for c in res["curve"]:
        assert 64 <= c["bytes_per_row"] < 1024, c      # dim 16 floats and more, not a KiB
        for key in ("zipf_lookup_ids_per_s", "zipf_update_ids_per_s",
                    "uniform_lookup_ids_per_s", "uniform_update_ids_per_s", "fill_ids_per_s"):
            assert c[key] > 0, (key, c)
    # a size predicted to pass --max-gib is skipped, saying so
    proc = run([SCALING, "--sizes", "20000", "60000", "--max-gib", "0.001", "--batch", "4096",
                "--batches", "1", "--rounds", "1"], timeout=100)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    res = json.loads(proc.stdout)
    assert [c["rows"] for c in res["curve"]] == [20000]
    assert "--max-gib" in res["skipped"][0]["why"]
