"""Bounds on RPC connections (stream_persia/rpc/server.py, transport.py): a cap on open
connections, an idle timeout, and a lean footprint for connections that carry little.
Real servers and clients on loopback; the memory check runs the server in a child process
on uvloop, as a role runs."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import subprocess
import sys

import numpy as np
import pytest

from stream_persia.config import GlobalConfig
from stream_persia.core import wire
from stream_persia.errors import ConfigError, PeerUnavailable
from stream_persia.rpc import RpcClient, RpcServer, parse_address
from stream_persia.rpc.auth import RoleSecret
from stream_persia.rpc.server import ConnectionLimits

SECRET = RoleSecret("correct-horse-battery-staple-0123")


async def echo(params):
    return params


async def sleep(params):
    await asyncio.sleep(params)
    return params


HANDLERS = {"echo": echo, "sleep": sleep}


def test_limits_are_validated_naming_the_field():
    for kw, field in (({"max_connections": 0}, "max_connections"),
                      ({"idle_timeout_s": 0}, "idle_timeout_s"),
                      ({"handshake_timeout_s": float("inf")}, "handshake_timeout_s")):
        with pytest.raises(ConfigError) as e:
            ConnectionLimits(**kw)
        assert e.value.field == field
    with pytest.raises(ConfigError, match="rpc.max_connections"):
        GlobalConfig.from_dict({"rpc": {"max_connections": 0}})
    assert GlobalConfig.from_dict({"rpc": {"idle_timeout_s": 0}}).rpc.idle_timeout_s == 0


# ----------------------------------------------------------------------- cap

@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "secret"])
async def test_connections_past_the_cap_are_refused_and_counted(secret):
    limits = ConnectionLimits(max_connections=3)
    async with RpcServer(HANDLERS, secret=secret, connection_limits=limits) as server:
        clients = [RpcClient(server.address, secret=secret, max_reconnect_backoff_ms=50)
                   for _ in range(5)]
        try:
            for c in clients[:3]:
                assert await c.call("echo", 1) == 1
            for c in clients[3:]:
                with pytest.raises(PeerUnavailable, match="max_connections=3") as e:
                    await c.call("echo", 1, timeout_ms=2000)
                assert e.value.field == "max_connections"
            stats = server.stats()
            assert stats["connections_open"] == 3 and stats["connections_refused"] == 2
            await clients[0].close()
            await asyncio.sleep(0.1)
            await asyncio.sleep(0.1)     # the refused client's backoff
            assert await clients[3].call("echo", 2) == 2    # a slot came free
        finally:
            for c in clients:
                await c.close()


async def test_strangers_cannot_keep_every_slot_from_the_jobs_roles():
    """Connections that never authenticate used to hold their slots for the whole
    handshake timeout: opened again and again they locked the job's own roles out of
    the port. At the cap, the oldest connection still in its handshake is closed for
    the new one; authenticated connections are never displaced."""
    limits = ConnectionLimits(max_connections=3, handshake_timeout_s=30)
    async with RpcServer(HANDLERS, secret=SECRET, connection_limits=limits) as server:
        host, port = parse_address(server.address)
        strangers = [await asyncio.open_connection(host, port) for _ in range(3)]
        await asyncio.sleep(0.1)
        async with RpcClient(server.address, secret=SECRET) as client:
            assert await client.call("echo", 1) == 1
            # the oldest stranger was told why (the cap: it may be a role that is slow
            # to authenticate, so nothing that blames its secret), and closed
            data = await asyncio.wait_for(strangers[0][0].read(), 5)
            (n,) = struct.unpack_from(">I", data)
            err = wire.unpack(data[4:4 + n])["e"]
            assert err["field"] == "max_connections" and err["type"] == "PeerUnavailable"
            # two more authenticated clients displace the other strangers; a fourth
            # finds only authenticated connections and is refused as before
            more = [RpcClient(server.address, secret=SECRET) for _ in range(3)]
            try:
                assert await more[0].call("echo", 2) == 2
                assert await more[1].call("echo", 3) == 3
                with pytest.raises(PeerUnavailable, match="max_connections=3"):
                    await more[2].call("echo", 4, timeout_ms=2000)
                assert await client.call("echo", 5) == 5
            finally:
                for c in more:
                    await c.close()
        for _, writer in strangers:
            writer.close()
        stats = server.stats()
        assert stats["auth_refused"] == 0 and stats["connections_refused"] >= 4


async def test_two_roles_connecting_at_once_at_the_cap_both_get_through():
    """With one slot, two clients holding the secret connect at once: the first, still
    in its handshake, is displaced for the second. It used to be told AuthError (a
    fatal 'wrong secret', counted in auth_refused, which fires the auth alarm); now it is
    told PeerUnavailable, which wait_ready retries, and is counted as a refusal at the
    cap. Once the second has closed, the first gets through."""
    limits = ConnectionLimits(max_connections=1, handshake_timeout_s=30)
    async with RpcServer(HANDLERS, secret=SECRET, connection_limits=limits) as server:
        a = RpcClient(server.address, secret=SECRET, max_reconnect_backoff_ms=50)
        b = RpcClient(server.address, secret=SECRET, max_reconnect_backoff_ms=50)
        try:
            res = await asyncio.gather(a.call("echo", 1, timeout_ms=3000),
                                       b.call("echo", 2, timeout_ms=3000),
                                       return_exceptions=True)
            failed = [r for r in res if isinstance(r, BaseException)]
            assert len(failed) == 1 and isinstance(failed[0], PeerUnavailable), res
            assert failed[0].field == "max_connections"
            stats = server.stats()
            assert stats["auth_refused"] == 0 and stats["connections_refused"] == 1
            loser = a if isinstance(res[0], BaseException) else b
            await (b if loser is a else a).close()
            await loser.wait_ready(5)                  # retried, not fatal
            assert await loser.call("echo", 3) == 3
        finally:
            await a.close()
            await b.close()


# ----------------------------------------------------------------------- idle timeout

@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "secret"])
async def test_an_idle_connection_is_closed_and_the_client_reconnects(secret):
    limits = ConnectionLimits(idle_timeout_s=0.4)
    async with RpcServer(HANDLERS, secret=secret, connection_limits=limits) as server, \
            RpcClient(server.address, secret=secret) as client:
        assert await client.call("echo", 1) == 1
        await asyncio.sleep(1.2)
        stats = server.stats()
        assert stats["idle_closed"] == 1 and stats["connections_open"] == 0
        assert client.stats()["goaways"] == 1 and not client.connected
        assert await client.call("echo", 2) == 2        # a new connection, no error
        assert client.stats()["connects"] == 2 and client.stats()["errors"] == 0


async def test_a_connection_with_a_request_in_flight_is_not_idle():
    limits = ConnectionLimits(idle_timeout_s=0.3)
    async with RpcServer(HANDLERS, connection_limits=limits) as server, \
            RpcClient(server.address) as client:
        assert await client.call("sleep", 1.2, timeout_ms=5000) == 1.2
        assert server.stats()["idle_closed"] == 0
        assert client.stats()["connects"] == 1


async def test_a_peer_that_ignores_the_goaway_is_closed(monkeypatch):
    """A raw client that never closes: the server closes it after the grace period."""
    from stream_persia.rpc import server as server_mod

    monkeypatch.setattr(server_mod, "GOAWAY_GRACE_S", 0.3)
    limits = ConnectionLimits(idle_timeout_s=0.2)
    async with RpcServer(HANDLERS, connection_limits=limits) as server:
        reader, writer = await asyncio.open_connection(*parse_address(server.address))
        data = await asyncio.wait_for(reader.read(), 5)    # goaway, then EOF
        writer.close()
        await writer.wait_closed()
    (n,) = struct.unpack_from(">I", data)
    goaway = wire.unpack(data[4:4 + n])
    assert goaway["goaway"] is True and goaway["id"] is None
    assert goaway["e"]["field"] == "idle_timeout_s"


async def test_a_peer_that_stops_reading_its_replies_is_aborted():
    """A raw client asks for large replies and never reads them: its requests stay in
    flight (so it is never idle), and it used to hold the connection, and every reply
    queued on it, for as long as it stayed connected. Now the connection is aborted once
    its replies have not drained for idle_timeout_s, and counted."""
    big = np.zeros(1 << 20, dtype=np.uint8)

    async def large(params):
        return big

    limits = ConnectionLimits(idle_timeout_s=0.5)
    async with RpcServer({"large": large, **HANDLERS}, connection_limits=limits) as server:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, parse_address(server.address))
        await loop.sock_sendall(sock, b"".join(frame({"id": i, "m": "large"})
                                               for i in range(16)))
        for _ in range(50):
            await asyncio.sleep(0.1)
            if not server._conns:
                break
        stats = server.stats()
        assert stats["connections_open"] == 0, "the stalled connection is still open"
        assert stats["write_stalled"] == 1
        assert server.connection_stats()["write_stalled"] == 1.0
        sock.close()
        # a client that reads its replies is not affected
        async with RpcClient(server.address) as client:
            for _ in range(3):
                assert len(await client.call("large", None)) == big.size
        assert server.stats()["write_stalled"] == 1


async def test_a_slow_but_steady_reader_of_a_large_reply_is_not_aborted():
    """The bound is on progress, not on the total time: a raw client that reads a 16 MiB
    reply steadily, but slower than the reply could drain within idle_timeout_s, used
    to be aborted once that time had passed; now it gets the whole reply. (Progress
    counts the kernel's send queue too: the write buffer alone moves in steps of half a
    send buffer, megabytes on loopback, which a slow reader takes seconds to read.)"""
    big = np.zeros(16 << 20, dtype=np.uint8)

    async def large(params):
        return big

    limits = ConnectionLimits(idle_timeout_s=0.5)
    async with RpcServer({"large": large, **HANDLERS}, connection_limits=limits) as server:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
        sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_connect(sock, parse_address(server.address))
        await loop.sock_sendall(sock, frame({"id": 1, "m": "large"}))
        got, t0 = 0, loop.time()
        try:
            while got < big.size:
                chunk = await asyncio.wait_for(loop.sock_recv(sock, 1 << 16), 5)
                if not chunk:
                    break
                got += len(chunk)
                await asyncio.sleep(0.02)
        finally:
            sock.close()
        took = loop.time() - t0
        assert server.stats()["write_stalled"] == 0 and got > big.size, (got, took)
        assert took > 2 * limits.idle_timeout_s, f"read in {took:.2f} s: too fast to tell"


async def test_the_idle_timeout_can_be_switched_off():
    limits = ConnectionLimits(idle_timeout_s=float("inf"))
    async with RpcServer(HANDLERS, connection_limits=limits) as server, \
            RpcClient(server.address) as client:
        assert await client.call("echo", 1) == 1
        assert server._sweeper is None


# ----------------------------------------------------------------------- footprint

def frame(msg) -> bytes:
    body = wire.pack(msg)
    return struct.pack(">I", len(body)) + body


async def test_a_connection_stays_lean_until_its_traffic_needs_more():
    """Small requests keep the connection's first (4 KiB) scratch buffer; frames of
    every size around its bounds, trickled or in one burst, are reassembled intact."""
    async with RpcServer(HANDLERS) as server, RpcClient(server.address) as client:
        for i in range(50):
            assert await client.call("echo", {"ids": [i, i + 1]}) == {"ids": [i, i + 1]}
        (conn,) = server._conns
        assert len(conn.proto._scratch) <= 4096
        sizes = [1, 900, 1010, 1100, 1500, 4000, 16_000, 16_400, 70_000, 3]
        arrays = [np.arange(n, dtype=np.float32) for n in sizes]
        back = await asyncio.gather(*(client.call("echo", a) for a in arrays))
        for a, b in zip(arrays, back, strict=True):
            np.testing.assert_array_equal(a, b)
        assert len(conn.proto._scratch) > 4096     # grown for the larger frames

        # the same frames trickled in by hand, a few bytes at a time, on a new connection
        stream = b"".join(frame({"id": i, "m": "echo", "p": a}) for i, a in enumerate(arrays))
        reader, writer = await asyncio.open_connection(*parse_address(server.address))
        for pos in range(0, len(stream), 4093):
            writer.write(stream[pos:pos + 4093])
            await writer.drain()
            await asyncio.sleep(0)
        got = {}
        for _ in arrays:
            (n,) = struct.unpack(">I", await reader.readexactly(4))
            reply = wire.unpack(await reader.readexactly(n))
            got[reply["id"]] = reply["r"]
        writer.close()
        await writer.wait_closed()
    for i, a in enumerate(arrays):
        np.testing.assert_array_equal(got[i], a)


SERVER = r"""
import sys
from stream_persia.core import aio
from stream_persia.launch.memory import keep_freed_memory
from stream_persia.rpc import RpcServer

async def echo(p):
    return p

async def main():
    keep_freed_memory()          # as a launched role does
    server = RpcServer({"echo": echo}, name="footprint")
    await server.start()
    print(server.port, flush=True)
    await aio.asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    await server.stop()

aio.run(main())
"""


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))


def _vm_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmSize")) // 1024


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_frames_announced_but_not_sent_reserve_little_memory():
    """A header announcing 256 MiB made the receiver reserve all of it before a byte of the
    body came: 20 connections that each announced one and sent 100 KB grew the server's
    address space (and the system's commit charge) by 5 GiB for 2 MB received. Now a
    large frame's buffer grows as its bytes arrive, 16 MiB ahead at most."""
    n = 20
    env = {**os.environ, "PERSIA_ROLE_SECRET": ""}
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        address = f"127.0.0.1:{int(proc.stdout.readline())}"

        async def body() -> int:
            async with RpcClient(address, secret=None) as client:
                assert await client.call("echo", 1) == 1
                before = _vm_mib(proc.pid)
                writers = []
                for _ in range(n):
                    _, w = await asyncio.open_connection(*parse_address(address))
                    w.write(struct.pack(">I", wire.WireLimits().max_frame_bytes) + b"\x81"
                            + b"x" * 100_000)
                    await w.drain()
                    writers.append(w)
                await asyncio.sleep(1.0)
                grew = _vm_mib(proc.pid) - before
                # the frames still arrive whole: one of 40 MiB, past two doublings
                big = np.arange(10 << 20, dtype=np.float32)
                np.testing.assert_array_equal(await client.call("echo", big), big)
                for w in writers:
                    w.close()
                return grew

        grew_mib = asyncio.run(asyncio.wait_for(body(), 60))
    finally:
        proc.stdin.close()
        proc.wait(30)
    assert grew_mib < n * 24, f"{n} announced frames grew the server by {grew_mib} MiB"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("secret", [None, SECRET], ids=["plain", "secret"])
def test_idle_connections_cost_little_memory(secret):
    """500 connections that each carried one small request, then went idle: the server
    grew by about 260 KiB per connection before (a 256 KiB scratch buffer each, ~127 MiB
    in all); now a few KiB. The bound is generous: 48 KiB per connection."""
    n = 500
    env = {**os.environ, "PERSIA_ROLE_SECRET": secret.value if secret else ""}
    proc = subprocess.Popen([sys.executable, "-c", SERVER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=env)
    try:
        address = f"127.0.0.1:{int(proc.stdout.readline())}"

        async def body() -> int:
            first = RpcClient(address, secret=secret)
            await first.call("echo", 0)
            await asyncio.sleep(0.3)
            before = _rss_kib(proc.pid)
            clients = [RpcClient(address, secret=secret) for _ in range(n)]
            try:
                for k in range(0, n, 50):   # in waves: the accept backlog is ~100
                    await asyncio.gather(*(c.call("echo", {"i": i})
                                           for i, c in enumerate(clients[k:k + 50])))
                await asyncio.sleep(0.5)
                return _rss_kib(proc.pid) - before
            finally:
                for c in [first, *clients]:
                    await c.close()

        grew_kib = asyncio.run(asyncio.wait_for(body(), 60))
    finally:
        proc.stdin.close()
        proc.wait(30)
    assert grew_kib < n * 48, f"{n} idle connections grew the server by {grew_kib} KiB"
