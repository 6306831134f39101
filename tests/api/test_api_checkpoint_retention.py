"""Checkpoints under the API's directory are bounded: ``keep_checkpoints`` after each one
the API takes, and ``DELETE /v1/checkpoints/{id}``.

Issue 17: six ``POST /v1/checkpoints`` in 6 s took the directory from 159 MiB to 1.1 GiB,
nothing was ever deleted and ``DELETE`` was 405. Retention never deletes the model being
served (nor the one configured to be served), nor one being taken or restored.
"""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np
import pytest
from api_helpers import AUTH, LiveApi, TwoHeads, settings_for, take_checkpoint, write_checkpoint
from prometheus_client.parser import text_string_to_metric_families
from stream_persia.api import ApiSettings

from stream_persia.checkpoint import CheckpointWriter, list_checkpoints, read_manifest
from stream_persia.config import GlobalConfig
from stream_persia.errors import ConfigError


def on_disk(root: str) -> list[str]:
    """Every entry under ``root`` (nothing hidden is left behind by a deletion)."""
    assert not [n for n in os.listdir(root) if n.startswith(".")], os.listdir(root)
    return sorted(os.listdir(root))


async def deleted_metric(api: LiveApi) -> dict[str, float]:
    text = (await api.client.get("/metrics")).text
    return {s.labels["reason"]: s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name == "persia_api_checkpoints_deleted_total"}


async def test_the_api_keeps_the_newest_checkpoints(job, tmp_path):
    root = str(tmp_path / "ckpts")
    await job.train(2)
    async with LiveApi(settings_for(job, checkpoint_dir=root, keep_checkpoints=2)) as api:
        for i in range(5):
            await job.train(1, seed=i)
            await take_checkpoint(api, f"c{i}")
            assert on_disk(root) == [f"c{k}" for k in range(max(0, i - 1), i + 1)]
        listed = (await api.client.get("/v1/checkpoints", headers=AUTH)).json()
        assert [c["id"] for c in listed["checkpoints"]] == ["c3", "c4"]
        assert (await api.client.get("/v1/checkpoints/c0", headers=AUTH)).status_code == 404
        assert (await deleted_metric(api)) == {"retention": 3.0}


async def test_retention_never_deletes_the_served_model(job, tmp_path):
    root = str(tmp_path / "ckpts")
    await job.train(2)
    await write_checkpoint(job, f"{root}/configured", TwoHeads())   # PERSIA_API_MODEL
    await write_checkpoint(job, f"{root}/reloaded", TwoHeads(seed=2))
    settings = settings_for(job, checkpoint_dir=root, keep_checkpoints=1, embeddings="local",
                            model_checkpoint=f"{root}/configured")
    async with LiveApi(settings) as api:
        r = await api.client.post("/v1/model/reload", headers=AUTH,
                                  json={"checkpoint": "reloaded"})
        assert r.status_code == 200, r.text
        for i in range(3):
            await take_checkpoint(api, f"c{i}")
        # Served, configured to serve (the API retries it after a restart), and newest.
        assert sorted(os.listdir(root)) == ["c2", "configured", "reloaded"]


async def test_delete_a_checkpoint(job, tmp_path):
    root = str(tmp_path / "ckpts")
    await job.train(2)
    for name in ("served", "old", "other"):
        await write_checkpoint(job, f"{root}/{name}", TwoHeads())
    async with LiveApi(settings_for(job, checkpoint_dir=root, embeddings="local",
                                    model_checkpoint=f"{root}/served")) as api:
        c = api.client
        assert (await c.delete("/v1/checkpoints/old")).status_code == 401
        assert (await c.delete("/v1/checkpoints/old",
                               headers={"Authorization": "Bearer wrong"})).status_code == 403
        r = await c.delete("/v1/checkpoints/old", headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json() == {"id": "old", "deleted": True, "dst": os.path.realpath(f"{root}/old")}
        assert (await c.get("/v1/checkpoints/old", headers=AUTH)).status_code == 404
        assert (await c.delete("/v1/checkpoints/old", headers=AUTH)).status_code == 404
        assert (await c.delete("/v1/checkpoints/never", headers=AUTH)).status_code == 404
        r = await c.delete("/v1/checkpoints/served", headers=AUTH)
        assert r.status_code == 409 and r.json()["error"]["field"] == "checkpoint", r.text
        assert "served" in r.json()["error"]["message"]
        for bad in (".hidden", "a%2Fb", "..", "x" * 200):
            r = await c.delete(f"/v1/checkpoints/{bad}", headers=AUTH)
            assert r.status_code in (404, 422), (bad, r.text)
            if r.status_code == 422:
                assert r.json()["error"]["field"] == "path.checkpoint_id"
        # Another model served: the previous one may go.
        r = await c.post("/v1/model/reload", headers=AUTH, json={"checkpoint": "other"})
        assert r.status_code == 200
        r = await c.delete("/v1/checkpoints/served", headers=AUTH)
        assert r.status_code == 409   # still PERSIA_API_MODEL: a restart serves it again
        assert (await deleted_metric(api)) == {"request": 1.0}
    assert sorted(os.listdir(root)) == ["other", "served"]


async def test_delete_refuses_a_checkpoint_being_taken(job, tmp_path, monkeypatch):
    root = str(tmp_path / "ckpts")
    await job.train(2)
    async with LiveApi(settings_for(job, checkpoint_dir=root)) as api:
        ckpts = api.state.checkpoints
        gate = asyncio.Event()
        real = ckpts._cut_by_api

        async def held(*args, **kw):   # the cut waits until the test lets it go
            await gate.wait()
            return await real(*args, **kw)

        monkeypatch.setattr(ckpts, "_cut_by_api", held)
        r = await api.client.post("/v1/checkpoints", headers=AUTH, json={"id": "slow"})
        assert r.status_code == 202
        r = await api.client.delete("/v1/checkpoints/slow", headers=AUTH)
        assert r.status_code == 409 and "being taken" in r.json()["error"]["message"], r.text
        gate.set()
        async with asyncio.timeout(30):
            while (await api.client.get("/v1/checkpoints/slow", headers=AUTH)
                   ).json()["state"] != "done":
                await asyncio.sleep(0.02)
        assert (await api.client.delete("/v1/checkpoints/slow", headers=AUTH)).status_code \
            == 200
    assert list_checkpoints(root) == []


def test_keep_checkpoints_is_validated_and_reaches_the_api():
    gc = GlobalConfig.from_dict({"common_config": {"checkpointing_config": {
        "keep_checkpoints": 7}}})
    assert ApiSettings.from_env(gc).keep_checkpoints == 7
    assert GlobalConfig.from_dict({}).common_config.checkpointing_config.keep_checkpoints == 3
    for bad in (-1, "3", 1.5, True):
        with pytest.raises(ConfigError) as err:
            GlobalConfig.from_dict({"common_config": {"checkpointing_config": {
                "keep_checkpoints": bad}}}, source="global_config.yml")
        assert "checkpointing_config.keep_checkpoints" in str(err.value)
        assert "global_config.yml" in str(err.value)
    with pytest.raises(ConfigError):
        ApiSettings(keep_checkpoints=-1)



def rows_of(job) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """id -> (weights, optimizer state) over every server."""
    return {k: (c["weights"][i].copy(), c["state"][i].copy())
            for s in job.servers for c in s.store.dump()
            for i, k in enumerate(c["ids"].tolist())}


async def test_a_patch_restores_through_the_api_and_its_base_is_not_deleted(job, tmp_path):
    """An incremental checkpoint (issue 21): POST /v1/checkpoints/{patch}/restore loads
    its base, then the patch; DELETE of the base is 409 while the patch needs it, and
    retention keeps the base of a kept patch."""
    root = str(tmp_path / "ckpts")
    await job.train(2)
    await write_checkpoint(job, f"{root}/base", TwoHeads())
    await job.train(2, seed=3)
    clients = [job.client(a) for a in job.server_addresses]
    with CheckpointWriter(f"{root}/patch") as w:
        w.write_torch("dense.pt", TwoHeads().state_dict())
        await w.dump_embeddings(clients, parent=read_manifest(f"{root}/base"))
        patch = w.commit(job="test", step=2, offsets={}, stream="direct")
    assert patch.chain is not None and patch.chain["parent"] == "base" and patch.rows > 0
    want = rows_of(job)
    await job.train(2, seed=4)
    async with LiveApi(settings_for(job, checkpoint_dir=root, keep_checkpoints=2)) as api:
        c = api.client
        r = await c.post("/v1/checkpoints/patch/restore", headers=AUTH)
        assert r.status_code == 200, r.text
        got = rows_of(job)
        assert got.keys() == want.keys()
        for k, (w8, st) in want.items():
            np.testing.assert_allclose(got[k][0], w8, atol=1e-6, rtol=0)
            np.testing.assert_allclose(got[k][1], st, atol=1e-6, rtol=0)
        r = await c.delete("/v1/checkpoints/base", headers=AUTH)
        assert r.status_code == 409 and "'patch'" in r.json()["error"]["message"], r.text
        await take_checkpoint(api, "c1")   # keeps c1 and patch, and base for patch
        assert on_disk(root) == ["base", "c1", "patch"]
        assert (await c.delete("/v1/checkpoints/patch", headers=AUTH)).status_code == 200
        assert (await c.delete("/v1/checkpoints/base", headers=AUTH)).status_code == 200


async def test_the_list_shows_each_chain_member_and_any_member_restores(job, tmp_path):
    """GET /v1/checkpoints gives each checkpoint's parent, base, depth and bytes (issue
    21, item 4); POST /v1/checkpoints/{id}/restore of a patch that is not the newest
    loads its chain up to it, not the patches after it."""
    root = str(tmp_path / "ckpts")
    await job.train(2)
    await write_checkpoint(job, f"{root}/base", TwoHeads())
    clients = [job.client(a) for a in job.server_addresses]
    tables = {}
    for k, parent in ((1, "base"), (2, "p1")):
        await job.train(2, seed=10 + k)
        with CheckpointWriter(f"{root}/p{k}") as w:
            w.write_torch("dense.pt", TwoHeads(seed=k).state_dict())
            await w.dump_embeddings(clients, parent=read_manifest(f"{root}/{parent}"))
            w.commit(job="test", step=2 + k, offsets={}, stream="direct")
        tables[k] = rows_of(job)
    assert any(k not in tables[2] or not np.array_equal(v[0], tables[2][k][0])
               for k, v in tables[1].items()), "p2 must change rows p1 holds"
    async with LiveApi(settings_for(job, checkpoint_dir=root, keep_checkpoints=0)) as api:
        c = api.client
        listed = (await c.get("/v1/checkpoints", headers=AUTH)).json()["checkpoints"]
        got = {i["id"]: (i["parent"], i["base"], i["depth"]) for i in listed}
        assert got == {"base": (None, "base", 0), "p1": ("base", "base", 1),
                       "p2": ("p1", "base", 2)}
        for info in listed:
            d = os.path.join(root, info["id"])
            assert info["bytes"] == sum(os.path.getsize(os.path.join(d, n))
                                        for n in os.listdir(d) if n != "manifest.json")
        one = (await c.get("/v1/checkpoints/p2", headers=AUTH)).json()
        assert (one["parent"], one["depth"]) == ("p1", 2) and one["bytes"] > 0
        await job.train(2, seed=20)
        r = await c.post("/v1/checkpoints/p1/restore", headers=AUTH)
        assert r.status_code == 200, r.text
        assert r.json()["rows"] == len(tables[1])
        got_rows = rows_of(job)
        assert got_rows.keys() == tables[1].keys()
        for key, (w8, st) in tables[1].items():
            np.testing.assert_allclose(got_rows[key][0], w8, atol=1e-6, rtol=0)
            np.testing.assert_allclose(got_rows[key][1], st, atol=1e-6, rtol=0)


async def test_a_checkpoint_that_comes_into_use_while_it_is_deleted_is_kept(job, tmp_path,
                                                                           monkeypatch):
    """A reload of the checkpoint lands while the delete reads its manifest and looks for
    patches that need it (two awaits after the first in-use check): the delete is refused,
    the served model's files stay."""
    from stream_persia.api import checkpoints as checkpoints_mod

    root = str(tmp_path / "ckpts")
    await job.train(2)
    for name in ("served", "old"):
        await write_checkpoint(job, f"{root}/{name}", TwoHeads())
    async with LiveApi(settings_for(job, checkpoint_dir=root, embeddings="local",
                                    model_checkpoint=f"{root}/served")) as api:
        loop = asyncio.get_running_loop()
        real = checkpoints_mod.dependents

        def reload_meanwhile(*args):
            r = asyncio.run_coroutine_threadsafe(api.client.post(
                "/v1/model/reload", headers=AUTH, json={"checkpoint": "old"}), loop).result()
            assert r.status_code == 200, r.text
            return real(*args)

        monkeypatch.setattr(checkpoints_mod, "dependents", reload_meanwhile)
        r = await api.client.delete("/v1/checkpoints/old", headers=AUTH)
        assert r.status_code == 409, r.text
        assert "old" in os.listdir(root)
        assert (await api.client.get("/v1/model")).json()["checkpoint"].endswith("old")


async def test_retention_leaves_another_jobs_checkpoints_alone(job, tmp_path):
    """Two jobs pointed at one checkpoint directory: the API's retention neither counts
    nor deletes the other job's checkpoints (it deleted them as its own oldest)."""
    root = str(tmp_path / "ckpts")
    await job.train(2)
    aged(await write_checkpoint(job, f"{root}/theirs", TwoHeads()), job="another-job")
    aged(await write_checkpoint(job, f"{root}/mine", TwoHeads()))
    async with LiveApi(settings_for(job, checkpoint_dir=root, keep_checkpoints=1)) as api:
        await take_checkpoint(api, "c1")
        await wait_retention(api)
        assert on_disk(root) == ["c1", "theirs"]
        await take_checkpoint(api, "c2")
        await wait_retention(api)
        assert on_disk(root) == ["c2", "theirs"]
        # Their newest, written after ours, is not this job's last checkpoint either.
        newer = await write_checkpoint(job, f"{root}/theirs-newer", TwoHeads())
        with open(os.path.join(newer, "manifest.json")) as f:
            m = json.load(f)
        m["job"] = "another-job"
        with open(os.path.join(newer, "manifest.json"), "w") as f:
            json.dump(m, f)
        status = (await api.client.get("/v1/status", headers=AUTH)).json()
        assert status["last_checkpoint"]["id"] == "c2", status["last_checkpoint"]


async def test_retention_keeps_a_checkpoint_reloaded_after_its_pass_began(job, tmp_path,
                                                                          monkeypatch):
    """Retention takes its in-use snapshot, then runs in a thread: a reload of an expired
    checkpoint that lands after the snapshot (here: as the pass computes what expired)
    is seen just before the deletion, and the served model's files stay."""
    from stream_persia.checkpoint import retention

    root = str(tmp_path / "ckpts")
    await job.train(2)
    aged(await write_checkpoint(job, f"{root}/old", TwoHeads()))
    async with LiveApi(settings_for(job, checkpoint_dir=root, keep_checkpoints=1,
                                    embeddings="local")) as api:
        loop = asyncio.get_running_loop()
        real = retention.expired
        reloads = []

        def reload_meanwhile(*args):
            found = real(*args)
            if not reloads:
                reloads.append(asyncio.run_coroutine_threadsafe(api.client.post(
                    "/v1/model/reload", headers=AUTH, json={"checkpoint": "old"}),
                    loop).result())
            return found

        monkeypatch.setattr(retention, "expired", reload_meanwhile)
        await take_checkpoint(api, "c1")
        await wait_retention(api)
        assert reloads and reloads[0].status_code == 200, reloads
        assert (await api.client.get("/v1/model")).json()["checkpoint"].endswith("old")
        assert on_disk(root) == ["c1", "old"]


async def test_a_reload_or_restore_of_a_checkpoint_retention_is_deleting_is_refused(
        job, tmp_path, monkeypatch):
    """Once retention has decided to delete a checkpoint, a reload or a restore of it is
    refused naming it (409), not answered 200 over files deleted right after."""
    from stream_persia.checkpoint import retention

    root = str(tmp_path / "ckpts")
    await job.train(2)
    aged(await write_checkpoint(job, f"{root}/old", TwoHeads()))
    aged(await write_checkpoint(job, f"{root}/served", TwoHeads(seed=1)))
    settings = settings_for(job, checkpoint_dir=root, keep_checkpoints=1, embeddings="local",
                            model_checkpoint=f"{root}/served")
    async with LiveApi(settings) as api:
        loop = asyncio.get_running_loop()
        real = retention.delete_checkpoint
        answers = {}

        def use_meanwhile(src, going=()):
            for what, url, body in (("reload", "/v1/model/reload", {"checkpoint": "old"}),
                                    ("restore", "/v1/checkpoints/old/restore", None)):
                answers[what] = asyncio.run_coroutine_threadsafe(api.client.post(
                    url, headers=AUTH, json=body), loop).result()
            return real(src, going)

        monkeypatch.setattr(retention, "delete_checkpoint", use_meanwhile)
        await take_checkpoint(api, "c1")
        await wait_retention(api)
        for what, r in answers.items():
            assert r.status_code == 409, (what, r.text)
            err = r.json()["error"]
            assert err["field"] == "checkpoint" and "'old' is being deleted" in err["message"]
        assert (await api.client.get("/v1/model")).json()["checkpoint"].endswith("served")
        assert on_disk(root) == ["c1", "served"]


async def test_retention_keeps_a_checkpoint_a_restore_is_reading(job, tmp_path, monkeypatch):
    """A restore that began after retention's snapshot and is still loading the rows when
    the pass reaches its checkpoint: the checkpoint is kept and the restore completes."""
    from stream_persia.api import checkpoints as checkpoints_mod

    from stream_persia.checkpoint import retention

    root = str(tmp_path / "ckpts")
    await job.train(2)
    aged(await write_checkpoint(job, f"{root}/old", TwoHeads()))
    want = rows_of(job)
    await job.train(2, seed=5)
    async with LiveApi(settings_for(job, checkpoint_dir=root, keep_checkpoints=1)) as api:
        loop = asyncio.get_running_loop()
        ckpts = api.state.checkpoints
        loading, pass_over = asyncio.Event(), asyncio.Event()
        real_load, real_expired, real_prune = (checkpoints_mod.load_embeddings,
                                               retention.expired, checkpoints_mod.prune_checkpoints)
        restore = []

        async def held_load(*args, **kw):   # the restore waits for retention's pass
            loading.set()
            await pass_over.wait()
            return await real_load(*args, **kw)

        async def start_restore():
            restore.append(asyncio.create_task(
                api.client.post("/v1/checkpoints/old/restore", headers=AUTH)))
            await loading.wait()

        def restore_meanwhile(*args):
            found = real_expired(*args)
            if not restore:
                asyncio.run_coroutine_threadsafe(start_restore(), loop).result()
            return found

        def prune(*args, **kw):
            try:
                return real_prune(*args, **kw)
            finally:
                loop.call_soon_threadsafe(pass_over.set)

        monkeypatch.setattr(checkpoints_mod, "load_embeddings", held_load)
        monkeypatch.setattr(retention, "expired", restore_meanwhile)
        monkeypatch.setattr(checkpoints_mod, "prune_checkpoints", prune)
        await take_checkpoint(api, "c1")
        async with asyncio.timeout(30):
            r = await restore[0]
        assert r.status_code == 200, r.text
        assert "old" in os.listdir(root)
        got = rows_of(job)
        assert got.keys() == want.keys()
        for k, (w8, _) in want.items():
            np.testing.assert_allclose(got[k][0], w8, atol=1e-6, rtol=0)
        assert ckpts.in_use() == {"old": "the model being served"}   # the restore reloaded it


def aged(path: str, **fields: str) -> None:
    """Make the checkpoint at ``path`` older than any taken now (retention's order), and
    change its manifest's ``fields``."""
    with open(os.path.join(path, "manifest.json")) as f:
        m = json.load(f)
    m["created_at"] = "2024-01-01T00:00:00Z"   # the manifest carries no checksum of itself
    m.update(fields)
    with open(os.path.join(path, "manifest.json"), "w") as f:
        json.dump(m, f)


async def wait_retention(api: LiveApi) -> None:
    """Until the retention pass after the last checkpoint (a task of its job) ended."""
    async with asyncio.timeout(30):
        for job in list(api.state.checkpoints.jobs.values()):
            if job.task is not None:
                await asyncio.shield(job.task)


@pytest.mark.kafka
async def test_an_api_cut_carries_no_dense_model_of_another_job(tmp_path):
    """Another job reading the same topic (an experiment on the same data) wrote the
    newest checkpoint under the directory, at the very offsets of this job's cut: the
    checkpoint the API takes does not carry its dense model as this job's."""
    from test_api_kafka_data_loss import kafka_job

    root = str(tmp_path / "ckpts")
    async with kafka_job() as (_, job, _), \
            LiveApi(settings_for(job, checkpoint_dir=root, keep_checkpoints=0)) as api:
        first = (await take_checkpoint(api, "c0"))["manifest"]
        assert first["stream"] == "kafka" and first["offsets"]
        with CheckpointWriter(f"{root}/theirs") as w:
            w.write_torch("dense.pt", TwoHeads().state_dict())
            await w.dump_embeddings([job.client(a) for a in job.server_addresses])
            w.commit(job="another-job", step=7, offsets=first["offsets"], stream="kafka")
        got = (await take_checkpoint(api, "c1"))["manifest"]
        assert got["extra"]["dense_from"] != "theirs" and got["dense_filename"] is None
        assert got["step"] != 7
        # nor does it claim one from its own embeddings-only one
        assert got["extra"]["dense_from"] is None and got["extra"]["embeddings_only"]


def test_a_patch_of_a_base_being_deleted_is_refused_like_the_base(tmp_path):
    """Retention deleting a base marks the checkpoints that deleting it breaks (its
    patches) as being deleted too: a restore or reload of a patch that starts meanwhile
    is refused naming it, instead of failing later on the base's missing files."""
    from types import SimpleNamespace

    from stream_persia.api.checkpoints import Checkpoints

    from stream_persia.errors import Misuse

    ck = Checkpoints(settings_for(checkpoint_dir=str(tmp_path)),
                     roles=SimpleNamespace(workers=[]))
    with ck._retention_guard("a-base", ["a-base", "b-patch"]) as why:
        assert why is None
        for name in ("a-base", "b-patch"):
            with pytest.raises(Misuse, match=f"'{name}' is being deleted"):
                ck._pin(name)
    ck._pin("b-patch")          # the pass is over: usable again
    with ck._retention_guard("a-base", ["a-base", "b-patch"]) as why:
        assert why == "'b-patch' is being restored, loaded or copied"
    ck._release("b-patch")
    assert ck.in_use() == {}


def test_a_replica_without_its_jobs_checkpoint_names_the_jobs_it_sees(tmp_path):
    """A replica whose kafka.job_name differs from the trainer's waits for ever: its
    NotReady names the jobs whose checkpoints the directory holds."""
    from stream_persia.api.errors import NotReady
    from stream_persia.api.metrics import ApiMetrics
    from stream_persia.api.predictor import LATEST, Predictor
    from stream_persia.api.roles import Roles

    with CheckpointWriter(str(tmp_path / "theirs")) as w:
        w.write_bytes("x.bin", b"x")
        w.commit(job="ctr", step=1, offsets={}, stream="direct")
    predictor = Predictor(settings_for(checkpoint_dir=str(tmp_path)), Roles([], []),
                          ApiMetrics())
    with pytest.raises(NotReady) as err:
        predictor._start_path(LATEST)
    assert "no checkpoint of job 'persia'" in err.value.message
    assert "job(s) ['ctr']" in err.value.message
