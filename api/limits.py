"""Request body limits as a plain ASGI middleware: size (413) and time (408).

A declared ``Content-Length`` over the limit is refused before any of the body is read.
A body without one (chunked) is counted as it arrives and refused as soon as it crosses
the limit, so no request ever makes the server buffer more than ``max_body_bytes``.

A body must also arrive whole within :data:`BODY_TIMEOUT_S` of its request head; else
the request is answered 408 and its connection closed. uvicorn has no such deadline, and
the sweep of stalled connections (:func:`stream_persia.api.server.close_stalled`) leaves
a request being served alone, so a client that sent a head announcing a body and then a
byte now and then (or nothing) held its connection, and whatever the handler had read,
for good: on ``/v1/predict``, open by default, anyone could hold any number of them.

The bodies of all requests being served together hold at most
:data:`MAX_INFLIGHT_BODY_BYTES` (counted as their bytes arrive, released when the request
is answered); a request whose bytes would pass it is answered 503 with ``Retry-After``.
Each request was bounded, their number was not: 2,000 concurrent 16 MiB bodies held
32 GiB.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from stream_persia.api.errors import error_body

from stream_persia.core.aio import run_until

__all__ = ["BODY_TIMEOUT_S", "MAX_INFLIGHT_BODY_BYTES", "BodySizeLimit"]

#: seconds a request body may take to arrive whole after its head (16 MiB, the default
#: size limit, at 280 KB/s)
BODY_TIMEOUT_S = 60.0
#: bytes of request bodies held by the requests being served at once (16 x 16 MiB; a
#: request alone may pass it, up to ``api.max_body_bytes``)
MAX_INFLIGHT_BODY_BYTES = 256 << 20
#: the default api.max_body_bytes: a raised one stretches BODY_TIMEOUT_S by as much
_DEFAULT_MAX_BODY = 16 << 20


class _TooLarge(HTTPException):
    """Raised from ``receive``; an HTTPException so that FastAPI's body reader re-raises it
    (instead of turning it into a 400) and the app's handler answers 413."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body is over the limit of {limit} bytes")


class _TooSlow(HTTPException):
    """Raised from ``receive`` when the body's deadline passes (answered 408 here)."""

    def __init__(self, timeout_s: float):
        super().__init__(408, f"the request body did not arrive whole within {timeout_s:g} s "
                              f"of its head", headers={"Connection": "close"})


class _Busy(HTTPException):
    """Raised from ``receive`` when the bodies in flight would pass their bound (503)."""

    def __init__(self, bound: int):
        super().__init__(503, f"the requests being served hold {bound} bytes of bodies "
                              f"already; retry shortly",
                         headers={"Retry-After": "1", "Connection": "close"})


class BodySizeLimit:
    """Wraps an ASGI app, refusing request bodies over ``max_body_bytes`` with 413, those
    not whole within :data:`BODY_TIMEOUT_S` with 408, and bytes past
    :data:`MAX_INFLIGHT_BODY_BYTES` over every request in flight with 503."""

    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.inflight_bytes = 0   # body bytes of the requests being served
        # The deadline scales with a raised api.max_body_bytes (the same rate is asked).
        self.timeout_s = BODY_TIMEOUT_S * max(1.0, max_body_bytes / _DEFAULT_MAX_BODY)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _reject(send, limit, declared)
            return
        received = 0   # body bytes of this request, all counted in inflight_bytes
        started = False
        whole = False   # the body has arrived (later receives wait for a disconnect)
        timeout_s = self.timeout_s
        deadline = asyncio.get_running_loop().time() + timeout_s

        async def limited_receive() -> Message:
            nonlocal received, whole
            if whole:
                return await receive()
            try:
                message = await run_until(receive(), deadline)   # Python 3.10 too
            except TimeoutError:
                raise _TooSlow(timeout_s) from None
            if message["type"] == "http.request":
                n = len(message.get("body", b""))
                if received + n > limit:
                    raise _TooLarge(limit)
                bound = MAX_INFLIGHT_BODY_BYTES
                # A body alone is bounded by max_body_bytes only (one over the shared
                # bound, after a raised api.max_body_bytes, was answered "retry" for ever).
                others = self.inflight_bytes - received
                if others > 0 and self.inflight_bytes + n > bound:
                    raise _Busy(bound)
                received += n
                self.inflight_bytes += n
                whole = not message.get("more_body", False)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _Busy:
            if not started:
                await _send_error(send, 503, error_body(
                    "backpressure", f"the requests being served hold "
                    f"{MAX_INFLIGHT_BODY_BYTES} bytes of bodies already", type_="Backpressure",
                    field="body", hint="retry shortly"))
        except _TooLarge:
            if started:  # the app answered before reading all of it; nothing to add
                return
            await _reject(send, limit, None)
        except _TooSlow:
            if not started:
                await _send_error(send, 408, error_body(
                    "timeout", f"the request body did not arrive whole within {timeout_s:g} "
                    f"s ({received} bytes came)", type_="BodyTimeout", field="body",
                    hint="send the body at once after the request head"))
        finally:
            self.inflight_bytes -= received


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


async def _reject(send: Send, limit: int, declared: int | None) -> None:
    got = f"{declared} bytes" if declared is not None else "more"
    await _send_error(send, 413, error_body(
        "too_large", f"request body is {got}; the limit is {limit} bytes", type_="TooLarge",
        field="body", hint="split the request, or raise api.max_body_bytes"))


async def _send_error(send: Send, status: int, body: dict[str, Any]) -> None:
    """Answer ``status`` with ``body`` and close the connection (the rest of the request
    body is never read)."""
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(raw)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": raw})
