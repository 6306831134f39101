"""``stream-persia checkpoint inspect|list``: human summary, JSON, verify, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from stream_persia.checkpoint import CheckpointWriter, config_digest, read_manifest
from stream_persia.embedding.optim import Adagrad
from stream_persia.launch import cli
from stream_persia.rpc import RpcClient
from stream_persia.server.service import EmbeddingServer
from stream_persia.testing.samples import SCHEMA


@pytest.fixture
async def checkpoints(tmp_path):
    """Two checkpoints under ``tmp_path/root``, each with one embedding shard."""
    server = EmbeddingServer(1000, Adagrad(), checkpoint_root=str(tmp_path))
    await server.start()
    client = RpcClient(server.address, timeout_ms=5000)
    try:
        await server.on_store(server.store.lookup, np.arange(1, 41, dtype=np.uint64), 8)
        paths = []
        for step in (200, 100):
            path = str(tmp_path / "root" / f"step-{step}")
            with CheckpointWriter(path) as w:
                w.write_bytes("dense.pt", b"\0" * 3000)
                await w.dump_embeddings([client])
                w.commit(job="ctr-demo", step=step, stream="kafka", schema=SCHEMA,
                         offsets={"samples": {0: 12 + step, 1: 7}})
            paths.append(path)
        yield tmp_path / "root", paths
    finally:
        await client.close()
        await server.stop()


def run_cli(*argv: str, capsys) -> tuple[int, str, str]:
    code = cli.main(["checkpoint", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_prints_a_summary(checkpoints, capsys):
    _, (path, _) = checkpoints
    code, out, _ = run_cli("inspect", path, capsys=capsys)
    assert code == 0
    for text in (f"checkpoint {path}", "job:           ctr-demo", "step:          200",
                 "stream:        kafka", "samples[0] = 212", "samples[1] = 7",
                 "embedding shards: 1 (40 rows)",
                 f"config digest: {config_digest(SCHEMA)}",
                 "embedding-shard-00000-of-00001.bin", "40 rows", "2.9 KiB",
                 read_manifest(path).created_at):
        assert text in out, f"{text!r} missing from:\n{out}"


def test_inspect_json_and_verify(checkpoints, capsys):
    _, (path, _) = checkpoints
    code, out, _ = run_cli("inspect", path, "--json", "--verify", capsys=capsys)
    got = json.loads(out)
    members = got.pop("chain_members")   # a full base: a chain of itself
    assert code == 0 and got == read_manifest(path).to_dict()
    assert [(m["id"], m["depth"], m["parent"]) for m in members] == [("step-200", 0, None)]
    code, out, _ = run_cli("inspect", path, "--verify", capsys=capsys)
    assert code == 0 and "verified: 2 file(s)" in out

    with open(os.path.join(path, "dense.pt"), "r+b") as f:
        f.write(b"\1")
    code, out, err = run_cli("inspect", path, "--verify", capsys=capsys)
    assert code == 2 and out == ""
    assert "dense.pt is corrupt" in err


def test_list_orders_by_step(checkpoints, capsys):
    root, (p200, p100) = checkpoints
    os.makedirs(root / "being-written")
    code, out, _ = run_cli("list", str(root), capsys=capsys)
    lines = out.strip().splitlines()
    assert code == 0 and lines[0].split()[:2] == ["STEP", "CREATED"]
    assert [ln.split()[0] for ln in lines[1:]] == ["100", "200"]
    assert lines[1].endswith(p100) and "being-written" not in out
    code, out, _ = run_cli("list", str(root), "--json", capsys=capsys)
    assert [m["step"] for m in json.loads(out)] == [100, 200]


def test_not_a_checkpoint_exits_2_from_the_console(tmp_path):
    (tmp_path / "empty").mkdir()
    proc = subprocess.run([sys.executable, "-m", "stream_persia.launch.cli", "checkpoint", "inspect",
                           str(tmp_path / "empty")], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "incomplete or not a checkpoint" in proc.stderr
    assert "Traceback" not in proc.stderr
