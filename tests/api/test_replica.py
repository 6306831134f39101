"""A serving replica (``PERSIA_API_EMBEDDINGS=replica``) follows training into serving.

Real embedding servers and a worker on loopback, the API served by uvicorn. The replica
restores a checkpoint, then follows the servers' update logs and server 0's dense model:
after training goes on and the logs are drained, its predictions equal (within 1e-6) those
of an API that looks the same rows up on the training servers with the same dense model;
a newer dense model published to server 0 is served from then on, and every answer names
the dense step (``model_version``) and ``trained_through``. A server restarted mid-stream
is followed from its new log (the replica converges again), and a replica that restarts
catches up from the checkpoint.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
from api_helpers import (
    AUTH,
    Click,
    Gated,
    LiveApi,
    TwoHeads,
    publish_dense,
    settings_for,
    start_job,
    stop_job,
    write_checkpoint,
)
from stream_persia.api import replica as replica_mod

from stream_persia.checkpoint import load_embeddings
from stream_persia.embedding.data import PersiaBatch
from stream_persia.errors import BadInput
from stream_persia.testing.samples import make_batch


async def train_stamped(job, n_batches: int, event_time: float, seed: int = 0) -> None:
    """``job.train`` with every batch stamped ``event_time`` (the servers' marks carry it)."""
    worker = job.client(job.workers[0].address)
    rng = np.random.default_rng(seed)
    for i in range(n_batches):
        batch = make_batch(i, seed=seed).stamped(event_time)
        await worker.call("ingest", {"batch": batch.to_wire()})
        served = await worker.call("next_batch", {"timeout_ms": 2000})
        grads = {e["name"]: rng.normal(size=e["emb"].shape).astype(np.float32)
                 for e in served["embeddings"]}
        await worker.call("push_gradients", {"batch_id": served["batch_id"], "grads": grads})


def eval_bodies() -> list[dict]:
    out = []
    for i, size in enumerate((1, 7, 40)):
        b = make_batch(300 + i, batch_size=size, vocab=70)
        b = PersiaBatch(b.id_type_features, b.non_id_type_features, b.labels,
                        requires_grad=False)
        out.append({"id_type_features": {f.name: [x.tolist() for x in f.data]
                                         for f in b.id_type_features},
                    "non_id_type_features": {f.name: f.data.tolist()
                                             for f in b.non_id_type_features}})
    return out


async def predictions(api: LiveApi) -> tuple[list[np.ndarray], list[dict]]:
    outs, metas = [], []
    for body in eval_bodies():
        r = await api.client.post("/v1/predict", json=body)
        assert r.status_code == 200, r.text
        j = r.json()
        outs.append(np.array([p["click"] for p in j["predictions"]]))
        metas.append({k: j[k] for k in ("model_version", "checkpoint", "trained_through")})
    return outs, metas


async def drained(api: LiveApi, job, timeout_s: float = 20.0) -> dict:
    """Until the replica has applied every server's rows as they are now."""
    want = [s.store.change_version for s in job.servers]
    async with asyncio.timeout(timeout_s):
        while True:
            info = (await api.client.get("/v1/model")).json()
            got = [sh["version"] for sh in info["replica"]["shards"]]
            if got == want:
                return info
            await asyncio.sleep(0.05)


def table_rows(store) -> dict[int, bytes]:
    return {k: w.tobytes() for c in store.dump()
            for k, w in zip(c["ids"].tolist(), c["weights"], strict=True)}


def server_rows(job) -> dict[int, bytes]:
    out: dict[int, bytes] = {}
    for s in job.servers:
        out.update(table_rows(s.store))
    return out


async def replica_of(job, tmp_path) -> tuple[str, object]:
    """A checkpoint of ``job`` and the settings of a replica that starts from it."""
    ckpt = await write_checkpoint(job, str(tmp_path / "ckpts" / "c1"), TwoHeads(seed=3))
    return ckpt, settings_for(job, model_checkpoint=ckpt, embeddings="replica",
                              checkpoint_dir=str(tmp_path / "ckpts"))


def assert_close(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-6, rtol=0)


@pytest.mark.parametrize("n_servers", [1, 2])
async def test_replica_follows_training_exactly(tmp_path, n_servers):
    job = await start_job(n_servers=n_servers)
    try:
        await job.train(4)
        ckpt, settings = await replica_of(job, tmp_path)
        async with LiveApi(settings) as replica:
            first, _ = await predictions(replica)
            await job.train(6, seed=1)      # rows change after the checkpoint
            await drained(replica, job)
            served, metas = await predictions(replica)
            assert table_rows(replica.state.predictor.replica.store) == server_rows(job)
            async with LiveApi(settings_for(job, model_checkpoint=ckpt,
                                            embeddings="workers")) as on_training:
                want, _ = await predictions(on_training)
            assert_close(served, want)
            assert any(np.abs(f - w).max() > 1e-4 for f, w in zip(first, want, strict=True))
            assert metas[0]["model_version"] == 1 and metas[0]["trained_through"] is None

            # a newer dense model published by training: served from then on
            newer = TwoHeads(seed=11)
            t0 = time.time()
            await publish_dense(job, newer, step=57, event_time=t0)
            async with asyncio.timeout(20):
                while (await replica.client.get("/v1/model")).json()["model_version"] != 57:
                    await asyncio.sleep(0.05)
            info = await drained(replica, job)
            served, metas = await predictions(replica)
            ckpt2 = await write_checkpoint(job, str(tmp_path / "ckpts" / "c2"), newer)
            async with LiveApi(settings_for(job, model_checkpoint=ckpt2,
                                            embeddings="workers")) as on_training:
                want, _ = await predictions(on_training)
            assert_close(served, want)
            assert all(m["model_version"] == 57 for m in metas)
            # trained_through: the oldest of the shards' marks and the dense model's
            assert info["trained_through"] is None or info["trained_through"] <= t0
    finally:
        await stop_job(job)


async def test_a_restarted_trainers_dense_model_is_served_at_a_lower_step(tmp_path):
    """Training restarted from scratch against the running servers: the crashed run
    published step 60, the new one publishes step 1 in a lineage of its own. The replica
    serves the new model (whose rows it serves already) from then on, as an API on the
    training servers with that model predicts; the crashed run, still publishing, is
    refused."""
    job = await start_job(n_servers=2)
    try:
        await job.train(3)
        _, settings = await replica_of(job, tmp_path)
        async with LiveApi(settings) as replica:
            await publish_dense(job, TwoHeads(seed=5), step=60, event_time=time.time(),
                                lineage=1234)
            async with asyncio.timeout(20):
                while (await replica.client.get("/v1/model")).json()["model_version"] != 60:
                    await asyncio.sleep(0.05)
            restarted = TwoHeads(seed=13)
            await publish_dense(job, restarted, step=1, event_time=time.time(), lineage=99)
            await job.train(2, seed=1)
            async with asyncio.timeout(20):
                while (await replica.client.get("/v1/model")).json()["model_version"] != 1:
                    await asyncio.sleep(0.05)
            follower = replica.state.predictor.replica
            assert (follower.dense_lineage, follower.counts["dense_lineage_changes"]) \
                == (99, 2)      # the checkpoint's legacy lineage, 1234, then 99
            info = await drained(replica, job)
            assert info["replica"]["dense_lineage"] == 99
            served, metas = await predictions(replica)
            assert all(m["model_version"] == 1 for m in metas)
            ckpt2 = await write_checkpoint(job, str(tmp_path / "ckpts" / "c2"), restarted)
            async with LiveApi(settings_for(job, model_checkpoint=ckpt2,
                                            embeddings="workers")) as on_training:
                want, _ = await predictions(on_training)
            assert_close(served, want)
            with pytest.raises(BadInput) as e:     # the crashed run, still publishing
                await publish_dense(job, TwoHeads(seed=6), step=61, event_time=time.time(),
                                    lineage=1234)
            assert e.value.field == "lineage"
            await asyncio.sleep(0.3)
            assert (await replica.client.get("/v1/model")).json()["model_version"] == 1
    finally:
        await stop_job(job)


async def test_a_replica_follows_an_older_server_0_that_knows_no_lineages(tmp_path,
                                                                         monkeypatch):
    """A rolling upgrade that reaches the API before the embedding servers: server 0
    refuses get_dense's unknown 'lineage' field (here: the hub's fields as they were
    before lineages). The replica asks by step alone from then on and follows the dense
    model, instead of failing every pull until the servers are upgraded."""
    from stream_persia.server import dense_hub

    monkeypatch.setattr(dense_hub, "_GET_KEYS", frozenset({"since", "chunk"}))
    job = await start_job(n_servers=1)
    try:
        await job.train(3)
        _, settings = await replica_of(job, tmp_path)
        async with LiveApi(settings) as replica:
            await publish_dense(job, TwoHeads(seed=5), step=60, event_time=time.time())
            async with asyncio.timeout(20):
                while (await replica.client.get("/v1/model")).json()["model_version"] != 60:
                    await asyncio.sleep(0.05)
            follower = replica.state.predictor.replica
            assert follower._legacy_hub
            await publish_dense(job, TwoHeads(seed=6), step=61, event_time=time.time())
            async with asyncio.timeout(20):
                while (await replica.client.get("/v1/model")).json()["model_version"] != 61:
                    await asyncio.sleep(0.05)
    finally:
        await stop_job(job)


async def test_a_replica_takes_the_lineage_and_step_of_its_checkpoint(tmp_path):
    """A checkpoint at step 5 records the lineage its model was published in: a replica
    restored from it does not go back to that lineage's step 4 (a publication that lagged
    the checkpoint), but takes another lineage's step 2 (a trainer restarted since)."""
    job = await start_job(n_servers=1)
    try:
        await job.train(2)
        ckpt = await write_checkpoint(job, str(tmp_path / "ckpts" / "c1"), TwoHeads(seed=3),
                                      step=5, dense_lineage=4321)
        settings = settings_for(job, model_checkpoint=ckpt, embeddings="replica",
                                checkpoint_dir=str(tmp_path / "ckpts"))
        await publish_dense(job, TwoHeads(seed=7), step=4, event_time=time.time(),
                            lineage=4321)
        async with LiveApi(settings) as replica:
            follower = replica.state.predictor.replica
            async with asyncio.timeout(20):
                while follower.counts["pulls"] < 5:      # it has looked a few times
                    await asyncio.sleep(0.05)
            await asyncio.sleep(0.3)                     # (dense: every 0.05 s too)
            assert (follower.dense_step, follower.dense_lineage) == (5, 4321)
            assert follower.counts["dense_loads"] == 0
            await publish_dense(job, TwoHeads(seed=8), step=2, event_time=time.time(),
                                lineage=8765)
            async with asyncio.timeout(20):
                while follower.dense_lineage != 8765:
                    await asyncio.sleep(0.05)
            assert (await replica.client.get("/v1/model")).json()["model_version"] == 2
    finally:
        await stop_job(job)


async def test_replica_converges_after_a_server_restart(tmp_path):
    job = await start_job(n_servers=2)
    try:
        await job.train(3)
        ckpt, settings = await replica_of(job, tmp_path)
        async with LiveApi(settings) as replica:
            await drained(replica, job)
            # server 1 "restarts": a new process at the same address, restored from the
            # checkpoint (another incarnation, a log that starts with a reset)
            old = job.servers[1]
            address = old.address
            await old.stop()
            from stream_persia.embedding import EmbeddingConfig
            from stream_persia.embedding.optim import SGD
            from stream_persia.server.service import EmbeddingServer
            from stream_persia.testing.servers import TEST_CHECKPOINT_ROOT
            host, port = address.rsplit(":", 1)
            new = EmbeddingServer(100_000, SGD(lr=0.5), EmbeddingConfig((-0.5, 0.5)),
                                  replica_index=1, replica_size=2, host=host, port=int(port),
                                  checkpoint_root=TEST_CHECKPOINT_ROOT)
            await new.start()
            job.servers[1] = new
            client = job.client(address)
            import json
            import os
            manifest = json.load(open(os.path.join(ckpt, "manifest.json")))
            await client.call("load", {"dir": ckpt, "files": manifest["embedding_files"]})
            info = await drained(replica, job)
            assert info["replica"]["shards"][1]["incarnation"] == new.incarnation
            follower = replica.state.predictor.replica
            assert follower.cursors[1].restarts == 1
            assert table_rows(follower.store) == server_rows(job)
    finally:
        await stop_job(job)


async def test_a_restarted_replica_catches_up_from_the_checkpoint(tmp_path):
    """A replica stopped mid-stream and started again (a new process would do the same)
    restores the checkpoint, goes on from the positions its manifest records, and ends with
    the servers' rows: what changed while it was down is applied once, nothing missed."""
    job = await start_job(n_servers=2)
    try:
        await job.train(3)
        ckpt, settings = await replica_of(job, tmp_path)
        async with LiveApi(settings) as replica:
            await job.train(2, seed=1)
            await drained(replica, job)
        await job.train(3, seed=2)          # while no replica runs
        async with LiveApi(settings) as replica:
            await drained(replica, job)
            follower = replica.state.predictor.replica
            assert table_rows(follower.store) == server_rows(job)
            assert all(c.resyncs == 0 and c.applied["resets"] == 0 for c in follower.cursors)
    finally:
        await stop_job(job)


async def test_a_replica_reloads_another_checkpoint_and_its_metrics_go_on(tmp_path):
    """POST /v1/model/reload on a replica restores that checkpoint and follows on from
    it; its metrics (one registry per process) keep counting, never drop."""
    job = await start_job(n_servers=2)
    try:
        await job.train(3)
        ckpt, settings = await replica_of(job, tmp_path)
        async with LiveApi(settings) as replica:
            await drained(replica, job)
            pulls = replica.state.predictor.replica.counts["pulls"]
            await job.train(2, seed=1)
            await write_checkpoint(job, str(tmp_path / "ckpts" / "c2"), TwoHeads(seed=4))
            r = await replica.client.post("/v1/model/reload", json={"checkpoint": "c2"},
                                          headers=AUTH)
            assert r.status_code == 200, r.text
            await job.train(2, seed=2)
            await drained(replica, job)
            assert table_rows(replica.state.predictor.replica.store) == server_rows(job)
            text = (await replica.client.get("/metrics")).text
            line = next(ln for ln in text.splitlines()
                        if ln.startswith("persia_api_replica_pulls_total"))
            assert float(line.split()[-1]) >= pulls
            assert "persia_api_freshness_seconds_bucket" in text
    finally:
        await stop_job(job)


async def test_an_answer_names_the_trained_through_of_the_model_that_gave_it(tmp_path):
    """A newer dense model (later event time) that lands while a forward pass of the older
    one is under way: that answer names the older step and the older trained_through, not
    the newer one (which it does not reflect)."""
    job = await start_job(n_servers=2)
    Gated.GATE.set()
    try:
        t1 = time.time() - 100.0
        t2 = t1 + 50.0
        await train_stamped(job, 3, t1)
        ckpt = await write_checkpoint(job, str(tmp_path / "ckpts" / "c1"), Gated(seed=3),
                                      jit=False)
        settings = settings_for(job, model_checkpoint=ckpt, embeddings="replica",
                                checkpoint_dir=str(tmp_path / "ckpts"),
                                model_class="api_helpers:Gated")
        async with LiveApi(settings) as replica:
            await publish_dense(job, Gated(seed=4), step=10, event_time=t1)
            await train_stamped(job, 2, t2, seed=1)    # the shards reach t2, the dense t1
            async with asyncio.timeout(20):
                while (info := await drained(replica, job))["model_version"] != 10:
                    await asyncio.sleep(0.05)
            assert info["trained_through"] == t1
            body = eval_bodies()[0]
            Gated.GATE.clear()
            Gated.ENTERED.clear()
            pending = asyncio.create_task(replica.client.post("/v1/predict", json=body))
            async with asyncio.timeout(20):
                while not Gated.ENTERED.is_set():
                    await asyncio.sleep(0.01)
            # mid-forward: a dense model trained through t2 is published and swapped in
            await publish_dense(job, Gated(seed=5), step=11, event_time=t2)
            async with asyncio.timeout(20):
                while (info := (await replica.client.get("/v1/model")).json()
                       )["model_version"] != 11:
                    await asyncio.sleep(0.05)
            assert info["trained_through"] == t2
            Gated.GATE.set()
            r = await pending
            assert r.status_code == 200, r.text
            assert (r.json()["model_version"], r.json()["trained_through"]) == (10, t1)
            r = await replica.client.post("/v1/predict", json=body)
            assert (r.json()["model_version"], r.json()["trained_through"]) == (11, t2)
    finally:
        Gated.GATE.set()
        await stop_job(job)


@pytest.mark.parametrize("pull_bytes", [8 << 20, 1], ids=["one-pull", "message-by-message"])
async def test_a_restore_to_an_older_checkpoint_lowers_trained_through(tmp_path, monkeypatch,
                                                                     pull_bytes):
    """The servers are restored from a checkpoint trained through t1 after training
    reached t2, and the trainer restarts from it (a new lineage, its dense model of t1).
    The replica follows the restored rows (a reset of every shard) and the new model, and
    says it is trained through t1 again: its rows and its dense model no longer reflect
    what came after (it kept claiming t2). Also when the replica reads a pass (reset,
    rows, mark) over several pulls."""
    monkeypatch.setattr(replica_mod, "PULL_BYTES", pull_bytes)
    job = await start_job(n_servers=2)
    try:
        t1 = time.time() - 100.0
        t2 = t1 + 50.0
        await train_stamped(job, 3, t1)
        ckpt = await write_checkpoint(job, str(tmp_path / "ckpts" / "c1"), TwoHeads(seed=3),
                                      trained_through=t1)
        settings = settings_for(job, model_checkpoint=ckpt, embeddings="replica",
                                checkpoint_dir=str(tmp_path / "ckpts"))
        async with LiveApi(settings) as replica:
            await publish_dense(job, TwoHeads(seed=4), step=10, event_time=t1, lineage=7)
            await train_stamped(job, 2, t2, seed=1)
            await publish_dense(job, TwoHeads(seed=5), step=20, event_time=t2, lineage=7)
            async with asyncio.timeout(20):
                while (info := await drained(replica, job))["model_version"] != 20:
                    await asyncio.sleep(0.05)
            assert info["trained_through"] == t2
            await load_embeddings(ckpt, [job.client(a) for a in job.server_addresses])
            # the rows are rebuilt (the dense model of t2 is still served): t1 already
            async with asyncio.timeout(20):
                while True:
                    info = await drained(replica, job)
                    if all(sh["event_time"] == t1 for sh in info["replica"]["shards"]):
                        break
                    await asyncio.sleep(0.05)
            assert (info["model_version"], info["trained_through"]) == (20, t1)
            assert "persia_api_replica_trained_through_rewinds_total 1.0" in \
                (await replica.client.get("/metrics")).text
            await publish_dense(job, TwoHeads(seed=3), step=1, event_time=t1, lineage=8)
            async with asyncio.timeout(20):
                while (info := await drained(replica, job))["model_version"] != 1:
                    await asyncio.sleep(0.05)
            assert info["trained_through"] == t1
            assert all(sh["event_time"] == t1 for sh in info["replica"]["shards"])
            await train_stamped(job, 1, t1 + 10.0, seed=2)     # training goes on from there
            await publish_dense(job, TwoHeads(seed=6), step=2, event_time=t1 + 10.0,
                                lineage=8)
            async with asyncio.timeout(20):
                while (info := await drained(replica, job))["model_version"] != 2:
                    await asyncio.sleep(0.05)
            assert info["trained_through"] == t1 + 10.0
    finally:
        await stop_job(job)


async def test_a_dense_model_that_does_not_fit_is_refused_and_following_goes_on(tmp_path):
    """A dense model of another architecture published by training: refused once (counted,
    the served model stays), and the next one that fits is served. Its load error used to
    end the task that follows server 0's dense models, silently: no newer model ever again."""
    job = await start_job(n_servers=2)
    try:
        await job.train(2)
        _, settings = await replica_of(job, tmp_path)
        async with LiveApi(settings) as replica:
            await publish_dense(job, Click(seed=1), step=20, event_time=time.time())
            async with asyncio.timeout(20):
                while (info := (await replica.client.get("/v1/model")).json()
                       )["replica"]["counts"]["dense_failures"] < 1:
                    await asyncio.sleep(0.05)
            assert info["model_version"] == 1 and info["replica"]["dense_refused_step"] == 20
            r = await replica.client.post("/v1/predict", json=eval_bodies()[0])
            assert r.status_code == 200 and r.json()["model_version"] == 1
            await publish_dense(job, TwoHeads(seed=11), step=21, event_time=time.time())
            async with asyncio.timeout(20):
                while (info := (await replica.client.get("/v1/model")).json()
                       )["model_version"] != 21:
                    await asyncio.sleep(0.05)
            assert info["replica"]["counts"]["dense_failures"] == 1   # not fetched again
            r = await replica.client.post("/v1/predict", json=eval_bodies()[0])
            assert r.status_code == 200 and r.json()["model_version"] == 21
    finally:
        await stop_job(job)


async def test_a_replica_follows_servers_rescaled_since_its_checkpoint(tmp_path):
    """The checkpoint was written by one embedding server; the job restored it into two
    (a checkpoint loads into another number of servers) and trains on. The manifest's
    update positions name one server's log: a replica starting from that checkpoint reads
    every server's log from its start (a reset each) and ends with the servers' rows. It
    used to index the positions by the new server's number: the task following server 1
    died with an IndexError, nothing said, and that shard was never followed again."""
    small = await start_job(n_servers=1)
    try:
        await small.train(3)
        ckpt = await write_checkpoint(small, str(tmp_path / "ckpts" / "c1"), TwoHeads(seed=3))
    finally:
        await stop_job(small)
    job = await start_job(n_servers=2)
    try:
        await load_embeddings(ckpt, [job.client(a) for a in job.server_addresses])
        await job.train(2, seed=1)
        settings = settings_for(job, model_checkpoint=ckpt, embeddings="replica",
                                checkpoint_dir=str(tmp_path / "ckpts"))
        async with LiveApi(settings) as replica:
            await job.train(2, seed=2)
            await drained(replica, job)
            follower = replica.state.predictor.replica
            assert table_rows(follower.store) == server_rows(job)
            assert all(c.applied["resets"] >= 1 for c in follower.cursors)
    finally:
        await stop_job(job)


async def test_a_replica_given_the_servers_in_another_order_says_so_and_asks_nothing(
        tmp_path):
    """PERSIA_EMBEDDING_SERVERS listed in another order than the job's: each follower
    talks to another shard's server. Every pull used to be refused message by message
    (logged each time) and answered with a resync: a full pass of every row asked of the
    training servers every 50 ms, for good. The reply names the server's shard: the
    replica refuses it once, naming the setting, asks for no full pass, and its
    trained_through stays unknown."""
    job = await start_job(n_servers=2)
    try:
        await job.train(3)
        ckpt, _ = await replica_of(job, tmp_path)
        settings = settings_for(job, model_checkpoint=ckpt, embeddings="replica",
                                checkpoint_dir=str(tmp_path / "ckpts"),
                                embedding_servers=tuple(reversed(job.server_addresses)))
        full = [s.feed.counts["full_passes"] for s in job.servers]
        async with LiveApi(settings) as replica:
            follower = replica.state.predictor.replica
            async with asyncio.timeout(20):
                while follower.counts["pull_failures"] < 4:
                    await asyncio.sleep(0.05)
            await job.train(2, seed=1)
            await asyncio.sleep(0.5)
            assert all(c.resyncs == 0 and c.version is None for c in follower.cursors)
            assert follower.counts["bad_messages"] == 0
            assert [s.feed.counts["full_passes"] for s in job.servers] == full
            info = (await replica.client.get("/v1/model")).json()
            assert info["replica"]["shards"][0]["version"] is None
    finally:
        await stop_job(job)
