"""Embedding worker + embedding servers in this process, on real loopback sockets.

Covers the broker-less path (DataCtx → ingest RPC), serving with embeddings equal to a
direct lookup on the owning server, gradients applied with the optimizer on the right
shard, eval lookups that never insert, validation errors naming the field, and the
bounded buffers.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest

from stream_persia.core.data import IDTypeFeature, Label, PersiaBatch
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.optim import SGD
from stream_persia.errors import Backpressure, BadInput, Misuse, ServerRestarted
from stream_persia.kernels.sharding import shard_of
from stream_persia.rpc import RpcClient
from stream_persia.server.service import EmbeddingServer
from stream_persia.testing.samples import SCHEMA, make_batch, naive_sum
from stream_persia.worker.service import EmbeddingWorker

LR = 0.5


@pytest.fixture
async def job():
    servers = [EmbeddingServer(10_000, SGD(lr=LR), EmbeddingConfig((-0.5, 0.5)),
                               replica_index=i, replica_size=2) for i in range(2)]
    for s in servers:
        await s.start()
    worker = EmbeddingWorker(SCHEMA, [s.address for s in servers], ready_buffer_batches=3)
    await worker.start()
    client = RpcClient(worker.address, timeout_ms=5000)
    try:
        yield servers, worker, client
    finally:
        await client.close()
        await worker.stop()
        for s in servers:
            await s.stop()


def _eval_rows(servers, slot, ids):
    """Rows of prefixed ``ids`` read straight from the owning server's store."""
    pref = SCHEMA.prefix_ids(slot, np.asarray(ids, dtype=np.uint64))
    owner = shard_of(pref, 2)
    out = np.zeros((pref.size, SCHEMA.slot(slot).dim), dtype=np.float32)
    for s in range(2):
        sel = owner == s
        if sel.any():
            store = servers[s].store
            assert store.contains(pref[sel]).all(), "id missing on its owning shard"
            assert not servers[1 - s].store.contains(pref[sel]).any(), "id on the wrong shard"
            out[sel] = store.lookup(pref[sel], out.shape[1], train=False)
    return out


async def test_serve_then_apply_matches_direct_store(job):
    servers, worker, client = job
    batch = make_batch(0)
    await client.call("ingest", {"batch": batch.to_wire()})
    served = await client.call("next_batch", {"timeout_ms": 2000})
    assert served["meta"] == b"batch-0" and served["requires_grad"]
    emb = {e["name"]: e for e in served["embeddings"]}

    for slot, sqrt in (("user", False), ("item", True)):
        feature = next(f for f in batch.id_type_features if f.name == slot)
        uniq = np.unique(feature.values)
        rows = dict(zip(uniq.tolist(), _eval_rows(servers, slot, uniq), strict=True))
        expected = naive_sum(feature.data, lambda x, r=rows: r.get(x, np.zeros(8, np.float32)),
                             sqrt)
        np.testing.assert_allclose(emb[slot]["emb"], expected, rtol=1e-6, atol=1e-6)
    raw = emb["tags"]
    assert raw["kind"] == "raw" and raw["index"].shape == (16, 3)
    assert not raw["emb"][0].any(), "row 0 is the padding row"

    # Gradients: each occurrence of an id receives its sample's gradient (scaled for the
    # sqrt slot); SGD applies -lr * sum on the owning shard.
    rng = np.random.default_rng(1)
    grads = {"user": rng.normal(size=(16, 8)).astype(np.float32),
             "item": rng.normal(size=(16, 8)).astype(np.float32),
             "tags": rng.normal(size=raw["emb"].shape).astype(np.float32)}
    before = {}
    for slot in ("user", "item"):
        feature = next(f for f in batch.id_type_features if f.name == slot)
        uniq = np.unique(feature.values)
        before[slot] = (uniq, _eval_rows(servers, slot, uniq))
    reply = await client.call("push_gradients", {"batch_id": served["batch_id"],
                                                 "grads": grads})
    assert reply["skipped_slots"] == [] and reply["dropped"] == 0
    for slot, sqrt in (("user", False), ("item", True)):
        feature = next(f for f in batch.id_type_features if f.name == slot)
        uniq, rows_before = before[slot]
        g = {int(x): np.zeros(8) for x in uniq}
        for sample, ids in enumerate(feature.data):
            scale = 1 / np.sqrt(len(ids)) if (sqrt and len(ids)) else 1.0
            for x in ids:
                g[int(x)] += grads[slot][sample] * scale
        expected = rows_before - LR * np.stack([g[int(x)] for x in uniq])
        np.testing.assert_allclose(_eval_rows(servers, slot, uniq), expected, atol=1e-5)

    # The batch is released. Pushing it again (an NN worker whose reply was lost) gets the
    # first reply and applies nothing; an id never served is refused, naming the field.
    after = {slot: _eval_rows(servers, slot, uniq) for slot, (uniq, _) in before.items()}
    again = await client.call("push_gradients", {"batch_id": served["batch_id"],
                                                 "grads": grads})
    assert again == {**reply, "duplicate": True}
    for slot, (uniq, _) in before.items():
        np.testing.assert_array_equal(_eval_rows(servers, slot, uniq), after[slot])
    with pytest.raises(BadInput) as err:
        await client.call("push_gradients", {"batch_id": served["batch_id"] + 1000,
                                             "grads": grads})
    assert err.value.field == "batch_id"


async def test_eval_lookup_never_inserts_and_counts_missing(job):
    servers, worker, client = job
    batch = make_batch(7, requires_grad=False)
    reply = await client.call("lookup_batch", {"batch": batch.to_wire(), "mode": "infer"})
    assert reply["missing"] > 0
    assert all(not e["emb"].any() for e in reply["embeddings"])
    assert sum(len(s.store) for s in servers) == 0


async def test_bad_batches_are_refused_with_the_field(job):
    servers, worker, client = job
    wire = make_batch(0).to_wire()
    wire["id_type_features"][0]["name"] = "no_such_slot"
    with pytest.raises(BadInput) as err:
        await client.call("ingest", {"batch": wire})
    assert "no_such_slot" in str(err.value)
    bad_grad = make_batch(1)
    await client.call("ingest", {"batch": bad_grad.to_wire()})
    served = await client.call("next_batch", {"timeout_ms": 2000})
    with pytest.raises(BadInput) as err:
        await client.call("push_gradients", {"batch_id": served["batch_id"],
                                             "grads": {"user": np.zeros((3, 8), np.float32),
                                                       "item": None, "tags": None}})
    assert "user" in (err.value.field or "")
    # NaN gradients skip the slot and are counted, the batch is still released.
    nan = np.full((16, 8), np.nan, np.float32)
    reply = await client.call("push_gradients", {"batch_id": served["batch_id"],
                                                 "grads": {"user": nan, "item": None,
                                                           "tags": None}})
    assert reply["skipped_slots"] == ["user"]


@pytest.mark.parametrize("offsets", [[0, 2, 1], [0, 1, 5], [1, 2, 3]])
async def test_malformed_ids_are_refused_at_decode_naming_the_feature(job, offsets):
    """The worker checks a batch's CSR ids once, when decoding it (planning trusts them
    then): a bad one is still refused, named, counted, and never buffered."""
    servers, worker, client = job
    wire = make_batch(0, batch_size=2).to_wire()
    tags = next(i for i, f in enumerate(wire["id_type_features"]) if f["name"] == "tags")
    wire["id_type_features"][tags]["values"] = np.arange(3, dtype=np.uint64)
    wire["id_type_features"][tags]["offsets"] = np.array(offsets, np.int64)
    with pytest.raises(BadInput) as err:
        await client.call("ingest", {"batch": wire})
    assert err.value.field == f"batch.id_type_features[{tags}]"
    assert "'tags': offsets must" in str(err.value)
    assert 'reason="WireError"} 1.0' in worker.metrics.render().decode()
    assert len(worker.ready) == 0
    with pytest.raises(BadInput) as err:
        await client.call("lookup_batch", {"batch": wire, "mode": "eval"})
    assert err.value.field == f"batch.id_type_features[{tags}]"


async def test_ids_a_raw_slot_keeps_no_row_for_are_counted_per_slot_and_logged_once(
        job, caplog):
    """A raw slot keeps each sample's first ``sample_fixed_size`` ids (PERSIA's rule) and
    drops the rest: nothing said so, so a data loader sending longer lists than the config
    allows lost ids unseen. They are counted per slot, and the first time logged."""
    servers, worker, client = job
    u64 = np.uint64
    batch = PersiaBatch([
        IDTypeFeature("user", [np.array([1], u64), np.array([2], u64)]),
        IDTypeFeature("item", [np.array([3], u64), np.array([4, 5, 6, 7, 8], u64)]),
        IDTypeFeature("tags", [np.arange(5, dtype=u64), np.array([9], u64)]),  # fixed size 3
    ], labels=[Label(np.zeros((2, 1), np.float32))])
    with caplog.at_level("WARNING", logger="stream_persia.worker.service"):
        for _ in range(2):
            await client.call("ingest", {"batch": batch.to_wire()})
    text = (await client.call("metrics")).decode()
    assert 'persia_embedding_worker_ids_truncated_total{slot="tags"} 4.0' in text
    assert 'slot="item"' not in text and 'slot="user"' not in text   # summation: all kept
    warned = [r.getMessage() for r in caplog.records if "sample_fixed_size" in r.getMessage()]
    assert len(warned) == 1 and "'tags'" in warned[0] and "3" in warned[0]
    served = await client.call("next_batch", {"timeout_ms": 2000})
    tags = next(e for e in served["embeddings"] if e["name"] == "tags")
    assert np.asarray(tags["mask"]).sum(axis=1).tolist() == [3, 1]


async def test_a_broker_less_worker_exports_no_kafka_series(job):
    servers, worker, client = job
    await client.call("ingest", {"batch": make_batch(0).to_wire()})
    text = (await client.call("metrics")).decode()
    assert "persia_embedding_worker_batches_ingested_total 1.0" in text
    assert "persia_embedding_worker_buffer_ready 1.0" in text
    assert "_kafka_" not in text
    assert (await client.call("frontier"))["stream"] == "direct"


def test_the_worker_loads_kafka_code_only_to_consume_kafka():
    """A broker-less worker imports neither the Kafka ingest nor aiokafka (~0.1 s)."""
    code = ("import sys\n"
            "from stream_persia.worker.service import EmbeddingWorker\n"
            "print(sorted(m for m in ('aiokafka', 'stream_persia.kafka',\n"
            "                         'stream_persia.worker.ingest') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]"


async def test_ready_buffer_is_bounded_and_ingest_waits(job):
    servers, worker, client = job
    for i in range(3):
        await client.call("ingest", {"batch": make_batch(i).to_wire()})
    with pytest.raises(Backpressure):
        await client.call("ingest", {"batch": make_batch(3).to_wire(), "timeout_ms": 200})
    # A waiting ingest completes as soon as a batch is pulled.
    waiting = asyncio.ensure_future(client.call("ingest", {"batch": make_batch(4).to_wire(),
                                                            "timeout_ms": 5000}))
    await asyncio.sleep(0.1)
    assert not waiting.done()
    first = await client.call("next_batch", {"timeout_ms": 1000})
    await asyncio.wait_for(waiting, 5)
    assert first["meta"] == b"batch-0"
    metas = [first["meta"]]
    for _ in range(3):
        b = await client.call("next_batch", {"timeout_ms": 1000})
        metas.append(b["meta"])
        await client.call("push_gradients", {"batch_id": b["batch_id"],
                                             "grads": dict.fromkeys(("user", "item", "tags"))})
    assert metas == [b"batch-0", b"batch-1", b"batch-2", b"batch-4"]
    assert await client.call("next_batch", {"timeout_ms": 50}) is None


async def test_timeout_must_be_a_number_not_a_bool(job):
    servers, worker, client = job
    for method, params in (("next_batch", {"timeout_ms": True}),
                           ("ingest", {"batch": make_batch(0).to_wire(), "timeout_ms": "1"})):
        with pytest.raises(BadInput) as err:
            await client.call(method, params)
        assert err.value.field == "timeout_ms"


async def test_next_batch_expecting_a_configuration_no_server_holds_fails_loudly(job):
    """The caller (an NN worker) configured the servers, but none holds a configuration:
    they all restarted (this worker too) and lost their tables. By default that is
    ServerRestarted naming every server, the batch kept and the worker unhealthy."""
    servers, worker, client = job
    await client.call("ingest", {"batch": make_batch(0).to_wire()})
    with pytest.raises(ServerRestarted, match="every server") as err:
        await client.call("next_batch", {"timeout_ms": 50, "config": "0123456789abcdef"})
    assert err.value.field == "config"
    assert all(s.address in str(err.value) for s in servers)
    health = await client.call("health")
    assert health["ok"] is False and "every server" in health["error"]
    assert len(worker.ready) == 1


async def test_next_batch_expecting_a_configuration_no_server_holds_is_refused(job):
    """With ``on_server_restart: continue``: refused naming ``config``, the batch kept;
    served, with the servers' digest, once they are configured again (the NN side does
    it)."""
    servers, worker, client = job
    worker.router.on_server_restart = "continue"
    await client.call("ingest", {"batch": make_batch(0).to_wire()})
    with pytest.raises(BadInput) as err:
        await client.call("next_batch", {"timeout_ms": 50, "config": "not-a-digest"})
    assert err.value.field == "config"
    with pytest.raises(Misuse, match="no embedding server holds a configuration") as err:
        await client.call("next_batch", {"timeout_ms": 50, "config": "0123456789abcdef"})
    assert err.value.field == "config"
    cfg = {"optimizer": SGD(lr=LR).to_dict(),
           "embedding_config": EmbeddingConfig((-0.5, 0.5)).to_dict()}
    for s in servers:
        async with RpcClient(s.address) as c:
            await c.call("configure", cfg)
            digest = (await c.call("get_config"))["digest"]
    served = await client.call("next_batch", {"timeout_ms": 2000, "config": digest})
    assert served["meta"] == b"batch-0" and served["config"] == digest
