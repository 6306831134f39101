"""Checkpoint library: round trip, atomic publish, corruption, manifest validation, fsspec.

Embedding servers run in this process on real loopback sockets; rows get non-trivial
Adagrad state through the ``lookup``/``update`` RPCs (via a ShardRouter), and a restore is
compared with the original by dumping every store.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
import uuid

import fsspec
import numpy as np
import pytest
import torch

from stream_persia import checkpoint as ck
from stream_persia.checkpoint import CheckpointWriter, Manifest
from stream_persia.checkpoint import writer as writer_mod
from stream_persia.errors import BadInput, Misuse
from stream_persia.testing.samples import SCHEMA
from stream_persia.testing.servers import running_servers
from stream_persia.worker.router import ShardRouter
from stream_persia.worker.shards import RowLookup, UpdateGroup

DIMS = (8, 4)
OFFSETS = {"samples": {"0": 17, "1": 5}}


async def train_rows(router: ShardRouter, seed: int = 0, rounds: int = 3) -> None:
    """Insert rows of two dims and apply a few Adagrad updates (non-trivial state)."""
    rng = np.random.default_rng(seed)
    for r in range(rounds):
        groups = [RowLookup(dim, rng.choice(10_000 * (k + 1), size=150, replace=False)
                            .astype(np.uint64) + np.uint64(k << 40))
                  for k, dim in enumerate(DIMS)]
        await router.lookup(groups, "train")
        await router.update([UpdateGroup(g.dim, g.ids, rng.normal(size=(g.ids.size, g.dim))
                                         .astype(np.float32)) for g in groups])
        del r


def snapshot(servers) -> dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Every row of every server: dim → (ids, weights, optimizer state), sorted by id."""
    parts: dict[int, list[dict]] = {}
    for s in servers:
        for chunk in s.store.dump():
            parts.setdefault(chunk["dim"], []).append(chunk)
    out = {}
    for dim, chunks in parts.items():
        ids = np.concatenate([c["ids"] for c in chunks])
        order = np.argsort(ids)
        out[dim] = (ids[order], np.concatenate([c["weights"] for c in chunks])[order],
                    np.concatenate([c["state"] for c in chunks])[order])
    return out


def assert_same_rows(a, b) -> None:
    assert sorted(a) == sorted(b)
    for dim in a:
        for x, y in zip(a[dim], b[dim], strict=True):
            np.testing.assert_array_equal(x, y)


def hidden_entries(parent) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith("."))


async def write_checkpoint(dst: str, router: ShardRouter, step: int = 10) -> Manifest:
    with CheckpointWriter(dst) as w:
        w.write_torch(ck.DENSE_FILENAME, {"w": torch.arange(6.0).reshape(2, 3)})
        w.write_torch(ck.OPT_FILENAME, {"state": {}, "param_groups": [{"lr": 0.01}]})
        await w.dump_embeddings(router.clients)
        return w.commit(job="ctr", step=step, offsets=OFFSETS, stream="kafka",
                        schema=SCHEMA, extra={"nn_ranks": 1})


# ------------------------------------------------------------------- round trip
@pytest.mark.parametrize("scheme", ["local", "memory"])
async def test_round_trip_restores_rows_and_optimizer_state(tmp_path, scheme):
    root = str(tmp_path) if scheme == "local" else f"memory://ck-{uuid.uuid4().hex}"
    dst = f"{root}/step-10"
    try:
        async with running_servers(2, checkpoint_root=root) as (servers, router):
            await train_rows(router)
            before = snapshot(servers)
            order_before = [[c["ids"].tolist() for c in s.store.dump()] for s in servers]
            m = await asyncio.wait_for(write_checkpoint(dst, router), 30)

        assert (m.job, m.step, m.stream, m.shard_count) == ("ctr", 10, "kafka", 2)
        assert m.dense_filename == "dense.pt" and m.opt_filename == "opt.pt"
        assert m.jit_filename is None
        assert m.rows == sum(len(v[0]) for v in before.values())
        back = ck.read_manifest(dst)
        assert back == m and back.offsets == OFFSETS
        # The job's embedding schema: its digest, and itself (a refused restore names
        # what differs).
        assert back.config_digest == ck.config_digest(SCHEMA)
        assert back.extra == {"nn_ranks": 1, "embedding_schema": SCHEMA.to_dict()}
        ck.verify(dst)
        assert [x.step for x in ck.list_checkpoints(root)] == [10]
        dense = ck.load_torch(dst, m.dense_filename)
        assert torch.equal(dense["w"], torch.arange(6.0).reshape(2, 3))

        async with running_servers(2, checkpoint_root=root) as (fresh, router2):
            loaded = await asyncio.wait_for(ck.load_embeddings(dst, router2.clients), 30)
            assert loaded == m.rows
            assert_same_rows(snapshot(fresh), before)
            # Same server count: each server gets its own rows back in the same LRU order.
            assert [[c["ids"].tolist() for c in s.store.dump()] for s in fresh] == order_before
    finally:
        if scheme == "memory":
            fsspec.filesystem("memory").rm(root.removeprefix("memory://"), recursive=True)


@pytest.mark.parametrize(("threads_before", "threads_after"), [(1, 3), (3, 2)])
async def test_servers_with_store_threads_serve_and_restore_the_same_rows(
        tmp_path, threads_before, threads_after):
    """Internal shards change neither what a server serves nor what its checkpoint holds:
    a checkpoint moves between thread counts with every row and optimizer state."""
    async with running_servers(2) as (_, plain):
        await train_rows(plain)
        async with running_servers(2, store_threads=threads_before) as (servers, router):
            await train_rows(router)
            before = snapshot(servers)
            probe = [RowLookup(dim, np.arange(20_000, dtype=np.uint64) + np.uint64(k << 40))
                     for k, dim in enumerate(DIMS)]
            want, _ = await plain.lookup(probe, "eval")
            got, _ = await router.lookup(probe, "eval")
            for a, b in zip(want, got, strict=True):
                np.testing.assert_array_equal(a, b)
            m = await write_checkpoint(str(tmp_path / "t"), router)
    async with running_servers(2, store_threads=threads_after) as (fresh, router2):
        await train_rows(router2, rounds=1)   # the first store's threads start
        assert await ck.load_embeddings(m.path, router2.clients) == m.rows
        assert_same_rows(snapshot(fresh), before)
        health = await router2.broadcast("health")
        assert [h["store_threads"] for h in health] == [threads_after] * 2
        assert all(getattr(s.store, "shards", 1) == threads_after for s in fresh)
        # The replaced stores' threads are gone: only the serving stores' pools are left.
        assert len(shard_threads()) <= 2 * (threads_after - 1)
    assert shard_threads() == [], "a stopped server left its store threads running"


def shard_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("store-shard")]


async def test_load_clears_rows_not_in_the_checkpoint(tmp_path):
    async with running_servers(2) as (servers, router):
        await train_rows(router, rounds=1)
        m = await write_checkpoint(str(tmp_path / "a"), router)
        await train_rows(router, seed=9, rounds=1)        # rows the checkpoint does not have
        assert sum(len(s.store) for s in servers) > m.rows
        replaced = [s.store for s in servers]
        await ck.load_embeddings(str(tmp_path / "a"), router.clients)
        assert sum(len(s.store) for s in servers) == m.rows
        # The replaced tables are freed at once, not when their last reference goes.
        assert [t.memory_bytes() for t in replaced] == [0, 0]
        serving = [s.store for s in servers]
    assert [t.memory_bytes() for t in serving] == [0, 0], "a stopped server kept its table"


async def test_servers_must_be_a_complete_set_in_replica_order(tmp_path):
    async with running_servers(2) as (servers, router):
        with CheckpointWriter(str(tmp_path / "x")) as w:
            with pytest.raises(Misuse, match="replica"):
                await w.dump_embeddings(router.clients[:1])
            with pytest.raises(Misuse, match="replica"):
                await w.dump_embeddings(router.clients[::-1])
        m = await write_checkpoint(str(tmp_path / "ok"), router)
        with pytest.raises(Misuse, match="replica"):
            await ck.load_embeddings(m.path, router.clients[::-1])
    assert not (tmp_path / "x").exists()


# ------------------------------------------------------------------- atomicity
async def test_failed_writer_leaves_no_checkpoint(tmp_path):
    dst = str(tmp_path / "step-1")
    async with running_servers(2) as (servers, router):
        await train_rows(router, rounds=1)
        with pytest.raises(RuntimeError, match="boom"), CheckpointWriter(dst) as w:
            w.write_torch("dense.pt", {"x": torch.ones(2)})
            await w.dump_embeddings(router.clients)
            assert os.listdir(w.staging), "servers wrote into the staging directory"
            raise RuntimeError("boom")
    assert not os.path.exists(dst)
    assert hidden_entries(tmp_path) == [], "staging directory is cleaned up"
    assert ck.list_checkpoints(str(tmp_path)) == []
    with pytest.raises(BadInput, match="incomplete or not a checkpoint"):
        ck.read_manifest(dst)


async def test_existing_checkpoint_is_replaced_only_on_commit(tmp_path):
    dst = str(tmp_path / "latest")
    async with running_servers(2) as (servers, router):
        await train_rows(router, rounds=1)
        await write_checkpoint(dst, router, step=1)
        await train_rows(router, seed=5, rounds=1)

        w = CheckpointWriter(dst)
        w.write_torch("dense.pt", {"x": torch.zeros(1)})
        await w.dump_embeddings(router.clients)
        # Everything is staged, yet readers still see the old, intact checkpoint.
        assert ck.read_manifest(dst).step == 1
        ck.verify(dst)
        w.abort()
        assert ck.read_manifest(dst).step == 1 and hidden_entries(tmp_path) == []

        w = CheckpointWriter(dst)
        await w.dump_embeddings(router.clients)
        with pytest.raises(BadInput, match="stream"):
            w.commit(job="ctr", step=2, offsets={}, stream="files")   # nothing published
        assert ck.read_manifest(dst).step == 1
        m = w.commit(job="ctr", step=2, offsets={}, stream="direct")
        with pytest.raises(Misuse, match="committed"):
            w.write_bytes("late.bin", b"x")
    assert ck.read_manifest(dst) == m and m.dense_filename is None
    assert "dense.pt" not in os.listdir(dst), "no file of the old checkpoint survives"
    ck.verify(dst)
    assert hidden_entries(tmp_path) == []
    assert [x.step for x in ck.list_checkpoints(str(tmp_path))] == [2]


def test_failed_swap_puts_the_previous_checkpoint_back(tmp_path, monkeypatch):
    dst = str(tmp_path / "c")
    with CheckpointWriter(dst) as w:
        w.write_bytes("a.bin", b"old")
        w.commit(job="j", step=1, offsets={}, stream="direct")
    w = CheckpointWriter(dst)
    w.write_bytes("a.bin", b"new")
    real_rename, calls = os.rename, []

    def failing_second_rename(src, target):
        calls.append(src)
        if len(calls) == 2:       # dst moved aside; publishing the new one fails
            raise OSError("disk gone")
        real_rename(src, target)

    monkeypatch.setattr(writer_mod.os, "rename", failing_second_rename)
    with pytest.raises(OSError, match="disk gone"):
        w.commit(job="j", step=2, offsets={}, stream="direct")
    monkeypatch.setattr(writer_mod.os, "rename", real_rename)
    assert ck.read_manifest(dst).step == 1
    ck.verify(dst)
    w.abort()
    assert hidden_entries(tmp_path) == []


def test_interrupted_swap_is_explained(tmp_path):
    dst = tmp_path / "c"
    with CheckpointWriter(str(dst)) as w:
        w.commit(job="j", step=1, offsets={}, stream="direct")
    os.rename(dst, tmp_path / ".c.old-123")       # what a crash between the renames leaves
    with pytest.raises(BadInput, match="incomplete or not a checkpoint") as err:
        ck.read_manifest(str(dst))
    assert ".c.old-123 (previous)" in str(err.value) and "rename one" in str(err.value)
    assert ck.list_checkpoints(str(tmp_path)) == []


def test_refuses_to_replace_a_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "root" / "step-1").mkdir(parents=True)
    with pytest.raises(BadInput, match="not a checkpoint") as err:
        CheckpointWriter(str(tmp_path / "root"))
    assert err.value.field == "dst"
    assert (tmp_path / "root" / "step-1").is_dir()
    with pytest.raises(BadInput, match="plain file name"):
        with CheckpointWriter(str(tmp_path / "d")) as w:
            w.write_bytes("../escape", b"x")


def test_remote_writer_without_commit_is_invisible_and_abort_removes_it():
    root = f"memory://ck-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    try:
        with CheckpointWriter(f"{root}/old") as w:
            w.write_bytes("a.bin", b"1")
            w.commit(job="j", step=1, offsets={}, stream="direct")
        w = CheckpointWriter(f"{root}/new")
        w.write_bytes("a.bin", b"2")
        assert w.staging == f"{root.replace('://', ':///')}/new"   # written in place
        assert [m.step for m in ck.list_checkpoints(root)] == [1]
        with pytest.raises(BadInput, match="incomplete"):
            ck.read_manifest(f"{root}/new")
        w.abort()
        assert not fs.exists(f"{root.removeprefix('memory://')}/new")
    finally:
        fs.rm(root.removeprefix("memory://"), recursive=True)


# ------------------------------------------------------------------- corruption
def _flip_byte(path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


async def test_corrupt_and_truncated_files_are_named(tmp_path):
    dst = str(tmp_path / "c")
    async with running_servers(2) as (servers, router):
        await train_rows(router, rounds=1)
        m = await write_checkpoint(dst, router)
        shard = m.embedding_files[1]
        _flip_byte(os.path.join(dst, shard), m.files[shard]["bytes"] // 2)
        with pytest.raises(BadInput, match=f"{shard} is corrupt") as err:
            ck.verify(dst)
        assert err.value.field == f"files.{shard}"
        with pytest.raises(BadInput, match="corrupt"):
            await ck.load_embeddings(dst, router.clients, verify_checksums=True)

        _flip_byte(os.path.join(dst, "dense.pt"), 40)
        with pytest.raises(BadInput, match="dense.pt is corrupt"):
            ck.load_torch(dst, "dense.pt")
        with pytest.raises(BadInput, match="no file 'nope.pt'"):
            ck.load_torch(dst, "nope.pt")

        shard0 = m.embedding_files[0]
        path0 = os.path.join(dst, shard0)
        os.truncate(path0, m.files[shard0]["bytes"] - 7)
        rows_before = sum(len(s.store) for s in servers)
        with pytest.raises(BadInput, match=f"{shard0} has .* bytes.*truncated"):
            await ck.load_embeddings(dst, router.clients)
        assert sum(len(s.store) for s in servers) == rows_before, "nothing was cleared"
        # The server itself refuses a truncated file too (the load RPC, bypassing checks).
        with pytest.raises(BadInput, match="truncated"):
            await router.clients[0].call("load", {"dir": dst, "files": [shard0]})
        os.remove(path0)
        with pytest.raises(BadInput, match=f"{shard0} is missing") as err:
            await ck.load_embeddings(dst, router.clients)
        assert err.value.field == f"files.{shard0}"


# ------------------------------------------------------------------- manifest
def _manifest_dict() -> dict:
    return Manifest(job="j", step=3, stream="kafka", offsets={"t": {1: 4, "0": 2}},
                    shard_count=1, files={"s.bin": {"sha256": "a" * 64, "bytes": 9, "rows": 2},
                                          "dense.pt": {"sha256": "b" * 64, "bytes": 1}},
                    embedding_files=["s.bin"], dense_filename="dense.pt").to_dict()


def test_manifest_round_trip_and_normalised_offsets():
    d = _manifest_dict()
    assert d["format_version"] == 1 and list(d)[0] == "format_version"
    assert d["offsets"] == {"t": {"0": 2, "1": 4}}
    assert d["created_at"].endswith("Z")
    assert Manifest.from_dict(json.loads(json.dumps(d))).to_dict() == d


FP = {"offset": 3, "timestamp": 1700000000000, "digest": "0123456789abcdef"}


def test_manifest_fingerprints_are_optional_and_kept():
    d = _manifest_dict()
    assert "fingerprints" not in d                 # none: read as before by older readers
    assert Manifest.from_dict(d).fingerprints is None
    d["fingerprints"] = {"t": {1: FP}}
    m = Manifest.from_dict(d)
    assert m.fingerprints == {"t": {"1": FP}}
    assert Manifest.from_dict(m.to_dict()).to_dict() == m.to_dict()
    # Offsets edited by hand leave a fingerprint of another offset: still a manifest (a
    # restore does not compare that one).
    d["offsets"]["t"]["1"] = 100
    assert Manifest.from_dict(d).fingerprints == {"t": {"1": FP}}


@pytest.mark.parametrize("prints, field", [
    ({"t": {"1": {**FP, "offset": -1}}}, "fingerprints.t.1"),
    ({"t": {"x": FP}}, "fingerprints.t.x"),
    ({"t": {"1": {**FP, "digest": "XYZ"}}}, "fingerprints.t.1"),
    ({"t": {"1": {**FP, "timestamp": "now"}}}, "fingerprints.t.1"),
    ({"t": {"1": {**FP, "extra": 1}}}, "fingerprints.t.1"),
    ({"t": [FP]}, "fingerprints"),
    ([FP], "fingerprints"),
])
def test_manifest_fingerprints_are_validated_naming_the_key(prints, field):
    d = _manifest_dict()
    d["fingerprints"] = prints
    with pytest.raises(BadInput) as err:
        Manifest.from_dict(d)
    assert err.value.field == field


@pytest.mark.parametrize("change, field", [
    (lambda d: d.update(format_version=2), "format_version"),
    (lambda d: d.pop("step"), "step"),
    (lambda d: d.update(step=-1), "step"),
    (lambda d: d.update(surprise=1), "surprise"),
    (lambda d: d.update(stream="file"), "stream"),
    (lambda d: d.update(created_at="yesterday"), "created_at"),
    (lambda d: d["offsets"]["t"].update(x=1), "offsets.t"),
    (lambda d: d["files"]["s.bin"].update(sha256="xyz"), "files.s.bin.sha256"),
    (lambda d: d.update(shard_count=2), "embedding_files"),
    (lambda d: d.update(dense_filename="other.pt"), "dense_filename"),
    (lambda d: d["files"].update({"../x": {"sha256": "c" * 64, "bytes": 1}}), "files"),
])
def test_manifest_validation_names_the_key(change, field):
    d = _manifest_dict()
    change(d)
    with pytest.raises(BadInput) as err:
        Manifest.from_dict(d)
    assert err.value.field == field


def test_unknown_format_version_is_a_clear_error(tmp_path):
    d = _manifest_dict()
    d["format_version"] = 7
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "manifest.json").write_text(json.dumps(d))
    with pytest.raises(BadInput, match="format_version 7 is not supported") as err:
        ck.read_manifest(str(tmp_path / "c"))
    assert "manifest.json" in str(err.value)
    (tmp_path / "c" / "manifest.json").write_text("{not json")
    with pytest.raises(BadInput, match="not valid JSON"):
        ck.read_manifest(str(tmp_path / "c"))
    assert ck.list_checkpoints(str(tmp_path)) == []


def test_the_latest_checkpoint_is_the_newest_not_the_highest_step(tmp_path):
    """An NN worker that restored step 5 of a run that reached step 10 goes on from step
    5: the checkpoints it writes next (steps 6, 7), within the same second too, are the
    latest, not the abandoned step 10 (a serving replica started on "latest" served the
    abandoned model; an incremental checkpoint patched it)."""
    for step in (10, 5, 6, 7):
        with CheckpointWriter(str(tmp_path / f"s{step}")) as w:
            w.write_bytes("x.bin", b"%d" % step)
            w.commit(job="j", step=step, offsets={}, stream="direct")
    assert ck.latest_checkpoint(str(tmp_path)).path == str(tmp_path / "s7")
    created = [ck.read_manifest(str(tmp_path / f"s{s}")).created_at for s in (10, 5, 6, 7)]
    assert created == sorted(created) and len(set(created)) == 4, created
    # retention agrees: the abandoned step 10 is the oldest
    assert ck.prune_checkpoints(str(tmp_path), keep=3) == ["s10"]


def test_the_latest_checkpoint_of_a_job(tmp_path):
    """Two jobs share a directory: each one's latest is its own (a serving replica of one
    served the other's model when it was the newer)."""
    for name, job in (("mine", "j"), ("theirs", "other")):
        with CheckpointWriter(str(tmp_path / name)) as w:
            w.write_bytes("x.bin", b"x")
            w.commit(job=job, step=1, offsets={}, stream="direct")
    assert ck.latest_checkpoint(str(tmp_path)).path == str(tmp_path / "theirs")
    assert ck.latest_checkpoint(str(tmp_path), "j").path == str(tmp_path / "mine")
    assert ck.latest_checkpoint(str(tmp_path), "none") is None


def test_list_checkpoints_sorted_complete_only(tmp_path):
    for step in (20, 3, 11):
        with CheckpointWriter(str(tmp_path / f"s{step}")) as w:
            w.write_bytes("x.bin", b"%d" % step)
            w.commit(job="j", step=step, offsets={}, stream="direct")
    (tmp_path / "partial").mkdir()
    (tmp_path / "partial" / "x.bin").write_bytes(b"x")
    (tmp_path / "a-file").write_bytes(b"x")
    found = ck.list_checkpoints(str(tmp_path))
    assert [m.step for m in found] == [3, 11, 20]
    assert found[0].path == str(tmp_path / "s3")
    assert ck.latest_checkpoint(str(tmp_path)).step == 11   # the one committed last
    assert ck.list_checkpoints(str(tmp_path / "missing")) == []

