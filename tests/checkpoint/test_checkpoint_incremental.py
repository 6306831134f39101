"""Incremental checkpoints: patches on a base, restored in order (issue 21, item 2).

Embedding servers run in this process on real loopback sockets (as in
``test_checkpoint_shard_load``); they train through the RPC router, write a base, train
on (with a small capacity, so that rows are evicted between checkpoints) and write
patches. Restoring base + patches into fresh servers gives every row, with its optimizer
state, that the servers held at the last patch; an id evicted before it stays evicted. A
corrupt or missing member of a chain is an error naming it, and the chain before it
still restores. The crash of a server during a patch write is in
``tests/launch/test_incremental_crash.py`` (a real process killed with SIGKILL).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os

import numpy as np
import pytest

from stream_persia.checkpoint import (
    CheckpointWriter,
    chain_of,
    load_embeddings,
    prune_checkpoints,
    read_manifest,
    verify,
)
from stream_persia.embedding.optim import Adam
from stream_persia.errors import BadInput, Misuse
from stream_persia.testing.servers import running_servers
from stream_persia.worker.shards import RowLookup, UpdateGroup

DIMS = (8, 4)
CAPACITY = 300     # per server: training evicts rows between checkpoints


async def train(router, rng, n: int = 150) -> None:
    """Look up ``n`` ids of each dim (some new, some seen) and update them."""
    groups = [RowLookup(dim, np.unique(rng.choice(3_000, size=n, replace=False))
                        .astype(np.uint64) + np.uint64((k + 1) << 40))
              for k, dim in enumerate(DIMS)]
    await router.lookup(groups, "train")
    await router.update([UpdateGroup(g.dim, g.ids, rng.normal(size=(g.ids.size, g.dim))
                                     .astype(np.float32)) for g in groups])


def table(servers) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """id → (weights, optimizer state) over every server."""
    out = {}
    for s in servers:
        for c in s.store.dump():
            for i, key in enumerate(c["ids"].tolist()):
                assert key not in out
                out[key] = (c["weights"][i].copy(), c["state"][i].copy())
    return out


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want), (
        f"{len(set(want) - set(got))} ids missing, {len(set(got) - set(want))} extra")
    for key, (w, s) in want.items():
        np.testing.assert_allclose(got[key][0], w, atol=1e-6, rtol=0)
        np.testing.assert_allclose(got[key][1], s, atol=1e-6, rtol=0)


async def checkpoint(router, dst, parent=None, step=1):
    with CheckpointWriter(str(dst)) as w:
        await w.dump_embeddings(router.clients,
                                parent=None if parent is None else read_manifest(str(parent)))
        return w.commit(job="j", step=step, offsets={}, stream="direct")


@pytest.fixture
async def chain(tmp_path):
    """A base and three patches of 2 servers that trained (and evicted) in between:
    (root, [manifests], the table at each, the ids evicted since the base)."""
    rng = np.random.default_rng(7)
    async with running_servers(2, Adam(lr=0.01), capacity=CAPACITY) as (servers, router):
        await train(router, rng, 400)
        made, tables = [], []
        parent = None
        for k in range(4):
            if k:
                await train(router, rng)
            m = await checkpoint(router, tmp_path / f"ck-{k}", parent, step=k)
            made.append(m)
            tables.append(table(servers))
            parent = tmp_path / f"ck-{k}"
        evicted = set(tables[0]) - set(tables[-1])
        yield tmp_path, made, tables, evicted


async def restored(src: str, **kw) -> dict:
    async with running_servers(3, Adam(lr=0.01), capacity=CAPACITY, **kw) as (servers, router):
        await load_embeddings(src, router.clients, verify_checksums=True)
        return table(servers)


async def test_base_and_patches_restore_every_row_and_its_optimizer_state(chain):
    root, made, tables, evicted = chain
    assert [m.chain["depth"] for m in made] == [0, 1, 2, 3]
    assert [m.chain["parent"] for m in made] == [None, "ck-0", "ck-1", "ck-2"]
    assert {m.chain["base"] for m in made} == {"ck-0"}
    assert all(m.chain["full_because"] is None for m in made)
    assert evicted, "the test must evict rows between the base and the last patch"
    for m in made[1:]:   # a patch holds what changed, not the table
        assert 0 < m.rows < m.table_rows
        assert sum(m.files[t]["rows"] for t in m.chain["tombstone_files"]) > 0
    assert [m.table_rows for m in made] == [len(t) for t in tables]
    for k in (1, 3):   # into 3 servers: every row goes to its new owner
        got = await restored(str(root / f"ck-{k}"))
        assert_same(got, tables[k])
    assert not evicted & set(got), "an id evicted after the base came back"


def flip_a_byte(path) -> None:
    """Corrupt ``path`` in place: its middle byte inverted (its size unchanged)."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


async def test_a_corrupt_or_missing_patch_is_named_and_the_chain_before_it_restores(chain):
    root, made, tables, _ = chain
    flip_a_byte(root / "ck-2" / made[2].embedding_files[0])
    for src in ("ck-2", "ck-3"):
        with pytest.raises(BadInput, match=f"ck-2.*{made[2].embedding_files[0]}"):
            verify(str(root / src))
        with pytest.raises(BadInput, match="ck-2"):
            await restored(str(root / src))
    assert_same(await restored(str(root / "ck-1")), tables[1])

    os.rename(root / "ck-1", root / ".ck-1.gone")   # a missing parent
    with pytest.raises(BadInput, match="patch of 'ck-1'") as err:
        chain_of(str(root / "ck-3"))
    assert err.value.field == "chain.parent"
    with pytest.raises(BadInput, match="ck-1"):
        await restored(str(root / "ck-3"))
    assert_same(await restored(str(root / "ck-0")), tables[0])


async def test_a_tombstone_file_is_checked_too(chain):
    root, made, _, _ = chain
    name = made[1].chain["tombstone_files"][1]
    (root / "ck-1" / name).write_bytes(b"")
    with pytest.raises(BadInput, match=f"ck-1.*{name}"):
        await restored(str(root / "ck-3"))


def test_retention_keeps_what_a_kept_patch_needs(chain):
    root, made, _, _ = chain
    assert prune_checkpoints(str(root), keep=1) == []   # ck-3 needs ck-0..ck-2
    assert [m.chain["id"] for m in (read_manifest(str(root / f"ck-{k}"))
                                    for k in range(4))] == ["ck-0", "ck-1", "ck-2", "ck-3"]


async def test_a_patch_after_a_restore_or_into_other_servers_is_a_full_base(tmp_path):
    rng = np.random.default_rng(3)
    async with running_servers(2, Adam(lr=0.01), capacity=CAPACITY) as (servers, router):
        await train(router, rng)
        await checkpoint(router, tmp_path / "a")
        await load_embeddings(str(tmp_path / "a"), router.clients)   # replaces the tables
        await train(router, rng)
        m = await checkpoint(router, tmp_path / "b", tmp_path / "a")
        assert m.chain["parent"] is None and m.chain["depth"] == 0
        assert "restore replaced" in m.chain["full_because"]
        assert m.rows == m.table_rows == len(table(servers))
        assert not [n for n in os.listdir(tmp_path / "b") if "patch" in n or "tomb" in n]
    async with running_servers(3, Adam(lr=0.01), capacity=CAPACITY) as (servers, router):
        await load_embeddings(str(tmp_path / "b"), router.clients)
        m = await checkpoint(router, tmp_path / "c", tmp_path / "b")
        assert "3 now" in m.chain["full_because"]


async def test_a_server_restarted_since_the_parent_makes_a_full_base(tmp_path):
    rng = np.random.default_rng(4)
    async with running_servers(1, Adam(lr=0.01), capacity=CAPACITY) as (servers, router):
        await train(router, rng)
        await checkpoint(router, tmp_path / "a")
    async with running_servers(1, Adam(lr=0.01), capacity=CAPACITY) as (servers, router):
        await train(router, rng)
        m = await checkpoint(router, tmp_path / "b", tmp_path / "a")
        assert "restarted" in m.chain["full_because"]


def test_a_manifest_chain_is_validated(chain):
    root, made, _, _ = chain
    path = root / "ck-2" / "manifest.json"
    d = json.loads(path.read_text())
    d["chain"]["depth"] = 0
    path.write_text(json.dumps(d))
    with pytest.raises(BadInput) as err:
        read_manifest(str(root / "ck-2"))
    assert err.value.field == "chain.depth"


def test_a_requested_checkpoint_patches_the_newest_chain_shorter_than_full_every(chain):
    from stream_persia.nn.periodic import latest_parent

    root = chain[0]
    assert latest_parent(str(root / "next"), 8) == str(root / "ck-3")
    assert latest_parent(str(root / "next"), 3) is None   # ck-3 is the 3rd patch: a base
    assert latest_parent(str(root / "empty" / "next"), 8) is None
    # Only the job's own: another job's chain in the same directory is no parent.
    assert latest_parent(str(root / "next"), 8, job="j") == str(root / "ck-3")
    assert latest_parent(str(root / "next"), 8, job="other") is None


@pytest.mark.parametrize("impl", ["cython", "python"])
def test_an_overrun_eviction_log_or_a_clear_makes_a_full_shard_not_a_patch(tmp_path, impl):
    """The server never writes a patch it cannot make complete (write_patch is what its
    dump runs on the store thread)."""
    from stream_persia.server import patches
    from stream_persia.server._pystore import PyEmbeddingStore
    from stream_persia.server.store import CEmbeddingStore

    store_type = PyEmbeddingStore if impl == "python" or CEmbeddingStore is None \
        else CEmbeddingStore
    store = store_type(4, Adam(lr=0.01), eviction_log=2)
    store.lookup(np.arange(1, 5, dtype=np.uint64), 4)
    since = patches.tracking("inc", 0, store)
    store.lookup(np.arange(5, 7, dtype=np.uint64), 4)     # evicts 2: the log holds them
    got = patches.write_patch(store, since, patches.tracking("inc", 0, store),
                              str(tmp_path), 0, 1)
    assert got is not None and got["tombstones"]["rows"] == 2 and got["rows"]["rows"] == 2
    store.lookup(np.arange(7, 10, dtype=np.uint64), 4)    # 3 more: the log overflows
    now = patches.tracking("inc", 0, store)
    assert patches.write_patch(store, since, now, str(tmp_path), 0, 1) is None
    assert "eviction log" in patches.why_full(since, now, store.evicted_since(
        since["version"])[2])
    later = patches.tracking("inc", 0, store)
    store.clear()
    assert patches.write_patch(store, later, patches.tracking("inc", 0, store),
                               str(tmp_path), 0, 1) is None
    assert "restarted" in patches.why_full(since, {**now, "incarnation": "other"}, True)
    assert "restore" in patches.why_full(since, {**now, "loads": 1}, True)


async def test_retention_keeps_the_chain_of_a_patch_that_comes_into_use_during_the_pass(
        tmp_path):
    """Retention's guard is asked, just before each deletion, about every checkpoint the
    deletion would break: a base whose expired patch came into use after the pass began
    (a restore of the patch) is kept with the patch, not deleted under it."""
    rng = np.random.default_rng(3)
    async with running_servers(2, Adam(lr=0.01), capacity=CAPACITY) as (_, router):
        await train(router, rng, 200)
        await checkpoint(router, tmp_path / "a-base", step=1)
        await train(router, rng)
        await checkpoint(router, tmp_path / "b-patch", tmp_path / "a-base", step=2)
        await train(router, rng)
        await checkpoint(router, tmp_path / "c-new", step=3)
    asked = []
    in_use = {"b-patch": "being restored"}

    @contextlib.contextmanager
    def guard(name, users):
        asked.append((name, sorted(users)))
        yield next((f"{u!r} is {in_use[u]}" for u in sorted(users) if u in in_use), None)

    assert prune_checkpoints(str(tmp_path), keep=1, guard=guard) == []
    assert asked == [("a-base", ["a-base", "b-patch"]), ("b-patch", ["b-patch"])]
    assert sorted(os.listdir(tmp_path)) == ["a-base", "b-patch", "c-new"]
    await restored(str(tmp_path / "b-patch"))   # its chain is whole
    in_use.clear()
    assert prune_checkpoints(str(tmp_path), keep=1, guard=guard) == ["a-base", "b-patch"]
    assert sorted(os.listdir(tmp_path)) == ["c-new"]


async def test_a_patch_whose_parent_was_written_again_at_its_path_is_refused(tmp_path):
    """A checkpoint written again at the parent's path (``dump_checkpoint`` to the same
    directory) has the same id, base and depth: the patch was restored over it, its rows
    over rows of another time, with the same row count (no id admitted or evicted in
    between) and no error. Its servers' positions tell it apart: refused naming it."""
    rng = np.random.default_rng(5)
    ids = [np.arange(400, dtype=np.uint64) + np.uint64((k + 1) << 40) for k in range(2)]

    async def train_known(n: int) -> None:   # only ids already held: the row count stays
        groups = [RowLookup(dim, np.unique(rng.choice(ids[k], size=n, replace=False)))
                  for k, dim in enumerate(DIMS)]
        await router.lookup(groups, "train")
        await router.update([UpdateGroup(g.dim, g.ids, rng.normal(size=(g.ids.size, g.dim))
                                         .astype(np.float32)) for g in groups])

    async with running_servers(2, Adam(lr=0.01), capacity=100_000) as (_, router):
        await train_known(400)
        await checkpoint(router, tmp_path / "b", step=1)
        await train_known(100)
        patch = await checkpoint(router, tmp_path / "p", tmp_path / "b", step=2)
        assert patch.is_patch
        await train_known(100)
        again = await checkpoint(router, tmp_path / "b", step=3)   # replaces b
        assert again.table_rows == patch.table_rows
    with pytest.raises(BadInput) as err:
        await restored(str(tmp_path / "p"))
    assert err.value.field == "chain.parent"
    assert "is not the checkpoint it was taken on" in err.value.message
    with pytest.raises(BadInput):
        verify(str(tmp_path / "p"))


async def test_a_patch_whose_parent_goes_while_it_is_written_is_not_published(tmp_path):
    """The parent is deleted (retention in another process) or written again between the
    servers' dump and the commit: the patch is refused naming it, nothing is published
    (it was: a complete-looking checkpoint that no restore can load)."""
    from stream_persia.checkpoint import delete_checkpoint

    rng = np.random.default_rng(6)
    async with running_servers(2, Adam(lr=0.01), capacity=CAPACITY) as (_, router):
        await train(router, rng, 200)
        await checkpoint(router, tmp_path / "b", step=1)
        for spoil in ("deleted", "written again"):
            await train(router, rng)
            with CheckpointWriter(str(tmp_path / "p")) as w:
                await w.dump_embeddings(router.clients,
                                        parent=read_manifest(str(tmp_path / "b")))
                if spoil == "deleted":
                    delete_checkpoint(str(tmp_path / "b"))
                else:
                    await train(router, rng)
                    await checkpoint(router, tmp_path / "b", step=3)
                with pytest.raises(BadInput) as err:
                    w.commit(job="j", step=2, offsets={}, stream="direct")
            assert err.value.field == "chain.parent" and "'b'" in err.value.message, spoil
            assert not (tmp_path / "p").exists(), spoil
            if spoil == "deleted":
                await checkpoint(router, tmp_path / "b", step=1)


async def test_a_parent_deleted_right_after_the_writer_checked_it_withdraws_the_patch(
        tmp_path, monkeypatch):
    """Retention in another process checked the parent's dependents before the patch was
    visible and deleted the parent right after the writer's check before publishing: the
    patch was published without its parent (no restore could load it). The writer checks
    again after publishing and withdraws it, naming the parent."""
    from stream_persia.checkpoint import delete_checkpoint, list_checkpoints

    checked = CheckpointWriter._check_parent

    def check_then_lose_the_parent(self, manifest):
        checked(self, manifest)
        delete_checkpoint(str(tmp_path / "b"))

    rng = np.random.default_rng(8)
    async with running_servers(2, Adam(lr=0.01), capacity=CAPACITY) as (_, router):
        await train(router, rng, 200)
        await checkpoint(router, tmp_path / "b", step=1)
        await train(router, rng)
        monkeypatch.setattr(CheckpointWriter, "_check_parent", check_then_lose_the_parent)
        with pytest.raises(BadInput) as err:
            await checkpoint(router, tmp_path / "p", tmp_path / "b", step=2)
    assert err.value.field == "chain.parent" and "'b'" in err.value.message
    assert not (tmp_path / "p").exists()
    assert list_checkpoints(str(tmp_path)) == []


async def test_a_parent_whose_patch_is_published_while_it_is_deleted_is_kept(tmp_path):
    """The other side of that race: a deletion whose check of the dependents came before
    a patch was published keeps the parent when the patch is there once the parent is
    hidden (retention: kept and logged; a delete: Misuse naming the patch)."""
    from stream_persia.checkpoint import delete_checkpoint

    rng = np.random.default_rng(9)
    async with running_servers(2, Adam(lr=0.01), capacity=CAPACITY) as (servers, router):
        await train(router, rng, 200)
        await checkpoint(router, tmp_path / "b", step=1)
        await train(router, rng)
        want = table(servers)

        await checkpoint(router, tmp_path / "c", step=2)   # b is the oldest of two

        def publish_a_patch_first(name, users):
            # Asked just before deleting b, after the pass listed the checkpoints and
            # found nothing that needs b: the patch of b is published meanwhile.
            assert name == "b"
            asyncio.run_coroutine_threadsafe(
                checkpoint(router, tmp_path / "p", tmp_path / "b", step=3), loop).result(30)
            return contextlib.nullcontext()

        loop = asyncio.get_running_loop()
        deleted = await asyncio.to_thread(prune_checkpoints, str(tmp_path), 1, (), None,
                                          publish_a_patch_first)
        assert deleted == [] and (tmp_path / "b").is_dir()
        with pytest.raises(Misuse) as err:
            delete_checkpoint(str(tmp_path / "b"))
        assert err.value.field == "checkpoint" and "'p'" in err.value.message
    assert (tmp_path / "b").is_dir() and (tmp_path / "p").is_dir()
    assert_same(await restored(str(tmp_path / "p")), want)


async def test_a_withdrawn_patch_puts_back_the_checkpoint_it_replaced(tmp_path, monkeypatch):
    """A patch written over an existing checkpoint at the same path, withdrawn because its
    parent went as it was published: the checkpoint it replaced is back, complete (it was
    deleted with the patch)."""
    from stream_persia.checkpoint import delete_checkpoint

    checked = CheckpointWriter._check_parent

    def check_then_lose_the_parent(self, manifest):
        checked(self, manifest)
        delete_checkpoint(str(tmp_path / "b"))

    rng = np.random.default_rng(10)
    async with running_servers(2, Adam(lr=0.01), capacity=CAPACITY) as (_, router):
        await train(router, rng, 200)
        await checkpoint(router, tmp_path / "b", step=1)
        await checkpoint(router, tmp_path / "p", step=2)          # a full one at p
        before = read_manifest(str(tmp_path / "p"))
        await train(router, rng)
        monkeypatch.setattr(CheckpointWriter, "_check_parent", check_then_lose_the_parent)
        with pytest.raises(BadInput) as err:
            await checkpoint(router, tmp_path / "p", tmp_path / "b", step=3)
    assert err.value.field == "chain.parent"
    after = read_manifest(str(tmp_path / "p"))
    assert (after.step, after.created_at, after.is_patch) == (2, before.created_at, False)
    verify(str(tmp_path / "p"))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


async def test_a_remote_parent_a_patch_needs_is_kept_with_its_manifest():
    """Remote storage (fsspec): the deletion hides the parent by removing its manifest,
    finds the patch that needs it, and writes the manifest back."""
    import uuid

    import fsspec

    from stream_persia.checkpoint import delete_checkpoint, list_checkpoints

    root = f"memory://ck-{uuid.uuid4().hex}"
    rng = np.random.default_rng(11)
    try:
        async with running_servers(2, Adam(lr=0.01), capacity=CAPACITY,
                                   checkpoint_root=root) as (servers, router):
            await train(router, rng, 200)
            await checkpoint(router, f"{root}/b", step=1)
            await train(router, rng)
            await checkpoint(router, f"{root}/p", f"{root}/b", step=2)
            want = table(servers)
        with pytest.raises(Misuse) as err:
            delete_checkpoint(f"{root}/b")
        assert err.value.field == "checkpoint" and "'p'" in err.value.message
        assert sorted(m.path.rsplit("/", 1)[1] for m in list_checkpoints(root)) == ["b", "p"]
        assert_same(await restored(f"{root}/p", checkpoint_root=root), want)
        delete_checkpoint(f"{root}/p")
        delete_checkpoint(f"{root}/b")
        assert list_checkpoints(root) == []
    finally:
        fsspec.filesystem("memory").rm(root.removeprefix("memory://"), recursive=True)
