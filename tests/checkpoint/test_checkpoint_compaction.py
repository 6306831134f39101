"""Compaction of a chain into a new full base (issue 21, item 3), and retention with it.

The chain is made as in ``test_checkpoint_incremental``: embedding servers in this
process on real loopback sockets train through the RPC router (a small capacity, so rows
are evicted between checkpoints), write a base with dense files and three patches.
Compaction then runs offline (the files alone, ``stream-persia checkpoint compact`` as a
real process too), and the compacted base is restored into fresh servers: it gives every
row with its optimizer state, and the dense files, that a restore of the chain gives.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from test_checkpoint_incremental import CAPACITY, assert_same, flip_a_byte, restored, table, train

from stream_persia.checkpoint import (
    DENSE_FILENAME,
    OPT_FILENAME,
    CheckpointWriter,
    chain_of,
    list_checkpoints,
    load_embeddings,
    load_torch,
    prune_checkpoints,
    read_manifest,
)
from stream_persia.embedding.optim import Adam
from stream_persia.errors import BadInput
from stream_persia.server.compaction import COMPACTED_AT, COMPACTED_FROM, compact
from stream_persia.testing.servers import running_servers


async def checkpoint(router, dst, parent=None, step=1):
    """A checkpoint with dense files that differ at each step."""
    with CheckpointWriter(str(dst)) as w:
        w.write_torch(DENSE_FILENAME, {"w": np.full(3, step, np.float32).tolist()})
        w.write_torch(OPT_FILENAME, {"step": step})
        await w.dump_embeddings(router.clients,
                                parent=None if parent is None else read_manifest(str(parent)))
        return w.commit(job="j", step=step, offsets={}, stream="direct",
                        extra={"id": dst.name, "by": "periodic"})


@pytest.fixture
async def chain(tmp_path):
    """ck-0 (a base) and patches ck-1..ck-3 of 2 servers that trained and evicted in
    between; yields (root, [manifests], the table at each), the servers still running
    (``router``) for more patches."""
    rng = np.random.default_rng(11)
    async with running_servers(2, Adam(lr=0.01), capacity=CAPACITY) as (servers, router):
        await train(router, rng, 400)
        made, tables, parent = [], [], None
        for k in range(4):
            if k:
                await train(router, rng)
            made.append(await checkpoint(router, tmp_path / f"ck-{k}", parent, step=10 * k))
            tables.append(table(servers))
            parent = tmp_path / f"ck-{k}"
        yield tmp_path, made, tables, (servers, router, rng)


async def test_the_compacted_base_restores_what_the_chain_restores(chain):
    root, made, tables, _ = chain
    assert set(tables[0]) - set(tables[3]), "the chain must tombstone evicted ids"
    base = compact(str(root / "ck-3"))
    assert base.path == str(root / "ck-3-compacted")
    c = base.chain
    assert (c["id"], c["parent"], c["base"], c["depth"], c["tombstone_files"]) == \
        ("ck-3-compacted", None, "ck-3-compacted", 0, [])
    assert c["tracking"] == made[3].chain["tracking"]
    assert base.extra[COMPACTED_FROM] == ["ck-0", "ck-1", "ck-2", "ck-3"]
    assert base.extra["id"] == "ck-3-compacted" and base.extra["by"] == "periodic"
    assert (base.step, base.offsets, base.server_config) == \
        (made[3].step, made[3].offsets, made[3].server_config)
    assert base.rows == base.table_rows == len(tables[3])
    assert [m.path for m in chain_of(base.path)] == [base.path]
    from_chain = await restored(str(root / "ck-3"))
    from_base = await restored(base.path)
    assert_same(from_base, from_chain)
    assert_same(from_base, tables[3])
    for name in (DENSE_FILENAME, OPT_FILENAME):
        assert load_torch(base.path, name) == load_torch(str(root / "ck-3"), name)
    # a member in the middle: its chain up to it, not the patches after it
    mid = compact(str(root / "ck-1"), str(root / "mid"))
    assert mid.extra[COMPACTED_FROM] == ["ck-0", "ck-1"] and mid.step == 10
    assert_same(await restored(mid.path), tables[1])
    assert load_torch(mid.path, DENSE_FILENAME) == {"w": [10.0, 10.0, 10.0]}


async def test_the_next_patch_patches_the_compacted_base_and_retention_frees_the_old_chain(
        chain):
    root, made, _, (servers, router, rng) = chain
    base = compact(str(root / "ck-3"))
    await train(router, rng)
    patch = await checkpoint(router, root / "ck-4", root / "ck-3-compacted", step=40)
    assert (patch.chain["parent"], patch.chain["base"], patch.chain["depth"]) == \
        ("ck-3-compacted", "ck-3-compacted", 1)
    assert patch.chain["full_because"] is None and 0 < patch.rows < patch.table_rows
    want = table(servers)
    # keep 2: ck-4 and its base; the old chain is needed by neither
    assert sorted(prune_checkpoints(str(root), keep=2)) == ["ck-0", "ck-1", "ck-2", "ck-3"]
    assert [os.path.basename(m.path) for m in list_checkpoints(str(root))] == \
        ["ck-3-compacted", "ck-4"]
    assert_same(await restored(str(root / "ck-4")), want)
    # keep 1: ck-4 still needs its base, which is never deleted
    assert prune_checkpoints(str(root), keep=1) == []
    assert read_manifest(base.path).chain["id"] == "ck-3-compacted"


def test_retention_never_deletes_what_a_kept_patch_needs_even_with_a_compacted_base(chain):
    root, _, _, _ = chain
    for i in range(4):   # the chain was cut days ago (the manifest has no checksum of itself)
        path = root / f"ck-{i}" / "manifest.json"
        m = json.loads(path.read_text())
        m["created_at"] = f"2024-01-0{i + 1}T00:00:00Z"
        path.write_text(json.dumps(m))
    compact(str(root / "ck-1"), str(root / "ck-1c"))   # a base at step 10, made now
    made = read_manifest(str(root / "ck-1c"))
    # it holds ck-1's state, so it ranks as ck-1 did: never above the newer ck-3
    assert made.created_at == "2024-01-02T00:00:00Z"
    assert made.extra[COMPACTED_AT] > "2024"
    # ck-3 is kept (the newest); it needs ck-0..ck-2 whatever their age, and the
    # compacted ck-1c does not free them
    for keep in (2, 1):
        assert set(prune_checkpoints(str(root), keep=keep)) <= {"ck-1c"}
        names = {os.path.basename(m.path) for m in list_checkpoints(str(root))}
        assert {"ck-0", "ck-1", "ck-2", "ck-3"} <= names


async def test_a_corrupt_member_fails_the_compaction_naming_it_and_publishes_nothing(chain):
    root, made, _, _ = chain
    flip_a_byte(root / "ck-2" / made[2].embedding_files[1])
    before = sorted(os.listdir(root))
    with pytest.raises(BadInput, match=f"ck-2.*{made[2].embedding_files[1]}"):
        compact(str(root / "ck-3"))
    assert sorted(os.listdir(root)) == before   # no dst, no staging left
    with pytest.raises(BadInput, match="exists") as err:
        compact(str(root / "ck-1"), str(root / "ck-0"))
    assert err.value.field == "dst"


async def test_the_console_command_compacts_with_progress_and_exit_codes(chain):
    root, _, tables, _ = chain
    cmd = [sys.executable, "-m", "stream_persia.launch.cli", "checkpoint", "compact",
           str(root / "ck-2"), "--dst", str(root / "c2")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(root / "c2")
    assert "ck-0 -> ck-1 -> ck-2" in proc.stderr and "shard 2/2: wrote" in proc.stderr
    assert_same(await restored(str(root / "c2")), tables[2])
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and "exists" in again.stderr
    assert "Traceback" not in again.stderr


def run_cli(*argv: str, capsys) -> tuple[int, str, str]:
    from stream_persia.launch import cli

    code = cli.main(["checkpoint", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_inspect_shows_the_chain_and_verify_checks_every_member(chain, capsys):
    root, made, _, _ = chain
    code, out, _ = run_cli("inspect", str(root / "ck-2"), "--verify", capsys=capsys)
    assert code == 0
    lines = out[out.index("  chain (3 checkpoint(s)"):].splitlines()[1:4]
    assert [line.split()[0:2] for line in lines] == [["ck-0", "depth"], ["→", "ck-1"],
                                                      ["→", "ck-2"]]
    assert f"step 20  {made[2].table_rows:,} rows ({made[2].rows:,} in its files)" in out
    assert "verified: " in out and "of 3 checkpoint(s)" in out
    code, out, _ = run_cli("inspect", str(root / "ck-2"), "--json", capsys=capsys)
    members = json.loads(out)["chain_members"]
    assert [(m["id"], m["depth"], m["parent"], m["step"]) for m in members] == [
        ("ck-0", 0, None, 0), ("ck-1", 1, "ck-0", 10), ("ck-2", 2, "ck-1", 20)]
    assert [m["bytes"] for m in members] == [
        sum(e["bytes"] for e in m.files.values()) for m in made[:3]]
    assert members[0]["full_because"] is None
    # a corrupt base: --verify of a patch names it
    bad = root / "ck-0" / made[0].embedding_files[0]
    bad.write_bytes(bad.read_bytes()[:-1] + b"\0")
    code, out, err = run_cli("inspect", str(root / "ck-2"), "--verify", capsys=capsys)
    assert code == 2 and f"ck-0: file {made[0].embedding_files[0]} is corrupt" in err


def test_list_marks_chain_members_and_groups_them_under_their_base(chain, capsys):
    root, made, _, _ = chain
    compact(str(root / "ck-1"), str(root / "ck-1c"))
    code, out, _ = run_cli("list", str(root), capsys=capsys)
    rows = [line.split() for line in out.splitlines()[1:]]
    # columns: step, created, job, shards, rows, size (2 words), kind, depth, parent, [mark], path
    assert [(r[7], r[8], r[9], r[-1].rsplit("/", 1)[-1]) for r in rows] == [
        ("base", "0", "-", "ck-0"), ("patch", "1", "ck-0", "ck-1"),
        ("patch", "2", "ck-1", "ck-2"), ("patch", "3", "ck-2", "ck-3"),
        ("base", "0", "-", "ck-1c")]
    assert all(r[-2] == "└" for r in rows[1:4])
    code, out, _ = run_cli("list", str(root), "--json", capsys=capsys)
    got = {d["id"]: d for d in json.loads(out)}
    assert got["ck-3"]["chain"]["parent"] == "ck-2" and got["ck-3"]["chain"]["depth"] == 3
    assert got["ck-1"]["bytes"] == sum(e["bytes"] for e in made[1].files.values())


async def test_the_compacted_base_keeps_the_counts_of_frequency_admission(tmp_path):
    """The base's count-min sketch (``min_count`` admission) is what a restore of the chain
    restores (patches carry none); the compacted base carries it too: ids seen twice under
    ``min_count: 3`` get rows at their next sight after restoring it."""
    import asyncio

    from stream_persia.embedding import EmbeddingConfig
    from stream_persia.embedding.optim import Adagrad
    from stream_persia.kernels.ids import index_prefix, prefix_ids
    from stream_persia.worker.shards import RowLookup

    policies = {"prefix_bits": 8, "policies": [None, {"min_count": 3}],
                "names": [None, "user"]}
    config = {"optimizer": Adagrad(lr=0.1).to_dict(),
              "embedding_config": EmbeddingConfig((-0.05, 0.05)).to_dict(),
              "policies": policies}
    ids = prefix_ids(np.arange(1, 200, dtype=np.uint64), index_prefix=index_prefix(0, 8),
                     prefix_bits=8)

    async def configure(router):
        await asyncio.gather(*(c.call("configure", config) for c in router.clients))

    async with running_servers(2, store_threads=2) as (servers, router):
        await configure(router)
        for _ in range(2):
            await router.lookup([RowLookup(4, ids)], "train")
        assert sum(len(s.store) for s in servers) == 0, "seen twice: no row yet"
        await checkpoint(router, tmp_path / "b")
        await checkpoint(router, tmp_path / "p", tmp_path / "b")
    assert read_manifest(str(tmp_path / "p")).is_patch
    compact(str(tmp_path / "p"), str(tmp_path / "c"))
    async with running_servers(2, store_threads=2) as (fresh, router):
        await configure(router)
        await load_embeddings(str(tmp_path / "c"), router.clients)
        await router.lookup([RowLookup(4, ids)], "train")
        assert sum(len(s.store) for s in fresh) == len(ids), "the third sight admits them"


async def test_compaction_keeps_the_kafka_offsets_and_their_fingerprints(tmp_path):
    """A compacted base restores onto the same topic only: the fingerprints of the
    records below its offsets go with them (stream_persia.kafka.fingerprint)."""
    prints = {"t": {"0": {"offset": 6, "timestamp": 1700000000000, "digest": "ab" * 8}}}
    async with running_servers(1, Adam(lr=0.01), capacity=CAPACITY) as (_, router):
        await train(router, np.random.default_rng(3), 50)
        with CheckpointWriter(str(tmp_path / "ck")) as w:
            await w.dump_embeddings(router.clients)
            w.commit(job="j", step=1, offsets={"t": {"0": 7}}, stream="kafka",
                     fingerprints=prints)
    base = compact(str(tmp_path / "ck"))
    assert (base.offsets, base.fingerprints) == ({"t": {"0": 7}}, prints)
    assert read_manifest(base.path).fingerprints == prints
