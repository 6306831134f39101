"""A restore is all or nothing across the embedding servers (two-phase ``load``).

Two embedding servers run in this process on real loopback sockets (the ``cluster`` of
``test_checkpoint_shard_load``: a checkpoint written, then trained on). Each server checks
every shard file by itself, so a damaged file is refused by all of them; what can fail on
one server alone is its memory (or the server itself). ``load_embeddings`` therefore
stages the new table on every server and swaps only once all of them staged: these tests
make one server fail and check that the other one did not change either.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import test_checkpoint_shard_load as shard_load
from prometheus_client.parser import text_string_to_metric_families

from stream_persia.checkpoint import CheckpointWriter, load_embeddings, read_manifest
from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.optim import Adagrad, Adam
from stream_persia.errors import BadInput, PeerUnavailable, RemoteError
from stream_persia.kernels.ids import index_prefix, prefix_ids
from stream_persia.server import service as embedding_server
from stream_persia.testing.servers import running_servers
from stream_persia.worker.router import ShardRouter
from stream_persia.worker.shards import RowLookup, UpdateGroup

cluster = shard_load.cluster   # the fixture: 2 servers, a checkpoint, trained on since
observe, probe_ids = shard_load.observe, shard_load.probe_ids


async def stats(router) -> list[dict]:
    return [await c.call("stats", None) for c in router.clients]


async def views(servers, router, probe) -> list[dict]:
    """What a user sees of each server (its eval lookups count in ``stats``: take those
    first)."""
    return [await observe(s, c, probe) for s, c in zip(servers, router.clients, strict=True)]


def fail_on(replica: int, monkeypatch) -> None:
    """Replica ``replica`` runs out of memory halfway through staging the checkpoint (as
    ``shard_files.stage_shard_files`` reports it); the other stages it normally."""
    real = embedding_server.stage_shard_files

    def stage(staging, directory, files, expected, replica_index, replica_size, **kw):
        kept = real(staging, directory, files, expected, replica_index, replica_size, **kw)
        if replica_index == replica:   # after the work, as if the last row did not fit
            raise BadInput(f"out of memory loading shard file {files[0]} into a new table "
                           "beside the current one", field="files[0]")
        return kept

    monkeypatch.setattr(embedding_server, "stage_shard_files", stage)


@pytest.mark.parametrize("failing", [0, 1])
async def test_a_server_failing_alone_leaves_every_server_as_it_was(cluster, monkeypatch,
                                                                    failing):
    servers, router, d, manifest = cluster
    probe = probe_ids(servers, d, manifest.embedding_files)
    seen, counted = await views(servers, router, probe), await stats(router)
    fail_on(failing, monkeypatch)
    with pytest.raises(BadInput, match="out of memory") as err:
        await load_embeddings(d, router.clients)
    assert err.value.field == "files[0]"
    assert await stats(router) == counted
    assert await views(servers, router, probe) == seen
    assert [s._staged for s in servers] == [None, None], "the staged table was dropped"


async def test_a_restore_swaps_every_server_once(cluster):
    servers, router, d, manifest = cluster
    loads = [(await c.call("stats", None))["loads"] for c in router.clients]
    assert await load_embeddings(d, router.clients) == manifest.rows
    assert [(await c.call("stats", None))["loads"] for c in router.clients] == \
        [n + 1 for n in loads]
    assert sum([len(s.store) for s in servers]) == manifest.rows
    assert [s._staged for s in servers] == [None, None]


class BeforeCommit:
    """A client of replica ``server`` that runs ``act(server)`` when told to commit, then
    passes the call on (or, with ``lose_reply``, makes it and reports the link lost)."""

    def __init__(self, client, server, act=None, lose_reply=False):
        self.client, self.server, self.act, self.lose_reply = client, server, act, lose_reply

    async def call(self, method, params, **kw):
        if method == "commit_load" and self.act is not None:
            await self.act(self.server)
        reply = await self.client.call(method, params, **kw)
        if method == "commit_load" and self.lose_reply:
            raise PeerUnavailable("the reply to commit_load was lost (test)")
        return reply


def staged_rows(server) -> float:
    """The server's exported persia_embedding_server_restore_staged_rows."""
    for family in text_string_to_metric_families(server.metrics.render().decode()):
        if family.name == "persia_embedding_server_restore_staged_rows":
            return family.samples[0].value
    raise AssertionError("no persia_embedding_server_restore_staged_rows metric")


def rows(server) -> list:
    return [(c["dim"], c["ids"].tolist(), c["weights"].tobytes(), c["state"].tobytes())
            for c in server.store.dump()]


def replacement(server, replica: int = 1) -> embedding_server.EmbeddingServer:
    """A fresh, empty server at ``server``'s address, as a supervisor restarts it."""
    host, port = server.address.rsplit(":", 1)
    return embedding_server.EmbeddingServer(
        10_000, server.store.optimizer, server.store.embedding_config,
        replica_index=replica, replica_size=2, host=host, port=int(port),
        checkpoint_root=server.checkpoint_root)


async def test_a_server_lost_before_its_commit_is_named(cluster):
    """Stage succeeds everywhere, then replica 1 stops before it is told to commit and
    does not come back within roll_forward_s: the error says which servers hold the
    checkpoint and which do not."""
    servers, router, d, manifest = cluster

    async def stop(server):
        await server.stop()

    clients = [router.clients[0], BeforeCommit(router.clients[1], servers[1], stop)]
    with pytest.raises(RemoteError, match=r"servers \[1\] did not take .* while servers "
                                          r"\[0\] did") as err:
        await load_embeddings(d, clients, timeout_ms=2000, roll_forward_s=0.5)
    assert "load the checkpoint again" in (err.value.hint or "")
    assert (await router.clients[0].call("stats", None))["loads"] == 1


async def test_a_server_restarted_before_its_commit_is_loaded_again(cluster):
    """Replica 1 dies between the phases (losing what it staged) and its supervisor starts
    a fresh one at the same address a moment later: the restore goes forward, loading the
    new server directly, and ends with both servers holding exactly the checkpoint (what a
    clean restore then gives)."""
    servers, router, d, manifest = cluster
    new = replacement(servers[1])

    async def crash_and_restart(server):
        await server.stop()

        async def restart():
            await asyncio.sleep(0.6)   # the first retries find nobody listening
            await new.start()
        asyncio.get_running_loop().create_task(restart())

    clients = [router.clients[0], BeforeCommit(router.clients[1], servers[1],
                                               crash_and_restart)]
    try:
        assert await load_embeddings(d, clients, timeout_ms=2000, roll_forward_s=30) == \
            manifest.rows
        assert new.store_stats()["loads"] == 1 and new._staged is None
        rolled = [rows(servers[0]), rows(new)]
        assert len(servers[0].store) + len(new.store) == manifest.rows
        assert await load_embeddings(d, router.clients) == manifest.rows   # a clean one
        assert [rows(servers[0]), rows(new)] == rolled
    finally:
        await new.stop()


async def test_a_lost_commit_reply_is_made_good_by_loading_again(cluster):
    """The commit happened but its reply was lost: loading the same checkpoint again is
    idempotent, so the restore succeeds and the server holds it once."""
    servers, router, d, manifest = cluster
    loads = [(await c.call("stats", None))["loads"] for c in router.clients]
    clients = [router.clients[0], BeforeCommit(router.clients[1], servers[1], lose_reply=True)]
    assert await load_embeddings(d, clients, timeout_ms=2000) == manifest.rows
    assert [(await c.call("stats", None))["loads"] for c in router.clients] == \
        [loads[0] + 1, loads[1] + 2]
    rolled = [rows(s) for s in servers]
    assert await load_embeddings(d, router.clients) == manifest.rows
    assert [rows(s) for s in servers] == rolled


async def test_a_different_replica_at_the_lost_servers_address_is_refused(cluster):
    """What answers at replica 1's address after the crash is replica 0 of another
    deployment: it is not loaded with replica 1's rows, and the error names the mix-up."""
    servers, router, d, manifest = cluster
    impostor = replacement(servers[1], replica=0)

    async def crash_and_replace(server):
        await server.stop()
        await impostor.start()

    clients = [router.clients[0], BeforeCommit(router.clients[1], servers[1],
                                               crash_and_replace)]
    try:
        with pytest.raises(RemoteError, match=r"servers \[1\] did not take .*reports "
                                              r"replica 0 of 2"):
            await load_embeddings(d, clients, timeout_ms=2000, roll_forward_s=5)
        assert impostor.store_stats()["loads"] == 0 and len(impostor.store) == 0
    finally:
        await impostor.stop()


async def test_a_staged_load_serves_nothing_until_committed(cluster):
    servers, router, d, manifest = cluster
    client, server = router.clients[0], servers[0]
    probe = probe_ids(servers, d, manifest.embedding_files)
    before = await observe(server, client, probe)
    params = {"dir": d, "files": manifest.embedding_files, "stage": True}
    assert staged_rows(server) == 0
    first = await client.call("load", params)
    assert set(first) == {"rows", "token"} and first["rows"] > 0
    assert staged_rows(server) == first["rows"]   # the second table shows in the metrics
    assert await observe(server, client, probe) == before
    # a newer load replaces the staged table: the first token is gone
    second = await client.call("load", params)
    with pytest.raises(BadInput, match="no staged load") as err:
        await client.call("commit_load", {"token": first["token"]})
    assert err.value.field == "token"
    assert await client.call("abort_load", {"token": first["token"]}) == {"aborted": False}
    assert await observe(server, client, probe) == before
    assert await client.call("commit_load", {"token": second["token"]}) == \
        {"rows": second["rows"]}
    assert len(server.store) == second["rows"] and staged_rows(server) == 0
    assert await observe(server, client, probe) != before
    with pytest.raises(BadInput, match="no staged load"):   # committed once only
        await client.call("commit_load", {"token": second["token"]})


async def test_a_configure_between_stage_and_commit_holds_after_the_commit(cluster):
    """A configure acknowledged while a restore is staged (the control plane's configure
    and restore run concurrently) is what the server serves once the restore commits:
    the staged table was built with the old configuration and used to bring it back,
    while the server kept reporting (and checking lookups against) the new digest."""
    servers, router, d, manifest = cluster
    client, server = router.clients[0], servers[0]
    staged = await client.call("load", {"dir": d, "files": manifest.embedding_files,
                                        "stage": True})
    await client.call("configure", {"optimizer": Adagrad(lr=0.25).to_dict()})
    configured = await client.call("get_config", None)
    assert configured["optimizer"]["lr"] == 0.25
    assert await client.call("commit_load", {"token": staged["token"]}) == \
        {"rows": staged["rows"]}
    assert await client.call("get_config", None) == configured
    assert server.store.optimizer.lr == 0.25
    assert server._config_digest == configured["digest"]


async def test_an_aborted_load_changes_nothing(cluster):
    servers, router, d, manifest = cluster
    client, server = router.clients[1], servers[1]
    probe = probe_ids(servers, d, manifest.embedding_files)
    before = await observe(server, client, probe)
    stats = await client.call("stats", None)
    staged = await client.call("load", {"dir": d, "files": manifest.embedding_files,
                                        "stage": True})
    assert await client.call("abort_load", {"token": staged["token"]}) == {"aborted": True}
    assert server._staged is None
    assert await observe(server, client, probe) == before
    stats_after = await client.call("stats", None)
    assert stats_after["loads"] == stats["loads"]


async def test_a_staged_load_is_dropped_after_its_ttl(tmp_path):
    async with running_servers(1) as (servers, router):
        await router.lookup([RowLookup(8, np.arange(5, dtype=np.uint64))], "train")
        with CheckpointWriter(str(tmp_path / "ck")) as w:
            await w.dump_embeddings(router.clients)
            manifest = w.commit(job="j", step=1, offsets={}, stream="direct")
        servers[0].stage_ttl_s = 0.2
        client = router.clients[0]
        staged = await client.call("load", {"dir": str(tmp_path / "ck"),
                                            "files": manifest.embedding_files, "stage": True})
        assert servers[0]._staged is not None
        await asyncio.sleep(0.6)
        assert servers[0]._staged is None, "the staged table's memory was freed"
        with pytest.raises(BadInput, match=r"stage_ttl_s=0.2 s"):
            await client.call("commit_load", {"token": staged["token"]})


@pytest.mark.parametrize("method, params, field", [
    ("commit_load", {}, "token"),
    ("commit_load", {"token": 7}, "token"),
    ("commit_load", {"token": "../../etc"}, "token"),
    ("abort_load", {"token": "ABCDEF0123456789"}, "token"),
    ("load", {"dir": "/x", "files": [], "stage": "yes"}, "stage"),
])
async def test_bad_two_phase_requests_name_the_field(cluster, method, params, field):
    _, router, _, _ = cluster
    with pytest.raises(BadInput) as err:
        await router.clients[0].call(method, params)
    assert err.value.field == field


def test_stage_ttl_must_be_positive():
    for bad in (0, -1, float("inf"), "10"):
        with pytest.raises(BadInput) as err:
            embedding_server.EmbeddingServer(10, stage_ttl_s=bad)
        assert err.value.field == "stage_ttl_s"


def by_id(servers) -> dict[int, tuple[bytes, bytes]]:
    """Every row of every server by id: (weights, optimizer state), any shard count."""
    return {i: (w.tobytes(), s.tobytes()) for server in servers for c in server.store.dump()
            for i, w, s in zip(c["ids"].tolist(), c["weights"], c["state"], strict=True)}


async def test_a_restore_into_fresh_servers_trains_on_as_the_job_did(tmp_path):
    """Issue 17: a restore into servers that were never configured (as launched: the
    default Adagrad and initialisation) failed, since the manifest did not record the
    embedding optimizer. The job's servers are configured with Adam (as TrainCtx does);
    the checkpoint records the configuration, the restore gives it to fresh servers (3
    instead of 2), and from there they train exactly as the job's own servers did."""
    config = {"optimizer": Adam(lr=0.01).to_dict(),
              "embedding_config": EmbeddingConfig((-0.05, 0.05)).to_dict()}
    d = str(tmp_path / "ck")
    async with running_servers(2) as (servers, router):
        await asyncio.gather(*(c.call("configure", config) for c in router.clients))
        held = await router.clients[0].call("get_config", None)
        await shard_load.train(router, seed=1)
        with CheckpointWriter(d) as w:
            await w.dump_embeddings(router.clients)
            manifest = w.commit(job="j", step=1, offsets={}, stream="direct")
        assert read_manifest(d).server_config == manifest.server_config == held
        assert held["optimizer"]["name"] == "adam"
        await shard_load.train(router, seed=2)
        want = by_id(servers)
    fresh = [embedding_server.EmbeddingServer(10_000, replica_index=i, replica_size=3,
                                              checkpoint_root=str(tmp_path))
             for i in range(3)]
    for s in fresh:
        await s.start()
    router = ShardRouter([s.address for s in fresh], timeout_ms=5000)
    try:
        assert [await c.call("get_config", None) for c in router.clients] == [None] * 3
        assert await load_embeddings(d, router.clients) == manifest.rows
        assert [await c.call("get_config", None) for c in router.clients] == [held] * 3
        await shard_load.train(router, seed=2)
        got = by_id(fresh)
        assert got.keys() == want.keys()
        assert got == want
    finally:
        await router.close()
        for s in fresh:
            await s.stop()


async def test_a_restore_leaves_a_configured_server_its_configuration(cluster):
    """A server that holds a configuration (the job's, or an operator's) keeps it."""
    servers, router, d, manifest = cluster
    assert manifest.server_config["optimizer"]["name"] == "adagrad"
    other = {"optimizer": Adagrad(lr=0.5).to_dict(),
             "embedding_config": EmbeddingConfig((-0.5, 0.5)).to_dict()}
    await asyncio.gather(*(c.call("configure", other) for c in router.clients))
    held = await router.clients[0].call("get_config", None)
    assert held["digest"] != manifest.server_config["digest"]
    assert await load_embeddings(d, router.clients) == manifest.rows
    assert [await c.call("get_config", None) for c in router.clients] == [held] * 2


async def test_a_float16_checkpoint_restores_into_fresh_servers_of_a_job_without_policies(
        tmp_path):
    """Table policies belong to the job (its embedding_config.yml, which the launcher
    gives the servers, or the API's configure), not to the checkpoint: the checkpoint of
    a job whose group was float16 restores into fresh servers of a job whose file has no
    policies as float32 rows holding the float16 values exactly, with the checkpoint's
    optimizer and no policies; a restore before or after the NN configures them ends alike."""
    float16 = {"prefix_bits": 8, "policies": [None, {"dtype": "float16"}],
               "names": [None, "user"]}
    config = {"optimizer": Adam(lr=0.01).to_dict(),
              "embedding_config": EmbeddingConfig((-0.05, 0.05)).to_dict()}
    ids = prefix_ids(np.arange(1, 200, dtype=np.uint64), index_prefix=index_prefix(0, 8),
                     prefix_bits=8)
    d = str(tmp_path / "ck")
    async with running_servers(2) as (servers, router):
        await asyncio.gather(*(c.call("configure", {**config, "policies": float16})
                               for c in router.clients))
        await router.lookup([RowLookup(4, ids)], "train")
        grads = np.random.default_rng(0).normal(size=(ids.size, 4)).astype(np.float32)
        await router.update([UpdateGroup(4, ids, grads)])
        with CheckpointWriter(d) as w:
            await w.dump_embeddings(router.clients)
            manifest = w.commit(job="j", step=1, offsets={}, stream="direct")
        assert manifest.server_config["policies"]["policies"][1]["dtype"] == "float16"
        want = by_id(servers)
    fresh = [embedding_server.EmbeddingServer(10_000, replica_index=i, replica_size=2,
                                              checkpoint_root=str(tmp_path))
             for i in range(2)]
    for s in fresh:
        await s.start()
    router = ShardRouter([s.address for s in fresh], timeout_ms=5000)
    try:
        assert await load_embeddings(d, router.clients) == manifest.rows
        held = [await c.call("get_config", None) for c in router.clients]
        assert all("policies" not in h for h in held), held
        assert held[0]["optimizer"] == config["optimizer"]
        assert by_id(fresh) == want     # float16 values held exactly as float32 rows
    finally:
        await router.close()
        for s in fresh:
            await s.stop()


@pytest.mark.parametrize("into, configured", [(2, "before"), (3, "after")])
async def test_a_restore_keeps_the_counts_of_frequency_admission(tmp_path, into, configured):
    """Issue 20: the count-min sketch of ``min_count`` admission went unsaved, so after a
    restore every id had to be seen ``min_count`` times again. It is in the checkpoint
    now: ids seen twice under ``min_count: 3`` get rows at their next training lookup
    after a restore into as many servers (and internal shards), or into another count
    (merged), the job's policies given before or after the restore."""
    policies = {"prefix_bits": 8, "policies": [None, {"min_count": 3}], "names": [None, "user"]}
    config = {"optimizer": Adagrad(lr=0.1).to_dict(),
              "embedding_config": EmbeddingConfig((-0.05, 0.05)).to_dict()}
    ids = prefix_ids(np.arange(1, 200, dtype=np.uint64), index_prefix=index_prefix(0, 8),
                     prefix_bits=8)
    d = str(tmp_path / "ck")

    async def configure(router):
        await asyncio.gather(*(c.call("configure", {**config, "policies": policies})
                               for c in router.clients))

    async with running_servers(2, store_threads=2) as (servers, router):
        await configure(router)
        for _ in range(2):
            await router.lookup([RowLookup(4, ids)], "train")
        assert sum(len(s.store) for s in servers) == 0, "seen twice: no row yet"
        with CheckpointWriter(d) as w:
            await w.dump_embeddings(router.clients)
            manifest = w.commit(job="j", step=1, offsets={}, stream="direct")
    async with running_servers(into, store_threads=2, checkpoint_root=str(tmp_path)) \
            as (fresh, router):
        if configured == "before":
            await configure(router)
        assert await load_embeddings(d, router.clients) == manifest.rows == 0
        if configured == "after":
            await configure(router)
        await router.lookup([RowLookup(4, ids)], "train")
        assert sum(len(s.store) for s in fresh) == len(ids), "the third sight admits them"


async def test_a_restore_rewinds_trained_through_to_the_checkpoints(tmp_path, monkeypatch):
    """Servers trained past a checkpoint and restored from it are trained through the
    checkpoint's event time (its manifest's ``extra``), not through what the replaced rows
    were: a status, replica or alert reading them would claim a freshness the restored
    model does not have. A server from before the field (a rolling upgrade) refuses it;
    the restore then goes on without it."""
    ids = np.arange(1, 33, dtype=np.uint64)

    async def train(router, event_time, token):
        await router.lookup([RowLookup(4, ids)], "train")
        update = router.split_update([UpdateGroup(4, ids, np.ones((ids.size, 4), np.float32))],
                                     token=token, event_time=event_time)
        await router.push(update)

    async def through(router):
        return [(await c.call("health"))["trained_through"] for c in router.clients]

    async with running_servers(2) as (_, router):
        await train(router, 100.0, "a")
        dst = str(tmp_path / "ck")
        with CheckpointWriter(dst) as w:
            await w.dump_embeddings(router.clients)
            w.commit(job="t", step=1, offsets={}, stream="direct",
                     extra={"trained_through": 100.0})
        await train(router, 200.0, "b")
        assert await through(router) == [200.0, 200.0]
        assert await load_embeddings(dst, router.clients) == 32
        assert await through(router) == [100.0, 100.0]

        await train(router, 200.0, "c")
        real = embedding_server.check_load_request

        def before_the_field(params):   # what a server of the previous version answers
            if "trained_through" in params:
                raise BadInput("unknown load field(s) ['trained_through']",
                               field="trained_through")
            return real(params)

        monkeypatch.setattr(embedding_server, "check_load_request", before_the_field)
        assert await load_embeddings(dst, router.clients) == 32
        assert await through(router) == [None, None]


async def test_a_restore_gives_the_servers_the_cuts_fingerprints(tmp_path, monkeypatch):
    """A Kafka checkpoint's fingerprints go to the servers with its cut (kept with the
    restored watermarks: a worker that resumes there checks them). A server from before
    the field (a rolling upgrade) refuses it, even beside trained_through; the restore
    then goes on without them."""
    ids = np.arange(1, 33, dtype=np.uint64)
    prints = {"t": {"0": {"offset": 4, "timestamp": 1_700_000_000_000,
                          "digest": "0123456789abcdef"}}}
    async with running_servers(2) as (_, router):
        await router.lookup([RowLookup(4, ids)], "train")
        dst = str(tmp_path / "ck")
        with CheckpointWriter(dst) as w:
            await w.dump_embeddings(router.clients)
            w.commit(job="t", step=1, offsets={"t": {"0": 5}}, stream="kafka",
                     fingerprints=prints, extra={"trained_through": 100.0})
        assert await load_embeddings(dst, router.clients) == 32
        for c in router.clients:
            assert (await c.call("watermarks"))["topics"] == {
                "t": {"0": {"offset": 4, "writer": None, "fingerprint": prints["t"]["0"]}}}
        real = embedding_server.check_load_request

        def before_the_fields(params):   # what a server of an older version answers
            unknown = sorted({"cut_fingerprints", "trained_through"} & set(params))
            if unknown:
                raise BadInput(f"unknown load field(s) {unknown}", field=unknown[0])
            return real(params)

        monkeypatch.setattr(embedding_server, "check_load_request", before_the_fields)
        assert await load_embeddings(dst, router.clients) == 32
        for c in router.clients:
            assert (await c.call("watermarks"))["topics"] == {
                "t": {"0": {"offset": 4, "writer": None}}}
