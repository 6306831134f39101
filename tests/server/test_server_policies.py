"""The embedding server's table policies (issue 20) over real loopback sockets: ``configure``
with ``policies`` (validated, applied on the store thread, in ``get_config`` and its digest,
given back to a restarted server), the constructor's policies (what the launcher passes),
the periodic expiry pass (stopped with the server), ``slot_stats`` and the per-slot
metrics, and loads that keep the policies."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest

from stream_persia.core.embedding_config import SlotPolicy
from stream_persia.core.optim import SGD
from stream_persia.errors import BadInput
from stream_persia.kernels.ids import index_prefix, prefix_ids
from stream_persia.rpc import RpcClient
from stream_persia.server import service as service_mod
from stream_persia.server.row_dtypes import dtype_code, round_weights
from stream_persia.server.service import EmbeddingServer, described
from stream_persia.server.slot_policies import EXPIRE_INTERVAL_S

BITS = 8
DIM = 4


def table(**groups: dict) -> dict:
    """A ``policies`` param: group index 0 "user", 1 "item"."""
    names = ["user", "item"]
    policies: list = [None, None, None]
    for name, policy in groups.items():
        policies[names.index(name) + 1] = SlotPolicy(**policy).to_dict()
    return {"prefix_bits": BITS, "policies": policies, "names": [None, *names]}


def group_ids(group: int, raw: list[int]) -> np.ndarray:
    return prefix_ids(np.array(raw, dtype=np.uint64), index_prefix=index_prefix(group, BITS),
                      prefix_bits=BITS)


async def lookup(c: RpcClient, ids: np.ndarray) -> np.ndarray:
    reply = await c.call("lookup", {"mode": "train", "groups": [{"dim": DIM, "ids": ids}]})
    return reply["rows"][0]


class running:
    """One embedding server on loopback and a client, stopped on exit."""

    def __init__(self, **kw):
        self.server = EmbeddingServer(1000, SGD(lr=0.1), **kw)

    async def __aenter__(self) -> tuple[EmbeddingServer, RpcClient]:
        await self.server.start()
        self.client = RpcClient(self.server.address, timeout_ms=5000)
        return self.server, self.client

    async def __aexit__(self, *exc) -> None:
        await self.client.close()
        await self.server.stop()


@pytest.mark.parametrize("policies, field", [
    ({"prefix_bits": 0, "policies": []}, "policies.prefix_bits"),
    ({"prefix_bits": 33, "policies": []}, "policies.prefix_bits"),
    ({"prefix_bits": 8, "policies": [None, {"min_count": 0}]}, "policies.policies[1].min_count"),
    ({"prefix_bits": 8, "policies": [None, {"dtype": "int8"}]}, "policies.policies[1].dtype"),
    ({"prefix_bits": 8, "policies": [None, {"colour": 1}]}, "policies.policies[1].colour"),
    ({"prefix_bits": 8, "policies": [None, 5]}, "policies.policies[1]"),
    ({"prefix_bits": 2, "policies": [None] * 5}, "policies.policies"),
    ({"prefix_bits": 16, "policies": [None] * 40_000}, "policies.policies"),   # > the store's
    ({"prefix_bits": 8, "policies": [None], "names": [None, "x"]}, "policies.names"),
    ({"prefix_bits": 8, "policies": [None, None], "names": [None, "a b"]}, "policies.names[1]"),
    ({"prefix_bits": 8, "policies": [], "extra": 1}, "policies.extra"),
    ([1, 2], "policies"),
])
async def test_bad_policies_are_refused_naming_the_field_and_nothing_changes(policies, field):
    async with running() as (_, c):
        before = await c.call("get_config")
        with pytest.raises(BadInput) as info:
            await c.call("configure", {"optimizer": SGD(lr=0.5).to_dict(),
                                       "policies": policies})
        assert info.value.field == field
        assert await c.call("get_config") == before is None


async def test_without_policies_get_config_and_its_digest_are_as_before():
    async with running() as (server, c):
        await c.call("configure", {"optimizer": SGD(lr=0.5).to_dict()})
        cfg = await c.call("get_config")
        assert set(cfg) == {"digest", "optimizer", "embedding_config"}
        # the digest of the two parts as it was computed before policies existed
        import hashlib
        import json
        text = json.dumps({"optimizer": cfg["optimizer"],
                           "embedding_config": cfg["embedding_config"]},
                          sort_keys=True, default=repr).encode()
        assert cfg["digest"] == hashlib.sha256(text).hexdigest()[:16]


async def test_the_expiry_task_runs_with_the_server_and_stops_with_it():
    def expiry_tasks() -> list[asyncio.Task]:
        return [t for t in asyncio.all_tasks() if t.get_name() == "expire-rows"]

    server = EmbeddingServer(1000, SGD(lr=0.1))
    await server.start()
    try:
        assert len(expiry_tasks()) == 1
    finally:
        await server.stop()
    assert expiry_tasks() == []
    text = server.metrics.render().decode()
    for family in ("slot_rows gauge", "slot_admitted_total counter",
                   "slot_rejected_total counter", "slot_expired_total counter",
                   "slot_evicted_total counter", "slot_dropped_grads_total counter"):
        assert f"# TYPE persia_embedding_server_{family}" in text


async def test_configured_policies_apply_are_described_and_come_back_to_a_restarted_server():
    async with running() as (server, c):
        await c.call("configure", {"optimizer": SGD(lr=0.5).to_dict(),
                                   "policies": table(user={"min_count": 2})})
        cfg = await c.call("get_config")
        assert cfg["policies"] == table(user={"min_count": 2})
        user, item = group_ids(0, [1, 2, 3]), group_ids(1, [1, 2, 3])
        await lookup(c, user)
        await lookup(c, item)
        assert await c.call("size") == 3          # user ids are seen once: not yet rows
        await lookup(c, user)
        assert await c.call("size") == 6
        # a get_config reply is a valid configure: a fresh server gets the same table
        async with running() as (_, c2):
            await c2.call("configure", cfg)
            assert (await c2.call("get_config"))["digest"] == cfg["digest"]
            await lookup(c2, user)
            assert await c2.call("size") == 0
        # a digest that does not cover the policies sent is refused
        with pytest.raises(BadInput) as info:
            await c.call("configure", {**cfg, "policies": table(user={"min_count": 3})})
        assert info.value.field == "digest"
        # back to the defaults: no policies in get_config, the digest of the two parts
        await c.call("configure", {"policies": {"prefix_bits": BITS, "policies": []}})
        plain = await c.call("get_config")
        assert "policies" not in plain
        assert plain["digest"] == described(server.store.optimizer,
                                            server.store.embedding_config)["digest"]


async def test_constructor_policies_hold_from_the_start_and_survive_a_load(tmp_path):
    async with running(policies=table(item={"min_count": 2}),
                       checkpoint_root=str(tmp_path)) as (server, c):
        item = group_ids(1, [7, 8])
        await lookup(c, item)
        assert await c.call("size") == 0
        await lookup(c, item)
        assert await c.call("size") == 2
        reply = await c.call("dump", {"dir": str(tmp_path / "ck")})
        await c.call("load", {"dir": str(tmp_path / "ck"), "files": [reply["file"]]})
        assert await c.call("size") == 2
        await lookup(c, group_ids(1, [9]))        # the loaded store has the policy too
        assert await c.call("size") == 2
        stats = await server.on_store(server.store.policy_stats)
        assert stats[2]["rejected"] >= 1


async def test_a_float32_checkpoint_restores_into_a_float16_group_rounded(tmp_path):
    """A restore stages the rows into a store that has the server's policies *before* the
    shard files are read: the float16 group's restored rows are float16 (its rows were
    written by a float32 server), the other group's stay exact."""
    async with running(checkpoint_root=str(tmp_path)) as (_, c):
        user, item = group_ids(0, [1, 2, 3]), group_ids(1, [4, 5])
        await lookup(c, user)
        await lookup(c, item)
        grads = np.full((3, DIM), 1e-4 / 3, np.float32)   # rows float16 cannot hold exactly
        await c.call("update", {"groups": [{"dim": DIM, "ids": user, "grads": grads}]})
        want_user, want_item = await lookup(c, user), await lookup(c, item)
        reply = await c.call("dump", {"dir": str(tmp_path / "ck")})
    assert not np.array_equal(round_weights(want_user, dtype_code("float16")), want_user)
    async with running(policies=table(user={"dtype": "float16"}),
                       checkpoint_root=str(tmp_path)) as (_, c):
        await c.call("load", {"dir": str(tmp_path / "ck"), "files": [reply["file"]]})
        np.testing.assert_array_equal(await lookup(c, user),
                                      round_weights(want_user, dtype_code("float16")))
        np.testing.assert_array_equal(await lookup(c, item), want_item)


async def test_ttl_rows_expire_on_the_periodic_pass_and_show_in_metrics_and_slot_stats():
    async with running(policies=table(user={"ttl_s": 0.2})) as (server, c):
        await lookup(c, group_ids(0, [1, 2]))
        await lookup(c, group_ids(1, [1]))
        assert await c.call("size") == 3
        deadline = time.monotonic() + 10
        while await c.call("size") > 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert await c.call("size") == 1          # item rows have no TTL
        await asyncio.sleep(1.5)                  # the next pass's snapshot
        slots = await c.call("slot_stats")
        assert slots["user"]["expired"] == 2 and slots["user"]["rows"] == 0
        assert slots["item"]["rows"] == 1
        text = (await c.call("metrics")).decode()
        assert 'persia_embedding_server_slot_expired_total{slot="user"} 2.0' in text
        assert 'persia_embedding_server_slot_rows{slot="item"} 1.0' in text
        assert 'persia_embedding_server_slot_evicted_total{policy="cap",slot="user"}' in text


async def test_a_sharded_store_splits_a_groups_row_cap():
    async with running(store_threads=2) as (server, c):
        await c.call("configure", {"policies": table(user={"max_rows": 4})})
        await lookup(c, group_ids(0, list(range(1, 41))))
        await lookup(c, group_ids(1, list(range(1, 11))))
        assert await c.call("size") == 4 + 10
        stats = await server.on_store(server.store.policy_stats)
        assert stats[1]["evicted_cap"] == 36


async def test_a_server_with_store_threads_starts_and_answers_slot_stats():
    async with running(store_threads=2) as (_, c):
        assert isinstance(await c.call("slot_stats"), dict)
        assert b"persia_embedding_server_slot_rows" in await c.call("metrics")


async def test_an_expiry_backlog_beyond_one_pass_drains_without_waiting_a_second_a_pass(
        monkeypatch):
    """A pass evicts at most EXPIRE_ROWS rows (bounded work between requests on the store
    thread), but a backlog larger than that is not left to drain at EXPIRE_ROWS a second:
    a pass that hit the bound is followed by the next at once."""
    monkeypatch.setattr(service_mod, "EXPIRE_ROWS", 100)
    async with running(policies=table(user={"ttl_steps": 1})) as (_, c):
        await lookup(c, group_ids(0, list(range(1, 2001))))
        await lookup(c, group_ids(0, [0]))
        await lookup(c, group_ids(0, [0]))     # every other row unseen for a step
        start = time.monotonic()
        while await c.call("size") > 1 and time.monotonic() - start < 15:
            await asyncio.sleep(0.05)
        assert await c.call("size") == 1
        assert time.monotonic() - start < 2 * EXPIRE_INTERVAL_S + 1.0   # not 20 passes
