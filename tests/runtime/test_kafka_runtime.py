"""The runtime issue end to end: real role processes consuming the Kafka test broker.

One job per module (starting a worker costs a process ~1.5 s): two embedding servers and
two embedding workers sharing a 4-partition samples topic by static assignment, a ready
buffer of 2 batches (so backpressure is reachable), SGD configured over RPC. The test
process plays the data loader (``DataCtx`` in Kafka mode, or raw producers for poisoned
messages) and the NN worker (``next_batch`` / ``push_gradients`` over RPC), and checks
every served embedding against the owning server's store, read with ``lookup`` in
``eval`` mode (which never inserts). Tests run in file order: the killed-server test and
the SIGTERM test come last because they change the processes.
"""

from __future__ import annotations

import asyncio
import re
import time
import uuid
from collections import Counter
from dataclasses import dataclass

import numpy as np
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from prometheus_client.parser import text_string_to_metric_families

from stream_persia.config import GlobalConfig, KafkaConfig
from stream_persia.core import wire
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.data import PersiaBatch
from stream_persia.embedding.optim import SGD
from stream_persia.errors import PeerUnavailable, RemoteError
from stream_persia.kafka import BatchProducer, parse_dead_letter
from stream_persia.kernels.sharding import shard_of
from stream_persia.launch.processes import RoleProcess
from stream_persia.loader.data_ctx import DataCtx
from stream_persia.rpc import RpcClient
from stream_persia.testing.samples import EMBEDDING_YAML, SCHEMA, make_batch, naive_sum

LR = 0.1
INIT = (-0.5, 0.5)
SLOTS = ("user", "item", "tags")
READY_CAPACITY = 2
# on_server_restart: continue, so that the job goes on after the killed-server test
# restarts a server (by default a restarted server fails the job: see
# tests/runtime/test_server_restart_process.py and tests/worker/test_server_restart.py).
GLOBAL_YAML = f"""\
embedding_worker_config:
  ready_buffer_batches: {READY_CAPACITY}
  rpc_timeout_ms: 5000
  on_server_restart: continue
"""
NO_GRADS = dict.fromkeys(SLOTS)


# ----------------------------------------------------------------------------- the job
@dataclass
class KafkaJob:
    bootstrap: str
    topic: str
    servers: list[RoleProcess]
    workers: list[RoleProcess]

    def restart_server(self, i: int) -> None:
        """Start server ``i`` again on its old port, as an orchestrator would."""
        old = self.servers[i]
        port = old.address.rpartition(":")[2]
        new = RoleProcess("embedding-server", [*_server_args(i), "--port", port],
                          name=f"embedding-server-{i}")
        self.servers[i] = new
        new.start()
        assert new.wait_ready(30) == old.address


def _server_args(i: int) -> list[str]:
    return ["--replica-index", str(i), "--replica-size", "2", "--capacity", "100000"]


@pytest.fixture(scope="module")
def job(kafka_broker, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kafka-job")
    topic = f"rt-{uuid.uuid4().hex[:12]}"
    kafka_broker.create_topic(topic, 4)
    kafka_broker.create_topic(f"{topic}.dlq", 1)
    (tmp / "embedding_config.yml").write_text(EMBEDDING_YAML)
    (tmp / "global_config.yml").write_text(GLOBAL_YAML)
    job = KafkaJob(kafka_broker.bootstrap_servers, topic, [], [])
    try:
        job.servers = [RoleProcess("embedding-server", _server_args(i),
                                   name=f"embedding-server-{i}") for i in range(2)]
        addresses = [s.start().wait_ready(30) for s in job.servers]
        job.workers = [RoleProcess("embedding-worker", [
            "--replica-index", str(i), "--replica-size", "2",
            "--embedding-config", str(tmp / "embedding_config.yml"),
            "--global-config", str(tmp / "global_config.yml"),
            "--embedding-servers", ",".join(addresses),
            "--kafka", kafka_broker.bootstrap_servers, "--topic", topic, "--num-partitions", "4",
        ], name=f"embedding-worker-{i}") for i in range(2)]
        for w in job.workers:
            w.start()
        for w in job.workers:
            w.wait_ready(60)
        yield job
    finally:  # the job's current processes: a restarted server replaced its predecessor
        for p in [*job.workers, *job.servers]:
            p.stop()


@dataclass
class Clients:
    servers: list[RpcClient]
    workers: list[RpcClient]


@pytest.fixture
async def rpc(job):
    """RPC clients of this test's loop; stores emptied and set to SGD, workers drained."""
    clients = Clients(
        [RpcClient(s.address, timeout_ms=5000, name=f"embedding-server-{i}")
         for i, s in enumerate(job.servers)],
        [RpcClient(w.address, timeout_ms=10_000, name=f"embedding-worker-{i}")
         for i, w in enumerate(job.workers)])
    try:
        for c in clients.servers:
            await configure(c)
        for c in clients.workers:
            await drain(c)
        yield clients
    finally:
        for c in [*clients.servers, *clients.workers]:
            await c.close()


async def configure(server: RpcClient) -> None:
    await server.call("clear")
    await server.call("configure", {"optimizer": SGD(lr=LR).to_dict(),
                                    "embedding_config": EmbeddingConfig(INIT).to_dict()})


async def drain(worker: RpcClient) -> None:
    """Release whatever an earlier (failed) test left behind."""
    while (b := await worker.call("next_batch", {"timeout_ms": 50})) is not None:
        if b["requires_grad"]:
            await worker.call("push_gradients", {"batch_id": b["batch_id"], "grads": NO_GRADS})


async def eventually(probe, what: str, timeout_s: float = 15.0):
    """Await ``probe()`` until it returns something truthy (bounded)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s (last: {value!r})")
        await asyncio.sleep(0.05)


def keyed(i: int, **kw) -> PersiaBatch:
    """``make_batch(i)`` keyed by ``i``, so its partition is fixed by the key's hash."""
    batch = make_batch(i, **kw)
    batch.batch_id = i
    return batch


def send_with_data_ctx(job: KafkaJob, batches: list[PersiaBatch]) -> None:
    """The data loader's Kafka path, configured as a user would: topic in the global config."""
    config = GlobalConfig(kafka=KafkaConfig(samples_topic=job.topic))
    with DataCtx(kafka_bootstrap_servers=job.bootstrap, global_config=config) as ctx:
        assert ctx.mode == "kafka"
        for b in batches:
            ctx.send_data(b)


async def frontier_total(rpc: Clients) -> int:
    total = 0
    for c in rpc.workers:
        f = await c.call("frontier")
        assert f["stream"] == "kafka"
        total += sum(f["offsets"].values())
    return total


async def assert_idle(rpc: Clients) -> None:
    for c in rpc.workers:
        assert await c.call("next_batch", {"timeout_ms": 300}) is None
        status = await c.call("status")
        assert (status["ready"], status["inflight"], status["pending"]) == (0, 0, 0), status


# ------------------------------------------------------------------ store-side checks
async def store_rows(rpc: Clients, slot: str, ids: np.ndarray) -> np.ndarray:
    """Rows of raw ``ids`` of ``slot`` read from the owning server (eval: never inserts),
    checking that each id is on its owning shard and absent from the other."""
    pref = SCHEMA.prefix_ids(slot, np.asarray(ids, dtype=np.uint64))
    dim = SCHEMA.slot(slot).dim
    owner = shard_of(pref, 2)
    out = np.zeros((pref.size, dim), dtype=np.float32)
    for s in range(2):
        sel = owner == s
        if not sel.any():
            continue
        group = {"mode": "eval", "groups": [{"dim": dim, "ids": pref[sel]}]}
        mine = await rpc.servers[s].call("lookup", group)
        assert mine["missing"] == 0, f"{slot}: ids missing on their owning shard {s}"
        out[sel] = mine["rows"][0]
        other = await rpc.servers[1 - s].call("lookup", group)
        assert other["missing"] == int(sel.sum()), f"{slot}: ids of shard {s} on shard {1 - s}"
    return out


def feature(batch: PersiaBatch, slot: str):
    return next(f for f in batch.id_type_features if f.name == slot)


def kept_ids(batch: PersiaBatch, slot: str) -> np.ndarray:
    """Distinct ids of ``slot`` that are looked up (raw slots keep sample_fixed_size)."""
    f, cfg = feature(batch, slot), SCHEMA.slot(slot)
    if cfg.embedding_summation:
        return np.unique(f.values)
    return np.unique(np.concatenate([ids[:cfg.sample_fixed_size] for ids in f.data]))


def raw_row_ids(batch: PersiaBatch, served_slot: dict) -> dict[int, int]:
    """Row of a raw slot's table → the id it holds (from ``index``/``mask``)."""
    f = feature(batch, served_slot["name"])
    fixed = served_slot["index"].shape[1]
    row_id: dict[int, int] = {}
    for b, ids in enumerate(f.data):
        for j, x in enumerate(ids[:fixed]):
            assert served_slot["mask"][b, j]
            r = int(served_slot["index"][b, j])
            assert row_id.setdefault(r, int(x)) == int(x), "one row holds two ids"
    assert int(served_slot["mask"].sum()) == sum(min(len(i), fixed) for i in f.data)
    return row_id


async def check_and_train(rpc: Clients, worker: RpcClient, served: dict, batch: PersiaBatch,
                          rng: np.random.Generator) -> None:
    """Served embeddings equal the store; pushed gradients land, SGD-applied, per shard."""
    assert served["meta"] == batch.meta and served["batch_size"] == batch.batch_size
    np.testing.assert_array_equal(served["non_id_type_features"][0]["data"],
                                  batch.non_id_type_features[0].data)
    np.testing.assert_array_equal(served["labels"][0]["data"], batch.labels[0].data)
    emb = {e["name"]: e for e in served["embeddings"]}
    assert set(emb) == set(SLOTS)
    grads: dict[str, np.ndarray] = {}
    expected_grad: dict[str, dict[int, np.ndarray]] = {}
    before: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for slot in SLOTS:
        f, cfg = feature(batch, slot), SCHEMA.slot(slot)
        uniq = kept_ids(batch, slot)
        rows = await store_rows(rpc, slot, uniq)
        before[slot] = (uniq, rows)
        row_of = dict(zip(uniq.tolist(), rows, strict=True))
        g = {int(x): np.zeros(cfg.dim, np.float64) for x in uniq}
        if cfg.embedding_summation:
            zero = np.zeros(cfg.dim, np.float32)
            expected = naive_sum(f.data, lambda x, r=row_of, z=zero: r.get(x, z),
                                 cfg.sqrt_scaling)
            np.testing.assert_allclose(emb[slot]["emb"], expected, rtol=1e-6, atol=1e-6)
            grads[slot] = rng.normal(size=(batch.batch_size, cfg.dim)).astype(np.float32)
            for sample, ids in enumerate(f.data):
                scale = 1 / np.sqrt(len(ids)) if (cfg.sqrt_scaling and len(ids)) else 1.0
                for x in ids:
                    g[int(x)] += grads[slot][sample] * scale
        else:
            table = emb[slot]["emb"]
            assert emb[slot]["kind"] == "raw" and not table[0].any(), "row 0 pads"
            row_id = raw_row_ids(batch, emb[slot])
            for r, x in row_id.items():
                np.testing.assert_allclose(table[r], row_of[x], rtol=1e-6, atol=1e-6)
            grads[slot] = rng.normal(size=table.shape).astype(np.float32)
            for r, x in row_id.items():
                g[x] += grads[slot][r]
        expected_grad[slot] = g
    reply = await worker.call("push_gradients", {"batch_id": served["batch_id"],
                                                 "grads": grads})
    assert reply["skipped_slots"] == [] and reply["dropped"] == 0
    assert reply["applied"] == sum(len(u) for u, _ in before.values())
    for slot in SLOTS:
        uniq, rows = before[slot]
        g = np.stack([expected_grad[slot][int(x)] for x in uniq])
        np.testing.assert_allclose(await store_rows(rpc, slot, uniq), rows - LR * g,
                                   atol=1e-5)


async def pull(rpc: Clients, want: int, on_batch, *, timeout_s: float = 30.0,
               pause_s: float = 0.0) -> list[tuple[int, dict]]:
    """Pull ``want`` batches one at a time, round-robin over the workers."""
    got: list[tuple[int, dict]] = []
    deadline = time.monotonic() + timeout_s
    turn = 0
    while len(got) < want:
        assert time.monotonic() < deadline, f"only {len(got)} of {want} batches were served"
        w = turn % len(rpc.workers)
        turn += 1
        served = await rpc.workers[w].call("next_batch", {"timeout_ms": 150})
        if served is None:
            continue
        got.append((w, served))
        await on_batch(w, served)
        if pause_s:
            await asyncio.sleep(pause_s)
    return got


def by_meta(batches: list[PersiaBatch]) -> dict[bytes, PersiaBatch]:
    return {b.meta: b for b in batches}


# --------------------------------------------------------------------------- the tests
async def test_every_batch_served_once_from_the_store_and_applied_on_its_shard(job, rpc):
    n = 16
    batches = [keyed(i, seed=3) for i in range(n)]
    for b in batches[::2]:    # the others get the data loader's clock
        b.event_time = 1_750_000_000.0 + b.batch_id
    sent = by_meta(batches)
    offsets_before = await frontier_total(rpc)
    rng = np.random.default_rng(0)

    async def on_batch(w: int, served: dict) -> None:
        await check_and_train(rpc, rpc.workers[w], served, sent[served["meta"]], rng)

    before = time.time()
    await asyncio.to_thread(send_with_data_ctx, job, batches)
    after = time.time()
    got = await pull(rpc, n, on_batch)
    # Event times came through Kafka with the batches, and went with every update.
    for _, s in got:
        given = sent[s["meta"]].event_time
        assert s["event_time"] == given if given is not None \
            else before <= s["event_time"] <= after
    newest = max(s["event_time"] for _, s in got)
    for c in rpc.servers:
        assert (await c.call("health"))["trained_through"] == newest

    metas = Counter(s["meta"] for _, s in got)
    assert metas == Counter(list(sent)), "every produced batch is served exactly once"
    served_by = Counter(w for w, _ in got)
    # Keys 0..15 hash to partitions {0, 2} (worker 0) and {1, 3} (worker 1) 8 times each.
    assert served_by == {0: 8, 1: 8}
    assert len({s["batch_id"] for _, s in got}) == n, "worker batch ids are unique"
    await assert_idle(rpc)
    assert await frontier_total(rpc) - offsets_before == n
    for w, client in enumerate(rpc.workers):  # a worker launched with --kafka counts them
        text = (await client.call("metrics")).decode()
        records = "persia_embedding_worker_kafka_consumer_records_total"
        assert f"# TYPE {records} counter\n" in text
        assert float(re.search(rf"^{records} (\S+)$", text, re.M)[1]) >= served_by[w]


def _poisoned() -> list[tuple[bytes, str]]:
    """Bad messages and a word their dead-letter reason must contain."""
    wrong_dtype = make_batch(900).to_wire()
    wrong_dtype["id_type_features"][0]["values"] = (
        wrong_dtype["id_type_features"][0]["values"].astype(np.int32))
    unknown_slot = make_batch(901).to_wire()
    unknown_slot["id_type_features"][1]["name"] = "no_such_slot"
    mismatched = make_batch(902).to_wire()
    mismatched["labels"][0]["data"] = mismatched["labels"][0]["data"][:5]
    return [(b"\x00not a frame", "stream-persia frame"),
            (wire.pack(wrong_dtype), "uint64"),
            (wire.pack(unknown_slot), "no_such_slot"),
            (wire.pack(mismatched), "batch size")]


async def read_topic(bootstrap: str, topic: str, n: int, timeout_s: float = 15.0) -> list:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False,
                                fetch_max_wait_ms=50)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        records: list = []
        deadline = time.monotonic() + timeout_s
        while len(records) < n and time.monotonic() < deadline:
            for recs in (await consumer.getmany(timeout_ms=200)).values():
                records.extend(recs)
        return records
    finally:
        await consumer.stop()


async def rejected(rpc: Clients) -> Counter:
    """``batches_rejected_total`` by reason, over both workers' metrics text."""
    out: Counter = Counter()
    for c in rpc.workers:
        text = (await c.call("metrics")).decode()
        for family in text_string_to_metric_families(text):
            if family.name == "persia_embedding_worker_batches_rejected":
                for s in family.samples:
                    if s.name.endswith("_total"):
                        out[s.labels["reason"]] += int(s.value)
    return out


async def test_poisoned_messages_go_to_the_dlq_and_the_stream_goes_on(job, rpc):
    poisoned = _poisoned()
    goods = [make_batch(500 + i) for i in range(len(poisoned) + 1)]
    rejected_before = await rejected(rpc)
    # One key, so one partition: each bad message sits between two good ones in order.
    async with BatchProducer(job.topic, bootstrap_servers=job.bootstrap) as producer:
        for good, (bad, _) in zip(goods, [*poisoned, (None, None)], strict=True):
            await producer.send(good, key="poison")
            if bad is not None:
                await producer.send(bad, key="poison")

    async def release(w: int, served: dict) -> None:
        await rpc.workers[w].call("push_gradients", {"batch_id": served["batch_id"],
                                                     "grads": NO_GRADS})

    got = await pull(rpc, len(goods), release)
    assert [s["meta"] for _, s in got] == [g.meta for g in goods], "good batches, in order"
    await assert_idle(rpc)

    records = await read_topic(job.bootstrap, f"{job.topic}.dlq", len(poisoned))
    letters = [parse_dead_letter(r) for r in records]
    assert [d.value for d in letters] == [bad for bad, _ in poisoned]
    for d, (_, word) in zip(letters, poisoned, strict=True):
        assert word in d.reason, d.reason
        assert d.source_topic == job.topic and d.key == b"poison"
        assert d.kind in ("WireError", "BadInput")
    assert len({d.source_partition for d in letters}) == 1
    offsets = [d.source_offset for d in letters]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)

    counts = await rejected(rpc)
    counts.subtract(rejected_before)
    assert counts == Counter({"WireError": 3, "BadInput": 1}), counts


async def test_backpressure_pauses_the_partitions_and_loses_nothing(job, rpc):
    n = 16
    batches = [keyed(i, seed=5) for i in range(n)]
    await asyncio.to_thread(send_with_data_ctx, job, batches)
    samples: list[dict] = []

    async def sample() -> list[dict]:
        statuses = [await c.call("status") for c in rpc.workers]
        samples.extend(statuses)
        return statuses

    async def all_full() -> bool:
        return all(s["ready"] == READY_CAPACITY and s["kafka"]["paused"]
                   and s["kafka"]["backpressure_pauses"] > 0 for s in await sample())

    # Nobody pulls yet: both buffers fill and the consumers pause.
    await eventually(all_full, "both ready buffers full with their partitions paused")

    async def slow_release(w: int, served: dict) -> None:
        await sample()
        await rpc.workers[w].call("push_gradients", {"batch_id": served["batch_id"],
                                                     "grads": NO_GRADS})

    got = await pull(rpc, n, slow_release, pause_s=0.05)
    assert Counter(s["meta"] for _, s in got) == Counter(b.meta for b in batches)
    await assert_idle(rpc)

    for s in samples:
        assert s["ready_capacity"] == READY_CAPACITY
        assert s["ready"] <= READY_CAPACITY, s
        # Read from Kafka but not yet served: the buffer plus the one waiting to enter it.
        assert s["pending"] - s["inflight"] <= READY_CAPACITY + 1, s
    for c in rpc.workers:
        kafka = (await c.call("status"))["kafka"]
        assert kafka["backpressure_pauses"] > 0
        assert kafka["paused"] == [], "partitions resume once the buffer has room"


async def test_killed_server_is_a_clear_error_and_the_batch_is_served_after_restart(job, rpc):
    batch = keyed(2, seed=7)  # key "2" → partition 0 → worker 0
    await asyncio.to_thread(send_with_data_ctx, job, [batch])
    worker = rpc.workers[0]

    async def ready_one() -> bool:
        return (await worker.call("status"))["ready"] == 1

    await eventually(ready_one, "the batch reaches worker 0")
    job.servers[1].kill()
    try:
        with pytest.raises(RemoteError) as err:
            await worker.call("next_batch", {"timeout_ms": 2000})
        assert isinstance(err.value, PeerUnavailable), repr(err.value)
        assert "embedding-server-1" in str(err.value)
        assert job.servers[1].address in str(err.value)
        status = await worker.call("status")
        assert (status["ready"], status["inflight"]) == (1, 0), "the batch went back first"
        # Still failing while the server is away (not lost, not skipped).
        with pytest.raises(PeerUnavailable):
            await worker.call("next_batch", {"timeout_ms": 2000})
    finally:  # later tests need the server whatever happened here
        await asyncio.to_thread(job.restart_server, 1)
    # A fresh process: empty store, default optimizer and initialisation. Nobody configures
    # it by hand: worker 0 does (on_server_restart: continue), from the configuration it
    # learned, before its lookup, and counts the restart.
    assert await rpc.servers[1].call("get_config") is None
    served = await worker.call("next_batch", {"timeout_ms": 5000})
    assert served is not None and served["meta"] == batch.meta
    assert b'persia_embedding_worker_server_restarts_total{server="1"} 1.0' in \
        await worker.call("metrics")
    job_config = await rpc.servers[0].call("get_config")
    assert job_config is not None and job_config["optimizer"] == SGD(lr=LR).to_dict()
    assert await rpc.servers[1].call("get_config") == job_config
    await check_and_train(rpc, worker, served, batch, np.random.default_rng(1))  # SGD, LR
    await assert_idle(rpc)


async def test_sigterm_drains_every_role_with_exit_code_zero(job, rpc):
    for c in [*rpc.workers, *rpc.servers]:
        await c.close()
    codes = await asyncio.to_thread(
        lambda: [p.stop(grace_s=15) for p in [*job.workers, *job.servers]])
    assert codes == [0, 0, 0, 0], [p.log_tail() for p in [*job.workers, *job.servers]]
