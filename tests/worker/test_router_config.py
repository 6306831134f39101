"""The router learns the job's configuration, and a server never trains with the defaults.

Two embedding servers run in this process on real loopback sockets. The job configures
them once (as the NN rank 0 or the API does); the router learns that configuration from
their replies. A server replaced by a fresh process at the same address (what a
supervisor's restart gives: the default optimizer and initialisation, and no rows) fails
the job by default (tests/worker/test_server_restart.py); with ``on_server_restart:
continue`` it refuses the router's next request for want of the configuration, and the
router configures it with what it learned and retries, so the update lands with the job's
optimizer.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from stream_persia.embedding import EmbeddingConfig
from stream_persia.embedding.optim import SGD, Adagrad
from stream_persia.errors import BadInput, Misuse, PeerUnavailable
from stream_persia.kernels.sharding import shard_of
from stream_persia.testing.servers import restarted, running_servers
from stream_persia.worker.router import ShardRouter
from stream_persia.worker.shards import RowLookup, UpdateGroup

DIM = 4
JOB = {"optimizer": SGD(lr=0.5).to_dict(),
       "embedding_config": EmbeddingConfig((-0.001, 0.001)).to_dict()}   # not the default


def ids_on(replica: int, n: int = 8) -> np.ndarray:
    """``n`` ids that shard to ``replica`` of 2."""
    ids = np.arange(1, 200, dtype=np.uint64)
    return ids[shard_of(ids, 2) == replica][:n]


async def test_with_continue_a_restarted_server_is_configured_again_before_it_serves():
    async with running_servers(2, on_server_restart="continue") as (servers, router):
        await router.broadcast("configure", JOB)
        ids = np.concatenate([ids_on(0), ids_on(1)])
        await router.lookup([RowLookup(DIM, ids)], "train")
        learned = await router.clients[0].call("get_config")
        assert router.config == learned and learned["optimizer"] == JOB["optimizer"]

        await servers[1].stop()
        fresh = restarted(servers[1])
        await fresh.start()
        try:
            assert await router.clients[1].call("get_config") is None
            rows, _ = await router.lookup([RowLookup(DIM, ids)], "train")
            assert await router.clients[1].call("get_config") == learned
            # rows admitted after the restart are drawn from the job's range, not the
            # default (-0.01, 0.01)
            assert np.abs(rows[0]).max() <= 0.001
            grads = np.ones((ids.size, DIM), np.float32)
            assert await router.update([UpdateGroup(DIM, ids, grads)]) == (ids.size, 0)
            after, _ = await router.lookup([RowLookup(DIM, ids)], "eval")
            np.testing.assert_allclose(after[0], rows[0] - 0.5 * grads, atol=1e-6)  # SGD
            assert router.restarts == [0, 1] and not router.lost   # counted, not failed
        finally:
            await fresh.stop()


async def test_with_continue_a_job_that_never_configures_is_served_as_before():
    async with running_servers(2, on_server_restart="continue") as (servers, router):
        ids = np.concatenate([ids_on(0), ids_on(1)])
        await router.lookup([RowLookup(DIM, ids)], "train")
        assert router.config is None
        await servers[1].stop()
        fresh = restarted(servers[1])
        await fresh.start()
        try:
            await router.lookup([RowLookup(DIM, ids)], "train")   # no digest sent, none refused
            assert await router.clients[1].call("get_config") is None
            assert router.restarts == [0, 1]
        finally:
            await fresh.stop()


async def test_a_reconfigured_job_is_learned_again():
    """The API changes the optimizer of every server: the router learns the new one, and
    is what it gives a server restarted after that."""
    async with running_servers(2) as (_, router):
        await router.broadcast("configure", JOB)
        ids = ids_on(0)
        await router.lookup([RowLookup(DIM, ids)], "train")
        first = router.config
        await router.broadcast("configure", {"optimizer": Adagrad(lr=0.2).to_dict()})
        await router.lookup([RowLookup(DIM, ids)], "train")
        assert router.config["digest"] != first["digest"]
        assert router.config["optimizer"] == Adagrad(lr=0.2).to_dict()
        assert router.config["embedding_config"] == JOB["embedding_config"]


async def test_the_server_checks_the_expected_configuration():
    async with running_servers(1) as (_, router):
        client = router.clients[0]
        lookup = {"mode": "train", "groups": [{"dim": DIM, "ids": ids_on(0)}]}
        assert (await client.call("lookup", lookup))["config"] is None
        with pytest.raises(BadInput) as err:
            await client.call("lookup", {**lookup, "config": "../not-hex"})
        assert err.value.field == "config"
        with pytest.raises(Misuse, match="never configured") as err:
            await client.call("lookup", {**lookup, "config": "0123456789abcdef"})
        assert err.value.field == "config"
        update = {"groups": [{"dim": DIM, "ids": ids_on(0),
                              "grads": np.zeros((8, DIM), np.float32)}],
                  "config": "0123456789abcdef"}
        with pytest.raises(Misuse, match="never configured"):
            await client.call("update", update)
        await client.call("configure", JOB)
        digest = (await client.call("get_config"))["digest"]
        assert (await client.call("lookup", lookup))["config"] == digest
        # Another digest than its own is served: the API may be reconfiguring the job.
        assert (await client.call("update", update))["config"] == digest


async def test_a_request_right_behind_a_configure_sees_it():
    """Requests are handled on the store thread in arrival order: a lookup expecting the
    configuration that a configure sent just before it sets is served, even while that
    configure still waits for the store thread (held busy here)."""
    async with running_servers(2) as (servers, router):
        await router.clients[0].call("configure", JOB)
        digest = (await router.clients[0].call("get_config"))["digest"]
        client = router.clients[1]   # never configured
        busy = asyncio.ensure_future(servers[1]._run(time.sleep, 0.3))
        configure = asyncio.ensure_future(client.call("configure", JOB))
        lookup = asyncio.ensure_future(client.call(
            "lookup", {"mode": "train", "groups": [{"dim": DIM, "ids": ids_on(1)}],
                       "config": digest}))
        await asyncio.gather(busy, configure)
        assert (await lookup)["config"] == digest


async def test_a_restarted_worker_learns_before_its_first_request():
    """A worker that restarts together with server 1 (a new router, a fresh server 1)
    before the job trained anything learns the configuration from server 0 before
    anything is sent, and configures server 1 first: the first batch's rows on server 1
    come from the job's range. (Had server 0 held rows, server 1 would have lost some:
    tests/worker/test_server_restart.py.)"""
    async with running_servers(2) as (servers, old_router):
        await old_router.broadcast("configure", JOB)
        job = await old_router.clients[0].call("get_config")
        await servers[1].stop()
        fresh = restarted(servers[1])
        await fresh.start()
        router = ShardRouter([s.address for s in servers], timeout_ms=5000)
        try:
            rows, _ = await router.lookup([RowLookup(DIM, ids_on(1))], "train")
            assert np.abs(rows[0]).max() <= 0.001
            assert router.config == job
            assert await router.clients[1].call("get_config") == job
        finally:
            await router.close()
            await fresh.stop()


async def test_learn_follows_the_configuration_most_servers_hold():
    async with running_servers(3) as (_, router):
        other = {"optimizer": Adagrad(lr=0.2).to_dict()}
        await router.clients[0].call("configure", other)
        for c in router.clients[1:]:
            await c.call("configure", JOB)
        job = await router.clients[1].call("get_config")
        assert await router.learn() == job
        assert (await router.clients[0].call("get_config"))["digest"] != job["digest"]


async def test_learn_skips_a_server_that_does_not_answer():
    async with running_servers(2) as (servers, router):
        await router.broadcast("configure", JOB)
        job = await router.clients[0].call("get_config")
        await servers[1].stop()
        assert await router.learn() == job


async def test_learn_with_every_server_down_names_one():
    async with running_servers(2) as (servers, router):
        for s in servers:
            await s.stop()
        with pytest.raises(PeerUnavailable, match="embedding-server-0"):
            await router.learn()


async def test_a_get_config_reply_is_a_configure_and_its_digest_is_checked():
    async with running_servers(2) as (servers, router):
        await router.clients[0].call("configure", JOB)
        learned = await router.clients[0].call("get_config")
        await router.clients[1].call("configure", learned)   # given back as it came
        assert await router.clients[1].call("get_config") == learned

        other = {**learned, "optimizer": SGD(lr=0.25).to_dict()}   # tampered with
        partial = {"digest": learned["digest"], "optimizer": learned["optimizer"]}
        for params in (other, partial, {**learned, "digest": "not-hex"}):
            with pytest.raises(BadInput) as err:
                await router.clients[1].call("configure", params)
            assert err.value.field == "digest", str(err.value)
        assert await router.clients[1].call("get_config") == learned, "nothing changed"
