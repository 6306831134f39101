"""An embedding server's ``load`` is all or nothing.

Two embedding servers run in this process on real loopback sockets. They write a
checkpoint, train on (so they hold rows the checkpoint lacks), and are then asked over RPC
to load a damaged copy of it: every damage fails with a BadInput naming the file, and
afterwards each server holds exactly what it held before — the same rows in the same LRU
order with the same optimizer state, the same ``size``, ``stats`` and eval lookups. A
good load replaces the rows, and the counters ``stats`` reports go on across it.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import struct

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from stream_persia.checkpoint import CheckpointWriter, Manifest
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.optim import Adagrad, Adam
from stream_persia.errors import BadInput
from stream_persia.server import service as embedding_server
from stream_persia.server import shard_files
from stream_persia.server.shard_files import read_shard_file, write_shard_file
from stream_persia.server.store import EmbeddingStore
from stream_persia.testing.servers import running_servers
from stream_persia.worker.shards import RowLookup, UpdateGroup

DIMS = (8, 4)


async def train(router, seed: int) -> None:
    """Insert 120 rows of each dim and give them non-trivial Adagrad state."""
    rng = np.random.default_rng(seed)
    groups = [RowLookup(dim, rng.choice(5_000, size=120, replace=False).astype(np.uint64)
               + np.uint64((k + 1) << 40)) for k, dim in enumerate(DIMS)]
    await router.lookup(groups, "train")
    await router.update([UpdateGroup(g.dim, g.ids, rng.normal(size=(g.ids.size, g.dim))
                                     .astype(np.float32)) for g in groups])


async def observe(server, client, probe: dict[int, np.ndarray]) -> dict:
    """What a user can see of one server: rows in LRU order, size, eval lookups (which
    count in ``stats``: see :func:`failed_load`)."""
    chunks = [(c["dim"], c["ids"].tolist(), c["weights"].tobytes(), c["state"].tobytes())
              for c in server.store.dump()]
    looked = await client.call("lookup", {"mode": "eval", "groups": [
        {"dim": dim, "ids": ids} for dim, ids in probe.items()]})
    return {"rows": chunks, "size": await client.call("size", None),
            "lookup": ([r.tobytes() for r in looked["rows"]], looked["missing"])}


async def failed_load(client, params: dict) -> BadInput:
    """The BadInput of a load that must fail, after checking it left ``stats`` alone."""
    stats = await client.call("stats", None)
    with pytest.raises(BadInput) as err:
        await asyncio.wait_for(client.call("load", params), 30)
    assert await client.call("stats", None) == stats
    return err.value


def probe_ids(servers, manifest_dir: str, files: list[str]) -> dict[int, np.ndarray]:
    """Per dim: ids the servers hold now and ids only the checkpoint holds."""
    ids: dict[int, list[np.ndarray]] = {}
    for s in servers:
        for c in s.store.dump():
            ids.setdefault(c["dim"], []).append(c["ids"])
    for name in files:
        for c in read_shard_file(manifest_dir, name):
            ids.setdefault(c["dim"], []).append(c["ids"])
    return {dim: np.unique(np.concatenate(parts)) for dim, parts in ids.items()}


def records(path: str) -> list[tuple[int, int]]:
    """(offset, length) of every record's frame in a shard file."""
    out, data, pos = [], open(path, "rb").read(), 0
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        out.append((pos + 4, n))
        pos += 4 + n
    return out


def flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def rewrite(d: str, name: str, change) -> None:
    """Rewrite shard file ``name`` with ``change(chunks)`` (a list of its chunks)."""
    chunks = [dict(c) for c in read_shard_file(d, name)]
    write_shard_file(iter(change(chunks)), d, name)


@pytest.fixture
async def cluster(tmp_path):
    """(servers, router, checkpoint dir, its manifest): the servers have trained on since."""
    async with running_servers(2) as (servers, router):
        await train(router, seed=1)
        with CheckpointWriter(str(tmp_path / "ck")) as w:
            await w.dump_embeddings(router.clients)
            manifest = w.commit(job="j", step=1, offsets={}, stream="direct")
        await train(router, seed=2)
        yield servers, router, str(tmp_path / "ck"), manifest


def expected_of(manifest: Manifest) -> dict:
    return {n: dict(manifest.files[n]) for n in manifest.embedding_files}


# Each damage: (damage(dir, files) -> (index of the file named, [replicas that refuse] or
# None for both), pass the manifest's expectations?, what the message says).
def _truncate(d, files):
    path = os.path.join(d, files[0])
    os.truncate(path, os.path.getsize(path) - 7)
    return 0, None


def _truncate_header(d, files):
    start, n = records(os.path.join(d, files[1]))[-1]
    os.truncate(os.path.join(d, files[1]), start + n + 2)   # a partial length after it
    return 1, None


def _corrupt_record(d, files):
    start, _ = records(os.path.join(d, files[1]))[1]
    flip(os.path.join(d, files[1]), start)                 # the second record's magic
    return 1, None


def _corrupt_length(d, files):
    flip(os.path.join(d, files[0]), 0)                      # 2**31 + n bytes claimed
    return 0, None


def _corrupt_data(d, files):
    start, n = records(os.path.join(d, files[0]))[0]
    flip(os.path.join(d, files[0]), start + n - 3)          # a float: decodes fine
    return 0, None


def _missing(d, files):
    os.remove(os.path.join(d, files[1]))
    return 1, None


def _directory(d, files):
    os.remove(os.path.join(d, files[1]))
    os.mkdir(os.path.join(d, files[1]))
    return 1, None


def _wrong_dim(d, files):
    def change(chunks):
        chunks[-1]["dim"] = chunks[-1]["dim"] * 2            # weights stay (n, dim)
        return chunks
    rewrite(d, files[1], change)
    return 1, None


def _wrong_state_width(d, files):
    def change(chunks):
        chunks[0]["state"] = np.zeros((len(chunks[0]["ids"]), 3), np.float32)
        return chunks
    rewrite(d, files[0], change)
    return 0, None


def _other_optimizer(d, files):
    def change(chunks):
        c = chunks[0]
        c["state"] = np.zeros((len(c["ids"]), Adam().state_width(c["dim"])), np.float32)
        c["state_kind"] = Adam().state_kind
        return chunks
    rewrite(d, files[1], change)
    return 1, None


def _not_a_chunk(d, files):
    rewrite(d, files[0], lambda chunks: [*chunks, {"ids": np.arange(3, dtype=np.int64)}])
    return 0, None


def _dim_clash(d, files):
    """A row of file 0 stored again, with another dim, in file 1: only its owner sees it."""
    first = next(read_shard_file(d, files[0]))
    key, dim = first["ids"][:1], 4 if first["dim"] == 8 else 8

    def change(chunks):
        return [*chunks, {"dim": dim, "ids": key, "weights": np.ones((1, dim), np.float32)}]
    rewrite(d, files[1], change)
    return 1, [0]      # files[0] is replica 0's shard, so replica 0 owns the row


DAMAGES = {
    "truncated": (_truncate, False, r"is truncated"),
    "truncated, checked against the manifest": (_truncate, True, r"has \d+ bytes but \d+ "
                                                r"were expected \(truncated"),
    "partial length": (_truncate_header, False, r"truncated: record \d+ at byte \d+ has a "
                                                r"partial length"),
    "corrupt record": (_corrupt_record, False, r"is corrupt: record 1 at byte \d+ does not "
                                               r"decode: bad magic"),
    "corrupt length": (_corrupt_length, False, r"record 0 at byte 0 declares \d+ bytes"),
    "corrupt data, caught by sha256": (_corrupt_data, True, r"is corrupt: its sha256"),
    "missing among several": (_missing, False, r"does not exist"),
    "missing, checked against the manifest": (_missing, True, r"does not exist"),
    "a directory": (_directory, False, r"cannot be read"),
    "chunk of the wrong dim": (_wrong_dim, False, r"record \d+: chunk weights must be "
                                                  r"float32 of shape \(\d+, (16|8)\)"),
    "state of the wrong width": (_wrong_state_width, False, r"record 0: chunk state must "
                                                            r"be float32"),
    "state of another optimizer": (_other_optimizer, False, r"'adam' optimizer state"),
    "not a store chunk": (_not_a_chunk, False, r"record \d+: dump chunk lacks \['dim', "
                                               r"'weights'\]"),
    "an id with two dims": (_dim_clash, False, r"id \d+ is stored with dim \d+ but this "
                                               r"load uses dim \d+"),
}


@pytest.mark.parametrize("damage, with_expected, reason", DAMAGES.values(), ids=DAMAGES)
async def test_a_bad_shard_file_is_refused_and_changes_nothing(cluster, damage, with_expected,
                                                               reason):
    servers, router, d, manifest = cluster
    files = manifest.embedding_files
    probe = probe_ids(servers, d, files)
    named, refusing = damage(d, files)
    refusing = range(len(servers)) if refusing is None else refusing
    for r in refusing:
        before = await observe(servers[r], router.clients[r], probe)
        params = {"dir": d, "files": files}
        if with_expected:
            params["expected"] = expected_of(manifest)
        err = await failed_load(router.clients[r], params)
        assert re.search(re.escape(files[named]) + ".*" + reason, err.message), err.message
        assert err.field == f"files[{named}]"
        assert await observe(servers[r], router.clients[r], probe) == before


async def test_running_out_of_memory_halfway_changes_nothing(cluster, monkeypatch):
    servers, router, d, manifest = cluster
    real = embedding_server.make_store

    class Starved:
        """A staging store whose memory runs out at its second chunk."""

        def __init__(self, *args, **kwargs):
            self._store, self._loads = real(*args, **kwargs), 0

        def __getattr__(self, name):
            return getattr(self._store, name)

        def load(self, chunks):
            self._loads += 1
            if self._loads == 2:
                raise MemoryError
            self._store.load(chunks)

    monkeypatch.setattr(embedding_server, "make_store", Starved)
    probe = probe_ids(servers, d, manifest.embedding_files)
    before = await observe(servers[0], router.clients[0], probe)
    err = await failed_load(router.clients[0], {"dir": d, "files": manifest.embedding_files})
    assert re.match(r"out of memory loading shard file .*"
                    + re.escape(manifest.embedding_files[0]), err.message), err.message
    assert "clear the server first" in (err.hint or "")
    assert await observe(servers[0], router.clients[0], probe) == before


async def test_a_good_multi_file_load_replaces_the_rows(cluster):
    servers, router, d, manifest = cluster
    async with running_servers(2) as (fresh, fresh_router):   # the checkpoint's own rows
        for c in fresh_router.clients:
            await c.call("load", {"dir": d, "files": manifest.embedding_files})
        want = [[(c["dim"], c["ids"].tolist(), c["weights"].tobytes(), c["state"].tobytes())
                 for c in s.store.dump()] for s in fresh]
    assert all(want)
    for expected in (None, expected_of(manifest)):
        params = {"dir": d, "files": manifest.embedding_files}
        if expected is not None:
            params["expected"] = expected
        replies = [await c.call("load", params) for c in router.clients]
        assert sum(r["rows"] for r in replies) == manifest.rows
        got = [[(c["dim"], c["ids"].tolist(), c["weights"].tobytes(), c["state"].tobytes())
                for c in s.store.dump()] for s in servers]
        assert got == want, "the rows, their state and LRU order are the checkpoint's"
        await train(router, seed=3)     # and the servers train on


async def test_an_empty_file_list_empties_the_server(cluster):
    servers, router, d, _ = cluster
    assert await router.clients[0].call("load", {"dir": d, "files": []}) == {"rows": 0}
    assert await router.clients[0].call("size", None) == 0


async def test_clear_and_dump_queued_behind_a_load_act_on_the_loaded_table(cluster, tmp_path):
    servers, router, d, manifest = cluster
    c = router.clients[0]
    load = {"dir": d, "files": manifest.embedding_files}
    await asyncio.gather(c.call("load", load), c.call("clear", None))
    assert await c.call("size", None) == 0, "the clear reached the table the load swapped in"
    _, info = await asyncio.gather(c.call("load", load),
                                   c.call("dump", {"dir": str(tmp_path / "again")}))
    assert info["rows"] == len(servers[0].store) > 0


@pytest.mark.parametrize("change, field", [
    ({"files": "a.bin"}, "files"),
    ({"files": ["a.bin", 3]}, "files[1]"),
    ({"files": ["../a.bin"]}, "files[0]"),
    ({"files": [".hidden"]}, "files[0]"),
    ({"files": ["a.bin", "a.bin"]}, "files[1]"),
    ({"verify": True}, "verify"),
    ({"expected": ["a.bin"]}, "expected"),
    ({"expected": {}}, "expected.a.bin"),
    ({"expected": {"a.bin": {}, "b.bin": {"bytes": 1}}}, "expected.a.bin"),
    ({"expected": {"a.bin": {"bytes": 1}, "c.bin": {"bytes": 1}}}, "expected.c.bin"),
    ({"expected": {"a.bin": {"bytes": True}, "b.bin": {"bytes": 1}}}, "expected.a.bin.bytes"),
    ({"expected": {"a.bin": {"rows": -1}, "b.bin": {"bytes": 1}}}, "expected.a.bin.rows"),
    ({"expected": {"a.bin": {"sha256": "AB" * 32}, "b.bin": {"bytes": 1}}},
     "expected.a.bin.sha256"),
    ({"expected": {"a.bin": {"md5": "x"}, "b.bin": {"bytes": 1}}}, "expected.a.bin.md5"),
    ({"dir": "nosuchprotocol://x"}, "dir"),
])
async def test_bad_load_requests_name_the_field(cluster, change, field):
    servers, router, d, _ = cluster
    size = len(servers[0].store)
    params = {"dir": d, "files": ["a.bin", "b.bin"], **change}
    with pytest.raises(BadInput) as err:
        await router.clients[0].call("load", params)
    assert err.value.field == field
    assert len(servers[0].store) == size


async def test_files_are_checked_before_any_is_read(cluster, monkeypatch):
    """A missing last file fails before the first one is streamed."""
    servers, router, d, manifest = cluster
    streamed = []
    real = shard_files.read_shard_file

    def spy(directory, name, **kw):
        streamed.append(name)
        return real(directory, name, **kw)

    monkeypatch.setattr(shard_files, "read_shard_file", spy)
    shutil.move(os.path.join(d, manifest.embedding_files[1]), os.path.join(d, "elsewhere"))
    with pytest.raises(BadInput, match="does not exist"):
        await router.clients[0].call("load", {"dir": d, "files": manifest.embedding_files})
    assert streamed == []


async def test_a_file_that_grew_is_refused_where_the_storage_gives_no_size(cluster, monkeypatch):
    """Storage that cannot tell a file's size: the bytes read are checked at its end."""
    servers, router, d, manifest = cluster
    monkeypatch.setattr(shard_files, "_file_size", lambda *args: None)
    path = os.path.join(d, manifest.embedding_files[1])
    start, n = records(path)[-1]
    data = open(path, "rb").read()
    with open(path, "ab") as f:            # one more well-formed record
        f.write(data[start - 4:start + n])
    err = await failed_load(router.clients[1], {"dir": d, "files": manifest.embedding_files,
                                                "expected": expected_of(manifest)})
    assert re.search(re.escape(manifest.embedding_files[1]) + r" has \d+ bytes but \d+ were "
                     r"expected", err.message), err.message


# ----------------------------------------------------------------- counters across loads
def traffic_ops(seed: int, n: int = 150) -> list[tuple]:
    """Serving traffic as (method, mode, dim, ids, grads): per dim a training lookup, an
    eval lookup that partly misses, and an update of which some ids are not stored."""
    rng = np.random.default_rng(seed)
    ops: list[tuple] = []
    for k, dim in enumerate(DIMS):
        ids = rng.choice(5_000, size=n, replace=False).astype(np.uint64) + np.uint64(
            (k + 1) << 40)
        ops.append(("lookup", "train", dim, ids, None))
        ops.append(("lookup", "eval", dim, ids + np.uint64(2_500), None))
        upd = np.concatenate([ids[:100], ids[:20] + np.uint64(1 << 30)])
        ops.append(("update", None, dim, upd,
                    rng.normal(size=(upd.size, dim)).astype(np.float32)))
    return ops


async def serve(client, ops: list[tuple]) -> None:
    for method, mode, dim, ids, grads in ops:
        if method == "lookup":
            await client.call("lookup", {"mode": mode, "groups": [{"dim": dim, "ids": ids}]})
        else:
            await client.call("update", {"groups": [{"dim": dim, "ids": ids, "grads": grads}]})


def counted(store, ops: list[tuple]) -> dict[str, int]:
    """What ``ops`` add to ``store``'s counters, replayed on it directly."""
    before = store.stats()
    for method, mode, dim, ids, grads in ops:
        if method == "lookup":
            store.lookup(ids, dim, mode == "train")
        else:
            store.update(ids, grads)
    after = store.stats()
    return {k: after[k] - before[k] for k in embedding_server.COUNTERS}


def exported(text: bytes) -> dict[str, float]:
    """The store gauges of a ``metrics`` reply, by key."""
    prefix = "persia_embedding_server_store_"
    return {f.name[len(prefix):]: f.samples[0].value
            for f in text_string_to_metric_families(text.decode())
            if f.name.startswith(prefix)}


async def test_counters_go_on_across_loads_and_leave_out_the_loads_own(tmp_path):
    """``stats`` (and the metrics) count the serving traffic before and after each load,
    exactly: a load neither resets them nor adds its own evictions; ``rows`` is the loaded
    table's; a failed load changes nothing."""
    cap, opt, cfg = 200, Adagrad(lr=0.1), EmbeddingConfig((-0.5, 0.5))
    ref = EmbeddingStore(cap, opt, cfg)      # the subject's traffic, replayed on a store
    want = dict.fromkeys(embedding_server.COUNTERS, 0)

    async def check(client, rows: int, loads: int) -> dict:
        stats = await client.call("stats", None)
        assert stats == {**want, "rows": rows, "capacity": cap, "loads": loads, "clears": 0}
        assert exported(await client.call("metrics", None)) == {
            k: float(v) for k, v in stats.items()}
        return stats

    def add(counts: dict[str, int]) -> None:
        for k, v in counts.items():
            want[k] += v

    async with running_servers(1) as (_, big_router), \
            running_servers(1, capacity=cap) as ([subject], router):
        # A checkpoint larger than the subject's capacity: loading it evicts.
        await serve(big_router.clients[0], traffic_ops(1, n=150))
        big = await big_router.clients[0].call("dump", {"dir": str(tmp_path / "big")})
        assert big["rows"] == 300 > cap

        c = router.clients[0]
        ops = traffic_ops(2)
        await serve(c, ops)
        add(counted(ref, ops))
        assert want["evictions"] > 0 and want["dropped_updates"] > 0 and want["misses"] > 0
        own = await c.call("dump", {"dir": str(tmp_path / "own")})
        ops = traffic_ops(3)
        await serve(c, ops)
        add(counted(ref, ops))
        await check(c, len(ref), 0)

        for loads, (d, info) in enumerate([(tmp_path / "own", own), (tmp_path / "big", big)],
                                          start=1):
            reply = await c.call("load", {"dir": str(d), "files": [info["file"]]})
            assert reply == {"rows": info["rows"]}
            ref = EmbeddingStore(cap, opt, cfg)   # the loaded table, then the same traffic
            ref.load(read_shard_file(str(d), info["file"]))
            assert len(subject.store) == len(ref) == min(info["rows"], cap)
            assert subject.store.stats()["evictions"] == info["rows"] - len(ref)
            await check(c, len(ref), loads)       # unchanged by the load
            ops = traffic_ops(3 + loads)
            await serve(c, ops)
            add(counted(ref, ops))
            stats = await check(c, len(ref), loads)

        # A failed load (a missing file) leaves every counter and the rows alone.
        with pytest.raises(BadInput, match="does not exist"):
            await c.call("load", {"dir": str(tmp_path / "big"), "files": ["nope.bin"]})
        assert await check(c, len(ref), 2) == stats
