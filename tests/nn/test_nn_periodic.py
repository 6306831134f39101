"""Periodic checkpoints from ``checkpointing_config`` (issue 21, item 1): taken by the NN
ranks at the configured steps without the API, as the same cut as ``dump_checkpoint``;
retention keeps the newest periodic ones only; one restores (Kafka offsets included) into
a run that continues; a failed or slow one never stops training.

Real embedding servers and workers on loopback (in this process, and an embedding worker
process with Kafka ingest on the session's test broker)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from nn_helpers import SumModel

from stream_persia.checkpoint import CheckpointWriter, list_checkpoints, read_manifest, verify
from stream_persia.config import CheckpointingConfig, GlobalConfig, KafkaConfig
from stream_persia.ctx import DataCtx, TrainCtx
from stream_persia.data import DataLoader, StreamingDataset
from stream_persia.embedding.optim import Adagrad
from stream_persia.errors import Misuse
from stream_persia.launch.processes import RoleProcess
from stream_persia.nn.periodic import PeriodicCheckpoints
from stream_persia.testing.samples import EMBEDDING_YAML, SCHEMA, make_batch
from stream_persia.worker.nn_relay import NnRelayCollector

IN_DIM = 3 + 8 + 8 + 4


def _ctx(workers, model, checkpointing, **kw):
    return TrainCtx(Adagrad(lr=0.1), torch.optim.SGD(model.parameters(), lr=0.1),
                    model=model, embedding_workers=workers, mixed_precision=False,
                    ready_timeout_s=10, checkpointing=checkpointing, **kw)


def _train(ctx, n, metas=None):
    for tb in DataLoader(StreamingDataset(), embedding_staleness=2, reproducible=True,
                         max_batches=n, timeout_ms=20_000):
        if metas is not None:
            metas.append(tb.meta)
        output, labels = ctx.forward(tb)
        ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))


def _periodic(root: Path) -> list:
    return sorted((m for m in list_checkpoints(str(root))
                   if m.extra.get("by") == "periodic"), key=lambda m: m.step)


def _root(tmp_path: Path) -> Path:
    # Under the test servers' checkpoint root (the system's temp directory).
    root = Path(tempfile.mkdtemp(prefix="periodic-", dir=tmp_path))
    assert str(root.resolve()).startswith(str(Path(tempfile.gettempdir()).resolve()))
    return root


def test_every_steps_with_retention_and_the_relayed_figures(job_factory, tmp_path):
    job = job_factory(SCHEMA)
    job.feed([make_batch(i) for i in range(11)], background=False)
    root = _root(tmp_path)
    # another checkpoint in the same directory: periodic retention neither counts nor
    # deletes it
    other = root / "by-hand"
    # nor another job's periodic one (a directory two jobs share)
    theirs = root / "periodic-step-000000000001-20240101T000000.000Z-0000"
    with CheckpointWriter(str(theirs)) as w:
        w.write_bytes("dense.pt", b"x")
        w.commit(job="another-job", step=1, offsets={}, stream="direct",
                 extra={"id": theirs.name, "by": "periodic"})
    config = CheckpointingConfig(every_steps=3, keep_checkpoints=2, periodic_dir=str(root))
    model = SumModel(IN_DIM)
    with _ctx(job.worker_addresses, model, config) as ctx:
        _train(ctx, 2)
        ctx.dump_checkpoint(str(other))
        _train(ctx, 9)
        periodic = ctx.periodic_checkpoints
        assert periodic is not None and len(periodic.taken) == 3
        figures = periodic.figures()
    # rank 0's heartbeat (the last one at the context's exit) relayed them to worker 0
    got = job.workers[0].mailbox.relay()
    # (no compaction ran: its counts are left out, as a previous version's worker wants)
    assert "compacted" not in figures and "compaction_failed" not in figures
    assert got is not None and got[0]["periodic"] == {**figures, "compacted": 0,
                                                      "compaction_failed": 0}
    relay = got[0]
    assert figures["taken"] == 3 and figures["failed"] == figures["skipped"] == 0
    assert figures["last_step"] == 9 and figures["last_bytes"] > 0
    assert figures["last_duration_s"] > 0
    # steps 3, 6 and 9 were taken; the two newest periodic ones are kept, and the other one
    kept = [m for m in _periodic(root) if m.job != "another-job"]
    assert [m.step for m in kept] == [6, 9]
    assert read_manifest(str(theirs)).job == "another-job"
    assert [Path(p).name for p in periodic.taken][1:] == [Path(m.path).name for m in kept]
    assert all(Path(m.path).name.startswith(f"periodic-step-{m.step:012d}-") for m in kept)
    assert read_manifest(str(other)).step == 2
    for m in kept:
        verify(m.path)
        assert {"dense.pt", "opt.pt"} <= set(m.files) and m.rows > 0
        assert m.extra["id"] == Path(m.path).name and m.stream == "direct"
    families = {f.name: f for f in NnRelayCollector(lambda: (relay, 0.5)).collect()}
    totals = {s.labels["outcome"]: s.value
              for s in families["persia_nn_periodic_checkpoints"].samples
              if s.name.endswith("_total")}
    assert totals == {"taken": 3.0, "skipped": 0.0, "failed": 0.0, "compacted": 0.0,
                      "compaction_failed": 0.0}
    assert families["persia_nn_periodic_checkpoint_last_step"].samples[0].value == 9


def test_off_by_default(job_factory, tmp_path, monkeypatch):
    monkeypatch.delenv("PERSIA_GLOBAL_CONFIG", raising=False)
    job = job_factory(SCHEMA)
    job.feed([make_batch(i) for i in range(4)], background=False)
    monkeypatch.setenv("PERSIA_CHECKPOINT_DIR", str(tmp_path))
    with _ctx(job.worker_addresses, SumModel(IN_DIM), None) as ctx:
        _train(ctx, 4)
        assert ctx.periodic_checkpoints is None
    assert list_checkpoints(str(tmp_path)) == []


def test_no_directory_is_a_clear_error(job_factory, monkeypatch):
    monkeypatch.delenv("PERSIA_CHECKPOINT_DIR", raising=False)
    monkeypatch.delenv("PERSIA_CHECKPOINT_ROOT", raising=False)
    job = job_factory(SCHEMA)
    with pytest.raises(Misuse, match="no directory") as err:
        with _ctx(job.worker_addresses, SumModel(IN_DIM), CheckpointingConfig(every_s=60)):
            pass
    assert err.value.field == "common_config.checkpointing_config.periodic_dir"


def test_a_failed_checkpoint_is_counted_and_training_goes_on(job_factory, tmp_path):
    """The servers refuse a destination outside their checkpoint root: each periodic
    checkpoint fails, is counted, and the job trains every batch."""
    job = job_factory(SCHEMA)
    job.feed([make_batch(i) for i in range(6)], background=False)
    outside = Path(tempfile.mkdtemp(prefix="periodic-outside-", dir="/var/tmp"))
    try:
        config = CheckpointingConfig(every_steps=2, periodic_dir=str(outside))
        metas: list[bytes] = []
        with _ctx(job.worker_addresses, SumModel(IN_DIM), config) as ctx:
            _train(ctx, 6, metas)
            assert ctx.periodic_checkpoints is not None
            figures = ctx.periodic_checkpoints.figures()
        assert metas == [f"batch-{i}".encode() for i in range(6)]
        assert figures["failed"] == 3 and figures["taken"] == 0
        assert list_checkpoints(str(outside)) == []
    finally:
        shutil.rmtree(outside, ignore_errors=True)


def test_due_times_passed_while_one_was_written_are_skipped(job_factory, tmp_path):
    """every_s: a checkpoint that takes longer than the interval does not make the next
    ones pile up: the due times it covered are skipped and counted. (The clock is the
    class's monotonic clock argument, advanced by the checkpoint's own progress hook.)"""
    job = job_factory(SCHEMA)
    job.feed([make_batch(i) for i in range(5)], background=False)
    root = _root(tmp_path)
    now = [0.0]

    def slow(phase, **_):
        if phase == "committing":
            now[0] += 25.0      # this checkpoint "took" 2.5 intervals

    config = CheckpointingConfig(every_s=10, keep_checkpoints=0, periodic_dir=str(root))
    with _ctx(job.worker_addresses, SumModel(IN_DIM), None) as ctx:
        periodic = PeriodicCheckpoints(ctx, config, str(root), clock=lambda: now[0],
                                       dump_kwargs={"progress": slow})
        ctx.periodic_checkpoints = periodic
        _train(ctx, 1)
        assert periodic.taken == []            # not due yet
        now[0] = 10.0
        _train(ctx, 1)                         # due: taken at step 2, "ends" at 35
        assert len(periodic.taken) == 1 and periodic.skipped == 2
        now[0] = 39.0
        _train(ctx, 1)                         # next due at 40, not before
        assert len(periodic.taken) == 1
        now[0] = 40.0
        _train(ctx, 1)
        assert len(periodic.taken) == 2 and periodic.skipped == 4
    assert [m.step for m in _periodic(root)] == [2, 4]


def test_a_periodic_checkpoint_restores_into_a_run_that_continues(job_factory, kafka_broker,
                                                                  kafka_topic, tmp_path):
    """Kafka ingest: the periodic checkpoint holds the cut's offsets; restored, the stream
    replays from the first batch after it, and training (and the periodic schedule, by
    step) go on."""
    topic = kafka_topic(1)
    kafka_broker.create_topic(f"{topic}.dlq", 1)
    job = job_factory(SCHEMA, workers=0)
    (tmp_path / "embedding_config.yml").write_text(EMBEDDING_YAML)
    worker = RoleProcess("embedding-worker", [
        "--embedding-config", str(tmp_path / "embedding_config.yml"),
        "--embedding-servers", job.servers[0].address, "--kafka",
        kafka_broker.bootstrap_servers, "--topic", topic, "--num-partitions", "1"],
        log_path=tmp_path / "worker.log")
    root = _root(tmp_path)
    config = CheckpointingConfig(every_steps=4, keep_checkpoints=2, periodic_dir=str(root))
    with worker:
        with DataCtx(kafka_bootstrap_servers=kafka_broker.bootstrap_servers,
                     global_config=GlobalConfig(kafka=KafkaConfig(samples_topic=topic))
                     ) as dc:
            for i in range(16):
                dc.send_data(make_batch(i))
        workers = [worker.address]
        metas: list[bytes] = []
        with _ctx(workers, SumModel(IN_DIM), config) as ctx:
            _train(ctx, 10, metas)
        assert [m.step for m in _periodic(root)] == [4, 8]
        first = _periodic(root)[0]
        assert first.stream == "kafka" and first.offsets == {topic: {"0": 4}}

        replayed: list[bytes] = []
        with _ctx(workers, SumModel(IN_DIM), config) as ctx:
            ctx.load_checkpoint(first.path)      # the checks of any restore run here
            assert ctx.steps == 4
            _train(ctx, 6, replayed)
            assert ctx.steps == 10
    assert metas == [f"batch-{i}".encode() for i in range(10)]
    assert replayed == metas[4:10], "training resumes at the first batch after the cut"
    # the continued run took its own checkpoint at step 8 (a new name), and retention kept
    # the newest two periodic ones: step 8 of each run
    kept = _periodic(root)
    assert [m.step for m in kept] == [8, 8] and kept[0].path != kept[1].path
    assert all(m.offsets == {topic: {"0": 8}} for m in kept)


def test_compact_after_compacts_a_chain_that_the_next_patch_patches(job_factory, tmp_path):
    """With incremental checkpoints and ``compact_after: 2``, the second patch's chain is
    compacted in the background into a new base; the next periodic checkpoint patches
    that base (not a full dump), retention then deletes the old chain, and no kept
    checkpoint ever misses a member of its chain."""
    from stream_persia.checkpoint import chain_of
    from stream_persia.server.compaction import COMPACTED_FROM

    job = job_factory(SCHEMA)
    job.feed([make_batch(i) for i in range(10)], background=False)
    root = _root(tmp_path)
    config = CheckpointingConfig(every_steps=2, keep_checkpoints=2, compact_after=2,
                                 periodic_dir=str(root))
    with _ctx(job.worker_addresses, SumModel(IN_DIM), config) as ctx:
        periodic = ctx.periodic_checkpoints
        assert periodic is not None
        periodic.incremental = True   # as enable_incremental_update: true makes it
        _train(ctx, 6)               # steps 2 (base), 4, 6: 6 is 2 patches from its base
        assert periodic.wait_compaction(60) and len(periodic.compacted) == 1
        compacted = read_manifest(periodic.compacted[0])
        names = [p.rsplit("/", 1)[-1] for p in periodic.taken]
        assert compacted.extra[COMPACTED_FROM] == names[:3]
        assert (compacted.step, compacted.chain["depth"], compacted.extra["by"]) == \
            (6, 0, "periodic")
        _train(ctx, 2)               # step 8: a patch of the compacted base
        after = read_manifest(periodic.taken[3])
        assert (after.chain["parent"], after.chain["depth"]) == \
            (compacted.chain["id"], 1)
        assert after.chain["full_because"] is None and after.rows < after.table_rows
        # keep 2: the compacted base and step 8 are the newest; steps 2, 4, 6 are gone
        kept = [m.path.rsplit("/", 1)[-1] for m in _periodic(root)]
        assert not set(names[:3]) & set(kept), kept
        _train(ctx, 2)               # step 10: 2 patches from the compacted base
    assert periodic.compactions_failed == 0 and len(periodic.compacted) == 2
    figures = periodic.figures()     # relayed, exported as outcome="compacted"
    assert (figures["compacted"], figures["compaction_failed"]) == (2, 0)
    for m in _periodic(root):        # every kept one restores: its whole chain is there
        verify(m.path)
        assert chain_of(m.path)[0].chain["depth"] == 0


def test_a_patch_whose_parent_is_deleted_while_it_is_written_fails_then_a_full_base(
        job_factory, tmp_path, monkeypatch):
    """The periodic checkpoint a patch patches is deleted while the patch is written (the
    API's retention, which counts every checkpoint of the job, or a DELETE): the patch is
    not published (it was, as a checkpoint no restore can load), the failure is counted,
    and the next periodic checkpoint is a full base that restores."""
    from stream_persia.checkpoint import chain_of, delete_checkpoint
    from stream_persia.nn import checkpointing

    job = job_factory(SCHEMA)
    job.feed([make_batch(i) for i in range(6)], background=False)
    root = _root(tmp_path)
    config = CheckpointingConfig(every_steps=2, keep_checkpoints=0, periodic_dir=str(root))
    real = checkpointing.check_servers_kept
    deleted = []

    def delete_the_parent_meanwhile(*args):   # between the shards' dump and the commit
        if len(periodic.taken) == 1 and not deleted:
            delete_checkpoint(periodic.taken[0])
            deleted.append(periodic.taken[0])
        return real(*args)

    monkeypatch.setattr(checkpointing, "check_servers_kept", delete_the_parent_meanwhile)
    with _ctx(job.worker_addresses, SumModel(IN_DIM), config) as ctx:
        periodic = ctx.periodic_checkpoints
        assert periodic is not None
        periodic.incremental = True   # as enable_incremental_update: true makes it
        _train(ctx, 2)                # step 2: a base
        _train(ctx, 2)                # step 4: a patch of it, deleted meanwhile
        assert deleted and periodic.failed == 1 and len(periodic.taken) == 1
        _train(ctx, 2)                # step 6: a full base
        assert periodic.failed == 1 and len(periodic.taken) == 2
    kept = _periodic(root)
    assert [m.step for m in kept] == [6] and kept[0].chain["parent"] is None
    assert len(chain_of(kept[0].path)) == 1
