"""Embedding server 0's dense model over real sockets (stream_persia.server.dense_hub):
chunks assemble in any order, the held version only grows, a newer version drops an
unfinished older one, the blob is checked against its sha256 and bounded, every bad param
is refused naming it, ``clear`` keeps the blob, a restarted server holds none, and a
launched server takes its bound from ``model_updates.max_dense_bytes``."""

from __future__ import annotations

import hashlib
import os

import pytest

from stream_persia.core import aio
from stream_persia.errors import BadInput
from stream_persia.launch.processes import RoleProcess
from stream_persia.rpc import RpcClient
from stream_persia.server.dense_hub import DENSE_CHUNK_BYTES, chunk_count
from stream_persia.server.service import EmbeddingServer
from stream_persia.testing.servers import restarted, running_servers

C = DENSE_CHUNK_BYTES


def chunked(blob: bytes, version: int, event_time: float | None = 12.5) -> list[dict]:
    n = chunk_count(len(blob))
    sha = hashlib.sha256(blob).hexdigest()
    return [{"version": version, "event_time": event_time, "chunk": i, "chunks": n,
             "data": blob[i * C:(i + 1) * C], "sha256": sha} for i in range(n)]


async def fetch(c: RpcClient, since: int = -1) -> tuple[int | None, bytes | None, dict]:
    """A replica's pull: every chunk of one version, checked."""
    first = await c.call("get_dense", {"since": since, "chunk": 0})
    if first["data"] is None:
        return first["version"], None, first
    parts = [first["data"]]
    for i in range(1, first["chunks"]):
        reply = await c.call("get_dense", {"since": since, "chunk": i})
        assert reply["version"] == first["version"]
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
                                               "sha256": None})
        parts = chunked(blob, 7)
        assert [(await c.call("put_dense", parts[i]))["complete"] for i in (2, 0, 0, 1)] \
            == [False, False, False, True]          # a chunk sent twice replaces itself
        version, got, meta = await fetch(c)
        assert (version, got, meta["event_time"], meta["chunks"]) == (7, blob, 12.5, 3)
        # Not newer than `since`: the metadata only.
        assert (await c.call("get_dense", {"since": 7}))["data"] is None
        assert (await c.call("get_dense", {"since": 7}))["version"] == 7
        assert await refused(c, "get_dense", {"chunk": 3}) == "chunk"
        # clear drops the rows, not the model
        await c.call("clear")
        assert (await fetch(c))[1] == blob
        assert await dense_metrics(c) == {"version": 7, "bytes": len(blob),
                                          "assembling_bytes": 0, "published_total": 1,
                                          "refused_total": 0}


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
