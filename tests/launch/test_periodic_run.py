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

import numpy as np
import pytest
import yaml

from stream_persia.checkpoint import (
    list_checkpoints,
    load_embeddings,
    load_torch,
    read_manifest,
    verify,
)
from stream_persia.core import aio
from stream_persia.rpc import RpcClient
from stream_persia.server.service import EmbeddingServer

ROOT = Path(__file__).resolve().parents[2]
BATCH, STEPS = 1024, 10


def _topology(tmp_path: Path, checkpointing: dict, incremental: bool = False) -> Path:
    topologies = tmp_path / "topologies"
    shutil.copytree(ROOT / "topologies", topologies,
                    ignore=shutil.ignore_patterns("__pycache__", "*.png"))
    path = topologies / "synthetic_ctr" / "global_config.yml"
    data = yaml.safe_load(path.read_text())
    data["common_config"]["checkpointing_config"] = checkpointing
    if incremental:
        data.setdefault("embedding_parameter_server_config", {})[
            "enable_incremental_update"] = True
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


def _table(src: str, root: Path) -> dict[int, tuple]:
    """id -> (weights, optimizer state) a restore of ``src`` (its whole chain) gives a
    fresh embedding server (on a real loopback socket, configured by the restore)."""
    async def restore() -> dict:
        server = EmbeddingServer(1_000_000, checkpoint_root=str(root))
        await server.start()
        try:
            async with RpcClient(server.address) as c:
                await load_embeddings(src, [c], verify_checksums=True)
            return {k: (c["weights"][i].copy(), c["state"][i].copy())
                    for c in server.store.dump() for i, k in enumerate(c["ids"].tolist())}
        finally:
            await server.stop()

    return aio.run(restore())


@pytest.mark.timeout(240)
def test_incremental_periodic_checkpoints_are_patches_that_restore_the_final_state(tmp_path):
    """enable_incremental_update: periodic checkpoints at steps 2..10 are a base (2), a
    patch (4, 6), a base again after full_every=2 patches (8) and a patch (10); retention
    keeps the two newest and what they need; the patch at the last step restores to
    exactly the rows and optimizer state of the final (full) checkpoint of that step."""
    out = tmp_path / "run"
    proc = _run(_topology(tmp_path, {"every_steps": 2, "keep_checkpoints": 2,
                                     "full_every": 2}, incremental=True), out, 230)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-6000:]}"
    found = {m.step: m for m in list_checkpoints(str(out / "checkpoints"))
             if m.extra.get("by") == "periodic"}
    assert sorted(found) == [8, 10], sorted(found)
    base, patch = found[8], found[10]
    assert base.chain is not None and patch.chain is not None
    assert base.chain["depth"] == 0 and patch.chain["parent"] == base.chain["id"]
    assert patch.rows < patch.table_rows, "a patch holds what changed, not the table"
    final = read_manifest(str(out / "checkpoints" / "final"))
    assert final.step == patch.step == 10
    dense = [load_torch(m.path or "", m.dense_filename or "") for m in (patch, final)]
    assert dense[0].keys() == dense[1].keys()
    for name in dense[1]:
        np.testing.assert_allclose(dense[0][name].numpy(), dense[1][name].numpy(), atol=1e-6,
                                   rtol=0)
    got, want = _table(patch.path or "", out), _table(final.path or "", out)
    assert sorted(got) == sorted(want)
    for key, (w, s) in want.items():
        np.testing.assert_allclose(got[key][0], w, atol=1e-6, rtol=0)
        np.testing.assert_allclose(got[key][1], s, atol=1e-6, rtol=0)
