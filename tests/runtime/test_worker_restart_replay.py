"""An embedding worker restarted alone never trains part of the stream twice.

A job trains Kafka batches, checkpoints, trains more; then its embedding worker is killed
with SIGKILL (a crash, an OOM kill, a Kubernetes pod restart) and a fresh one starts on the
same topic. With no checkpoint to start from it would start the partition over, while the
embedding server still holds every update since the cut: the batches in between would be
trained a second time. The server's stream watermark (stream_persia.core.watermarks) tells the
fresh worker: it refuses the partition (health names it, the NN side's ``next_batch``
raises; it stays up for the restore) and no row changes. A restore of the checkpoint is the
way back, by ``reset_stream`` or by a worker that starts after the restore (it resumes at
the restored cut), and then every batch is trained exactly once: the rows equal an
uninterrupted run's.

The embedding server and the workers are real processes (``launch``), the broker the
suite's Kafka-protocol mock; the NN side is played over RPC.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from stream_persia.checkpoint import CheckpointWriter, load_embeddings, read_cut, stream_cut
from stream_persia.errors import StreamReplay
from stream_persia.kafka import BatchProducer
from stream_persia.launch.processes import RoleProcess
from stream_persia.rpc import RpcClient
from stream_persia.server.shard_files import read_shard_file
from stream_persia.testing.kafka_mock import MockKafkaCluster
from stream_persia.testing.pytest_plugin import TANSU_LIST_OFFSETS, deviates_on
from stream_persia.testing.samples import EMBEDDING_YAML, make_batch

pytestmark = pytest.mark.kafka

N, CUT, PAST = 10, 4, 3     # batches; the checkpoint after CUT; trained past it before the kill


def grads_for(served: dict) -> dict[str, np.ndarray]:
    """Gradients that depend on the rows served and on the batch (a batch trained twice,
    or on a wrong table, changes the result)."""
    i = int(bytes(served["meta"]).split(b"-")[1])
    return {e["name"]: (0.1 * e["emb"] + 0.01 * (i + 1)).astype(np.float32)
            for e in served["embeddings"]}


async def train(client: RpcClient, n: int) -> list[str]:
    metas = []
    for _ in range(n):
        served = await client.call("next_batch", {"timeout_ms": 10_000})
        assert served is not None, f"no batch after {metas}"
        await client.call("push_gradients", {"batch_id": served["batch_id"],
                                             "grads": grads_for(served)})
        metas.append(bytes(served["meta"]).decode())
    return metas


async def start_server(tmp: Path, name: str) -> tuple[RoleProcess, RpcClient]:
    server = RoleProcess("embedding-server", ["--checkpoint-root", str(tmp)],
                         log_path=tmp / f"{name}.log", name=name).start()
    address = await asyncio.to_thread(server.wait_ready, 60)
    return server, RpcClient(address, timeout_ms=20_000)


async def launch_worker(tmp: Path, name: str, server: str, bootstrap: str,
                        topic: str) -> RoleProcess:
    (tmp / "embedding_config.yml").write_text(EMBEDDING_YAML)
    worker = RoleProcess("embedding-worker", [
        "--embedding-config", str(tmp / "embedding_config.yml"), "--embedding-servers", server,
        "--kafka", bootstrap, "--topic", topic, "--num-partitions", "1"],
        log_path=tmp / f"{name}.log", name=name).start()
    await asyncio.to_thread(worker.wait_ready, 60)
    return worker


async def snapshot(client: RpcClient, where: Path) -> dict[int, bytes]:
    """Every row of the server: id -> weights and optimizer state."""
    info = await client.call("dump", {"dir": str(where)})
    out = {}
    for chunk in read_shard_file(str(where), info["file"]):
        for i, x in enumerate(chunk["ids"].tolist()):
            out[x] = chunk["weights"][i].tobytes() + chunk["state"][i].tobytes()
    return out


def assert_rows_close(got: dict[int, bytes], want: dict[int, bytes]) -> None:
    assert got.keys() == want.keys()
    for x, row in want.items():
        np.testing.assert_allclose(np.frombuffer(got[x], np.float32),
                                   np.frombuffer(row, np.float32), atol=1e-6, rtol=0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("way_back", ["reset_stream", "worker_started_after_the_restore"])
@deviates_on("tansu", TANSU_LIST_OFFSETS)
async def test_a_worker_restarted_alone_refuses_the_replay_and_a_restore_trains_once(
        tmp_path, kafka_broker, kafka_topic, way_back):
    topic = kafka_topic(partitions=1)
    bootstrap = kafka_broker.bootstrap_servers
    kafka_broker.create_topic(f"{topic}.dlq", 1)
    async with BatchProducer(topic, bootstrap_servers=bootstrap) as producer:
        for i in range(N):
            await producer.send(make_batch(i), key=i)
    everything = [f"batch-{i}" for i in range(N)]

    # The uninterrupted run.
    server, sc = await start_server(tmp_path, "full-server")
    worker = await launch_worker(tmp_path, "full-worker", sc.address, bootstrap, topic)
    try:
        async with RpcClient(worker.address, timeout_ms=20_000) as client:
            assert await train(client, N) == everything
        want = await snapshot(sc, tmp_path / "full")
    finally:
        worker.stop()
        await sc.close()
        server.stop()

    # Train, checkpoint after CUT, train PAST more, serve one more; then kill -9 the worker.
    server, sc = await start_server(tmp_path, "server")
    workers = [await launch_worker(tmp_path, "worker-1", sc.address, bootstrap, topic)]
    ck = str(tmp_path / "ck")
    try:
        async with RpcClient(workers[0].address, timeout_ms=20_000) as client:
            trained = await train(client, CUT)
            cut = stream_cut([await client.call("frontier")], [topic])
            with CheckpointWriter(ck) as w:
                await w.dump_embeddings([sc])
                w.commit(job="replay", step=CUT, offsets=cut.offsets, stream=cut.stream)
            trained += await train(client, PAST)
            assert await client.call("next_batch", {"timeout_ms": 10_000}) is not None
        assert trained == everything[:CUT + PAST]
        workers[0].kill()
        held = await snapshot(sc, tmp_path / "held")
        applied = CUT + PAST - 1     # the last offset whose update the server applied

        # A fresh worker on the same topic (it would start at offset 0) refuses the
        # partition: health names it, the NN side hears it, and no row changes.
        workers.append(await launch_worker(tmp_path, "worker-2", sc.address, bootstrap, topic))
        async with RpcClient(workers[1].address, timeout_ms=20_000) as client:
            health = await client.call("health")
            assert health["ok"] is False
            assert f"refuses to serve {topic}/0 from offset 0: embedding server 0 " \
                   f"({sc.address}) holds the updates of that partition up to offset " \
                   f"{applied}" in health["error"]
            with pytest.raises(StreamReplay, match=f"{topic}/0 from offset 0"):
                await client.call("next_batch", {"timeout_ms": 2000})
            status = await client.call("status")
            assert [(r["partition"], r["start"], r["watermark"])
                    for r in status["kafka"]["refused"]] == [(0, 0, applied)]
            assert "persia_embedding_worker_partitions_replay_refused 1.0" in \
                (await client.call("metrics")).decode()
            assert await snapshot(sc, tmp_path / "after") == held    # no row changed
            # No checkpoint records the partition at 0 while the server holds 0..applied.
            with CheckpointWriter(str(tmp_path / "bad")) as w:
                await w.dump_embeddings([sc])
                with pytest.raises(StreamReplay):
                    w.commit(job="replay", step=0, offsets={topic: {"0": 0}}, stream="kafka")
            assert workers[1].alive()   # waiting for the restore, which needs it to answer
            assert f"refuses to serve {topic}/0" in workers[1].log_tail(1 << 20)

            # The way back: restore the checkpoint.
            await load_embeddings(ck, [sc])
            if way_back == "reset_stream":
                await client.call("reset_stream", {"offsets": cut.partitions})
                assert (await client.call("health"))["ok"] is True
                rest = await train(client, N - CUT)
        if way_back != "reset_stream":
            # A worker (re)started after the restore resumes at its cut by itself.
            workers[1].kill()
            workers.append(await launch_worker(tmp_path, "worker-3", sc.address, bootstrap,
                                               topic))
            async with RpcClient(workers[2].address, timeout_ms=20_000) as client:
                assert (await client.call("health"))["ok"] is True
                rest = await train(client, N - CUT)
        assert trained[:CUT] + rest == everything, "every batch trained exactly once"
        assert_rows_close(await snapshot(sc, tmp_path / "rest"), want)
    finally:
        for w in workers:
            w.kill()
        await sc.close()
        server.stop()


@pytest.mark.timeout(300)
async def test_a_worker_started_after_a_restore_refuses_a_topic_recreated_since(tmp_path):
    """A restore checks the checkpoint's fingerprints against the topic; a worker that
    starts after it resumes at the restored cut by itself, and checks them there too
    (the servers keep them with the restored watermarks). A topic deleted and created
    again since the restore (modelled as the same topic name on a new cluster, grown past
    the cut: the mock cannot delete a topic) is refused naming it, instead of being read
    from the old topic's offsets (its records 0..CUT-1 never trained, silently); the
    topic the checkpoint was cut from resumes there and trains the rest once."""
    topic = "samples"
    clusters = [MockKafkaCluster().start() for _ in range(2)]
    for c, first in zip(clusters, (0, 100), strict=True):
        c.create_topic(topic, 1)
        c.create_topic(f"{topic}.dlq", 1)
        async with BatchProducer(topic, bootstrap_servers=c.bootstrap_servers) as producer:
            for i in range(N):
                await producer.send(make_batch(first + i), key=i)
    old, new = (c.bootstrap_servers for c in clusters)
    server, sc = await start_server(tmp_path, "server")
    workers = [await launch_worker(tmp_path, "worker-1", sc.address, old, topic)]
    ck = str(tmp_path / "ck")
    try:
        async with RpcClient(workers[0].address, timeout_ms=20_000) as client:
            trained = await train(client, CUT)

            async def call_workers(method: str, params: object = None) -> list:
                return [await client.call(method, params)]

            cut = await read_cut(call_workers, [topic])
            assert cut.fingerprints[topic]["0"]["offset"] == CUT - 1
            with CheckpointWriter(ck) as w:
                await w.dump_embeddings([sc])
                w.commit(job="replay", step=CUT, offsets=cut.offsets, stream=cut.stream,
                         fingerprints=cut.fingerprints)
            trained += await train(client, PAST)
        workers[0].kill()
        await load_embeddings(ck, [sc])
        marks = (await sc.call("watermarks"))["topics"][topic]["0"]
        assert marks == {"offset": CUT - 1, "writer": None,
                         "fingerprint": cut.fingerprints[topic]["0"]}
        # The topic was recreated meanwhile: the worker that starts now does not resume.
        with pytest.raises(RuntimeError) as err:
            await launch_worker(tmp_path, "worker-2", sc.address, new, topic)
        assert f"data lost in Kafka: {topic}/0: the record at offset {CUT - 1} is not the " \
               "one the checkpoint recorded" in str(err.value)
        assert "the topic was deleted and created again" in str(err.value)
        # The checkpoint's own topic resumes at the cut and trains the rest once.
        workers.append(await launch_worker(tmp_path, "worker-3", sc.address, old, topic))
        async with RpcClient(workers[1].address, timeout_ms=20_000) as client:
            assert (await client.call("health"))["ok"] is True
            rest = await train(client, N - CUT)
        assert trained[:CUT] + rest == [f"batch-{i}" for i in range(N)]
    finally:
        for w in workers:
            w.kill()
        await sc.close()
        server.stop()
        for c in clusters:
            c.stop()
