"""Embedding server 0's dense model over real sockets (stream_persia.server.dense_hub):
chunks assemble in any order, the held version only grows within a lineage, a newer
version drops an unfinished older one, a new lineage replaces the held blob whatever its
version and fences the one it replaced, the blob is checked against its sha256 and
bounded, every bad param is refused naming it, ``clear`` keeps the blob, a restarted
server holds none, and a launched server takes its bound from
``model_updates.max_dense_bytes``."""

from __future__ import annotations

import asyncio
import hashlib
import os

import pytest

from stream_persia.core import aio
from stream_persia.errors import BadInput
from stream_persia.launch.processes import RoleProcess
from stream_persia.rpc import RpcClient
from stream_persia.server.dense_hub import (
    DENSE_CHUNK_BYTES,
    MAX_LINEAGE,
    REPLACED_LINEAGES_KEPT,
    DenseHub,
    chunk_count,
)
from stream_persia.server.service import EmbeddingServer
from stream_persia.testing.servers import restarted, running_servers

C = DENSE_CHUNK_BYTES


def chunked(blob: bytes, version: int, event_time: float | None = 12.5,
            lineage: int | None = None) -> list[dict]:
    """``put_dense`` params of ``blob`` (without ``lineage`` unless given: a legacy put)."""
    n = chunk_count(len(blob))
    sha = hashlib.sha256(blob).hexdigest()
    extra = {} if lineage is None else {"lineage": lineage}
    return [{"version": version, "event_time": event_time, "chunk": i, "chunks": n,
             "data": blob[i * C:(i + 1) * C], "sha256": sha, **extra} for i in range(n)]


async def put(c: RpcClient, blob: bytes, version: int, lineage: int | None = None) -> None:
    for p in chunked(blob, version, lineage=lineage):
        await c.call("put_dense", p)


async def fetch(c: RpcClient, since: int = -1, lineage: int | None = None
                ) -> tuple[int | None, bytes | None, dict]:
    """A replica's pull: every chunk of one blob, checked."""
    ask = {"since": since} | ({} if lineage is None else {"lineage": lineage})
    first = await c.call("get_dense", {**ask, "chunk": 0})
    if first["data"] is None:
        return first["version"], None, first
    parts = [first["data"]]
    for i in range(1, first["chunks"]):
        reply = await c.call("get_dense", {**ask, "chunk": i})
        assert (reply["version"], reply["lineage"]) == (first["version"], first["lineage"])
        parts.append(reply["data"])
    blob = b"".join(parts)
    assert hashlib.sha256(blob).hexdigest() == first["sha256"]
    return first["version"], blob, first


async def dense_metrics(c: RpcClient) -> dict[str, float]:
    text = (await c.call("metrics")).decode()
    prefix = "persia_embedding_server_dense_"
    return {name.removeprefix(prefix): float(value) for name, value in
            (line.split() for line in text.splitlines() if line.startswith(prefix))}


async def refused(c: RpcClient, method: str, params: object) -> str | None:
    with pytest.raises(BadInput) as info:
        await c.call(method, params)
    return info.value.field


async def test_chunks_assemble_in_any_order_and_replicas_pull_the_newest():
    blob = os.urandom(2 * C + 123)
    async with running_servers(1) as ([server], _), RpcClient(server.address) as c:
        assert await fetch(c) == (None, None, {"version": None, "event_time": None,
                                               "chunks": 0, "chunk": 0, "data": None,
                                               "sha256": None, "lineage": None})
        parts = chunked(blob, 7)
        assert [(await c.call("put_dense", parts[i]))["complete"] for i in (2, 0, 0, 1)] \
            == [False, False, False, True]          # a chunk sent twice replaces itself
        version, got, meta = await fetch(c)
        assert (version, got, meta["event_time"], meta["chunks"]) == (7, blob, 12.5, 3)
        assert meta["lineage"] == 0            # a put without one: the legacy lineage
        # Not newer than `since`: the metadata only.
        assert (await c.call("get_dense", {"since": 7}))["data"] is None
        assert (await c.call("get_dense", {"since": 7}))["version"] == 7
        assert await refused(c, "get_dense", {"chunk": 3}) == "chunk"
        # clear drops the rows, not the model
        await c.call("clear")
        assert (await fetch(c))[1] == blob
        assert await dense_metrics(c) == {"version": 7, "bytes": len(blob),
                                          "assembling_bytes": 0, "published_total": 1,
                                          "refused_total": 0, "lineage_changes_total": 0,
                                          "lineage_refused_total": 0}


async def test_versions_only_grow_and_a_newer_version_drops_an_unfinished_one():
    old, new, newest = os.urandom(C + 5), os.urandom(10), os.urandom(C + 9)
    async with running_servers(1) as ([server], _), RpcClient(server.address) as c:
        for p in chunked(old, 5):
            await c.call("put_dense", p)
        for v in (5, 3):   # at or below the held version
            assert await refused(c, "put_dense", chunked(new, v)[0]) == "version"
        # version 9 starts assembling; version 10 drops it; 9's rest is then refused
        a = chunked(newest, 9)
        assert (await c.call("put_dense", a[0]))["complete"] is False
        assert (await c.call("put_dense", chunked(new, 10)[0]))["complete"] is True
        assert await refused(c, "put_dense", a[1]) == "version"
        assert (await fetch(c))[:2] == (10, new)
        assert (await fetch(c, since=10))[1] is None
        # a chunk older than the version assembling (but newer than the held one)
        await c.call("put_dense", chunked(newest, 12)[0])
        assert await refused(c, "put_dense", chunked(new, 11)[0]) == "version"
        assert (await dense_metrics(c))["refused_total"] == 4
        assert (await dense_metrics(c))["assembling_bytes"] == C
        assert (await c.call("put_dense", chunked(newest, 12)[1]))["complete"] is True
        assert (await fetch(c))[:2] == (12, newest)


async def test_a_sha256_mismatch_is_refused_and_nothing_is_held():
    blob = os.urandom(C + 1)
    async with running_servers(1) as ([server], _), RpcClient(server.address) as c:
        parts = chunked(blob, 1)
        bad = hashlib.sha256(b"other").hexdigest()
        for p in parts:
            p["sha256"] = bad
        await c.call("put_dense", parts[0])
        assert await refused(c, "put_dense", parts[1]) == "sha256"
        assert (await fetch(c))[0] is None
        # the same version, sent correctly, is then accepted
        for p in chunked(blob, 1):
            await c.call("put_dense", p)
        assert (await fetch(c))[:2] == (1, blob)


async def test_a_new_lineage_replaces_the_held_model_whatever_its_version():
    """A trainer restarted from scratch (step 1) against a server holding the crashed
    run's step 60: its model is held from its first publication on, and a replica serving
    the old one (since=60) gets it."""
    old, new = os.urandom(C + 5), os.urandom(2 * C + 7)
    a, b = 0x5EED, MAX_LINEAGE
    async with running_servers(1) as ([server], _), RpcClient(server.address) as c:
        await put(c, old, 60, lineage=a)
        assert (await fetch(c))[:2] == (60, old)
        await put(c, new, 1, lineage=b)
        version, got, meta = await fetch(c)
        assert (version, got, meta["lineage"]) == (1, new, b)
        # a replica serving lineage a's step 60 gets it; one asking by version alone (a
        # replica from before lineages) does not
        assert (await fetch(c, since=60, lineage=a))[:2] == (1, new)
        assert (await fetch(c, since=1, lineage=b))[1] is None
        assert (await c.call("get_dense", {"since": 60}))["data"] is None
        m = await dense_metrics(c)
        assert (m["lineage_changes_total"], m["published_total"], m["refused_total"]) \
            == (1, 2, 0)


async def test_a_replaced_lineage_is_refused_and_counted():
    """The trainer that was replaced, still running (a zombie), cannot publish over its
    successor: its puts are refused naming ``lineage``, even at a newer version; the new
    lineage's first chunk drops the old one's unfinished blob; the old blob stays held
    until the new one is complete."""
    held, unfinished, new = os.urandom(10), os.urandom(C + 1), os.urandom(C + 2)
    a, b = 11, 22
    async with running_servers(1) as ([server], _), RpcClient(server.address) as c:
        await put(c, held, 60, lineage=a)
        zombie = chunked(unfinished, 61, lineage=a)
        await c.call("put_dense", zombie[0])
        parts = chunked(new, 1, lineage=b)
        assert (await c.call("put_dense", parts[0]))["complete"] is False
        assert (await dense_metrics(c))["assembling_bytes"] == C     # b's, not a's
        assert (await fetch(c))[:2] == (60, held)        # until b's blob is complete
        with pytest.raises(BadInput) as info:
            await c.call("put_dense", zombie[1])
        assert info.value.field == "lineage" and "replaced" in info.value.message
        assert (await c.call("put_dense", parts[1]))["complete"] is True
        assert (await fetch(c))[:2] == (1, new)
        for version in (2, 10**9):
            assert await refused(c, "put_dense", chunked(held, version, lineage=a)[0]) \
                == "lineage"
        assert (await fetch(c))[:2] == (1, new)
        m = await dense_metrics(c)
        assert (m["lineage_refused_total"], m["refused_total"], m["lineage_changes_total"]) \
            == (3, 3, 1)


async def test_within_a_lineage_versions_only_grow():
    blob = os.urandom(10)
    async with running_servers(1) as ([server], _), RpcClient(server.address) as c:
        await put(c, os.urandom(20), 5, lineage=1)
        await put(c, blob, 7, lineage=2)
        for version in (7, 6, 0):
            assert await refused(c, "put_dense", chunked(os.urandom(8), version,
                                                         lineage=2)[0]) == "version"
        await put(c, os.urandom(9), 8, lineage=2)
        assert (await fetch(c))[0] == 8
        assert (await dense_metrics(c))["lineage_changes_total"] == 1


async def test_the_legacy_lineage_is_a_lineage_like_the_others():
    """Puts without ``lineage`` (a publisher from before lineages) are lineage 0: among
    themselves exactly as before (versions only grow: the other tests); a publisher with a
    lineage replaces them, and then they are refused like any replaced lineage."""
    async with running_servers(1) as ([server], _), RpcClient(server.address) as c:
        await put(c, b"legacy", 60)
        assert (await fetch(c))[2]["lineage"] == 0
        await put(c, b"fresh", 1, lineage=3)
        assert (await fetch(c))[:2] == (1, b"fresh")
        assert await refused(c, "put_dense", chunked(b"late", 61)[0]) == "lineage"
        # an explicit 0 is the legacy lineage too, and None means absent
        assert await refused(c, "put_dense", chunked(b"late", 62, lineage=0)[0]) \
            == "lineage"
        assert await refused(c, "put_dense", {**chunked(b"late", 63)[0], "lineage": None}) \
            == "lineage"


async def test_a_blob_whose_lineage_is_replaced_while_it_is_hashed_is_dropped():
    """The last chunk of lineage a arrives; while its sha256 runs (on a thread) lineage b's
    first chunk replaces a: a's blob is dropped, naming ``lineage``, and the held one is
    not replaced by it."""
    hub = DenseHub()
    await hub.put_dense(chunked(b"held", 1, lineage=1)[0])
    parts = chunked(os.urandom(C + 1), 2, lineage=1)
    await hub.put_dense(parts[0])
    last = asyncio.ensure_future(hub.put_dense(parts[1]))
    await asyncio.sleep(0)                     # a's last chunk: now hashing
    assert await hub.put_dense(chunked(os.urandom(C + 1), 1, lineage=2)[0]) \
        == {"complete": False}
    with pytest.raises(BadInput) as info:
        await last
    assert info.value.field == "lineage"
    assert (hub.held.version, hub.held.lineage, hub.held.data) == (1, 1, b"held")
    assert (hub.stats()["lineage_refused"], hub.stats()["refused"]) == (1, 1)


async def test_the_memory_of_replaced_lineages_is_bounded():
    async with running_servers(1) as ([server], _), RpcClient(server.address) as c:
        for lineage in range(1, REPLACED_LINEAGES_KEPT + 3):
            await c.call("put_dense", chunked(b"x", 1, lineage=lineage)[0])
        hub = server.dense
        assert len(hub._replaced) == REPLACED_LINEAGES_KEPT
        assert 1 not in hub._replaced and REPLACED_LINEAGES_KEPT + 1 in hub._replaced
        assert await refused(c, "put_dense", chunked(b"x", 2, lineage=2)[0]) == "lineage"


@pytest.mark.parametrize("lineage", [-1, 1 << 63, "7", True, 1.5, b"\x01"])
async def test_a_bad_lineage_is_refused_naming_it(lineage):
    async with running_servers(1) as ([server], _), RpcClient(server.address) as c:
        for method, params in (("put_dense", {**GOOD, "lineage": lineage}),
                               ("get_dense", {"lineage": lineage})):
            with pytest.raises(BadInput) as info:
                await c.call(method, params)
            assert info.value.field == "lineage"
            assert "lineage must be an int in [0, 2**63 - 1]" in info.value.message
        assert (await fetch(c))[0] is None
        # the bounds themselves are lineages
        for good in (0, MAX_LINEAGE):
            await c.call("put_dense", {**GOOD, "version": 2 + good % 7, "lineage": good})
            assert (await c.call("get_dense", {"lineage": good}))["lineage"] == good


GOOD = {"version": 1, "event_time": None, "chunk": 0, "chunks": 1, "data": b"x",
        "sha256": hashlib.sha256(b"x").hexdigest()}


@pytest.mark.parametrize("change,field", [
    ({"version": -1}, "version"), ({"version": "1"}, "version"), ({"version": True}, "version"),
    ({"chunks": 0}, "chunks"), ({"chunks": 1 << 40}, "chunks"),
    ({"chunk": 1}, "chunk"), ({"chunk": -1}, "chunk"),
    ({"event_time": "now"}, "event_time"), ({"event_time": float("nan")}, "event_time"),
    ({"data": "x"}, "data"), ({"data": b""}, "data"),
    ({"chunks": 2, "data": b"x"}, "data"),           # a chunk but the last one is short
    ({"data": b"x" * (C + 1)}, "data"),
    ({"sha256": "ABC"}, "sha256"), ({"sha256": None}, "sha256"),
    ({"extra": 1}, "extra"),
])
async def test_every_bad_put_param_is_refused_naming_it(change, field):
    async with running_servers(1) as ([server], _), RpcClient(server.address) as c:
        assert await refused(c, "put_dense", {**GOOD, **change}) == field
        assert (await fetch(c))[0] is None
        assert await refused(c, "put_dense", {k: v for k, v in GOOD.items()
                                              if k != "data"}) == "data"
        assert await refused(c, "put_dense", [GOOD]) == "params"


@pytest.mark.parametrize("params,field", [
    ({"since": -2}, "since"), ({"since": 1.5}, "since"), ({"chunk": -1}, "chunk"),
    ({"version": 3}, "version"), ("x", "params"),
])
async def test_every_bad_get_param_is_refused_naming_it(params, field):
    async with running_servers(1) as ([server], _), RpcClient(server.address) as c:
        assert await refused(c, "get_dense", params) == field


async def test_chunks_of_one_version_must_agree():
    blob = os.urandom(C + 3)
    async with running_servers(1) as ([server], _), RpcClient(server.address) as c:
        a, b = chunked(blob, 4)
        await c.call("put_dense", a)
        assert await refused(c, "put_dense", {**b, "event_time": 1.0}) == "event_time"
        assert await refused(c, "put_dense", {**b, "sha256": "0" * 64}) == "sha256"
        assert (await c.call("put_dense", b))["complete"] is True


async def test_the_blob_is_bounded_by_max_dense_bytes():
    server = EmbeddingServer(100, max_dense_bytes=C + 10)
    await server.start()
    try:
        async with RpcClient(server.address) as c:
            # more chunks than the bound allows: refused on its first chunk
            assert await refused(c, "put_dense", chunked(os.urandom(2 * C + 1), 1)[0]) \
                == "chunks"
            # two chunks, one byte too many in total: refused on the last one
            parts = chunked(os.urandom(C + 11), 2)
            await c.call("put_dense", parts[0])
            assert await refused(c, "put_dense", parts[1]) == "data"
            blob = os.urandom(C + 10)
            for p in chunked(blob, 3):
                await c.call("put_dense", p)
            assert (await fetch(c))[:2] == (3, blob)
    finally:
        await server.stop()


async def test_a_restarted_server_holds_no_dense_model():
    async with running_servers(1) as ([server], _):
        async with RpcClient(server.address) as c:
            for p in chunked(b"dense", 2):
                await c.call("put_dense", p)
            assert (await fetch(c))[0] == 2
        await server.stop()
        fresh = restarted(server)
        await fresh.start()
        try:
            async with RpcClient(fresh.address) as c:
                assert (await fetch(c))[0] is None
                # and it takes a lower version again (a fresh process knows none)
                for p in chunked(b"dense", 1):
                    await c.call("put_dense", p)
                assert (await fetch(c))[0] == 1
        finally:
            await fresh.stop()


def test_a_launched_server_takes_its_bound_from_the_global_config(tmp_path):
    cfg = tmp_path / "global_config.yml"
    cfg.write_text(f"model_updates:\n  max_dense_bytes: {C + 10}\n")
    proc = RoleProcess("embedding-server", ["--global-config", str(cfg)],
                       log_path=tmp_path / "server.log").start()
    try:
        address = proc.wait_ready(60)

        async def check() -> None:
            async with RpcClient(address) as c:
                assert await refused(c, "put_dense", chunked(os.urandom(2 * C + 1), 1)[0]) \
                    == "chunks"
                blob = os.urandom(C + 10)
                for p in chunked(blob, 1):
                    await c.call("put_dense", p)
                assert (await fetch(c))[:2] == (1, blob)

        aio.run(check())
    finally:
        proc.stop()
