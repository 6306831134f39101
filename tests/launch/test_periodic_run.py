"""Periodic checkpoints from the global config in a whole job (issue 21, item 1):
``stream-persia run`` of synthetic_ctr (servers, worker, NN worker and data loader as
separate processes, broker-less) with ``checkpointing_config.every_steps`` writes them at
those steps into the job's checkpoint directory, keeps the newest ``keep_checkpoints``
periodic ones beside the final checkpoint, and logs each; a bad key stops the run before
any role starts, naming the file and the key."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from stream_persia.checkpoint import list_checkpoints, verify

ROOT = Path(__file__).resolve().parents[2]
BATCH, STEPS = 1024, 10


def _topology(tmp_path: Path, checkpointing: dict) -> Path:
    topologies = tmp_path / "topologies"
    shutil.copytree(ROOT / "topologies", topologies,
                    ignore=shutil.ignore_patterns("__pycache__", "*.png"))
    path = topologies / "synthetic_ctr" / "global_config.yml"
    data = yaml.safe_load(path.read_text())
    data["common_config"]["checkpointing_config"] = checkpointing
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return topologies / "synthetic_ctr"


def _run(topology: Path, out: Path, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "KAFKA_BOOTSTRAP_SERVERS"}
    cmd = [sys.executable, "-m", "stream_persia.launch.cli", "run", str(topology),
           "--output-dir", str(out), "--samples", str(BATCH * STEPS), "--batch-size",
           str(BATCH), "--eval-samples", "1000", "--no-replica", "--no-api",
           "--predict-samples", "0", "--no-gates"]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=env)


@pytest.mark.timeout(180)
def test_a_job_takes_its_periodic_checkpoints_at_the_configured_steps(tmp_path):
    out = tmp_path / "run"
    proc = _run(_topology(tmp_path, {"every_steps": 3, "keep_checkpoints": 2}), out, 170)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-6000:]}"
    found = list_checkpoints(str(out / "checkpoints"))
    periodic = sorted((m for m in found if m.extra.get("by") == "periodic"),
                      key=lambda m: m.step)
    # steps 3, 6 and 9 were taken, the newest two kept; the final checkpoint too
    assert [m.step for m in periodic] == [6, 9], [(m.path, m.step) for m in found]
    assert {Path(m.path or "").name for m in found} - {Path(m.path or "").name
                                                        for m in periodic} == {"final"}
    for m in periodic:
        verify(m.path)
        assert Path(m.path or "").name.startswith(f"periodic-step-{m.step:012d}-")
        assert {"dense.pt", "opt.pt"} <= set(m.files) and m.rows > 0
        # the cut of any checkpoint: the stream position, and the update stream's
        # position per server for serving replicas
        assert m.stream == "direct" and m.model_updates, m
    logs = "\n".join(p.read_text(errors="replace") for p in out.rglob("*.log"))
    lines = re.findall(r"periodic checkpoint (\S+): step (\d+), (\d+) bytes, [\d.]+ s", logs)
    assert [int(step) for _, step, _ in lines] == [3, 6, 9], logs[-4000:]
    assert {Path(p).name for p, _, _ in lines[1:]} == {Path(m.path or "").name
                                                        for m in periodic}


def test_a_bad_periodic_key_stops_the_run_before_any_role_starts(tmp_path):
    topology = _topology(tmp_path, {"every_s": -5})
    proc = _run(topology, tmp_path / "run", 60)
    assert proc.returncode == 2, proc.stderr
    assert (f"{topology / 'global_config.yml'}: common_config.checkpointing_config.every_s: "
            "expected a number of seconds") in proc.stderr, proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()
