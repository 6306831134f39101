"""Checkpoints from TrainCtx: the cut returns prefetched batches and waits for pushes, the
files restore the dense model, optimizer, step and embeddings (into any server count), and
with Kafka the stream resumes at the first batch after the cut. Workers that mix Kafka and
direct ingest refuse the cut; a restore into another embedding schema is refused.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from aiokafka import AIOKafkaProducer
from nn_helpers import SumModel

from stream_persia.checkpoint import config_digest, read_manifest, verify
from stream_persia.config import GlobalConfig, KafkaConfig, load_embedding_config
from stream_persia.ctx import DataCtx, TrainCtx, eval_ctx
from stream_persia.data import DataLoader, IterableDataset, StreamingDataset
from stream_persia.embedding.data import Label, PersiaBatch
from stream_persia.embedding.optim import Adagrad
from stream_persia.errors import BadInput, DataLost, Misuse
from stream_persia.kafka import DeadLetterWriter, SampleConsumer
from stream_persia.launch.processes import RoleProcess
from stream_persia.testing.kafka_mock import MockKafkaCluster
from stream_persia.testing.samples import EMBEDDING_YAML, SCHEMA, make_batch
from stream_persia.worker.ingest import KafkaIngest

IN_DIM = 3 + 8 + 8 + 4


def _ctx(job, model, opt):
    return TrainCtx(Adagrad(lr=0.1), opt, model=model, embedding_workers=job.worker_addresses,
                    mixed_precision=False, ready_timeout_s=10)


def _step(ctx, tb):
    output, labels = ctx.forward(tb)
    ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))


def _eval_embeddings(job, batch):
    with eval_ctx(embedding_workers=job.worker_addresses) as ctx:
        tb = ctx.get_embedding_from_data(batch)
        return [s.emb.numpy().copy() for s in tb.id_type_feature_embeddings]


@pytest.mark.filterwarnings("ignore:`torch.jit.load` is deprecated:DeprecationWarning")
def test_checkpoint_cut_and_restore(job_factory, tmp_path):
    job = job_factory(SCHEMA)
    job.feed([make_batch(i) for i in range(12)], background=False)
    model = SumModel(IN_DIM, hidden=4)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    probe = make_batch(0, requires_grad=False)
    ck = str(tmp_path / "ck")
    metas = []
    with _ctx(job, model, opt) as ctx:
        for tb in DataLoader(StreamingDataset(), embedding_staleness=4, reproducible=True,
                             max_batches=12, timeout_ms=3000):
            metas.append(tb.meta)
            _step(ctx, tb)
            if len(metas) == 5:
                # Let the prefetcher get ahead (staleness 4), so the cut has served but
                # untrained batches to give back; on a busy machine it may lag.
                deadline = time.monotonic() + 10
                while ctx.stats()["served"] <= len(metas) and time.monotonic() < deadline:
                    time.sleep(0.01)
                ctx.dump_checkpoint(ck, with_jit_model=True)
                # (Nothing was in flight at the cut: rank 0 refuses to commit otherwise.
                # Right after it returns the prefetcher runs again, so don't look now.)
                saved_dense = {k: v.clone() for k, v in model.state_dict().items()}
                saved_opt_steps = opt.state_dict()["state"][0]["step"].item()
        assert ctx.stats()["returned"] > 0, "the cut returned prefetched batches"
        # Training went on from exactly where the cut was: every batch once, in order.
        assert metas == [f"batch-{i}".encode() for i in range(12)]
        after_emb = _eval_embeddings(job, probe)

        manifest = read_manifest(ck)
        verify(ck)
        assert manifest.step == 5 and manifest.stream == "direct" and manifest.offsets == {}
        assert {"dense.pt", "opt.pt", "jit_dense.pt"} <= set(manifest.files)
        assert manifest.rows > 0
        scripted = torch.jit.load(str(tmp_path / "ck" / "jit_dense.pt"))
        assert isinstance(scripted, torch.jit.ScriptModule)

        ctx.load_checkpoint(ck)
        assert ctx.steps == 5
        for k, v in model.state_dict().items():
            assert torch.equal(v, saved_dense[k]), k
        assert opt.state_dict()["state"][0]["step"].item() == saved_opt_steps
        assert sum(ctx.get_embedding_size()) == manifest.rows
        restored_emb = _eval_embeddings(job, probe)
        assert any(not np.array_equal(a, b) for a, b in zip(after_emb, restored_emb,
                                                            strict=True)), \
            "the restore brought back the rows of the cut, not the latest ones"


def test_embeddings_reload_into_more_servers(job_factory, tmp_path):
    one = job_factory(SCHEMA)
    one.feed([make_batch(i) for i in range(3)], background=False)
    model = SumModel(IN_DIM)
    with _ctx(one, model, torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
        for tb in DataLoader(StreamingDataset(), max_batches=3):
            _step(ctx, tb)
        ctx.dump_embedding(str(tmp_path / "emb"))
        sizes = ctx.get_embedding_size()
    probe = make_batch(1, requires_grad=False)
    expected = _eval_embeddings(one, probe)

    two = job_factory(SCHEMA, servers=2)
    with eval_ctx(embedding_workers=two.worker_addresses) as ctx:
        ctx.load_embedding(str(tmp_path / "emb"), blocking=False)
        ctx.wait_for_load_embedding()
        assert sum(ctx.get_embedding_size()) == sum(sizes)
        assert all(n > 0 for n in ctx.get_embedding_size())
    # Pooled rows summed from two servers' replies add in another order than from one:
    # float32 sums agree to a few ulps of their terms (~1e-2), not relative to a sum near 0.
    for a, b in zip(expected, _eval_embeddings(two, probe), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_checkpoint_between_forward_and_backward_is_refused(job_factory, tmp_path):
    job = job_factory(SCHEMA)
    job.feed([make_batch(0)], background=False)
    model = SumModel(IN_DIM)
    with _ctx(job, model, torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
        for tb in DataLoader(StreamingDataset(), max_batches=1):
            ctx.forward(tb)
            with pytest.raises(Misuse, match="backward"):
                ctx.dump_checkpoint(str(tmp_path / "ck"))
            _step(ctx, tb)
    assert not (tmp_path / "ck").exists()


def test_kafka_checkpoint_replays_the_stream_from_the_cut(job_factory, kafka_broker,
                                                          kafka_topic, tmp_path):
    """Exactly once across a restore: offsets of the cut in the manifest, reset_stream."""
    topic = kafka_topic(1)
    kafka_broker.create_topic(f"{topic}.dlq", 1)
    job = job_factory(SCHEMA, workers=0)
    (tmp_path / "embedding_config.yml").write_text(EMBEDDING_YAML)
    worker = RoleProcess("embedding-worker", [
        "--embedding-config", str(tmp_path / "embedding_config.yml"),
        "--embedding-servers", job.servers[0].address, "--kafka", kafka_broker.bootstrap_servers,
        "--topic", topic, "--num-partitions", "1"], log_path=tmp_path / "worker.log")
    ck = str(tmp_path / "ck")
    with worker:
        config = GlobalConfig(kafka=KafkaConfig(samples_topic=topic))
        with DataCtx(kafka_bootstrap_servers=kafka_broker.bootstrap_servers,
                     global_config=config) as dc:
            for i in range(20):
                dc.send_data(make_batch(i))
        model = SumModel(IN_DIM)
        with _ctx(SimpleNamespace(worker_addresses=[worker.address]), model,
                  torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
            metas = []
            for tb in DataLoader(StreamingDataset(), embedding_staleness=4, reproducible=True,
                                 max_batches=14, timeout_ms=20_000):
                metas.append(tb.meta)
                _step(ctx, tb)
                if len(metas) == 8:
                    ctx.dump_checkpoint(ck)
            manifest = read_manifest(ck)
            assert manifest.stream == "kafka"
            assert manifest.offsets == {topic: {"0": 8}}, "the cut is after the 8th batch"
            # The record below the cut is fingerprinted; a restore whose record differs
            # there (the topic created again) is refused before anything changes.
            recorded = (manifest.fingerprints or {})[topic]["0"]
            assert recorded["offset"] == 7 and len(recorded["digest"]) == 16
            other = tmp_path / "other"
            shutil.copytree(ck, other)
            d = json.loads((other / "manifest.json").read_text())
            d["fingerprints"][topic]["0"]["digest"] = "0" * 16
            (other / "manifest.json").write_text(json.dumps(d))
            with pytest.raises(DataLost, match=rf"{topic}/0: the record at offset 7 is not"):
                ctx.load_checkpoint(str(other))
            ctx.load_checkpoint(ck)
            replayed = []
            for tb in DataLoader(StreamingDataset(), embedding_staleness=4, reproducible=True,
                                 max_batches=6, timeout_ms=20_000):
                replayed.append(tb.meta)
                _step(ctx, tb)
    assert metas == [f"batch-{i}".encode() for i in range(14)]
    assert replayed == metas[8:14], "training resumes at the first batch after the cut"


def test_forward_only_batches_kept_at_a_pause_are_dropped_by_a_restore(
        job_factory, kafka_broker, kafka_topic, tmp_path):
    """Forward-only batches a loop's end kept for the next loop carry embeddings looked
    up before a restore, and the replay from the checkpoint's offsets serves them again:
    they were served first after the restore, then a second time by the replay."""
    topic = kafka_topic(1)
    kafka_broker.create_topic(f"{topic}.dlq", 1)
    job = job_factory(SCHEMA, workers=0)
    (tmp_path / "embedding_config.yml").write_text(EMBEDDING_YAML)
    worker = RoleProcess("embedding-worker", [
        "--embedding-config", str(tmp_path / "embedding_config.yml"),
        "--embedding-servers", job.servers[0].address, "--kafka", kafka_broker.bootstrap_servers,
        "--topic", topic, "--num-partitions", "1"], log_path=tmp_path / "worker.log")
    ck = str(tmp_path / "ck")

    def step(ctx, tb):
        output, labels = ctx.forward(tb)
        if tb.requires_grad:
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))

    with worker:
        config = GlobalConfig(kafka=KafkaConfig(samples_topic=topic))
        with DataCtx(kafka_bootstrap_servers=kafka_broker.bootstrap_servers,
                     global_config=config) as dc:
            for i in range(12):
                b = make_batch(i)
                if i in (6, 7):
                    b = PersiaBatch(b.id_type_features, b.non_id_type_features, b.labels,
                                    requires_grad=False, meta=b.meta)
                dc.send_data(b)
        model = SumModel(IN_DIM)
        with TrainCtx(Adagrad(lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1),
                      model=model, embedding_workers=[worker.address],
                      mixed_precision=False, ready_timeout_s=10) as ctx:
            first = []
            for tb in DataLoader(StreamingDataset(), embedding_staleness=4, reproducible=True,
                                 max_batches=6, timeout_ms=20_000):
                first.append(tb.meta)
                if len(first) == 6:
                    time.sleep(2)   # the prefetcher fetches the forward-only 6 and 7
                step(ctx, tb)
                if len(first) == 4:
                    ctx.dump_checkpoint(ck)
            ctx.load_checkpoint(ck)
            replayed = []
            for tb in DataLoader(StreamingDataset(), embedding_staleness=4, reproducible=True,
                                 max_batches=8, timeout_ms=5_000):
                replayed.append(tb.meta)
                step(ctx, tb)
    # The cut at batch 4 hands the prefetched training batches back to the worker and
    # keeps forward-only ones already fetched: those are served first (they train nothing,
    # so training order holds; see the README).
    assert first[:4] == [f"batch-{i}".encode() for i in range(4)]
    assert len(first) == 6 and set(first[4:]) <= {f"batch-{i}".encode() for i in range(4, 8)}
    assert replayed == [f"batch-{i}".encode() for i in range(4, 12)]


def test_a_kafka_restore_the_broker_cannot_replay_changes_nothing(job_factory, tmp_path):
    """load_checkpoint of a cut whose offsets retention has deleted since raises DataLost
    naming them before the servers load anything: the job trains on as it was. (Its own
    mock broker: retention there keeps ~5 MiB per partition.)"""
    with MockKafkaCluster() as cluster:
        topic = "samples"
        cluster.create_topic(topic, 1)
        cluster.create_topic(f"{topic}.dlq", 1)
        job = job_factory(SCHEMA, workers=0)
        (tmp_path / "embedding_config.yml").write_text(EMBEDDING_YAML)
        worker = RoleProcess("embedding-worker", [
            "--embedding-config", str(tmp_path / "embedding_config.yml"),
            "--embedding-servers", job.servers[0].address,
            "--kafka", cluster.bootstrap_servers, "--topic", topic, "--num-partitions", "1"],
            log_path=tmp_path / "worker.log")
        ck = str(tmp_path / "ck")
        with worker:
            with DataCtx(kafka_bootstrap_servers=cluster.bootstrap_servers,
                         global_config=GlobalConfig(kafka=KafkaConfig(samples_topic=topic))
                         ) as dc:
                for i in range(12):
                    dc.send_data(make_batch(i))
            workers = SimpleNamespace(worker_addresses=[worker.address])
            model = SumModel(IN_DIM)
            with _ctx(workers, model, torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
                for n, tb in enumerate(DataLoader(StreamingDataset(), max_batches=12,
                                                  timeout_ms=20_000), 1):
                    _step(ctx, tb)
                    if n == 8:
                        ctx.dump_checkpoint(ck)
                probe = make_batch(0, requires_grad=False)
                trained = _eval_embeddings(workers, probe)
                asyncio.run(_produce(cluster.bootstrap_servers, topic,
                                     [b"x" * 100_000] * 80))   # retention deletes 8..
                with pytest.raises(DataLost, match=rf"{topic}/0: offsets 8\.\.") as err:
                    ctx.load_checkpoint(ck)
                assert "on_data_loss" in (err.value.hint or "")
                for now, before in zip(_eval_embeddings(workers, probe), trained,
                                       strict=True):
                    np.testing.assert_array_equal(now, before)


async def _produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    await producer.start()
    try:
        for v in values:
            await producer.send(topic, v, partition=0)
        await producer.flush()
    finally:
        await producer.stop()


def test_restore_refuses_a_checkpoint_of_another_embedding_schema(job_factory, tmp_path,
                                                                  monkeypatch):
    """The checkpoint records the digest of the job's embedding schema
    (PERSIA_EMBEDDING_CONFIG); restoring it where that file says otherwise is refused on
    every rank before anything changes, naming what differs; the same schema restores."""
    (tmp_path / "same.yml").write_text(EMBEDDING_YAML)
    (tmp_path / "wider.yml").write_text(EMBEDDING_YAML.replace("user: {dim: 8}",
                                                               "user: {dim: 16}"))
    monkeypatch.setenv("PERSIA_EMBEDDING_CONFIG", str(tmp_path / "same.yml"))
    job = job_factory(SCHEMA)
    job.feed([make_batch(i) for i in range(4)], background=False)
    model = SumModel(IN_DIM)
    ck = str(tmp_path / "ck")
    with _ctx(job, model, torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
        for n, tb in enumerate(DataLoader(StreamingDataset(), max_batches=4), 1):
            _step(ctx, tb)
            if n == 2:
                ctx.dump_checkpoint(ck)
        manifest = read_manifest(ck)
        assert manifest.config_digest == config_digest(SCHEMA)
        probe = make_batch(0, requires_grad=False)
        trained = _eval_embeddings(job, probe)   # two steps past the cut

        monkeypatch.setenv("PERSIA_EMBEDDING_CONFIG", str(tmp_path / "wider.yml"))
        with pytest.raises(Misuse, match="slot 'user' has dim 8 in the checkpoint, 16 here"
                           ) as err:
            ctx.load_checkpoint(ck)
        assert err.value.field == "config_digest"
        assert f"checkpoint {ck} was trained with another embedding config" in str(err.value)
        with pytest.raises(Misuse, match="slot 'user' has dim 8"):
            ctx.load_embedding(ck)
        assert ctx.steps == 4   # nothing changed
        for now, before in zip(_eval_embeddings(job, probe), trained, strict=True):
            np.testing.assert_array_equal(now, before)

        monkeypatch.setenv("PERSIA_EMBEDDING_CONFIG", str(tmp_path / "same.yml"))
        ctx.load_checkpoint(ck)
        assert ctx.steps == 2 and job.rows() == manifest.rows
        assert any(not np.array_equal(a, b) for a, b in zip(
            _eval_embeddings(job, probe), trained, strict=True)), "the cut's rows are back"


def test_without_the_config_variable_the_workers_schema_is_digested_and_checked(
        job_factory, tmp_path, monkeypatch):
    """A training script run without PERSIA_EMBEDDING_CONFIG digests its checkpoints with
    the schema the embedding workers plan batches with, so a restore into a job whose
    slots_config lists two same-dim slots in another order (their rows would be read as
    each other's) is refused rather than done unchecked."""
    monkeypatch.delenv("PERSIA_EMBEDDING_CONFIG", raising=False)
    swapped = tmp_path / "swapped.yml"
    swapped.write_text(EMBEDDING_YAML.replace("  user: {dim: 8}\n", "").replace(
        "  tags:", "  user: {dim: 8}\n  tags:"))
    job = job_factory(SCHEMA)
    job.feed([make_batch(i) for i in range(2)], background=False)
    model = SumModel(IN_DIM)
    ck = str(tmp_path / "ck")
    with _ctx(job, model, torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
        for tb in DataLoader(StreamingDataset(), max_batches=2):
            _step(ctx, tb)
        ctx.dump_checkpoint(ck)
    assert read_manifest(ck).config_digest == config_digest(SCHEMA)
    other = job_factory(load_embedding_config(str(swapped)))
    assert list(other.workers[0].schema.slots) == ["item", "user", "tags"]
    with _ctx(other, model, torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
        with pytest.raises(Misuse, match="another order") as err:
            ctx.load_checkpoint(ck)
        assert err.value.field == "config_digest"
        assert other.rows() == 0   # nothing restored


def test_kafka_and_direct_workers_refuse_the_checkpoint(job_factory, kafka_broker,
                                                        kafka_topic, tmp_path):
    """Worker 0 reads Kafka, worker 1 takes direct ingest: the checkpoint is refused naming
    them (it used to record a 'direct' stream with no offsets, whose restore rolled the
    Kafka worker's rows back without resetting its stream), and nothing is written."""
    topic = kafka_topic(1)
    job = job_factory(SCHEMA, workers=2)
    worker = job.workers[0]
    cfg = KafkaConfig(bootstrap_servers=kafka_broker.bootstrap_servers, samples_topic=topic,
                      dlq_topic=f"{topic}.dlq", job_name="mixed")
    job.loop.run(worker.start_kafka_ingest(lambda start: KafkaIngest(
        worker, SampleConsumer.from_config(cfg, replica_index=0, replica_size=1),
        DeadLetterWriter.from_config(cfg), start_offsets=start)), timeout=30)
    model = SumModel(IN_DIM)
    ck = tmp_path / "ck"
    with _ctx(job, model, torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
        with pytest.raises(Misuse, match=r"mix Kafka \(embedding worker 0\) and direct ingest "
                                         r"\(embedding worker 1\)") as err:
            ctx.dump_checkpoint(str(ck))
        assert err.value.field == "stream"
    assert not ck.exists()


def _at(batch, event_time, labels=None):
    return PersiaBatch(batch.id_type_features, batch.non_id_type_features,
                       batch.labels if labels is None else labels,
                       requires_grad=batch.requires_grad, meta=batch.meta,
                       event_time=event_time)


def test_a_restore_takes_the_checkpoints_trained_through(job_factory, tmp_path):
    """``trained_through`` (the newest event time in the dense model: the next checkpoint,
    the heartbeat and the dense publisher carry it) is the restored checkpoint's after
    ``load_checkpoint``. It was left as it was: restoring an older checkpoint in the same
    context kept claiming the newer time, and a fresh context restored None, so the
    checkpoints they wrote next recorded a freshness the model did not have (or none)."""
    job = job_factory(SCHEMA)
    job.feed([_at(make_batch(i), 1000.0 + i) for i in range(6)], background=False)
    model = SumModel(IN_DIM)
    old, again = str(tmp_path / "old"), str(tmp_path / "again")
    with _ctx(job, model, torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
        for tb in DataLoader(StreamingDataset(), embedding_staleness=1, max_batches=6,
                             timeout_ms=3000):
            _step(ctx, tb)
            if ctx.steps == 2:
                ctx.dump_checkpoint(old)
        assert read_manifest(old).extra["trained_through"] == 1001.0
        assert ctx.trained_through == 1005.0
        ctx.load_checkpoint(old)
        assert ctx.trained_through == 1001.0
        ctx.dump_checkpoint(again)
        assert read_manifest(again).extra["trained_through"] == 1001.0
    fresh = SumModel(IN_DIM)
    with _ctx(job, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1)) as ctx:
        ctx.load_checkpoint(old)
        assert ctx.trained_through == 1001.0


class TwoHeads(torch.nn.Module):
    """Two sigmoid heads over every input, and the labels of each batch it was given."""

    tasks = ["click", "buy"]

    def __init__(self):
        super().__init__()
        self.sum = SumModel(IN_DIM)
        self.w = torch.nn.Parameter(torch.ones(2))

    def forward(self, non_id_type_feature_tensors, id_type_feature_embedding_tensors):
        return self.sum(non_id_type_feature_tensors, id_type_feature_embedding_tensors) * self.w


def test_a_restored_model_gets_the_labels_in_its_order(job_factory, tmp_path):
    """A checkpoint records its labels' names in order (``extra["label_names"]``), and a
    restore arranges the labels of the batches trained next to it. Without it a context
    that restored a model trained on labels (click, buy) took the order of the first
    batch it trained: a data loader that now sends (buy, click) trained each head on the
    other's label, silently."""
    job = job_factory(SCHEMA)

    def labelled(i, order):
        b = make_batch(i)
        y = {"click": np.zeros((16, 1), np.float32), "buy": np.ones((16, 1), np.float32)}
        return PersiaBatch(b.id_type_features, b.non_id_type_features,
                           [Label(y[n], n) for n in order], meta=b.meta)

    job.feed([labelled(0, ["click", "buy"])], background=False)
    model = TwoHeads()
    ck = str(tmp_path / "ck")
    with _ctx(job, model, torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
        for tb in DataLoader(StreamingDataset(), max_batches=1, timeout_ms=3000):
            out, labels = ctx.forward(tb)
            ctx.backward(torch.nn.functional.binary_cross_entropy(
                out, torch.cat(labels, dim=1)))
        ctx.dump_checkpoint(ck)
    assert read_manifest(ck).extra["label_names"] == ["click", "buy"]
    job.feed([labelled(1, ["buy", "click"])], background=False)
    model = TwoHeads()
    with _ctx(job, model, torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
        ctx.load_checkpoint(ck)
        for tb in DataLoader(StreamingDataset(), max_batches=1, timeout_ms=3000):
            out, labels = ctx.forward(tb)
            assert [float(y.mean()) for y in labels] == [0.0, 1.0]   # click, then buy
            ctx.backward(torch.nn.functional.binary_cross_entropy(
                out, torch.cat(labels, dim=1)))


def test_an_eval_ctx_arranges_batches_to_the_restored_models_inputs(job_factory, tmp_path):
    """An evaluation of a checkpoint (``eval_ctx`` + ``load_checkpoint``) took batches in
    the order they came: a test set whose loader sent the slots or labels in another
    order than the training stream fed the model one slot's embeddings as another's and
    scored each head against the other's label, silently. It is arranged to the
    checkpoint's inputs, and one lacking an input is refused naming it."""
    job = job_factory(SCHEMA)

    def labelled(i, order, slots=("user", "item", "tags")):
        b = make_batch(i)
        feats = {f.name: f for f in b.id_type_features}
        y = {"click": np.zeros((16, 1), np.float32), "buy": np.ones((16, 1), np.float32)}
        return PersiaBatch([feats[n] for n in slots], b.non_id_type_features,
                           [Label(y[n], n) for n in order], meta=b.meta)

    job.feed([labelled(0, ["click", "buy"])], background=False)
    model = TwoHeads()
    ck = str(tmp_path / "ck")
    with _ctx(job, model, torch.optim.SGD(model.parameters(), lr=0.1)) as ctx:
        for tb in DataLoader(StreamingDataset(), max_batches=1, timeout_ms=3000):
            out, labels = ctx.forward(tb)
            ctx.backward(torch.nn.functional.binary_cross_entropy(
                out, torch.cat(labels, dim=1)))
        ctx.dump_checkpoint(ck)
    test_set = [labelled(1, ["buy", "click"], ("tags", "user", "item"))]
    with eval_ctx(model=TwoHeads(), embedding_workers=job.worker_addresses) as ctx:
        ctx.load_checkpoint(ck)
        for tb in DataLoader(IterableDataset(iterable=test_set)):
            assert [s.name for s in tb.id_type_feature_embeddings] == ["tags", "user", "item"]
            _, labels = ctx.forward(tb)
            assert [s.name for s in tb.id_type_feature_embeddings] == ["user", "item", "tags"]
            assert [float(y.mean()) for y in labels] == [0.0, 1.0]   # click, then buy
        # A test set labelled with fewer labels (or others) is evaluated as it comes:
        # labels never reach the model, only the script's metrics.
        for tb in DataLoader(IterableDataset(iterable=[labelled(3, ["buy"])])):
            _, labels = ctx.forward(tb)
            assert tb.label_names == ["buy"] and float(labels[0].mean()) == 1.0
        with pytest.raises(BadInput) as err:
            for tb in DataLoader(IterableDataset(
                    iterable=[labelled(2, ["click", "buy"], ("user", "item"))])):
                ctx.forward(tb)
        assert err.value.field == "id_type_features.tags"


@pytest.mark.parametrize("other", ["model", "dense_optimizer"])
def test_a_checkpoint_of_another_dense_model_restores_nothing(job_factory, tmp_path, other):
    """A checkpoint whose dense model (or optimizer) is not this one's is refused naming
    it before anything changed. The servers' rows and the stream were restored first and
    the dense model failed after: a script that went on after the error (starting fresh,
    say) trained the checkpoint's embeddings with a dense model they had not met."""
    job = job_factory(SCHEMA)
    job.feed([make_batch(i) for i in range(3)], background=False)
    model = SumModel(IN_DIM)
    ck = str(tmp_path / "ck")
    with _ctx(job, model, torch.optim.Adam(model.parameters(), lr=0.01)) as ctx:
        for tb in DataLoader(StreamingDataset(), embedding_staleness=1, max_batches=3,
                             timeout_ms=3000):
            _step(ctx, tb)
            if ctx.steps == 1:
                ctx.dump_checkpoint(ck)
    probe = make_batch(0, requires_grad=False)
    rows = _eval_embeddings(job, probe)
    if other == "model":
        model = SumModel(IN_DIM, hidden=4)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        opt = torch.optim.Adam([model.mlp[0].weight], lr=0.01)
    with _ctx(job, model, opt) as ctx:
        with pytest.raises(Misuse, match="nothing was restored") as err:
            ctx.load_checkpoint(ck)
        assert err.value.field == other and ctx.steps == 0
    for a, b in zip(rows, _eval_embeddings(job, probe), strict=True):
        np.testing.assert_array_equal(a, b)
