"""Which update records a Kafka-following replica applies (``api.replica_kafka.admit``) and
how it applies them (``api.replica.apply_messages``): duplicates are skipped, a gap or an
incarnation joined mid-log skips to the next reset, the checkpoint's position is honoured,
a restarted server's log is followed from its reset; and messages are validated first
(``dense`` records too: their ``lineage``, absent in a record from before lineages)."""

from __future__ import annotations

import asyncio
import hashlib
import io
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from api_helpers import start_job, stop_job
from stream_persia.api.replica import (
    Replica,
    ShardCursor,
    TableRefused,
    apply_messages,
    check_message,
)
from stream_persia.api.replica_kafka import KafkaFollow, admit, check_dense
from stream_persia.api.roles import Roles

from stream_persia.core import wire
from stream_persia.embedding.optim import SGD
from stream_persia.errors import BadInput
from stream_persia.server.store import EmbeddingStore


def msg(seq: int, kind: str = "rows", inc: str = "a", ids=(1,), value: float = 1.0) -> dict:
    m = {"job": "j", "shard": 0, "shards": 1, "incarnation": inc, "seq": seq, "kind": kind,
         "version": seq, "event_time": 100.0 + seq}
    if kind == "rows":
        ids_a = np.array(ids, np.uint64)
        m.update(dim=2, ids=ids_a, weights=np.full((len(ids_a), 2), value, np.float32))
    elif kind == "tombstones":
        m["ids"] = np.array(ids, np.uint64)
    return m


def run(cursor: ShardCursor, store, msgs: list[dict]) -> list[str]:
    verdicts = []
    for m in msgs:
        v = admit(cursor, m)
        verdicts.append(v)
        if v != "skip":
            apply_messages(store, cursor, 1, [m])
    return verdicts


@pytest.fixture
def store():
    return EmbeddingStore(100, SGD(lr=0.0))


def test_in_order_then_duplicates_are_skipped(store):
    c = ShardCursor(0)
    log = [msg(0, "reset"), msg(1, ids=(1, 2)), msg(2, "mark")]
    assert run(c, store, log) == ["apply"] * 3
    assert run(c, store, [msg(1, ids=(1, 2), value=9.0)]) == ["skip"]   # a producer retry
    assert store.lookup(np.array([1], np.uint64), 2, train=False)[0, 0] == 1.0
    assert (c.version, c.event_time) == (2, 102.0)


def test_a_gap_skips_to_the_next_reset(store):
    c = ShardCursor(0)
    run(c, store, [msg(0, "reset"), msg(1, ids=(1,))])
    assert run(c, store, [msg(3, ids=(2,)), msg(4, "mark")]) == ["gap", "apply"]
    assert c.skipping and c.version is None         # nothing applied past the gap
    assert not store.contains(np.array([2], np.uint64))[0]
    assert run(c, store, [msg(5, "reset"), msg(6, ids=(3,)), msg(7, "mark")]) == ["apply"] * 3
    assert not c.skipping and c.version == 7
    assert store.contains(np.array([1, 3], np.uint64)).tolist() == [False, True]


def test_the_checkpoint_position_and_a_restarted_server(store):
    c = ShardCursor(0, start=("b", 5))
    mine = [msg(4, inc="b", ids=(8,)), msg(5, inc="b", ids=(9,)), msg(6, "mark", inc="b")]
    assert run(c, store, mine) == ["skip", "apply", "apply"]   # read from the offset on
    assert store.contains(np.array([8, 9], np.uint64)).tolist() == [False, True]
    # the server restarts: its new log starts with a reset, followed without a gap
    assert run(c, store, [msg(0, "reset", inc="c"), msg(1, inc="c", ids=(4,))]) \
        == ["apply", "apply"]
    assert c.restarts == 1 and not c.skipping
    # mid-pass the rows held answer still; the pass's mark drops those it did not send
    assert store.contains(np.array([9, 4], np.uint64)).tolist() == [True, True]
    assert run(c, store, [msg(2, "mark", inc="c")]) == ["apply"]
    assert store.contains(np.array([9, 4], np.uint64)).tolist() == [False, True]


def test_from_a_checkpoint_a_first_record_past_its_place_is_a_gap(store):
    """The checkpoint's own place in the log is gone from the topic (retention, or a broker
    restarted empty): the first record read is a later one of the same log. What lies
    between is missing: a gap (skip to the next reset, resync), never a silent jump."""
    c = ShardCursor(0, start=("b", 5))
    assert run(c, store, [msg(8, inc="b", ids=(8,)), msg(9, "mark", inc="b")]) \
        == ["gap", "apply"]
    assert c.skipping and c.version is None
    assert not store.contains(np.array([8], np.uint64))[0]
    assert run(c, store, [msg(10, "reset", inc="b"), msg(11, inc="b", ids=(3,))]) \
        == ["apply", "apply"]
    assert not c.skipping and store.contains(np.array([3], np.uint64))[0]


def test_from_a_checkpoint_a_server_restarted_since_is_followed_from_its_reset(store):
    """(The recorded offset is past the checkpoint's own earlier messages.) Server 'b'
    restarted as 'c' after the checkpoint: its new log is followed from its reset."""
    c = ShardCursor(0, start=("b", 5))
    assert run(c, store, [msg(0, "reset", inc="c"), msg(1, inc="c", ids=(6,))]) \
        == ["apply", "apply"]
    assert c.incarnation == "c" and not c.skipping
    assert store.contains(np.array([6], np.uint64)).tolist() == [True]


def test_without_an_offset_an_older_log_first_ends_in_a_resync_never_silently(store):
    """Read from the partition's start (no offset recorded): an older process's log comes
    first; following it then meeting the checkpoint's log mid-way is a gap (skip to the
    next reset; the server is asked for a full pass), not rows applied out of place."""
    c = ShardCursor(0, start=("b", 5))
    got = run(c, store, [msg(0, "reset", inc="a"), msg(1, inc="a", ids=(7,)),
                         msg(6, inc="b", ids=(8,))])
    assert got == ["apply", "apply", "gap"] and c.skipping
    assert not store.contains(np.array([8], np.uint64))[0]


def test_from_a_checkpoints_offset_a_later_process_past_its_reset_is_a_gap(store):
    """The replica reads from the offset its checkpoint records; the server restarted
    since, and retention deleted the new process's first records (its reset): the first
    record read is one of the new log's middle. Every such record used to be skipped as if
    from before the checkpoint, until that server's next full pass (none comes unasked):
    nothing said, nothing resynced. Read from an offset, every record is after the
    checkpoint's place: it is a gap (skip to the next reset, resync)."""
    c = ShardCursor(0, start=("b", 5), start_at_offset=True)
    c.incarnation, c.next_seq = c.start            # as KafkaFollow sets it
    assert run(c, store, [msg(40, inc="c", ids=(8,)), msg(41, "mark", inc="c")]) \
        == ["gap", "apply"]
    assert c.skipping and c.restarts == 1 and c.version is None and c.start is None
    assert run(c, store, [msg(42, "reset", inc="c"), msg(43, inc="c", ids=(3,)),
                          msg(44, "mark", inc="c")]) == ["apply"] * 3
    assert not c.skipping and c.version == 44
    # without an offset (read from the partition's start) an older process's records
    # come first: they are before the checkpoint's place, skipped as before
    c = ShardCursor(0, start=("b", 5))
    c.incarnation, c.next_seq = c.start
    assert run(c, store, [msg(40, inc="a", ids=(8,))]) == ["skip"]


def test_joining_a_new_incarnation_mid_log_is_a_gap(store):
    c = ShardCursor(0)
    run(c, store, [msg(0, "reset"), msg(1)])
    assert run(c, store, [msg(5, inc="z")]) == ["gap"]
    assert c.skipping


@pytest.mark.parametrize("change,field", [
    ({"kind": "delta"}, "kind"), ({"shard": 1}, "shard"), ({"seq": -1}, "seq"),
    ({"version": "1"}, "version"), ({"event_time": float("nan")}, "event_time"),
    ({"ids": np.array([1], np.int64)}, "ids"), ({"dim": 0}, "dim"),
    ({"weights": np.zeros((1, 3), np.float32)}, "weights"),
    ({"incarnation": None}, "incarnation"), ({"incarnation": 7}, "incarnation"),
    ({"incarnation": ""}, "incarnation")])
def test_bad_messages_are_refused_naming_the_field(change, field):
    m = {**msg(1), **change}
    with pytest.raises(BadInput) as e:
        check_message(m, ShardCursor(0), 1)
    assert e.value.field == field


def dense(**change) -> dict:
    return {"job": "j", "shard": 1, "shards": 1, "incarnation": "a", "seq": 0,
            "kind": "dense", "version": 3, "event_time": None, "chunk": 0, "chunks": 1,
            "sha256": "0" * 64, "data": b"x", "lineage": 5, **change}


def test_a_dense_records_lineage_is_validated_and_absent_is_the_legacy_one():
    assert check_dense(dense(), 1)["lineage"] == 5
    legacy = dense()
    del legacy["lineage"]
    assert check_dense(legacy, 1)["lineage"] == 0
    for bad in (-1, 1 << 63, "5", True):
        with pytest.raises(BadInput) as e:
            check_dense(dense(lineage=bad), 1)
        assert e.value.field == "lineage"


def test_a_row_the_table_refuses_is_never_passed_over_as_applied(store):
    """Rows of another dim for an id the table holds (a job started again with another
    embedding config) are refused by the table. The cursor used to be past that message
    already: the rest of the pass and its mark were applied, the shard said it was at the
    server's version while that row kept its old value. Now it skips to the next reset,
    its version and event time held, and says so (BadInput naming the refusal)."""
    c = ShardCursor(0)
    run(c, store, [msg(0, "reset"), msg(1, ids=(1,)), msg(2, "mark")])
    bad = msg(3, ids=(1,))
    bad.update(dim=3, weights=np.full((1, 3), 5.0, np.float32))
    with pytest.raises(BadInput, match="refused by the serving table"):
        apply_messages(store, c, 1, [bad, msg(4, ids=(2,)), msg(5, "mark")])
    assert c.skipping and not c.refused_full and c.next_seq == 6   # past what it looked at
    assert (c.version, c.event_time) == (2, 102.0)       # nothing claimed past the refusal
    assert not store.contains(np.array([2], np.uint64))[0]
    # a full pass the table refuses too: no resync asked (it would only repeat it)
    with pytest.raises(BadInput):
        apply_messages(store, c, 1, [msg(6, "reset"), bad | {"seq": 7}, msg(8, "mark")])
    assert c.refused_full and c.skipping and c.version == 2
    run(c, store, [msg(9, "reset"), msg(10, ids=(2,)), msg(11, "mark")])
    assert not c.refused_full and not c.skipping and c.version == 11


def test_a_reset_after_a_refused_message_of_the_same_pull_still_applies(store):
    """Messages after the refused one used to be never looked at: a ``reset`` among them
    was lost, and the shard waited (skipping) for another full pass that nobody asked
    for. It applies now, and its pass ends; the refusal is still said."""
    c = ShardCursor(0)
    run(c, store, [msg(0, "reset"), msg(1, ids=(1,)), msg(2, "mark")])
    bad = msg(3, ids=(1,))
    bad.update(dim=3, weights=np.full((1, 3), 5.0, np.float32))
    with pytest.raises(TableRefused) as e:
        apply_messages(store, c, 1, [bad, msg(4, ids=(2,)), msg(5, "reset"), msg(6, ids=(3,)),
                                     msg(7, "mark")])
    assert e.value.ended
    assert not c.skipping and c.next_seq == 8 and (c.version, c.event_time) == (7, 107.0)
    held = store.contains(np.array([1, 2, 3], np.uint64))
    assert list(held) == [False, False, True]   # the pass did not send 1; 2 was skipped


async def test_a_record_the_table_refuses_does_not_end_the_kafka_follower():
    """Over Kafka the same refusal used to escape ``take`` and end the task that reads
    the topic: the replica never applied another record, with nothing said until it
    stopped. It is counted, the shard skips to the next reset, and the server is asked
    for one (a real server: its next pass is a full one)."""
    async def execute(fn):
        return fn()

    async def on_dense(*_):
        return None

    job = await start_job(n_servers=1)
    roles = Roles([], job.server_addresses)
    try:
        replica = Replica(roles, EmbeddingStore(100, SGD(lr=0.0)), None, execute, on_dense)
        follow = KafkaFollow(replica, "127.0.0.1:9", "j.model.updates", None)
        cursor = replica.cursors[0]
        bad = msg(3, ids=(1,))
        bad.update(dim=3, weights=np.full((1, 3), 5.0, np.float32))
        log = [msg(0, "reset"), msg(1, ids=(1,)), msg(2, "mark"), bad, msg(4, ids=(2,)),
               msg(5, "mark")]
        records = [SimpleNamespace(value=wire.pack(m), key=None, topic="j.model.updates",
                                   partition=0, offset=i) for i, m in enumerate(log)]
        feed = job.servers[0].feed
        assert feed is not None

        def resets() -> int:
            return sum(m["kind"] == "reset" for m in feed.log.read(feed.log.first_seq, 1 << 30))

        await follow.take(cursor, records[:3])
        await feed.run_pass()
        before = resets()
        await follow.take(cursor, records[3:])
        assert replica.counts["bad_messages"] == 1 and cursor.resyncs == 1
        assert cursor.skipping and cursor.version == 2
        await feed.run_pass()
        assert resets() == before + 1
        # The next batch follows on: the cursor is past the whole batch, as the consumer
        # is. It used to drop back to the refused record, so this record was a gap and a
        # full pass was asked again on every batch.
        nxt = SimpleNamespace(value=wire.pack(msg(6, ids=(3,))), key=None,
                              topic="j.model.updates", partition=0, offset=6)
        await follow.take(cursor, [nxt])
        assert cursor.resyncs == 1 and cursor.next_seq == 7
    finally:
        await roles.close()
        await stop_job(job)


async def test_a_replaced_dense_lineage_is_never_served_again():
    """Over Kafka a replica takes the dense model once over RPC at start, then reads the
    dense partition from its end: a blob of the lineage server 0 just replaced (a trainer
    restored, a new lineage) may still be on its way there and arrive after the new
    lineage's model. It used to be served as "another lineage", training's replaced model
    answering under a higher model_version until the next publication. Refused now, and
    the current lineage goes on."""
    served: list[tuple[int, float | None]] = []

    async def execute(fn):
        return fn()

    async def on_dense(state, step, event_time):
        served.append((step, event_time))

    def blob(value: float) -> tuple[bytes, str]:
        buf = io.BytesIO()
        torch.save({"w": torch.full((2,), value)}, buf)
        return buf.getvalue(), hashlib.sha256(buf.getvalue()).hexdigest()

    roles = Roles([], ["127.0.0.1:9"])   # never called: the blobs come as Kafka's would
    try:
        replica = Replica(roles, EmbeddingStore(100, SGD(lr=0.0)), None, execute, on_dense,
                          dense_step=40, dense_event_time=100.0, dense_lineage=5)
        data, digest = blob(2.0)
        assert await replica.apply_dense(data, 3, digest, 90.0, lineage=9)   # restored
        data, digest = blob(1.0)
        assert not await replica.apply_dense(data, 41, digest, 101.0, lineage=5)
        assert (replica.dense_lineage, replica.dense_step) == (9, 3)
        assert replica.refused == (5, 41)     # over RPC: asked past it, not fetched again
        assert replica.info()["dense_refused_step"] is None   # it fits: not "refused"
        # Asked past it, server 0 answers with the model served: it used to be fetched
        # again at every poll (asked past the replaced one again)
        data, digest = blob(2.0)
        assert not await replica.apply_dense(data, 3, digest, 90.0, lineage=9)
        assert replica.refused is None
        data, digest = blob(3.0)
        assert await replica.apply_dense(data, 4, digest, 91.0, lineage=9)
        assert served == [(3, 90.0), (4, 91.0)]
        assert replica.counts["dense_lineage_changes"] == 1
    finally:
        await roles.close()


class FailingOnce:
    """A table whose first load of rows raises MemoryError (the Cython table's load raises
    it when it cannot grow); the rest is a real table's."""

    def __init__(self, table):
        self.table, self.failed = table, False

    def __getattr__(self, name):
        return getattr(self.table, name)

    def load(self, chunks):
        if not self.failed:
            self.failed = True
            raise MemoryError("the table could not grow")
        return self.table.load(chunks)


async def test_a_pull_that_fails_with_a_bug_resyncs_and_never_passes_the_rows_over():
    """Over RPC, ``next_seq`` is past a message before it is applied: a MemoryError from
    the table (or any exception that is not a PersiaError) was only logged, and the next
    pull started after the rows it lost. Their pass's mark then dropped them as unsent
    and the shard claimed the server's version without them. The shard now resyncs and
    holds the server's rows."""
    async def execute(fn):
        return fn()

    async def on_dense(*_):
        return None

    def rows(store) -> dict[int, bytes]:
        return {k: w.tobytes() for c in store.dump()
                for k, w in zip(c["ids"].tolist(), c["weights"], strict=True)}

    job = await start_job(n_servers=1)
    roles = Roles([], job.server_addresses)
    store = FailingOnce(EmbeddingStore(100_000, SGD(lr=0.0)))
    replica = Replica(roles, store, None, execute, on_dense, interval_s=0.01)
    try:
        await job.train(2)
        feed = job.servers[0].feed
        assert feed is not None
        await feed.run_pass()
        want = rows(job.servers[0].store)
        assert want
        replica.start()
        cursor = replica.cursors[0]
        async with asyncio.timeout(20):
            while not (store.failed and cursor.version is not None and not cursor.skipping
                       and not cursor.rebuilding):
                await asyncio.sleep(0.02)
        assert cursor.resyncs == 1 and replica.counts["pull_failures"] == 1
        assert rows(store) == want
    finally:
        await replica.stop()
        await roles.close()
        await stop_job(job)
