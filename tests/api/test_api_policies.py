"""Table policies through the HTTP API (issue 20) against real embedding servers:
``POST /v1/embeddings/configure`` with ``policies`` keyed by slot name (checked in full,
422 naming the slot and key, before any server changes; mapped to feature groups with the
job's schema; groups not named keep theirs), per-slot rows in ``/v1/status`` and
``/v1/embeddings/sizes``, and the per-slot series relayed in ``/metrics``.
"""

from __future__ import annotations

import pytest
from api_helpers import AUTH, LiveApi, settings_for, start_job, stop_job
from prometheus_client.parser import text_string_to_metric_families

from stream_persia.config import EmbeddingSchema
from stream_persia.rpc import RpcClient
from stream_persia.server.service import EmbeddingServer
from stream_persia.testing.samples import SCHEMA

CONFIGURE = "/v1/embeddings/configure"


async def held_configs(job) -> list:
    out = []
    for s in job.servers:
        async with RpcClient(s.address, timeout_ms=5000) as c:
            out.append(await c.call("get_config"))
    return out


@pytest.mark.parametrize("body, field", [
    ({"policies": {"nope": {"min_count": 2}}}, "body.policies.nope"),
    ({"policies": {"user": {"min_count": 0}}}, "body.policies.user.min_count"),
    ({"policies": {"user": {"min_count": "2"}}}, "body.policies.user.min_count"),
    ({"policies": {"user": {"ttl_s": -1}}}, "body.policies.user.ttl_s"),
    ({"policies": {"user": {"dtype": "int8"}}}, "body.policies.user.dtype"),
    ({"policies": {"user": {"colour": 1}}}, "body.policies.user.colour"),
    ({"policies": [1]}, "body.policies"),
    ({"admit_probability": 0.5, "policies": {"item": {"max_rows": 0}}},
     "body.policies.item.max_rows"),
])
async def test_bad_policies_are_a_422_naming_slot_and_key_and_nothing_changes(job, body, field):
    before = await held_configs(job)
    async with LiveApi(settings_for(job)) as api:
        r = await api.client.post(CONFIGURE, json=body, headers=AUTH)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["field"] == field, r.json()
    assert await held_configs(job) == before


async def test_policies_need_id_prefixes_and_a_schema(job):
    flat = EmbeddingSchema.from_dict({"feature_index_prefix_bit": 0,
                                      "slots_config": {"user": {"dim": 8}}})
    body = {"policies": {"user": {"min_count": 2}}}
    async with LiveApi(settings_for(job, schema=flat)) as api:
        r = await api.client.post(CONFIGURE, json=body, headers=AUTH)
        assert r.status_code == 422, r.text
        assert r.json()["error"]["field"] == "body.policies"
        assert "feature_index_prefix_bit" in r.json()["error"]["message"]
    async with LiveApi(settings_for(job, schema=None)) as api:
        r = await api.client.post(CONFIGURE, json=body, headers=AUTH)
        assert r.status_code == 409, r.text
        assert r.json()["error"]["field"] == "body.policies"
    assert await held_configs(job) == [None, None]


async def test_status_and_sizes_carry_per_slot_rows(job):
    async with LiveApi(settings_for(job)) as api:
        status = (await api.client.get("/v1/status", headers=AUTH)).json()
        assert all(isinstance(s["slots"], dict) for s in status["servers"])
        sizes = (await api.client.get("/v1/embeddings/sizes", headers=AUTH)).json()
        assert isinstance(sizes["slots"], dict) and sizes["total"] == sum(sizes["servers"])


async def test_policies_by_slot_name_reach_every_server_and_others_keep_theirs(job):
    async with LiveApi(settings_for(job)) as api:
        r = await api.client.post(CONFIGURE, headers=AUTH,
                                  json={"policies": {"user": {"min_count": 2}}})
        assert r.status_code == 200, r.text
        configs = await held_configs(job)
        assert configs[0] == configs[1]
        table = configs[0]["policies"]
        assert table["prefix_bits"] == 8 and table["names"] == [None, "user", "item", "tags"]
        assert table["policies"][1]["min_count"] == 2
        assert table["policies"][2] is None and table["policies"][3] is None
        r = await api.client.post(CONFIGURE, headers=AUTH,
                                  json={"policies": {"item": {"ttl_s": 60}}})
        assert r.status_code == 200, r.text
        table = (await held_configs(job))[0]["policies"]
        assert table["policies"][1]["min_count"] == 2        # kept
        assert table["policies"][2]["ttl_s"] == 60.0
        r = await api.client.post(CONFIGURE, headers=AUTH,
                                  json={"policies": {"user": None, "item": None}})
        assert r.status_code == 200, r.text
        assert "policies" not in (await held_configs(job))[0]

        await job.train(2)
        sizes = (await api.client.get("/v1/embeddings/sizes", headers=AUTH)).json()
        text = (await api.client.get("/metrics")).text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    rows = families["persia_embedding_server_slot_rows"].samples
    assert {s.labels["replica"] for s in rows} == {"0", "1"}
    assert sum(s.value for s in rows) <= sizes["total"]
    assert sum(sizes["slots"].values()) <= sizes["total"]


async def test_a_group_reset_at_run_time_is_not_brought_back_from_the_file(job):
    # The job's file gives user a policy; the operator resets it to the default, then
    # changes another slot: the servers' table (no policies at all now) is the base, not
    # the file's.
    d = SCHEMA.to_dict()
    d["slots_config"]["user"]["min_count"] = 3
    filed = EmbeddingSchema.from_dict(d)
    async with LiveApi(settings_for(job, schema=filed)) as api:
        r = await api.client.post(CONFIGURE, headers=AUTH,
                                  json={"policies": {"item": {"ttl_s": 60}}})
        assert r.status_code == 200, r.text
        table = (await held_configs(job))[0]["policies"]
        assert table["policies"][1]["min_count"] == 3        # the file's, servers unconfigured
        r = await api.client.post(CONFIGURE, headers=AUTH,
                                  json={"policies": {"user": None, "item": None}})
        assert r.status_code == 200, r.text
        assert "policies" not in (await held_configs(job))[0]
        r = await api.client.post(CONFIGURE, headers=AUTH,
                                  json={"policies": {"tags": {"max_rows": 1000}}})
        assert r.status_code == 200, r.text
        table = (await held_configs(job))[0]["policies"]
    assert table["policies"][3]["max_rows"] == 1000
    assert table["policies"][1] is None, table               # stays reset


async def test_a_server_restarted_after_a_policy_change_gets_the_new_policies_back():
    """kill -9 and a supervisor's restart of a server launched with the file's policies
    (the launcher passes them) after the API changed them: the embedding worker
    (``on_server_restart: continue``) configures it with what it learned, the new table,
    and the digests agree again."""
    d = SCHEMA.to_dict()
    d["slots_config"]["item"]["ttl_s"] = 3600
    filed = EmbeddingSchema.from_dict(d)
    job = await start_job(on_server_restart="continue")
    try:
        async with LiveApi(settings_for(job, schema=filed)) as api:
            r = await api.client.post(CONFIGURE, headers=AUTH,
                                      json={"policies": {"user": {"min_count": 2}}})
            assert r.status_code == 200, r.text
        await job.train(1)
        want = (await held_configs(job))[1]
        assert want["policies"]["policies"][1]["min_count"] == 2
        assert want["policies"]["policies"][2]["ttl_s"] == 3600.0
        old = job.servers[0]
        await old.stop()
        host, port = old.address.rsplit(":", 1)
        fresh = EmbeddingServer(old.store.capacity, replica_index=0, replica_size=2,
                                host=host, port=int(port), checkpoint_root=old.checkpoint_root,
                                policies=filed.policy_params())
        await fresh.start()
        job.servers[0] = fresh
        await job.train(2, seed=1)
        assert await held_configs(job) == [want, want]
    finally:
        await stop_job(job)


async def test_a_change_while_server_0_restarted_unconfigured_keeps_the_others_table(job):
    """Server 0 restarted (launched with the file's policies, not yet configured again by
    the embedding workers) when the operator changes another slot: the base is the table
    the configured servers hold, not the file's, so the run-time change of user is kept."""
    d = SCHEMA.to_dict()
    d["slots_config"]["user"]["min_count"] = 3
    filed = EmbeddingSchema.from_dict(d)
    async with LiveApi(settings_for(job, schema=filed)) as api:
        r = await api.client.post(CONFIGURE, headers=AUTH,
                                  json={"policies": {"user": {"ttl_s": 60}}})
        assert r.status_code == 200, r.text
        old = job.servers[0]
        await old.stop()
        host, port = old.address.rsplit(":", 1)
        job.servers[0] = EmbeddingServer(old.store.capacity, replica_index=0, replica_size=2,
                                         host=host, port=int(port),
                                         checkpoint_root=old.checkpoint_root,
                                         policies=filed.policy_params())
        await job.servers[0].start()
        r = await api.client.post(CONFIGURE, headers=AUTH,
                                  json={"policies": {"tags": {"max_rows": 1000}}})
        assert r.status_code == 200, r.text
        configs = await held_configs(job)
    assert configs[0]["policies"] == configs[1]["policies"]
    user = configs[1]["policies"]["policies"][1]
    assert user["ttl_s"] == 60.0 and user["min_count"] == 1, user
