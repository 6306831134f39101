"""The Unix-socket shortcut for same-host RPC peers (stream_persia/rpc/unix.py)."""

from __future__ import annotations

import socket
import sys

import numpy as np
import pytest

from stream_persia.errors import PeerUnavailable
from stream_persia.rpc import RpcClient, RpcServer, unix

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="abstract Unix sockets exist on Linux only")


async def echo(params):
    return params


def transport_of(client: RpcClient) -> str:
    """"unix" or "tcp": the family of the client's socket (asyncio's or uvloop's)."""
    family = client._conn.proto.transport.get_extra_info("socket").family
    return {socket.AF_UNIX: "unix", socket.AF_INET: "tcp", socket.AF_INET6: "tcp"}[family]


async def test_a_loopback_client_talks_over_a_unix_socket():
    server = RpcServer({"echo": echo}, host="127.0.0.1", port=0)
    await server.start()
    try:
        async with RpcClient(server.address) as client:
            big = np.arange(1 << 20, dtype=np.float32)
            assert np.array_equal(await client.call("echo", big), big)
            assert transport_of(client) == "unix"
            assert client._conn.proto.transport.get_extra_info("peername") == \
                unix.name_for(server.port).encode()
    finally:
        await server.stop()


async def test_unix_connections_get_wide_buffers():
    """A stream Unix socket's default buffer (~208 KiB) made a 1 MiB echo 0.8x TCP's speed
    (load_tests/bench_rpc.py); widened, both ends ask for BUFFER_BYTES (capped by the
    kernel at net.core.wmem_max / rmem_max; Linux reports double what it grants)."""
    server = RpcServer({"echo": echo}, host="127.0.0.1", port=0)
    await server.start()
    try:
        async with RpcClient(server.address) as client:
            await client.call("echo", 1)
            sock = client._conn.proto.transport.get_extra_info("socket")
            for opt, cap_file in ((socket.SO_SNDBUF, "wmem_max"), (socket.SO_RCVBUF, "rmem_max")):
                with open(f"/proc/sys/net/core/{cap_file}") as f:
                    cap = int(f.read())
                assert sock.getsockopt(socket.SOL_SOCKET, opt) >= 2 * min(unix.BUFFER_BYTES, cap)
    finally:
        await server.stop()


async def test_switched_off_it_uses_tcp(monkeypatch):
    monkeypatch.setenv("STREAM_PERSIA_RPC_UNIX", "0")
    server = RpcServer({"echo": echo}, host="127.0.0.1", port=0)
    await server.start()
    try:
        assert server._unix is None
        async with RpcClient(server.address) as client:
            assert await client.call("echo", 7) == 7
            assert transport_of(client) == "tcp"
    finally:
        await server.stop()


async def test_tcp_connections_keep_alive_so_a_vanished_host_is_noticed(monkeypatch):
    """A peer whose host went away (no reset ever comes) with a call waiting on it was
    noticed only when the call timed out: up to a data loader's timeout_ms (600 s) for a
    lone worker. Both ends of a TCP connection now probe it after 15 s idle."""
    from stream_persia.rpc import transport

    monkeypatch.setenv("STREAM_PERSIA_RPC_UNIX", "0")
    server = RpcServer({"echo": echo}, host="127.0.0.1", port=0)
    await server.start()
    try:
        async with RpcClient(server.address) as client:
            await client.call("echo", 1)
            sock = client._conn.proto.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == \
                transport.KEEPALIVE_IDLE_S
            assert transport.KEEPALIVE_IDLE_S + transport.KEEPALIVE_COUNT * \
                transport.KEEPALIVE_INTERVAL_S <= 30
    finally:
        await server.stop()


async def test_a_name_held_by_something_else_falls_back_to_tcp():
    server = RpcServer({"echo": echo}, host="127.0.0.1", port=0)
    await server.start()
    port = server.port
    await server.stop()
    squatter = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    squatter.bind(unix.name_for(port))          # bound, never listening: connects fail
    try:
        server = RpcServer({"echo": echo}, host="127.0.0.1", port=port)
        await server.start()
        try:
            assert server._unix is None, "the server must not take a name in use"
            async with RpcClient(server.address) as client:
                assert await client.call("echo", "x") == "x"
                assert transport_of(client) == "tcp"
        finally:
            await server.stop()
    finally:
        squatter.close()


async def test_the_name_is_released_on_stop_and_a_stopped_peer_is_named():
    server = RpcServer({"echo": echo}, host="127.0.0.1", port=0)
    await server.start()
    port = server.port
    async with RpcClient(server.address, timeout_ms=2000) as client:
        assert await client.call("echo", 1) == 1
        await server.stop()
        with pytest.raises(PeerUnavailable) as err:
            await client.call("echo", 2)
        assert f"127.0.0.1:{port}" in str(err.value)
    again = RpcServer({"echo": echo}, host="127.0.0.1", port=port)
    await again.start()
    try:
        assert again._unix is not None
    finally:
        await again.stop()


def test_the_roles_event_loop_uses_it_too():
    """Roles run on aio.run's loop (uvloop where installed), not pytest's."""
    from stream_persia.core import aio

    async def main() -> str:
        server = RpcServer({"echo": echo}, host="127.0.0.1", port=0)
        await server.start()
        try:
            async with RpcClient(server.address) as client:
                assert await client.call("echo", [1, 2]) == [1, 2]
                return transport_of(client)
        finally:
            await server.stop()

    assert aio.run(main()) == "unix"
