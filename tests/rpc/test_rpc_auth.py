"""The job's role secret on RPC connections (stream_persia/rpc/auth.py): real servers and
clients on loopback, over TCP and over the same-host Unix socket, and raw sockets that
speak the frames by hand the way a stranger would."""

from __future__ import annotations

import asyncio
import os
import struct
import subprocess
import sys

import pytest

from stream_persia.core import wire
from stream_persia.errors import AuthError, ConfigError, PeerUnavailable
from stream_persia.rpc import RpcClient, RpcServer, auth, parse_address
from stream_persia.rpc.auth import RoleSecret
from stream_persia.rpc.server import ConnectionLimits

SECRET = RoleSecret("correct-horse-battery-staple-0123")
OTHER = RoleSecret("another-jobs-secret-456789abcdef")

uvloop = pytest.importorskip("uvloop")


@pytest.fixture(params=["unix", "tcp"])
def transport(request, monkeypatch):
    """Each test once over the same-host Unix socket, once over TCP loopback."""
    if request.param == "tcp":
        monkeypatch.setenv("STREAM_PERSIA_RPC_UNIX", "0")
    return request.param


class Spy:
    """Handlers that record every call they ran."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def handlers(self) -> dict:
        async def clear(params):
            self.calls.append(("clear", params))

        async def echo(params):
            self.calls.append(("echo", params))
            return params

        return {"clear": clear, "echo": echo}


def frame(msg) -> bytes:
    body = wire.pack(msg)
    return struct.pack(">I", len(body)) + body


async def raw_frames(address: str, payload: bytes, *, timeout: float = 5.0) -> list:
    """Send raw bytes (no handshake), then read every frame until the server closes."""
    reader, writer = await asyncio.open_connection(*parse_address(address))
    writer.write(payload)
    await writer.drain()
    data = await asyncio.wait_for(reader.read(), timeout)
    writer.close()
    await writer.wait_closed()
    out, pos = [], 0
    while pos + 4 <= len(data):
        (n,) = struct.unpack_from(">I", data, pos)
        out.append(wire.unpack(data[pos + 4:pos + 4 + n]))
        pos += 4 + n
    return out


# ----------------------------------------------------------------------- the setting

def test_the_secret_comes_from_env_or_a_file(tmp_path):
    assert RoleSecret.from_env({}) is None
    got = RoleSecret.from_env({auth.SECRET_ENV: SECRET.value})
    assert got == SECRET and got.source == auth.SECRET_ENV
    f = tmp_path / "secret"
    f.write_text(SECRET.value + "\n")
    got = RoleSecret.from_env({auth.SECRET_FILE_ENV: str(f)})
    assert got.key == SECRET.key and got.source == auth.SECRET_FILE_ENV
    assert SECRET.value not in repr(got)


@pytest.mark.parametrize("env, field, match", [
    ({auth.SECRET_ENV: "x" * 20, auth.SECRET_FILE_ENV: "/f"}, auth.SECRET_ENV, "both"),
    ({auth.SECRET_ENV: "short"}, auth.SECRET_ENV, "at least 16"),
    ({auth.SECRET_FILE_ENV: "/nonexistent/secret"}, auth.SECRET_FILE_ENV, "cannot read"),
])
def test_bad_secret_settings_are_refused_naming_the_variable(env, field, match):
    with pytest.raises(ConfigError, match=match) as e:
        RoleSecret.from_env(env)
    assert e.value.field == field


def test_an_empty_secret_file_is_refused(tmp_path):
    (tmp_path / "s").write_text("\n")
    with pytest.raises(ConfigError, match="empty") as e:
        RoleSecret.from_env({auth.SECRET_FILE_ENV: str(tmp_path / "s")})
    assert e.value.field == auth.SECRET_FILE_ENV


# ----------------------------------------------------------------------- handshake

async def test_the_right_secret_works_and_authenticates_once_per_connection(transport):
    spy = Spy()
    async with RpcServer(spy.handlers(), secret=SECRET) as server, \
            RpcClient(server.address, secret=SECRET) as client:
        for i in range(20):
            assert await client.call("echo", i) == i
        stats = server.stats()
    assert stats["connections_total"] == 1 and stats["auth_refused"] == 0
    assert len(spy.calls) == 20


@pytest.mark.parametrize("client_secret", [None, OTHER], ids=["no-secret", "wrong-secret"])
async def test_a_client_without_the_secret_is_refused_and_runs_nothing(transport, client_secret):
    spy = Spy()
    async with RpcServer(spy.handlers(), secret=SECRET) as server:
        async with RpcClient(server.address, secret=client_secret,
                             max_reconnect_backoff_ms=50) as client:
            for _ in range(2):   # refused again on the reconnect, not a hang
                with pytest.raises(AuthError) as e:
                    await client.call("clear", None, timeout_ms=3000)
                assert auth.SECRET_ENV in str(e.value)
                assert e.value.field == auth.SETTING
                await asyncio.sleep(0.1)
        await asyncio.sleep(0.05)   # the mismatch notice reaches the server
        assert spy.calls == []
        assert server.stats()["auth_refused"] >= 2


async def test_a_client_with_a_secret_refuses_a_server_without_one(transport):
    """Mutual authentication: the client sends no request to a server that cannot prove
    the secret, and both sides name the setting."""
    spy = Spy()
    async with RpcServer(spy.handlers(), secret=None) as server, \
            RpcClient(server.address, secret=SECRET) as client:
        with pytest.raises(AuthError, match="has no role secret") as e:
            await client.call("clear", None, timeout_ms=3000)
        assert auth.SECRET_ENV in str(e.value)
        assert spy.calls == [] and server.stats()["auth_refused"] == 1


async def test_a_request_sent_without_the_handshake_is_answered_with_an_auth_error():
    """A stranger speaking the frame protocol by hand: its request is never run."""
    spy = Spy()
    async with RpcServer(spy.handlers(), secret=SECRET) as server:
        frames = await raw_frames(server.address, frame({"id": 1, "m": "clear", "p": None}))
    assert len(frames) == 1 and frames[0]["id"] is None
    err = frames[0]["e"]
    assert err["kind"] == "auth" and err["field"] == auth.SETTING
    assert "sent a request without authenticating" in err["message"]
    assert spy.calls == []


async def test_a_large_frame_before_the_handshake_is_refused_without_reading_it():
    """Before authenticating, a peer may not make the server allocate a large body."""
    spy = Spy()
    async with RpcServer(spy.handlers(), secret=SECRET) as server:
        frames = await raw_frames(server.address, struct.pack(">I", 200 << 20) + b"x" * 64)
    assert frames[0]["e"]["kind"] == "auth" and spy.calls == []
    assert server.stats()["auth_refused"] == 1


async def test_a_forged_proof_is_refused():
    """A stranger that sends a hello and then a proof it made up (it cannot compute the
    HMAC without the secret)."""
    spy = Spy()
    async with RpcServer(spy.handlers(), secret=SECRET) as server:
        reader, writer = await asyncio.open_connection(*parse_address(server.address))
        writer.write(frame(auth.hello(auth.new_nonce())))
        (n,) = struct.unpack(">I", await reader.readexactly(4))
        challenge = wire.unpack(await reader.readexactly(n))
        assert challenge["auth"] == "challenge"
        writer.write(frame({"auth": "proof", "proof": b"\0" * 32}) +
                     frame({"id": 1, "m": "clear", "p": None}))
        data = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        await writer.wait_closed()
    (n,) = struct.unpack_from(">I", data)
    refusal = wire.unpack(data[4:4 + n])
    assert refusal["id"] is None and refusal["e"]["kind"] == "auth"
    assert "does not match" in refusal["e"]["message"]
    assert spy.calls == [] and server.stats()["auth_refused"] == 1


async def test_a_silent_connection_is_closed_after_the_handshake_timeout():
    spy = Spy()
    limits = ConnectionLimits(handshake_timeout_s=0.3)
    async with RpcServer(spy.handlers(), secret=SECRET, connection_limits=limits) as server:
        frames = await raw_frames(server.address, b"", timeout=5)
        assert frames[0]["e"]["kind"] == "auth"
        assert "did not authenticate within 0.3 s" in frames[0]["e"]["message"]
        assert server.stats()["auth_refused"] == 1 and server.stats()["connections_open"] == 0


async def test_a_probe_that_connects_and_leaves_is_not_counted_as_refused():
    """Kubernetes' tcpSocket probes and compose's health checks only connect."""
    async with RpcServer(Spy().handlers(), secret=SECRET) as server:
        _, writer = await asyncio.open_connection(*parse_address(server.address))
        writer.close()
        await writer.wait_closed()
        await asyncio.sleep(0.1)
        assert server.stats()["auth_refused"] == 0


async def test_the_secret_never_travels_in_the_clear():
    """A relay between client and server records every byte both ways: the handshake
    works through it, and neither the secret nor anything it can be read from is sent."""
    seen = bytearray()

    async with RpcServer(Spy().handlers(), secret=SECRET) as server:
        host, port = parse_address(server.address)

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            while data := await src.read(65536):
                seen.extend(data)
                dst.write(data)
                await dst.drain()
            dst.close()

        async def relay(reader, writer):
            up_reader, up_writer = await asyncio.open_connection(host, port)
            await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer),
                                 return_exceptions=True)

        relay_server = await asyncio.start_server(relay, "127.0.0.2", 0)
        relay_port = relay_server.sockets[0].getsockname()[1]
        try:
            async with RpcClient(f"127.0.0.2:{relay_port}", secret=SECRET) as client:
                assert await client.call("echo", "hello") == "hello"
        finally:
            relay_server.close()
            await relay_server.wait_closed()
    assert b"challenge" in seen and b"proof" in seen      # the handshake went through
    assert SECRET.key not in seen and SECRET.key[:8] not in seen


def test_a_handshake_under_uvloop():
    """Roles run on uvloop: the same refusal and acceptance there."""
    async def body():
        spy = Spy()
        async with RpcServer(spy.handlers(), secret=SECRET) as server:
            async with RpcClient(server.address, secret=SECRET) as good:
                assert await good.call("echo", 1) == 1
            async with RpcClient(server.address, secret=None) as bad:
                with pytest.raises(AuthError):
                    await bad.call("clear", None, timeout_ms=3000)
        return spy.calls

    loop = uvloop.new_event_loop()
    try:
        assert loop.run_until_complete(asyncio.wait_for(body(), 20)) == [("echo", 1)]
    finally:
        loop.close()


async def test_a_client_reads_the_secret_from_its_environment(monkeypatch):
    """Every client in the project (the API's, the NN workers', the data loaders',
    stream-persia run's roles) presents the process's secret without being told."""
    monkeypatch.setenv(auth.SECRET_ENV, SECRET.value)
    async with RpcServer(Spy().handlers()) as server, RpcClient(server.address) as client:
        assert server.secret == SECRET
        assert await client.call("echo", 3) == 3


# ----------------------------------------------------------------------- loopback only

async def test_without_a_secret_a_server_binds_loopback_only():
    with pytest.raises(ConfigError, match="without a role secret") as e:
        await RpcServer(Spy().handlers(), host="0.0.0.0", secret=None).start()
    assert e.value.field == auth.SETTING and auth.SECRET_ENV in str(e.value)
    async with RpcServer(Spy().handlers(), host="0.0.0.0", secret=SECRET) as server:
        port = server.port
    async with RpcClient(f"127.0.0.1:{port}", secret=SECRET, timeout_ms=500) as client:
        with pytest.raises(PeerUnavailable):   # stopped: nothing left listening
            await client.call("echo", 1)


@pytest.mark.parametrize("role", ["embedding-server", "embedding-worker"])
def test_launching_a_role_on_a_public_address_without_a_secret_exits_2(role, tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in (auth.SECRET_ENV, auth.SECRET_FILE_ENV)}
    args = [sys.executable, "-m", "stream_persia.launch.cli", "launch", role, "--host", "0.0.0.0",
            "--ready-file", str(tmp_path / "ready")]
    if role == "embedding-worker":
        import yaml

        from stream_persia.testing.samples import SCHEMA

        cfg = tmp_path / "embedding_config.yml"
        cfg.write_text(yaml.safe_dump(SCHEMA.to_dict()))
        args += ["--embedding-servers", "127.0.0.1:1", "--embedding-config", str(cfg)]
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "without a role secret" in proc.stderr and auth.SECRET_ENV in proc.stderr
    assert not (tmp_path / "ready").exists()
