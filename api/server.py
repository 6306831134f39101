"""Serve the API with uvicorn (uvloop + httptools), as ``stream-persia launch api`` does.

uvicorn handles SIGTERM/SIGINT itself: it stops accepting connections, lets in-flight
requests finish (up to ``graceful_timeout_s``), runs the lifespan shutdown (queued
inference requests complete, connections to the roles close) and returns, so the
process exits 0. The socket is bound before uvicorn starts so that port 0 works and the
real ``host:port`` can be written to ``ready_file`` once the app is ready. If a
supervised task of the app fails (the inference micro-batcher; :mod:`stream_persia.
supervisor`), ``/readyz`` answers 503 naming it, and after ``EXIT_GRACE_S`` the API drains
the same way and exits 1.

uvicorn has no timeout on a request's head: a connection that sends nothing, or part of
the request line and headers, stays open for good (and one fd with it), before any
authentication. :func:`close_stalled` closes those that have not completed a request
head for :data:`HEAD_TIMEOUT_S` (an idle keep-alive connection uvicorn closes itself
after 5 s; a request being served is never touched). It reads uvicorn's protocol
internals (``cycle``): with a uvicorn whose connections lack them it logs an error once
and stops, rather than take every connection for a stalled one.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Any

from stream_persia.api.app import create_app
from stream_persia.api.settings import ApiSettings

from stream_persia.core import aio
from stream_persia.core.supervisor import EXIT_GRACE_S, Supervisor
from stream_persia.errors import ConfigError

__all__ = ["HEAD_TIMEOUT_S", "bind_socket", "close_stalled", "serve"]

#: seconds a connection may take to complete a request head (see the module docstring)
HEAD_TIMEOUT_S = 30.0

log = logging.getLogger(__name__)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on ``host:port`` (IPv6 when ``host`` is one)."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host.strip("[]"), port))
    sock.set_inheritable(True)
    return sock


async def close_stalled(server: Any, timeout_s: float = HEAD_TIMEOUT_S) -> None:
    """Forever: close the connections of ``server`` (a ``uvicorn.Server``) that serve no
    request and have not completed a request head for ``timeout_s`` (found by a sweep
    every ``timeout_s / 2``; nothing is timed per request)."""
    # connection -> (its last request, sweeps in a row that found it waiting after it)
    waiting: dict[Any, tuple[Any, int]] = {}
    tick = timeout_s / 2
    while True:
        await asyncio.sleep(tick)
        seen: dict[Any, tuple[Any, int]] = {}
        for conn in list(server.server_state.connections):
            if not type(conn).__module__.startswith("uvicorn.protocols.http"):
                continue   # a WebSocket upgrade under way (no request cycle): not ours
            missing = _missing_internals(conn)
            if missing:
                # Without them every connection would look idle, and requests in flight
                # would be cut off: better no sweep than that (uvicorn is pinned >= only).
                log.error("not closing stalled HTTP connections: uvicorn's %s has no %s "
                          "(a uvicorn this stream-persia does not know); connections that "
                          "never complete a request head stay open",
                          type(conn).__name__, missing)
                return
            cycle = conn.cycle   # uvicorn's current request, if any
            if cycle is not None and not cycle.response_complete:
                continue   # a request is being served (its body may still be arriving)
            last, sweeps = waiting.get(conn, (cycle, 0))
            sweeps = sweeps + 1 if last is cycle else 1   # a new request since: progress
            if sweeps * tick > timeout_s:
                transport = getattr(conn, "transport", None)
                if transport is not None and not transport.is_closing():
                    log.warning("closing an HTTP connection from %s: no complete request "
                                "head in %g s", _peer(transport), timeout_s)
                    transport.close()
                continue
            seen[conn] = (cycle, sweeps)
        waiting = seen


def _missing_internals(conn: Any) -> str:
    """The uvicorn internals :func:`close_stalled` reads that ``conn`` (an established
    connection's protocol) lacks, or ''. uvicorn 0.29-0.54's HTTP protocols set
    ``cycle`` (None between requests) and ``transport`` when the connection is made."""
    for name in ("cycle", "transport"):
        if not hasattr(conn, name):
            return f"attribute {name!r}"
    cycle = conn.cycle
    if cycle is not None and not hasattr(cycle, "response_complete"):
        return f"attribute 'response_complete' on its {type(cycle).__name__}"
    return ""


def _peer(transport: Any) -> str:
    addr = transport.get_extra_info("peername")
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else "?"


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _write_ready(path: str | None, address: str) -> None:
    if not path:
        return
    tmp = Path(f"{path}.tmp")
    tmp.write_text(address)
    os.replace(tmp, path)


def _drained(signum: int, frame: object) -> None:
    log.info("%s: the API has drained", signal.Signals(signum).name)


def serve(settings: ApiSettings, *, ready_file: str | None = None, log_level: str = "info",
          graceful_timeout_s: float = 30.0) -> int:
    """Run the API until SIGTERM/SIGINT; returns the exit code (0 after a clean drain)."""
    import uvicorn

    app = create_app(settings)   # refuses to start without a token on a public address
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as e:   # a taken port: a traceback would bury the reason
        raise ConfigError(f"--port {settings.port}: the API cannot listen on "
                          f"{settings.host}:{settings.port} ({e.strerror or e})",
                          field="--port", hint="pick a free port (--port or api.port), or 0 "
                                               "for any") from None
    loop = "uvloop" if aio.uvloop_available() else "asyncio"
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    config = uvicorn.Config(app, loop=loop, http=http, lifespan="on", log_level=log_level,
                            # typed int, but uvicorn waits with asyncio.wait_for: a float works
                            timeout_graceful_shutdown=graceful_timeout_s,  # type: ignore[arg-type]
                            access_log=False, server_header=False)
    server = uvicorn.Server(config)

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            address = _address(sock)
            _write_ready(ready_file, address)
            log.info("API listening on http://%s (loop %s, http %s)", address, loop, http)
        watch = asyncio.create_task(_exit_on_failure(app.state.supervisor, server))
        sweep = asyncio.create_task(close_stalled(server))
        try:
            await task
        finally:
            watch.cancel()
            sweep.cancel()

    # uvicorn re-raises the signal it caught once it has drained, with the handler that was
    # installed before it started; a Python-level no-op there makes a drained exit 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _drained)
    aio.run(main())   # the project's loop choice (uvloop unless STREAM_PERSIA_NO_UVLOOP)
    return 0 if server.started and app.state.supervisor.ok else 1


async def _exit_on_failure(supervisor: Supervisor, server: Any) -> None:
    """A supervised task failed: let /readyz say why for a moment, then drain as on
    SIGTERM (``serve`` returns 1)."""
    await supervisor.failed.wait()
    log.error("stopping in %.0f s with exit status 1: %s", EXIT_GRACE_S, supervisor.error)
    await asyncio.sleep(EXIT_GRACE_S)
    server.should_exit = True
