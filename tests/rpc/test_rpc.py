"""RPC layer: real sockets on loopback, real subprocess servers, under asyncio and uvloop.

Every socket test runs once on the standard loop (in debug mode) and once on uvloop,
through the ``run`` fixture, which also fails a test that leaves tasks behind.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import sys
import threading
import time

import numpy as np
import pytest

from stream_persia.core import aio, wire
from stream_persia.core.aio import LoopThread
from stream_persia.errors import (
    BadInput,
    ConfigError,
    InternalError,
    Misuse,
    PeerUnavailable,
    RemoteTimeout,
    WireError,
)
from stream_persia.rpc import RpcClient, RpcServer, framing, parse_address

uvloop = pytest.importorskip("uvloop")

SMALL = wire.WireLimits(max_frame_bytes=4096)


def _loop_factory(kind: str):
    def make():
        if kind == "uvloop":
            return uvloop.new_event_loop()
        loop = asyncio.new_event_loop()
        loop.set_debug(True)
        return loop
    return make


@pytest.fixture(params=["asyncio", "uvloop"])
def run(request):
    """Run a coroutine to completion on a fresh loop of the parametrized kind."""
    make = _loop_factory(request.param)

    def _run(coro, timeout: float = 15.0):
        loop = make()
        try:
            result = loop.run_until_complete(asyncio.wait_for(coro, timeout))
            left = [t for t in asyncio.all_tasks(loop) if not t.done()]
            if left:
                for t in left:
                    t.cancel()
                loop.run_until_complete(asyncio.wait(left))
            assert not left, f"test left tasks running: {left}"
            return result
        finally:
            loop.close()

    _run.kind = request.param
    return _run


# -- handlers -------------------------------------------------------------------------

async def echo(params):
    return params


async def bad_input(params):
    raise BadInput("slot 'x' has no dim", field="slots.x.dim", hint="set dim: 8")


async def config_error(params):
    raise ConfigError("bad capacity", field="capacity")


async def remote_timeout(params):
    raise RemoteTimeout("the embedding server did not answer", field="timeout_ms")


async def crash(params):
    return {"x": 1}["missing"]


async def zeros(params):
    return np.zeros(params, dtype=np.float64)


async def sleep_then_echo(params):
    await asyncio.sleep(params["s"])
    return params


HANDLERS = {"echo": echo, "bad_input": bad_input, "config_error": config_error,
            "remote_timeout": remote_timeout, "crash": crash, "sleep": sleep_then_echo, "zeros": zeros}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def raw_exchange(address: str, payload: bytes) -> list:
    """Send raw bytes, then read every frame until the server closes the connection."""
    host, port = parse_address(address)
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(payload)
    writer.write_eof()
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    await writer.wait_closed()
    frames = []
    while data:
        (n,) = struct.unpack(">I", data[:4])
        frames.append(wire.unpack(data[4:4 + n]))
        data = data[4 + n:]
    return frames


def frame(msg) -> bytes:
    body = wire.pack(msg)
    return struct.pack(">I", len(body)) + body


# -- pure framing (no sockets) ----------------------------------------------------------

def test_parse_address():
    assert parse_address("127.0.0.1:7000") == ("127.0.0.1", 7000)
    assert parse_address("[::1]:80") == ("::1", 80)
    assert parse_address("embedding-server-0.svc:9000") == ("embedding-server-0.svc", 9000)
    for bad in ("127.0.0.1", ":80", "host:0", "host:70000", "host:http"):
        with pytest.raises(BadInput, match="host:port") as info:
            parse_address(bad)
        assert info.value.field == "address"


def test_request_parsing_tells_identifiable_from_unidentifiable():
    req = framing.parse_request({"id": 3, "m": "lookup", "p": {"a": 1}}, "peer")
    assert req == framing.Request(3, "lookup", {"a": 1})
    assert framing.parse_request({"id": 4, "m": "health"}, "peer").params is None
    for msg in ([1, 2], {"m": "x"}, {"id": "3", "m": "x"}, {"id": True, "m": "x"}):
        with pytest.raises(framing.Unidentifiable):
            framing.parse_request(msg, "peer")
    with pytest.raises(framing.MalformedRequest) as info:
        framing.parse_request({"id": 9, "m": 5}, "peer")
    assert info.value.request_id == 9 and info.value.field == "m"


def test_frame_length_checked_before_body():
    framing.check_length(4096, SMALL, "peer")
    with pytest.raises(framing.Unidentifiable, match="4097 bytes, over max_frame_bytes=4096"):
        framing.check_length(4097, SMALL, "peer")
    with pytest.raises(framing.Unidentifiable, match="empty frame"):
        framing.check_length(0, SMALL, "peer")


def test_encode_joins_small_frames_and_splits_large_ones():
    small = framing.encode({"id": 1, "r": 2}, wire.DEFAULT_LIMITS, "reply")
    assert len(small) == 1 and struct.unpack(">I", small[0][:4])[0] == len(small[0]) - 4
    big = framing.encode({"id": 1, "r": np.zeros(1 << 17)}, wire.DEFAULT_LIMITS, "reply")
    assert len(big) == 2 and struct.unpack(">I", big[0])[0] == len(big[1])
    with pytest.raises(WireError, match="reply to 'lookup': .*max_frame_bytes 4096") as info:
        framing.encode({"id": 1, "r": b"x" * 5000}, SMALL, "reply to 'lookup'")
    assert info.value.field == "max_frame_bytes"


def test_reply_parsing():
    assert framing.parse_reply({"id": 1, "r": None}, "p") == framing.Reply(1, None, None)
    err = BadInput("x").to_dict()
    assert framing.parse_reply({"id": None, "e": err}, "p") == framing.Reply(None, None, err)
    for msg in ({"id": 1}, {"id": None, "r": 1}, {"id": "1", "r": 1}, {"id": 1, "e": "x"}, 7):
        with pytest.raises(WireError):
            framing.parse_reply(msg, "p")


def test_handlers_must_be_async():
    def sync_handler(params):
        return params

    with pytest.raises(Misuse, match="'sync' must be an `async def`"):
        RpcServer({"sync": sync_handler})

    class AsyncCallable:
        async def __call__(self, params):
            return params

    RpcServer({"ok": AsyncCallable(), "partial": echo})


# -- calls over real sockets ------------------------------------------------------------

def test_echo_round_trips_nested_values_and_arrays(run):
    arrays = {
        "f32": np.random.default_rng(0).standard_normal((64, 16)).astype(np.float32),
        "u64": np.array([0, 1, 2**64 - 1], dtype=np.uint64),
        "i8": np.arange(-5, 5, dtype=np.int8),
        "empty": np.zeros((0, 8), dtype=np.float16),
        "big": np.arange(1 << 17, dtype=np.float64),  # 1 MiB
    }
    value = {"ids": [1, 2, [3, {"deep": None}]], "ok": True, "f": 0.5, "s": "é",
             "b": b"\x00\xff", "arrays": arrays}

    async def body():
        if run.kind == "uvloop":
            assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
        async with RpcServer(HANDLERS, name="echo-server") as server:
            async with RpcClient(server.address) as client:
                got = await client.call("echo", value)
        assert {k: got[k] for k in ("ids", "ok", "f", "s")} == \
            {k: value[k] for k in ("ids", "ok", "f", "s")}
        assert bytes(got["b"]) == value["b"]
        for name, arr in arrays.items():
            assert got["arrays"][name].dtype == arr.dtype, name
            np.testing.assert_array_equal(got["arrays"][name], arr)

    run(body())


def test_many_concurrent_calls_share_one_connection_with_bounded_in_flight(run):
    active = {"now": 0, "max": 0}

    async def tracked(params):
        active["now"] += 1
        active["max"] = max(active["max"], active["now"])
        await asyncio.sleep(0.005)
        active["now"] -= 1
        return params * 2

    async def body():
        async with RpcServer({"double": tracked}, max_in_flight_per_conn=16) as server:
            async with RpcClient(server.address) as client:
                got = await asyncio.gather(*(client.call("double", i) for i in range(200)))
                assert got == [2 * i for i in range(200)]
                assert client.stats()["connects"] == 1
            stats = server.stats()
        assert stats["connections_total"] == 1
        assert stats["methods"]["double"]["calls"] == 200
        assert stats["methods"]["double"]["latency_s_buckets"][float("inf")] == 200
        # pipelined (many at once), but never more than the per-connection bound
        assert active["max"] == 16

    run(body())


def test_typed_errors_are_preserved(run):
    async def body():
        async with RpcServer(HANDLERS) as server, RpcClient(server.address) as client:
            with pytest.raises(BadInput) as info:
                await client.call("bad_input")
            assert type(info.value) is BadInput
            assert info.value.field == "slots.x.dim" and info.value.hint == "set dim: 8"
            assert "slot 'x' has no dim" in str(info.value)
            with pytest.raises(ConfigError) as info:
                await client.call("config_error")
            assert info.value.field == "capacity"
            # a handler's RemoteTimeout is not mistaken for this call's own timeout
            with pytest.raises(RemoteTimeout, match="the embedding server did not answer"):
                await client.call("remote_timeout")
            assert server.stats()["methods"]["bad_input"]["errors"] == 1

    run(body())


def test_unknown_method_names_it_and_lists_known_ones(run):
    async def body():
        async with RpcServer({"echo": echo, "lookup": echo}, name="emb-0") as server:
            async with RpcClient(server.address) as client:
                with pytest.raises(Misuse, match="emb-0 has no RPC method 'lokup'") as info:
                    await client.call("lokup", {})
                assert info.value.hint == "known methods: echo, lookup"
                assert await client.call("echo", 1) == 1

    run(body())


def test_handler_crash_is_internal_error_and_connection_survives(run, caplog):
    async def body():
        async with RpcServer(HANDLERS, name="emb-1") as server:
            async with RpcClient(server.address) as client:
                with pytest.raises(InternalError, match="'crash' raised KeyError"):
                    await client.call("crash")
                assert await client.call("echo", "still here") == "still here"
                assert client.stats()["connects"] == 1
    run(body())
    assert "Traceback" in caplog.text and "KeyError: 'missing'" in caplog.text


def test_timeout_is_remote_timeout_and_late_reply_is_discarded(run):
    async def body():
        async with RpcServer(HANDLERS) as server:
            async with RpcClient(server.address, name="slow-peer") as client:
                t0 = time.monotonic()
                with pytest.raises(RemoteTimeout) as info:
                    await client.call("sleep", {"s": 0.4}, timeout_ms=100)
                assert 0.09 <= time.monotonic() - t0 < 1.0
                msg = str(info.value)
                assert f"slow-peer {server.address}" in msg
                assert "'sleep'" in msg and "100 ms" in msg
                await asyncio.sleep(0.5)  # the late reply arrives and must be dropped
                assert await client.call("echo", "next") == "next"
                assert client.stats()["timeouts"] == 1

    run(body())


def test_dead_peer_fails_fast_naming_the_address(run):
    port = free_port()

    async def body():
        async with RpcClient(f"127.0.0.1:{port}", name="embedding-server") as client:
            t0 = time.monotonic()
            with pytest.raises(PeerUnavailable) as info:
                await client.call("lookup", {}, timeout_ms=10_000)
            assert time.monotonic() - t0 < 2.0
            assert f"embedding-server 127.0.0.1:{port} refused the connection" in str(info.value)
            # while backing off, a short call fails at once instead of waiting
            with pytest.raises(PeerUnavailable, match="refused.*reconnect backoff"):
                await client.call("lookup", {}, timeout_ms=1)
            # a call with time to spare waits out the backoff and reconnects
            async with RpcServer(HANDLERS, port=port):
                assert await client.call("echo", 1, timeout_ms=5000) == 1

    run(body())


def test_reconnect_backoff_is_capped(run):
    port = free_port()

    async def body():
        async with RpcClient(f"127.0.0.1:{port}", max_reconnect_backoff_ms=50) as client:
            for _ in range(6):
                t0 = time.monotonic()
                with pytest.raises(PeerUnavailable, match="refused"):
                    await client.call("echo", 1, timeout_ms=5000)
                # uncapped, the doubling backoff would pass 0.5 s by the 6th attempt
                assert time.monotonic() - t0 < 0.5
            assert client.stats()["connect_failures"] == 6

    run(body())


def test_wait_ready_waits_for_a_late_server_and_times_out_on_a_dead_one(run):
    port = free_port()

    async def body():
        async with RpcClient(f"127.0.0.1:{port}", name="late") as client:
            t0 = time.monotonic()
            with pytest.raises(PeerUnavailable, match="was not ready within 0.3 s.*refused"):
                await client.wait_ready(0.3)
            assert time.monotonic() - t0 < 1.5
        server = RpcServer(HANDLERS, port=port)

        async def start_later():
            await asyncio.sleep(0.3)
            await server.start()

        starter = asyncio.ensure_future(start_later())
        async with RpcClient(f"127.0.0.1:{port}") as client:
            await client.wait_ready(5.0, probe="echo")
            assert await client.call("echo", 1) == 1
        await starter
        await server.stop()

    run(body())


SERVER_SCRIPT = r"""
import asyncio, sys
from stream_persia.core import aio
from stream_persia.rpc import RpcServer

async def echo(p):
    return p

async def hang(p):
    print("hanging", flush=True)
    await asyncio.sleep(3600)

async def main():
    server = RpcServer({"echo": echo, "hang": hang}, port=int(sys.argv[1]), name="child")
    await server.start()
    print(server.port, flush=True)
    await asyncio.Event().wait()

aio.run(main())
"""


async def spawn_server(port: int = 0):
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SERVER_SCRIPT, str(port), stdout=asyncio.subprocess.PIPE)
    line = await asyncio.wait_for(proc.stdout.readline(), 10)
    return proc, int(line)


def test_killed_server_fails_pending_call_and_restart_recovers(run):
    async def body():
        proc, port = await spawn_server()
        address = f"127.0.0.1:{port}"
        try:
            async with RpcClient(address, name="child") as client:
                assert await client.call("echo", 1) == 1
                pending = asyncio.ensure_future(client.call("hang", None, timeout_ms=30_000))
                assert await asyncio.wait_for(proc.stdout.readline(), 5) == b"hanging\n"
                proc.kill()
                await proc.wait()
                with pytest.raises(PeerUnavailable) as info:
                    await asyncio.wait_for(pending, 5)
                assert f"child {address} closed the connection while 'hang'" in str(info.value)

                proc, _ = await spawn_server(port)  # same port
                assert await client.call("echo", 2) == 2
                assert client.stats()["connects"] == 2
        finally:
            if proc.returncode is None:
                proc.kill()
            await proc.wait()

    run(body())


def test_in_process_restart_on_same_port_recovers(run):
    async def body():
        server = RpcServer(HANDLERS)
        await server.start()
        port = server.port
        async with RpcClient(server.address) as client:
            assert await client.call("echo", 1) == 1
            await server.stop()
            with pytest.raises(PeerUnavailable):
                await client.call("echo", 2)
            server = RpcServer(HANDLERS, port=port)
            await server.start()
            assert await client.call("echo", 3) == 3
        await server.stop()

    run(body())


# -- hostile frames ---------------------------------------------------------------------

def test_oversized_frame_is_rejected_and_server_keeps_serving(run):
    async def body():
        async with RpcServer(HANDLERS, limits=SMALL, name="small") as server:
            # announces 1 GiB: rejected from the header alone, no body is sent or read
            (reply,) = await raw_exchange(server.address, struct.pack(">I", 1 << 30))
            assert reply["id"] is None and reply["e"]["kind"] == "wire"
            assert "over max_frame_bytes=4096" in reply["e"]["message"]
            # an HTTP request is not a frame either: its first 4 bytes read as ~1.2 GB
            (reply,) = await raw_exchange(server.address, b"GET / HTTP/1.1\r\n\r\n")
            assert reply["e"]["kind"] == "wire"
            async with RpcClient(server.address) as client:
                assert await client.call("echo", "alive") == "alive"
                # a real client whose limits allow more than the server's
                with pytest.raises(WireError, match="rejected a frame.*over max_frame_bytes=4096"):
                    await client.call("echo", b"x" * 5000)
                assert await client.call("echo", "reconnected") == "reconnected"
            assert server.stats()["frames_rejected"] == 3

    run(body())


def test_garbage_frames_are_rejected_and_server_keeps_serving(run):
    async def body():
        async with RpcServer(HANDLERS) as server:
            (reply,) = await raw_exchange(server.address, struct.pack(">I", 8) + b"\xc1" * 8)
            assert reply["id"] is None and reply["e"]["kind"] == "wire"
            (reply,) = await raw_exchange(server.address, struct.pack(">I", 0))
            assert "empty frame" in reply["e"]["message"]
            (reply,) = await raw_exchange(server.address, frame(["not", "a", "request"]))
            assert "no integer 'id'" in reply["e"]["message"]
            # a half-sent frame then EOF: the server just drops the connection
            assert await raw_exchange(server.address, struct.pack(">I", 100) + b"abc") == []
            async with RpcClient(server.address) as client:
                assert await client.call("echo", "alive") == "alive"

    run(body())


def test_malformed_request_with_id_gets_a_reply_and_connection_stays_open(run):
    async def body():
        async with RpcServer(HANDLERS) as server:
            host, port = parse_address(server.address)
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(frame({"id": 7, "m": 42}) + frame({"id": 8, "m": "echo", "p": "ok"}))
            await writer.drain()
            replies = []
            for _ in range(2):
                (n,) = struct.unpack(">I", await reader.readexactly(4))
                replies.append(wire.unpack(await reader.readexactly(n)))
            writer.close()
            await writer.wait_closed()
        assert replies[0]["id"] == 7 and replies[0]["e"]["field"] == "m"
        assert replies[1] == {"id": 8, "r": "ok"}

    run(body())


def test_limits_apply_to_replies_both_ways(run):
    async def body():
        async with RpcServer(HANDLERS, limits=SMALL) as server:
            async with RpcClient(server.address) as client:
                # the server will not send a reply over its own limit
                with pytest.raises(WireError, match="rpc cannot send the reply to 'zeros': .*max_frame_bytes 4096"):
                    await client.call("zeros", 1000)
                assert await client.call("echo", 1) == 1
        async with RpcServer(HANDLERS) as server:
            async with RpcClient(server.address, limits=SMALL, name="strict") as client:
                # a request over the client's own limit never leaves the process
                with pytest.raises(WireError, match="request 'echo' to strict .*max_frame_bytes 4096"):
                    await client.call("echo", b"x" * 5000)
                assert client.stats()["connects"] == 0
                # a reply over the client's limit fails the call, then the client reconnects
                with pytest.raises(WireError, match="strict .* sent an invalid reply frame"):
                    await client.call("zeros", 1000)
                assert await client.call("echo", 1) == 1
                assert client.stats()["connects"] == 2

    run(body())


# -- shutdown -------------------------------------------------------------------------

def started_sleep():
    """A handler that sleeps ``params`` seconds, and an event set once it has started."""
    started = asyncio.Event()

    async def handler(params):
        started.set()
        await asyncio.sleep(params)
        return params

    return handler, started


def test_stop_drains_in_flight_calls_then_refuses(run):
    async def body():
        handler, started = started_sleep()
        server = RpcServer({"sleep": handler, "echo": echo})
        await server.start()
        async with RpcClient(server.address) as client:
            call = asyncio.ensure_future(client.call("sleep", 0.3))
            await started.wait()
            await server.stop(drain_timeout_s=5)
            assert call.done() and call.result() == 0.3
            with pytest.raises(PeerUnavailable, match="refused"):
                await client.call("echo", 1)

    run(body())


def test_stop_cancels_calls_past_the_drain_timeout(run):
    async def body():
        handler, started = started_sleep()
        server = RpcServer({"sleep": handler}, name="emb-2")
        await server.start()
        async with RpcClient(server.address) as client:
            call = asyncio.ensure_future(client.call("sleep", 30))
            await started.wait()
            t0 = time.monotonic()
            await server.stop(drain_timeout_s=0.2)
            assert time.monotonic() - t0 < 3.0
            with pytest.raises(PeerUnavailable, match="emb-2 .* is shutting down"):
                await asyncio.wait_for(call, 2)

    run(body())


def test_client_close_fails_pending_calls_and_rejects_new_ones(run):
    async def body():
        handler, started = started_sleep()
        async with RpcServer({"sleep": handler, "echo": echo}) as server:
            client = RpcClient(server.address, name="c")
            call = asyncio.ensure_future(client.call("sleep", 5))
            await started.wait()
            await client.close()
            with pytest.raises(PeerUnavailable, match="was closed while 'sleep'"):
                await call
            with pytest.raises(Misuse, match="is closed"):
                await client.call("echo", 1)
            await server.stop(drain_timeout_s=0)

    run(body())


# -- sync code ------------------------------------------------------------------------

def test_loop_thread_runs_coroutines_from_sync_code():
    threads_before = threading.active_count()
    with LoopThread(name="rpc-test-loop") as lt:
        assert isinstance(lt.loop, uvloop.Loop) == aio.uvloop_available()
        server = RpcServer(HANDLERS)
        lt.run(server.start(), timeout=5)
        client = RpcClient(server.address)
        assert lt.run(client.call("echo", {"x": [1, 2]}), timeout=5) == {"x": [1, 2]}
        futures = [lt.submit(client.call("echo", i)) for i in range(50)]
        assert [f.result(5) for f in futures] == list(range(50))
        with pytest.raises(TimeoutError, match="cancelled"):
            lt.run(asyncio.sleep(10), timeout=0.1)
        with pytest.raises(BadInput):
            lt.run(client.call("bad_input"), timeout=5)
        lt.run(client.close(), timeout=5)
        lt.run(server.stop(), timeout=5)
    assert threading.active_count() == threads_before
    with pytest.raises(Misuse, match="closed"):
        lt.submit(asyncio.sleep(0))
    lt.close()  # idempotent


def test_client_is_bound_to_one_loop():
    async def first():
        async with RpcServer(HANDLERS) as server:
            client = RpcClient(server.address)
            assert await client.call("echo", 1) == 1
            with LoopThread() as other:
                with pytest.raises(Misuse, match="bound to another event loop"):
                    other.run(client.call("echo", 2), timeout=5)
            await client.close()

    aio.run(first())


def test_aio_run_uses_uvloop_when_available(monkeypatch):
    async def loop_type():
        return type(asyncio.get_running_loop())

    assert (aio.run(loop_type()) is uvloop.Loop) == aio.uvloop_available()
    try:
        assert aio.install_uvloop() == aio.uvloop_available()
        assert isinstance(asyncio.get_event_loop_policy(), uvloop.EventLoopPolicy)
    finally:
        asyncio.set_event_loop_policy(None)
    monkeypatch.setenv("STREAM_PERSIA_NO_UVLOOP", "1")
    assert not aio.uvloop_available()
    assert aio.run(loop_type()) is not uvloop.Loop


def test_loop_thread_run_reraises_the_coroutines_own_timeout():
    """A TimeoutError subclass raised by the coroutine is its result, not run()'s timeout."""
    from stream_persia.core.aio import LoopThread
    from stream_persia.errors import RemoteTimeout

    async def fails():
        raise RemoteTimeout("peer did not answer", field="peer")

    with LoopThread(name="t") as lt:
        with pytest.raises(RemoteTimeout, match="peer did not answer"):
            lt.run(fails())
