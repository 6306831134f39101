"""Request body size limit (413) as a plain ASGI middleware.

A declared ``Content-Length`` over the limit is refused before any of the body is read.
A body without one (chunked) is counted as it arrives and refused as soon as it crosses
the limit, so no request ever makes the server buffer more than ``max_body_bytes``.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from stream_persia.api.errors import error_body

__all__ = ["BodySizeLimit"]


class _TooLarge(HTTPException):
    """Raised from ``receive``; an HTTPException so that FastAPI's body reader re-raises it
    (instead of turning it into a 400) and the app's handler answers 413."""

    def __init__(self, limit: int):
        super().__init__(413, f"request body is over the limit of {limit} bytes")


class BodySizeLimit:
    """Wraps an ASGI app, refusing request bodies over ``max_body_bytes`` with 413."""

    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_body_bytes
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            await _reject(send, limit, declared)
            return
        received = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise _TooLarge(limit)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if started:  # the app answered before reading all of it; nothing to add
                return
            await _reject(send, limit, None)


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
    body: dict[str, Any] = error_body(
        "too_large", f"request body is {got}; the limit is {limit} bytes", type_="TooLarge",
        field="body", hint="split the request, or raise api.max_body_bytes")
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(raw)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": raw})
