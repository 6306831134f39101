"""HTTP status for every error family, and the one error body every route returns.

================================  ======  =========================================
error                             status  why
================================  ======  =========================================
BadInput (WireError, ConfigError)  422    the request is wrong; ``field`` names where
request validation (pydantic)      422    same body; ``field`` is the dotted location
body not JSON / not UTF-8          422    ``field`` is ``body`` (FastAPI would say 400)
a key twice, NaN (BadJson)         422    ``field`` names the key (``json_body``)
BodyTooLarge / too many rows       413    limits of :class:`~stream_persia.api.settings.ApiSettings`
body not whole within 60 s         408    :mod:`stream_persia.api.limits`; the
                                          connection is closed
bodies in flight over 256 MiB      503    :mod:`stream_persia.api.limits`: retry later
Misuse                             409    the job is not in a state that allows it
DataLost                           409    data the request needs is gone (a restore
                                          whose Kafka offsets retention deleted)
PeerUnavailable, RemoteTimeout     503    a role is down or slow: retry later
Backpressure, NotReady             503    a buffer is full / no model yet: retry later
other RemoteError                  502    a role answered with a failure
InternalError, anything else       500    a bug (logged with its traceback)
method not allowed                 405    ``Allow`` lists every method of the path
================================  ======  =========================================

An unexpected exception is answered by :class:`UnhandledErrors` inside the app, never
by Starlette's outermost ``ServerErrorMiddleware``: that one re-raises the exception
after sending its 500 (so that the server can log it), and uvicorn then closes the
connection, so the client's next request on the same keep-alive connection failed.

Body: ``{"error": {"kind", "type", "message", "field", "hint", "peer"}}`` (see
:class:`stream_persia.api.schemas.ErrorBody`). ``peer`` names the role that failed for 502/503.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stream_persia.errors import (
    Backpressure,
    BadInput,
    DataLost,
    InternalError,
    Misuse,
    PeerUnavailable,
    PersiaError,
    RemoteError,
    RemoteTimeout,
)

__all__ = ["BadJson", "install_error_handlers", "status_of", "error_body", "TooLarge", "NotReady",
           "UnhandledErrors"]

log = logging.getLogger(__name__)


class TooLarge(BadInput):
    """The request is over a size limit (body bytes or rows)."""

    kind = "too_large"


class BadJson(StarletteHTTPException):
    """A JSON body refused by :func:`stream_persia.api.json_body.loads`: an HTTPException
    so that FastAPI's body reader lets it through, answered as its ``error`` (422)."""

    def __init__(self, error: BadInput):
        super().__init__(422, error.message)
        self.error = error


class NotReady(PersiaError):
    """This API instance cannot serve the request yet (no model loaded)."""

    kind = "not_ready"


def status_of(err: BaseException) -> int:
    """The HTTP status an exception maps to (table in the module docstring)."""
    if isinstance(err, TooLarge):
        return 413
    if isinstance(err, BadInput):
        return 422
    if isinstance(err, (Misuse, DataLost)):
        return 409
    if isinstance(err, (PeerUnavailable, RemoteTimeout, Backpressure, NotReady)):
        return 503
    if isinstance(err, InternalError):
        return 500
    if isinstance(err, RemoteError):
        return 502
    return 500


def error_body(kind: str, message: str, *, type_: str | None = None, field: str | None = None,
               hint: str | None = None, peer: str | None = None) -> dict[str, Any]:
    return {"error": {"kind": kind, "type": type_ or kind, "message": message, "field": field,
                      "hint": hint, "peer": peer}}


def _persia_response(err: PersiaError) -> JSONResponse:
    status = status_of(err)
    peer = getattr(err, "peer", None)
    if status >= 500 and not isinstance(err, NotReady):
        log.log(logging.ERROR if status == 500 else logging.WARNING, "%s: %s",
                type(err).__name__, err, exc_info=status == 500)
    headers = {"Retry-After": "1"} if status == 503 else None
    body = error_body(err.kind, err.message, type_=type(err).__name__, field=err.field,
                      hint=err.hint, peer=peer)
    return JSONResponse(body, status_code=status, headers=headers)


def _loc(loc: Any) -> str:
    return ".".join(str(p) for p in loc) if isinstance(loc, (list, tuple)) else str(loc)


def _leaf_routes(app: FastAPI) -> Iterable[Any]:
    try:   # FastAPI >= 0.16x keeps included routers as branches; this walks their leaves
        from fastapi.routing import iter_route_contexts
    except ImportError:
        return app.router.routes
    return iter_route_contexts(app.router.routes)


def _allowed_methods(request: Request) -> str | None:
    """Every method of every route whose path matches: Starlette's 405 names only the first
    matching route's methods (``/v1/checkpoints`` has a GET and a POST route)."""
    methods: set[str] = set()
    for route in _leaf_routes(request.app):
        match, _ = route.matches(dict(request.scope))
        if match != Match.NONE:
            methods.update(getattr(route, "methods", None) or ())
    return ", ".join(sorted(methods)) or None


def install_error_handlers(app: FastAPI) -> None:
    """Register the mapping above on ``app``."""

    @app.exception_handler(PersiaError)
    async def persia_error(request: Request, err: PersiaError) -> JSONResponse:
        return _persia_response(err)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, err: RequestValidationError) -> JSONResponse:
        errors = err.errors()
        first = errors[0] if errors else {}
        field = _loc(first.get("loc", ("body",)))
        message = f"{field}: {first.get('msg', 'invalid request')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more problem(s))"
        body = error_body("bad_input", message, type_="RequestValidationError", field=field,
                          hint="see the request schema in /docs")
        return JSONResponse(body, status_code=422)

    @app.exception_handler(BadJson)
    async def bad_json(request: Request, err: BadJson) -> JSONResponse:
        return _persia_response(err.error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        status, headers = err.status_code, err.headers
        if status == 400:
            # FastAPI's body reader: the body is not text (UnicodeDecodeError) or otherwise
            # unreadable. The request is wrong like any other invalid body: 422, as documented.
            body = error_body("bad_input", f"body: {err.detail} (it must be UTF-8 JSON)",
                              type_="RequestValidationError", field="body",
                              hint="send a UTF-8 JSON body matching the schema in /docs")
            return JSONResponse(body, status_code=422)
        if status == 405:
            allow = _allowed_methods(request)
            if allow:
                headers = {**(headers or {}), "Allow": allow}
        kinds = {401: "unauthorized", 403: "forbidden", 404: "not_found",
                 405: "method_not_allowed", 408: "timeout", 413: "too_large",
                 503: "backpressure"}
        body = error_body(kinds.get(status, "http"), str(err.detail), type_="HTTPException",
                          field="body" if status in (408, 413, 415, 503) else None)
        return JSONResponse(body, status_code=status, headers=headers)



class UnhandledErrors:
    """ASGI middleware: an exception that no handler mapped (a bug) becomes the 500 error
    body here, logged with its traceback, and goes no further, so the server keeps the
    connection open (see the module docstring). One raised after the response started
    cannot be answered any more and is re-raised."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception as err:
            if started:
                raise
            log.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            response = JSONResponse(error_body("internal", f"internal error: "
                                               f"{type(err).__name__}", type_="InternalError"),
                                    status_code=500)
            await response(scope, receive, send)
