"""Authentication, the loopback rule, and request size limits, against a live server."""

from __future__ import annotations

import pytest
from api_helpers import AUTH, TOKEN, LiveApi, settings_for
from stream_persia.api import ApiSettings, create_app

from stream_persia.config import GlobalConfig
from stream_persia.core.hosts import is_loopback
from stream_persia.errors import ConfigError

CONTROL_ROUTES = [("GET", "/v1/status"), ("POST", "/v1/ingest/pause"),
                  ("POST", "/v1/ingest/resume"), ("GET", "/v1/embeddings/sizes"),
                  ("POST", "/v1/embeddings/clear"), ("GET", "/v1/checkpoints"),
                  ("POST", "/v1/checkpoints"), ("POST", "/v1/model/reload")]


async def test_control_routes_need_the_token():
    async with LiveApi(settings_for()) as api:
        for method, path in CONTROL_ROUTES:
            r = await api.client.request(method, path)
            assert r.status_code == 401, (path, r.text)
            assert r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["kind"] == "unauthorized"
            r = await api.client.request(method, path,
                                         headers={"Authorization": "Bearer nope"})
            assert r.status_code == 403, (path, r.text)
            assert r.json()["error"]["kind"] == "forbidden"
            r = await api.client.request(method, path, headers={"Authorization": f"Basic {TOKEN}"})
            assert r.status_code == 401, path
        # With the token the route runs (no roles configured: a 409 naming what is missing,
        # or an answer), never an auth error.
        r = await api.client.get("/v1/embeddings/sizes", headers=AUTH)
        assert r.status_code == 409
        assert r.json()["error"]["field"] == "PERSIA_EMBEDDING_SERVERS"
        assert (await api.client.get("/v1/status", headers=AUTH)).status_code == 200
        # Probes and metrics never need it.
        for path in ("/healthz", "/readyz", "/metrics", "/openapi.json"):
            assert (await api.client.get(path)).status_code == 200, path


async def test_predict_token_is_optional_and_configurable():
    async with LiveApi(settings_for()) as api:   # open by default: 503 (no model), not 401
        r = await api.client.post("/v1/predict", json={"id_type_features": {"user": [1]}})
        assert r.status_code == 503 and r.json()["error"]["kind"] == "not_ready"
    async with LiveApi(settings_for(predict_requires_token=True)) as api:
        body = {"id_type_features": {"user": [1]}}
        assert (await api.client.post("/v1/predict", json=body)).status_code == 401
        r = await api.client.post("/v1/predict", json=body,
                                  headers={"Authorization": "Bearer x"})
        assert r.status_code == 403
        assert (await api.client.post("/v1/predict", json=body,
                                      headers=AUTH)).status_code == 503


def test_no_token_refuses_a_public_address_but_allows_loopback():
    for host in ("0.0.0.0", "10.1.2.3", "::", "api.example.com"):
        with pytest.raises(ConfigError) as err:
            create_app(ApiSettings(host=host))
        assert "PERSIA_API_TOKEN" in str(err.value)
    for host in ("127.0.0.1", "127.8.0.1", "::1", "[::1]", "localhost"):
        assert is_loopback(host)
        create_app(ApiSettings(host=host))
    create_app(ApiSettings(host="0.0.0.0", token=TOKEN))


async def test_without_a_token_loopback_control_is_open():
    async with LiveApi(settings_for(token=None)) as api:
        assert (await api.client.get("/v1/status")).status_code == 200


def test_token_from_env_file_and_config(tmp_path, monkeypatch):
    monkeypatch.delenv("PERSIA_API_TOKEN", raising=False)
    monkeypatch.delenv("PERSIA_API_TOKEN_FILE", raising=False)
    monkeypatch.delenv("PERSIA_EMBEDDING_CONFIG", raising=False)
    assert ApiSettings.from_env().token is None
    secret = tmp_path / "token"
    secret.write_text("from-file-0123456789\n")
    monkeypatch.setenv("PERSIA_API_TOKEN_FILE", str(secret))
    assert ApiSettings.from_env().token == "from-file-0123456789"
    monkeypatch.setenv("PERSIA_API_TOKEN", "inline-0123456789")
    with pytest.raises(ConfigError, match="both"):
        ApiSettings.from_env()
    monkeypatch.delenv("PERSIA_API_TOKEN_FILE")
    assert ApiSettings.from_env().token == "inline-0123456789"
    monkeypatch.delenv("PERSIA_API_TOKEN")
    gc = GlobalConfig.from_dict({"api": {"token_file": str(secret), "host": "0.0.0.0"}})
    settings = ApiSettings.from_env(gc)
    assert settings.token == "from-file-0123456789" and settings.host == "0.0.0.0"
    settings.check_bind()
    (tmp_path / "empty").write_text("  \n")
    monkeypatch.setenv("PERSIA_API_TOKEN_FILE", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="empty"):
        ApiSettings.from_env()


@pytest.mark.parametrize("token", ["", "   ", "short", "fifteen-chars-x", " " * 8 + "a" * 15])
def test_a_short_or_empty_token_is_refused_naming_its_setting(tmp_path, monkeypatch, token):
    """The role secret needs 16 characters; the API token took any, even one character, so
    a bearer token guessable over HTTP served every control route. Each source is named."""
    for name in ("PERSIA_API_TOKEN", "PERSIA_API_TOKEN_FILE", "PERSIA_EMBEDDING_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    secret = tmp_path / "token"
    secret.write_text(token + "\n")
    with pytest.raises(ConfigError) as err:
        ApiSettings(host="0.0.0.0", token=token)
    assert err.value.field == "token" and "at least 16" in str(err.value)
    if token.strip():   # an empty env var means no token; an empty file is refused as empty
        monkeypatch.setenv("PERSIA_API_TOKEN", token)
        with pytest.raises(ConfigError) as err:
            ApiSettings.from_env()
        assert err.value.field == "PERSIA_API_TOKEN" and "at least 16" in str(err.value)
        monkeypatch.delenv("PERSIA_API_TOKEN")
        monkeypatch.setenv("PERSIA_API_TOKEN_FILE", str(secret))
        with pytest.raises(ConfigError) as err:
            ApiSettings.from_env()
        assert err.value.field == "PERSIA_API_TOKEN_FILE"
        monkeypatch.delenv("PERSIA_API_TOKEN_FILE")
        with pytest.raises(ConfigError) as err:
            ApiSettings.from_env(GlobalConfig.from_dict({"api": {"token_file": str(secret)}}))
        assert err.value.field == "api.token_file"
    with pytest.raises(ConfigError) as err:
        ApiSettings.from_env(GlobalConfig.from_dict({"api": {"token": token}}))
    assert err.value.field == "api.token"
    ApiSettings(host="0.0.0.0", token=" " + "x" * 16 + " ").check_bind()   # 16 will do


async def test_body_size_limit_is_413_declared_or_streamed():
    async with LiveApi(settings_for(max_body_bytes=2048)) as api:
        big = b'{"id_type_features": {"user": [' + b"1," * 3000 + b"1]}}"
        r = await api.client.post("/v1/predict", content=big,
                                  headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert r.json()["error"]["kind"] == "too_large"

        async def chunks():   # no Content-Length: counted as it arrives
            for _ in range(10):
                yield b" " * 1000

        r = await api.client.post("/v1/embeddings/configure", content=chunks(),
                                  headers={"content-type": "application/json", **AUTH})
        assert r.status_code == 413
        assert r.json()["error"]["field"] == "body"
        # The server is fine afterwards.
        assert (await api.client.get("/healthz")).status_code == 200


async def test_a_body_that_does_not_arrive_in_time_is_408_and_its_connection_closed(
        monkeypatch):
    """uvicorn has no deadline on a request body and the stalled-connection sweep leaves a
    request being served alone: a head announcing 1000 bytes followed by a byte now and
    then held its connection (and the handler waiting on it) for good. Now the body must
    arrive whole within BODY_TIMEOUT_S of its head (shortened here); a slower one is 408
    and its connection closed, and a body that arrives in time in pieces is served."""
    import asyncio
    import time

    from stream_persia.api import limits

    monkeypatch.setattr(limits, "BODY_TIMEOUT_S", 1.0)
    async with LiveApi(settings_for()) as api:
        host, port = api.url.removeprefix("http://").split(":")
        head = (b"POST /v1/embeddings/configure HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nAuthorization: Bearer " + TOKEN.encode()
                + b"\r\nContent-Length: %d\r\n\r\n")

        async def send_slowly(body: bytes, pieces: int, gap_s: float) -> tuple[bytes, float]:
            reader, writer = await asyncio.open_connection(host, int(port))
            t0 = time.monotonic()
            writer.write(head % len(body))

            async def trickle() -> None:
                for i in range(pieces):
                    writer.write(body[i * len(body) // pieces:(i + 1) * len(body) // pieces])
                    await asyncio.sleep(gap_s)

            task = asyncio.create_task(trickle())
            try:
                reply = await asyncio.wait_for(reader.read(), 10)   # until it closes
            finally:
                task.cancel()
                writer.close()
            return reply, time.monotonic() - t0

        body = b'{"admit_probability": 0.5}'.ljust(1000)
        reply, took = await send_slowly(body, 100, 0.2)     # 20 s of trickle
        assert reply.startswith(b"HTTP/1.1 408 "), reply
        assert b'"field":"body"' in reply and b"connection: close" in reply.lower()
        assert 0.9 < took < 5, took
        # in time, in pieces: served (no servers configured: 409 naming them, not 408)
        ok = await api.client.post("/v1/embeddings/configure", headers=AUTH,
                                   json={"admit_probability": 0.5})
        assert ok.status_code == 409
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(head % len(body) + body[:500])
        await asyncio.sleep(0.5)
        writer.write(body[500:])
        reply = await asyncio.wait_for(reader.readuntil(b"}}"), 5)
        assert reply.startswith(b"HTTP/1.1 409 "), reply
        writer.close()


async def test_bodies_held_by_the_requests_in_flight_are_bounded_together(monkeypatch):
    """Each body was bounded (max_body_bytes), their number was not: 2,000 concurrent
    16 MiB bodies held 32 GiB. Past MAX_INFLIGHT_BODY_BYTES over every request being served
    (shortened here), a request is 503 with Retry-After; the bytes are given back as
    requests are answered."""
    import asyncio

    from stream_persia.api import limits

    monkeypatch.setattr(limits, "MAX_INFLIGHT_BODY_BYTES", 1500)
    async with LiveApi(settings_for()) as api:
        host, port = api.url.removeprefix("http://").split(":")
        body = b'{"admit_probability": 0.5}'.ljust(1000)
        head = (b"POST /v1/embeddings/configure HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nAuthorization: Bearer " + TOKEN.encode()
                + b"\r\nContent-Length: 1000\r\n\r\n")
        first = await asyncio.open_connection(host, int(port))
        first[1].write(head + body[:900])
        await asyncio.sleep(0.3)
        second = await asyncio.open_connection(host, int(port))
        second[1].write(head + body[:900])
        reply = await asyncio.wait_for(second[0].read(), 5)
        assert reply.startswith(b"HTTP/1.1 503 "), reply
        assert b"retry-after: 1" in reply.lower() and b'"field":"body"' in reply
        first[1].write(body[900:])   # the first one completes and is answered
        reply = await asyncio.wait_for(first[0].readuntil(b"}}"), 5)
        assert reply.startswith(b"HTTP/1.1 409 "), reply   # no servers: 409, not 503
        for _, writer in (first, second):
            writer.close()
        for _ in range(3):   # its bytes were given back
            r = await api.client.post("/v1/embeddings/configure", content=body, headers={
                "content-type": "application/json", **AUTH})
            assert r.status_code == 409, r.text


async def test_a_body_alone_over_the_shared_bound_is_served(monkeypatch):
    """The shared bound is for bodies held together: one request alone is bounded by
    api.max_body_bytes only (a body over the bound, after a raised max_body_bytes, was
    answered 503 "retry shortly" every time)."""
    from stream_persia.api import limits

    monkeypatch.setattr(limits, "MAX_INFLIGHT_BODY_BYTES", 500)
    async with LiveApi(settings_for()) as api:
        body = b'{"admit_probability": 0.5}'.ljust(1000)
        r = await api.client.post("/v1/embeddings/configure", content=body, headers={
            "content-type": "application/json", **AUTH})
        assert r.status_code == 409, r.text   # no servers: 409, not 503


async def test_a_json_key_given_twice_is_refused_not_last_one_wins():
    """json.loads keeps the last value of a duplicated key: a control body that named a
    key twice was applied with whichever came last (past a proxy or a validator that
    read the first) without a word. Refused naming the key, nested ones included."""
    async with LiveApi(settings_for()) as api:
        post = api.client.post
        json_ = {"content-type": "application/json", **AUTH}
        for url, body, field in (
                ("/v1/embeddings/configure",
                 b'{"admit_probability": 7, "admit_probability": 0.5}',
                 "body.admit_probability"),
                ("/v1/embeddings/configure",
                 b'{"optimizer": {"name": "sgd", "lr": -1, "lr": 0.1}}',
                 "body.optimizer.lr"),
                ("/v1/embeddings/configure",
                 b'{"policies": {"user": {"min_count": 0, "min_count": 2}}}',
                 "body.policies.user.min_count"),
                ("/v1/model/reload",
                 b'{"checkpoint": "../../etc", "checkpoint": "ckpt-x"}', "body.checkpoint"),
                ("/v1/embeddings/configure", b'{"admit_probability": NaN}', "body"),
                ("/v1/embeddings/configure", b'{"weight_bound": Infinity}', "body"),
                # JSON's grammar allows it, but json.loads reads it as inf (ttl_s has
                # no upper bound, so the body model alone took it: an endless TTL)
                ("/v1/embeddings/configure", b'{"policies": {"user": {"ttl_s": 1e999}}}',
                 "body.policies.user.ttl_s"),
                ("/v1/embeddings/configure", b'[-1e999]', "body.0")):
            r = await post(url, content=body, headers=json_)
            assert r.status_code == 422, (body, r.status_code, r.text)
            err = r.json()["error"]
            assert err["kind"] == "bad_input" and err["field"] == field, (body, err)
        # a body with each key once still goes through to the route (no roles here: 503)
        r = await post("/v1/embeddings/configure", content=b'{"admit_probability": 0.5}',
                       headers=json_)
        assert r.status_code != 422, r.text


async def test_connections_that_never_complete_a_request_head_are_closed():
    """uvicorn keeps a connection that sends nothing, or half a request head, open for
    good (one fd each, before any authentication); close_stalled closes them, and
    leaves a client that keeps making requests alone."""
    import asyncio

    from stream_persia.api.server import close_stalled

    async with LiveApi(settings_for()) as api:
        sweep = asyncio.create_task(close_stalled(api.server, 0.6))
        try:
            host, port = api.url.removeprefix("http://").split(":")
            silent = await asyncio.open_connection(host, int(port))
            partial = await asyncio.open_connection(host, int(port))
            partial[1].write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
            for _ in range(8):      # a live keep-alive client, one request every 0.25 s
                assert (await api.client.get("/healthz")).status_code == 200
                await asyncio.sleep(0.25)
            for reader, writer in (silent, partial):
                assert await asyncio.wait_for(reader.read(), 5) == b""   # closed by us
                writer.close()
            assert (await api.client.get("/healthz")).status_code == 200
        finally:
            sweep.cancel()


async def test_close_stalled_stands_down_on_a_uvicorn_without_its_internals(caplog):
    """close_stalled reads uvicorn's per-connection ``cycle`` (pyproject pins only
    uvicorn>=0.29). On a uvicorn without it, every connection used to look stalled and
    was closed, requests in flight included; now the sweep logs an error once and stops.
    The stand-in is a real server on a real socket whose protocol (like such a uvicorn's)
    has a transport but no ``cycle``."""
    import asyncio
    import logging
    from types import SimpleNamespace

    from stream_persia.api.server import close_stalled

    class Bare(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport
            conns.add(self)

    Bare.__module__ = "uvicorn.protocols.http.future_impl"   # an HTTP protocol of its
    conns: set = set()
    tcp = await asyncio.get_running_loop().create_server(Bare, "127.0.0.1", 0)
    port = tcp.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        stand_in = SimpleNamespace(server_state=SimpleNamespace(connections=conns))
        with caplog.at_level(logging.ERROR, logger="stream_persia.api.server"):
            await asyncio.wait_for(close_stalled(stand_in, 0.2), 3)   # returns: stood down
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "'cycle'" in errors[0].getMessage(), errors
        (conn,) = conns
        assert not conn.transport.is_closing()     # left alone
    finally:
        writer.close()
        tcp.close()


async def test_close_stalled_goes_on_past_a_websocket_upgrade():
    """A WebSocket upgrade under way (uvicorn[standard] brings websockets) sits in the
    server's connections without a request cycle: the sweep skips it and goes on (it
    took it for a uvicorn it did not know and stopped for good, so a flood of upgrade
    requests switched off the closing of stalled connections)."""
    import asyncio
    from types import SimpleNamespace

    from stream_persia.api.server import close_stalled

    class Upgrading(asyncio.Protocol):
        def connection_made(self, transport):
            self.transport = transport
            conns.add(self)

    Upgrading.__module__ = "uvicorn.protocols.websockets.websockets_sansio_impl"
    conns: set = set()
    tcp = await asyncio.get_running_loop().create_server(Upgrading, "127.0.0.1", 0)
    port = tcp.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        stand_in = SimpleNamespace(server_state=SimpleNamespace(connections=conns))
        sweep = asyncio.ensure_future(close_stalled(stand_in, 0.2))
        await asyncio.sleep(1.0)
        assert not sweep.done(), "the sweep stopped"
        (conn,) = conns
        assert not conn.transport.is_closing()
        sweep.cancel()
    finally:
        writer.close()
        tcp.close()
