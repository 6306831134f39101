"""The embedding servers' stream watermarks over real sockets (stream_persia.core.watermarks):
an update carrying its batch's (topic, partition, offset) advances them, another stream's
replay is refused with nothing applied, a retried push stays a duplicate, and they follow
the rows through dump, load (into any number of servers), clear and a checkpoint commit.
The embedding workers that use them are tests/runtime/test_worker_restart_replay.py."""

from __future__ import annotations

import numpy as np
import pytest

from stream_persia.checkpoint import CheckpointWriter, load_embeddings, stream_cut
from stream_persia.config import KafkaConfig
from stream_persia.errors import BadInput, PushFailed, StreamReplay
from stream_persia.kafka import BatchProducer, DeadLetterWriter, SampleConsumer
from stream_persia.kernels.sharding import shard_of
from stream_persia.rpc import RpcClient
from stream_persia.testing.samples import SCHEMA, make_batch
from stream_persia.testing.servers import running_servers
from stream_persia.worker.ingest import KafkaIngest
from stream_persia.worker.service import EmbeddingWorker

DIM = 4


def ids_on(replica: int, of: int, n: int = 8) -> np.ndarray:
    ids = np.arange(1, 400, dtype=np.uint64)
    return ids[shard_of(ids, of) == replica][:n]


def update(ids: np.ndarray, offset: int | None, writer: str = "a.1", partition: int = 0,
           topic: str = "t", token: str | None = None) -> dict:
    params: dict = {"groups": [{"dim": DIM, "ids": ids,
                                "grads": np.ones((ids.size, DIM), np.float32)}]}
    if offset is not None:
        params["source"] = {"topic": topic, "partition": partition, "offset": offset,
                            "writer": writer}
    if token is not None:
        params["token"] = token
    return params


def rows(server) -> dict[int, bytes]:
    out = {}
    for chunk in server.store.dump():
        for i, x in enumerate(chunk["ids"].tolist()):
            out[x] = chunk["weights"][i].tobytes() + chunk["state"][i].tobytes()
    return out


async def test_an_update_advances_the_mark_and_another_streams_replay_is_refused():
    async with running_servers(1) as ([server], _):
        ids = ids_on(0, 1)
        async with RpcClient(server.address) as c:
            assert await c.call("watermarks") == {"topics": {}}
            for o in (0, 2, 1):
                await c.call("update", update(ids, o, token=f"a-{o}"))
            await c.call("update", update(ids, 0, partition=3))
            await c.call("update", update(ids, None))          # broker-less: no mark
            assert await c.call("watermarks") == {"topics": {"t": {
                "0": {"offset": 2, "writer": "a.1"}, "3": {"offset": 0, "writer": "a.1"}}}}
            before = rows(server)
            updates = server.store_stats()["updates"]
            for o in (0, 2):   # a worker restarted alone serves offsets 0.. again
                with pytest.raises(StreamReplay) as err:
                    await c.call("update", update(ids, o, writer="b.1"))
                assert err.value.field == "offset"
                assert f"t/0 offset {o} from stream b.1" in str(err.value)
                assert "up to offset 2 (applied by stream a.1)" in str(err.value)
                assert "nothing was applied" in str(err.value)
            assert rows(server) == before and server.store_stats()["updates"] == updates
            # A retried push (same token) is a duplicate, not a replay, and applies nothing.
            again = await c.call("update", update(ids, 1, token="a-1"))
            assert again["duplicate"] is True and rows(server) == before
            # Past the mark a new stream takes over; the old one is refused from then on.
            await c.call("update", update(ids, 3, writer="b.1"))
            with pytest.raises(StreamReplay, match="applied by stream b.1"):
                await c.call("update", update(ids, 3, writer="a.1"))
            metrics = (await c.call("metrics")).decode()
            assert "persia_embedding_server_stream_replays_refused_total 3.0" in metrics
            assert "persia_embedding_server_stream_partitions 2.0" in metrics
            for bad, field in (({"topic": "t", "partition": 0, "offset": -1, "writer": "w"},
                                "source.offset"), ("x", "source")):
                with pytest.raises(BadInput) as err:
                    await c.call("update", {**update(ids, None), "source": bad})
                assert err.value.field == field
            await c.call("clear")
            assert await c.call("watermarks") == {"topics": {}}
            await c.call("update", update(ids, 0, writer="c.1"))   # started over, on purpose


@pytest.mark.parametrize("into", [1, 3])
async def test_a_checkpoint_restores_its_cut_as_the_marks_of_any_number_of_servers(
        tmp_path, into):
    dst = str(tmp_path / "ck")
    async with running_servers(2) as (servers, router):
        for s, server in enumerate(servers):
            async with RpcClient(server.address) as c:
                for o in range(3):   # partition 0 up to 2 on server 0, up to 1 on server 1
                    if s == 0 or o < 2:
                        await c.call("update", update(ids_on(s, 2), o))
                await c.call("update", update(ids_on(s, 2), 6, partition=1))
        front = {"stream": "kafka", "offsets": {"0": 3, "1": 7}, "inflight": 0}
        cut = stream_cut([front], ["t"])
        # A cut below what a server applied is refused: its restore would replay it.
        with CheckpointWriter(str(tmp_path / "bad")) as w:
            await w.dump_embeddings(router.clients)
            with pytest.raises(StreamReplay) as err:
                w.commit(job="j", step=1, offsets={"t": {"0": 2, "1": 7}}, stream="kafka")
            assert "record t/0 at 2, but embedding server 0 holds the updates of that " \
                   "partition up to offset 2" in str(err.value)
        assert not (tmp_path / "bad").exists()
        with CheckpointWriter(dst) as w:
            await w.dump_embeddings(router.clients)
            w.commit(job="j", step=1, offsets=cut.offsets, stream=cut.stream)
        # Trained past the cut, then restored: the marks go back to it.
        await router.clients[0].call("update", update(ids_on(0, 2), 9))
    async with running_servers(into) as (servers, router):
        await router.clients[0].call("update", update(ids_on(0, into), 50, topic="other"))
        await load_embeddings(dst, router.clients)
        restored = {"t": {"0": {"offset": 2, "writer": None},
                          "1": {"offset": 6, "writer": None}}}
        for c in router.clients:
            assert await c.call("watermarks") == {"topics": restored}
        with pytest.raises(StreamReplay, match="a checkpoint restored since"):
            await router.clients[0].call("update", update(ids_on(0, into), 2, writer="z.1"))
        await router.clients[0].call("update", update(ids_on(0, into), 3, writer="z.1"))
        # A staged load that is aborted leaves the marks as they were.
        reply = await router.clients[0].call("load", {"dir": dst, "files": [], "stage": True,
                                                      "cut": {"t": {"0": 100}}})
        await router.clients[0].call("abort_load", {"token": reply["token"]})
        assert (await router.clients[0].call("watermarks"))["topics"]["t"]["0"] == {
            "offset": 3, "writer": "z.1"}
        # A checkpoint without a stream position (direct, embedding-only) leaves none.
        direct = str(tmp_path / "direct")
        with CheckpointWriter(direct) as w:
            await w.dump_embeddings(router.clients)
            w.commit(job="j", step=1, offsets={}, stream="direct")
        await load_embeddings(direct, router.clients)
        for c in router.clients:
            assert await c.call("watermarks") == {"topics": {}}
        with pytest.raises(BadInput) as err:
            await router.clients[0].call("load", {"dir": dst, "files": [],
                                                  "cut": {"t": {"0": -3}}})
        assert err.value.field == "cut.t.0"


@pytest.mark.kafka
async def test_two_workers_reading_one_partition_cannot_both_apply_it(kafka_broker,
                                                                      kafka_topic):
    """Two workers given the same replica index (a misconfiguration, or a pod that is
    still alive when its replacement starts) both start at offset 0 on empty servers: the
    servers take the first one's updates and refuse the second's, which fails loudly."""
    topic = kafka_topic(partitions=1)
    bootstrap = kafka_broker.bootstrap_servers
    async with BatchProducer(topic, bootstrap_servers=bootstrap) as producer:
        for i in range(3):
            await producer.send(make_batch(i), key=i)
    cfg = KafkaConfig(bootstrap_servers=bootstrap, samples_topic=topic,
                      dlq_topic=f"{topic}.dlq", job_name="two")
    async with running_servers(2) as (servers, _):
        workers = [EmbeddingWorker(SCHEMA, [s.address for s in servers]) for _ in range(2)]
        clients = []
        try:
            for w in workers:
                await w.start()
                await w.start_kafka_ingest(lambda start, w=w: KafkaIngest(
                    w, SampleConsumer.from_config(cfg, replica_index=0, replica_size=1),
                    DeadLetterWriter.from_config(cfg), start_offsets=start))
                clients.append(RpcClient(w.address, timeout_ms=20_000))
            served = [await c.call("next_batch", {"timeout_ms": 10_000}) for c in clients]
            assert [bytes(b["meta"]) for b in served] == [b"batch-0", b"batch-0"]
            grads = [{e["name"]: np.full_like(e["emb"], 0.01) for e in b["embeddings"]}
                     for b in served]
            await clients[0].call("push_gradients", {"batch_id": served[0]["batch_id"],
                                                     "grads": grads[0]})
            with pytest.raises(StreamReplay) as err:
                await clients[1].call("push_gradients", {"batch_id": served[1]["batch_id"],
                                                         "grads": grads[1]})
            assert f"{topic}/0 offset 0" in str(err.value)
            assert not isinstance(err.value, PushFailed)   # pushing it again cannot help
            health = await clients[1].call("health")
            assert health["ok"] is False and f"{topic}/0 offset 0" in health["error"]
            with pytest.raises(StreamReplay):                 # the NN side hears it
                await clients[1].call("next_batch", {"timeout_ms": 100})
            assert (await clients[0].call("health"))["ok"] is True
        finally:
            for c in clients:
                await c.close()
            for w in workers:
                await w.stop()


async def test_hostile_watermark_requests_are_refused_naming_the_field():
    """A ``watermarks`` request whose topic no Kafka topic could have, or whose params are
    not a map, is refused naming it (it was answered with no marks: nothing to see)."""
    async with running_servers(1) as (servers, router):
        c = router.clients[0]
        await c.call("update", update(ids_on(0, 1), 3, topic="t"))
        for params, field in (({"topic": "x" * 300}, "topic"), ({"topic": 5}, "topic"),
                              ([1], "params")):
            with pytest.raises(BadInput) as err:
                await c.call("watermarks", params)
            assert err.value.field == field
        # Reordered keys in an update's source are the same source.
        await c.call("update", {**update(ids_on(0, 1), None),
                                "source": {"writer": "a.1", "offset": 4, "partition": 0,
                                           "topic": "t"}})
        assert (await c.call("watermarks", {"topic": "t"}))["topics"]["t"]["0"] == \
            {"offset": 4, "writer": "a.1"}
