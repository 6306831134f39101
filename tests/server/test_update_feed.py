"""The embedding server's update feed (stream_persia.server.updates) over real RPC.

A follower that applies the ``model_updates`` log to a serving store (``api.replica``'s
``apply_messages``) ends with exactly the server's rows, whatever happened in between:
training, LRU evictions, a clear, a restore that replaces the store, a reader that fell
behind the bounded log and resynced. Bad requests are refused naming the field.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from stream_persia.api.replica import Replica, ShardCursor, apply_messages
from stream_persia.api.roles import Roles

from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.optim import SGD, Adagrad
from stream_persia.errors import BadInput, PeerUnavailable
from stream_persia.rpc import RpcClient
from stream_persia.server.service import EmbeddingServer
from stream_persia.server.store import EmbeddingStore
from stream_persia.server.updates import UpdateLog
from stream_persia.testing.servers import TEST_CHECKPOINT_ROOT

DIM = 4


def rows_of(store) -> dict[int, np.ndarray]:
    out = {}
    for chunk in store.dump():
        for k, w in zip(chunk["ids"].tolist(), chunk["weights"], strict=True):
            out[k] = w.copy()
    return out


async def train(client: RpcClient, rng, steps: int, vocab: int = 3000) -> None:
    for _ in range(steps):
        ids = np.unique(rng.integers(0, vocab, 400).astype(np.uint64))
        await client.call("lookup", {"mode": "train", "groups": [{"dim": DIM, "ids": ids}]})
        grads = rng.normal(size=(len(ids), DIM)).astype(np.float32)
        await client.call("update", {"groups": [{"dim": DIM, "ids": ids, "grads": grads}]})


class Follower:
    """What a serving replica does with one server's log, without the HTTP around it."""

    def __init__(self, client: RpcClient):
        self.client = client
        self.store = EmbeddingStore(1_000_000, SGD(lr=0.0))
        self.cursor = ShardCursor(0)
        self.resyncs = 0

    async def drain(self) -> None:
        while True:
            r = await self.client.call("model_updates", {"from_seq": self.cursor.next_seq})
            if r["incarnation"] != self.cursor.incarnation:
                self.cursor.incarnation = r["incarnation"]
                self.cursor.next_seq = 0
                if r["first_seq"] > 0:
                    await self.resync()
                continue
            if self.cursor.next_seq < r["first_seq"]:
                await self.resync()
                continue
            if not r["messages"]:
                return
            apply_messages(self.store, self.cursor, 1, r["messages"])

    async def resync(self) -> None:
        r = await self.client.call("model_updates", {"resync": True})
        self.cursor.next_seq, self.cursor.skipping = r["resync_seq"], True
        self.resyncs += 1


async def settle(server: EmbeddingServer) -> None:
    """Until a pass has published everything the store holds now."""
    assert server.feed is not None
    for _ in range(200):
        if await server.feed.run_pass() is False:
            return
        await asyncio.sleep(0)
    raise AssertionError("the feed never caught up")


def same_rows(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


@pytest.fixture
async def server():
    s = EmbeddingServer(2000, Adagrad(lr=0.1), EmbeddingConfig((-0.1, 0.1)),
                        checkpoint_root=TEST_CHECKPOINT_ROOT, model_update_interval_ms=60_000)
    await s.start()
    c = RpcClient(s.address, timeout_ms=5000)
    try:
        yield s, c
    finally:
        await c.close()
        await s.stop()


async def test_follower_equals_server_through_training_and_evictions(server):
    s, c = server
    rng = np.random.default_rng(0)
    f = Follower(c)
    await settle(s)
    await f.drain()
    assert f.cursor.applied["resets"] == 1        # every log starts with one
    for _ in range(4):
        await train(c, rng, 3)                       # 3000 ids through 2000 rows: evictions
        await settle(s)
        await f.drain()
        assert f.cursor.version == s.store.change_version
        same_rows(rows_of(f.store), rows_of(s.store))
    assert s.store.stats()["evictions"] > 0
    assert f.cursor.applied["tombstones"] > 0
    assert f.cursor.applied["resets"] == 1          # nothing forced a full pass


async def test_changed_rows_only_after_the_first_pass(server):
    s, c = server
    rng = np.random.default_rng(1)
    await train(c, rng, 2)
    await settle(s)
    f = Follower(c)
    await f.drain()
    before = f.cursor.applied["rows"]
    ids = np.arange(5, dtype=np.uint64)
    await c.call("lookup", {"mode": "train", "groups": [{"dim": DIM, "ids": ids}]})
    await c.call("update", {"groups": [{"dim": DIM, "ids": ids,
                                        "grads": np.ones((5, DIM), np.float32)}]})
    await settle(s)
    await f.drain()
    assert f.cursor.applied["rows"] - before == 5     # the changed rows, not the table
    same_rows(rows_of(f.store), rows_of(s.store))


async def test_clear_and_restore_reset_the_follower(server, tmp_path):
    s, c = server
    rng = np.random.default_rng(2)
    await train(c, rng, 2)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    dumped = await c.call("dump", {"dir": str(ckpt)})
    assert dumped["updates"]["incarnation"] == s.incarnation
    await settle(s)
    f = Follower(c)
    await f.drain()
    await c.call("clear", None)
    await settle(s)
    await f.drain()
    assert len(f.store) == 0 and f.cursor.applied["resets"] == 2
    await c.call("load", {"dir": str(ckpt), "files": [dumped["file"]]})
    await settle(s)
    await f.drain()
    assert f.cursor.applied["resets"] == 3
    same_rows(rows_of(f.store), rows_of(s.store))
    assert len(f.store) == dumped["rows"]


async def test_a_reader_behind_the_bounded_log_resyncs(server):
    s, c = server
    assert s.feed is not None
    s.feed.log.max_bytes = 70_000      # a full pass fits, three rounds of changes do not
    rng = np.random.default_rng(3)
    f = Follower(c)
    await settle(s)
    await f.drain()
    for _ in range(20):
        await train(c, rng, 2)
        await settle(s)
        if s.feed.log.first_seq > f.cursor.next_seq:
            break
    assert s.feed.log.first_seq > f.cursor.next_seq
    await f.drain()                   # asks for a full pass...
    await settle(s)
    await f.drain()                   # ... and rebuilds from its reset
    assert f.resyncs == 1
    same_rows(rows_of(f.store), rows_of(s.store))


async def test_a_full_pass_read_over_many_pulls_never_empties_the_shard(server):
    """A resync's full pass read one message per pull (as a replica reads a large shard
    over many 8 MiB pulls): between the pass's reset and its mark the follower keeps
    every row it held (the ones the pass re-sent are new already); at the mark the rows
    the server no longer holds leave, and the follower equals the server."""
    s, c = server
    rng = np.random.default_rng(5)
    f = Follower(c)
    await train(c, rng, 3)
    await settle(s)
    await f.drain()
    held = set(rows_of(f.store))
    assert held == set(rows_of(s.store)) and len(held) > 100
    gone = np.array(sorted(held)[:40], dtype=np.uint64)
    assert s.store.remove(gone) == len(gone)   # (as an LRU eviction or an expiry would)
    r = await c.call("model_updates", {"resync": True})
    f.cursor.next_seq, f.cursor.skipping = r["resync_seq"], True
    await settle(s)
    pulls = 0
    while True:
        r = await c.call("model_updates", {"from_seq": f.cursor.next_seq, "max_bytes": 1})
        if not r["messages"]:
            break
        assert len(r["messages"]) == 1
        apply_messages(f.store, f.cursor, 1, r["messages"])
        pulls += 1
        if f.cursor.rebuilding:      # mid-pass: nothing it held has left yet
            assert held <= set(rows_of(f.store)), pulls
    assert pulls >= 3 and not f.cursor.rebuilding and f.cursor.received == []
    same_rows(rows_of(f.store), rows_of(s.store))
    assert not set(gone.tolist()) & set(rows_of(f.store))


async def test_the_checkpoint_position_is_where_a_restored_reader_goes_on(server, tmp_path):
    s, c = server
    rng = np.random.default_rng(4)
    await train(c, rng, 2)
    await settle(s)
    await train(c, rng, 1)            # changed after the last pass, before the dump
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    dumped = await c.call("dump", {"dir": str(ckpt)})
    await train(c, rng, 2)            # and after it
    await settle(s)
    from stream_persia.server.shard_files import read_shard_file
    f = Follower(c)
    f.store.load([{"dim": ch["dim"], "ids": ch["ids"], "weights": ch["weights"]}
                  for ch in read_shard_file(str(ckpt), dumped["file"])])
    f.cursor.incarnation = dumped["updates"]["incarnation"]
    f.cursor.next_seq = dumped["updates"]["seq"]
    await f.drain()
    assert f.cursor.applied["resets"] == 0     # followed on from the checkpoint
    same_rows(rows_of(f.store), rows_of(s.store))


@pytest.mark.parametrize("params,field", [
    ({"from_seq": -1}, "from_seq"), ({"from_seq": "0"}, "from_seq"),
    ({"from_seq": True}, "from_seq"), ({"max_bytes": 0}, "max_bytes"),
    ({"max_bytes": 1 << 40}, "max_bytes"), ({"resync": 1}, "resync"),
    ({"from": 0}, "from"), (None, "params")])
async def test_bad_requests_name_the_field(server, params, field):
    _, c = server
    with pytest.raises(BadInput) as e:
        await c.call("model_updates", params)
    assert e.value.field == field


def test_log_is_bounded_and_keeps_the_newest():
    log = UpdateLog(1000)
    for _ in range(10):
        log.append({"ids": np.zeros(50, np.uint64)})   # 600 bytes each with the header
    assert len(log) == 1 and log.first_seq == 9 and log.next_seq == 10
    assert log.bytes <= 1000 or len(log) == 1
    assert [m["seq"] for m in log.read(9, 1)] == [9]   # at least one, even past max_bytes


@pytest.mark.parametrize("kw,field", [({"model_update_interval_ms": 5},
                                       "model_update_interval_ms"),
                                      ({"update_log_bytes": 10}, "update_log_bytes")])
def test_bad_feed_settings_name_the_field(kw, field):
    with pytest.raises(BadInput) as e:
        EmbeddingServer(10, **kw)
    assert e.value.field == field


async def test_a_replica_whose_resync_failed_after_a_restart_never_reads_the_new_log_midway(
        server, monkeypatch):
    """A replica meets a server's new process (a restart) whose log no longer starts at 0:
    it must ask for a full pass. That request fails (the server flapping); the next pull
    must not read the new log from the old log's position (rows applied without their
    reset: a table that never matches the server's again), but ask again."""
    s, c = server
    assert s.feed is not None
    s.feed.log.max_bytes = 70_000
    rng = np.random.default_rng(11)
    for _ in range(20):
        await train(c, rng, 2)
        await settle(s)
        if s.feed.log.first_seq > 2:
            break
    first, nxt = s.feed.log.first_seq, s.feed.log.next_seq
    assert 0 < first < nxt - 1

    async def execute(fn):
        return fn()

    async def on_dense(*_):
        return None

    roles = Roles([], [s.address])
    replica = Replica(roles, EmbeddingStore(1_000_000, SGD(lr=0.0)), None, execute, on_dense)
    cursor = replica.cursors[0]
    # what it followed of the process before the restart: a place inside the new log
    cursor.incarnation, cursor.next_seq = "0123456789abcdef", first + 1
    real, failures = replica._resync, []

    async def flapping(cur):
        if not failures:
            failures.append(1)
            raise PeerUnavailable("embedding-server-0 refused the connection")
        await real(cur)

    monkeypatch.setattr(replica, "_resync", flapping)
    try:
        with pytest.raises(PeerUnavailable):
            await replica.pull(cursor)
        for _ in range(50):
            if not await replica.pull(cursor):
                break
        await settle(s)                  # the full pass asked for
        for _ in range(50):
            if not await replica.pull(cursor):
                break
        same_rows(rows_of(replica.store), rows_of(s.store))
        assert cursor.restarts == 1
    finally:
        await roles.close()
