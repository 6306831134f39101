"""Health, readiness, metrics and job control against real embedding servers and workers."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from api_helpers import AUTH, LiveApi, settings_for
from prometheus_client.parser import text_string_to_metric_families

from stream_persia.errors import Backpressure, BadInput, Misuse
from stream_persia.rpc import RpcServer
from stream_persia.testing.samples import make_batch


async def test_health_readiness_and_a_role_going_away(job):
    async with LiveApi(settings_for(job)) as api:
        assert (await api.client.get("/healthz")).json() == {"status": "ok"}
        r = await api.client.get("/readyz")
        assert r.status_code == 200, r.text
        ready = r.json()
        assert ready["ready"] and ready["problems"] == []
        assert sorted((x["role"], x["index"]) for x in ready["roles"]) == [
            ("embedding-server", 0), ("embedding-server", 1), ("embedding-worker", 0)]
        await job.servers[1].stop()
        r = await api.client.get("/readyz")
        assert r.status_code == 503
        assert len(r.json()["problems"]) == 1
        assert job.servers[1].address in r.json()["problems"][0]
        assert (await api.client.get("/healthz")).status_code == 200
        # A route that needs the dead server names it, with 503 (retry later).
        r = await api.client.get("/v1/embeddings/sizes", headers=AUTH)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["peer"] == f"embedding-server-1 {job.servers[1].address}"
        assert r.headers["retry-after"] == "1"


async def test_status_aggregates_every_role(job):
    await job.train(3)
    worker = job.client(job.workers[0].address)
    await worker.call("ingest", {"batch": make_batch(10).to_wire()})
    served = await worker.call("next_batch", {"timeout_ms": 2000})   # one batch in flight
    async with LiveApi(settings_for(job)) as api:
        r = await api.client.get("/v1/status", headers=AUTH)
        assert r.status_code == 200, r.text
        status = r.json()
        rows = [len(s.store) for s in job.servers]
        assert [s["rows"] for s in status["servers"]] == rows
        assert status["rows_total"] == sum(rows) > 0
        assert status["servers"][0]["stats"]["lookups"] > 0
        assert status["staleness_in_flight"] == 1
        assert status["workers"][0]["inflight"] == 1
        assert status["workers"][0]["healthy"] and status["workers"][0]["ingest_paused"] is False
        assert status["training"]["batches_applied"] == 3
        assert len(status["roles"]) == 3 and all(x["healthy"] for x in status["roles"])
        assert status["last_checkpoint"] is None and status["model"] is None
    await worker.call("push_gradients", {"batch_id": served["batch_id"],
                                         "grads": dict.fromkeys(("user", "item", "tags"))})


async def test_pause_resume_clear_sizes(job):
    await job.train(2)
    async with LiveApi(settings_for(job)) as api:
        r = await api.client.post("/v1/ingest/pause", headers=AUTH)
        assert r.json() == {"ingest_paused": True, "workers": 1}
        assert job.workers[0].ingest_paused.is_set()
        st = (await api.client.get("/v1/status", headers=AUTH)).json()
        assert st["ingest_paused"] is True
        assert (await api.client.post("/v1/ingest/resume", headers=AUTH)).json()[
            "ingest_paused"] is False
        assert not job.workers[0].ingest_paused.is_set()

        sizes = (await api.client.get("/v1/embeddings/sizes", headers=AUTH)).json()
        assert sizes["servers"] == [len(s.store) for s in job.servers]
        assert sizes["total"] == sum(sizes["servers"]) > 0
        r = await api.client.post("/v1/embeddings/clear", headers=AUTH)
        assert r.json() == {"applied": True, "servers": 2}
        assert [len(s.store) for s in job.servers] == [0, 0]
        assert (await api.client.get("/v1/embeddings/sizes", headers=AUTH)).json()[
            "total"] == 0


async def test_paused_ingest_holds_broker_less_batches_until_resumed(job):
    worker = job.client(job.workers[0].address)
    async with LiveApi(settings_for(job)) as api:
        assert (await api.client.post("/v1/ingest/pause", headers=AUTH)).status_code == 200
        with pytest.raises(Backpressure) as err:
            await worker.call("ingest", {"batch": make_batch(0).to_wire(), "timeout_ms": 150})
        assert err.value.field == "timeout_ms" and "paused" in err.value.message
        waiting = asyncio.ensure_future(worker.call(
            "ingest", {"batch": make_batch(1).to_wire(), "timeout_ms": 10_000}))
        await asyncio.sleep(0.3)
        assert not waiting.done() and len(job.workers[0].ready) == 0
        # A bad batch is refused at once, paused or not.
        with pytest.raises(BadInput):
            await worker.call("ingest", {"batch": {"id_type_features": 3}, "timeout_ms": 10_000})
        assert (await api.client.post("/v1/ingest/resume", headers=AUTH)).status_code == 200
        assert "batch_id" in await asyncio.wait_for(waiting, 2)
        assert len(job.workers[0].ready) == 1
        served = await worker.call("next_batch", {"timeout_ms": 2000})
        assert served["meta"] == make_batch(1).meta
        await worker.call("push_gradients", {"batch_id": served["batch_id"],
                                             "grads": dict.fromkeys(("user", "item", "tags"))})


async def test_configure_checks_everything_before_changing_any_server(job):
    async with LiveApi(settings_for(job)) as api:
        before = [s.store.embedding_config for s in job.servers]
        bad = [
            ({"admit_probability": 2}, "body.admit_probability"),
            ({"emb_initialization": [1, -1]}, "body.emb_initialization"),
            ({"optimizer": {"name": "sgd"}}, "body.optimizer"),
            ({"optimizer": {"name": "adagrad", "lr": -1}}, "body.optimizer.lr"),
            ({"optimizer": {"name": "rmsprop", "lr": 1}}, "body.optimizer.name"),
            ({"weight_bound": "big"}, "body.weight_bound"),
            ({"surprise": 1}, "body.surprise"),
            ({}, "body"),
        ]
        for body, field in bad:
            r = await api.client.post("/v1/embeddings/configure", json=body, headers=AUTH)
            assert r.status_code == 422, (body, r.text)
            assert r.json()["error"]["field"] == field, (body, r.json())
        assert [s.store.embedding_config for s in job.servers] == before

        r = await api.client.post("/v1/embeddings/configure", headers=AUTH, json={
            "emb_initialization": [-0.1, 0.1], "admit_probability": 0.5,
            "optimizer": {"name": "adagrad", "lr": 0.05}})
        assert r.status_code == 200, r.text
        for s in job.servers:
            assert s.store.embedding_config.admit_probability == 0.5
            assert s.store.embedding_config.emb_initialization == (-0.1, 0.1)
            assert s.store.optimizer.name == "adagrad" and s.store.optimizer.lr == 0.05


async def test_a_server_that_is_down_leaves_every_server_unchanged(job):
    """With embedding server 1 down, a configure or a clear was answered 503 ("retry
    later") after server 0 had already taken it: the servers then trained with different
    configurations (or one held its rows) though the docs said nothing changes before
    every server is checked. Every server must answer before any is changed."""
    await job.train(2)
    async with LiveApi(settings_for(job, rpc_timeout_ms=2000)) as api:
        before = job.servers[0].store.embedding_config
        rows = len(job.servers[0].store)
        assert rows > 0
        await job.servers[1].stop()
        for url, body in (("/v1/embeddings/configure", {"admit_probability": 0.25}),
                          ("/v1/embeddings/clear", None)):
            r = await api.client.post(url, json=body, headers=AUTH)
            assert r.status_code == 503, r.text
            assert r.json()["error"]["peer"].startswith("embedding-server-1"), r.text
        assert job.servers[0].store.embedding_config == before
        assert len(job.servers[0].store) == rows


async def test_a_server_that_fails_the_change_is_named_with_those_that_took_it(job):
    """A server that answers but fails the change itself: the error says which servers
    took it and which did not, instead of only the failure (a retry makes them agree)."""
    async def health(params):
        return {"ok": True}

    async def refuse(params):
        raise Misuse("this server refuses every change", field="config")

    other = RpcServer({"health": health, "configure": refuse, "clear": refuse},
                      name="refusing-server")
    await other.start()
    try:
        settings = settings_for(job, embedding_servers=(job.servers[0].address, other.address))
        async with LiveApi(settings) as api:
            r = await api.client.post("/v1/embeddings/configure", headers=AUTH,
                                      json={"admit_probability": 0.25})
            assert r.status_code == 409, r.text
            error = r.json()["error"]
            assert error["message"].startswith(
                f"configure was applied on embedding-server-0 {job.servers[0].address} but "
                f"not on embedding-server-1 {other.address} (this server refuses"), error
            assert error["peer"] == f"embedding-server-1 {other.address}"
            assert "send the same request again" in error["hint"]
            assert job.servers[0].store.embedding_config.admit_probability == 0.25
            r = await api.client.post("/v1/embeddings/clear", headers=AUTH)
            assert r.status_code == 409
            assert r.json()["error"]["message"].startswith("clear was applied on embedding-server-0")
    finally:
        await other.stop()


async def test_metrics_cover_routes_and_every_role(job):
    await job.train(2)
    async with LiveApi(settings_for(job)) as api:
        for _ in range(3):
            await api.client.get("/v1/status", headers=AUTH)
        await api.client.get("/v1/checkpoints/nope", headers=AUTH)
        text = (await api.client.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    requests = families["persia_api_requests"].samples
    status_calls = [s for s in requests if s.labels.get("route") == "/v1/status"
                    and s.name.endswith("_total")]
    assert status_calls and status_calls[0].value == 3
    assert status_calls[0].labels["status"] == "200"
    # Templates, never raw paths.
    assert any(s.labels.get("route") == "/v1/checkpoints/{checkpoint_id}" for s in requests)
    assert not any("nope" in str(s.labels) for s in requests)
    latency = families["persia_api_request_seconds"].samples
    assert any(s.name.endswith("_count") and s.labels.get("route") == "/v1/status"
               for s in latency)
    # Role metrics, labelled by role and replica; servers merged into one family.
    applied = families["persia_embedding_worker_batches_applied"].samples
    assert [(s.labels["role"], s.labels["replica"], s.value) for s in applied
            if s.name.endswith("_total")] == [("embedding-worker", "0", 2.0)]
    lookups = families["persia_embedding_server_store_lookups"]
    assert lookups.type == "counter"
    assert {(s.name, s.labels["replica"]) for s in lookups.samples} == {
        ("persia_embedding_server_store_lookups_total", "0"),
        ("persia_embedding_server_store_lookups_total", "1")}
    up = {(s.labels["role"], s.labels["replica"]): s.value
          for s in families["persia_api_role_up"].samples}
    assert up[("embedding-server", "1")] == 1.0


async def test_metrics_survive_a_dead_role(job):
    async with LiveApi(settings_for(job)) as api:
        await job.workers[0].stop()
        r = await api.client.get("/metrics")
        assert r.status_code == 200
        fams = {f.name: f for f in text_string_to_metric_families(r.text)}
        up = {(s.labels["role"], s.labels["replica"]): s.value
              for s in fams["persia_api_role_up"].samples}
        assert up[("embedding-worker", "0")] == 0.0 and up[("embedding-server", "0")] == 1.0
        assert np.isfinite(sum(s.value for s in fams["persia_api_requests_in_flight"].samples))
