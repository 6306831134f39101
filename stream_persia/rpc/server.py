"""RPC server: serves ``async def handler(params)`` coroutines over framed TCP (and, for
clients on the same host, a Unix socket: :mod:`stream_persia.rpc.unix`).

Who may connect, and for how long (every bound is counted in :meth:`RpcServer.stats`):

- With a role secret (:mod:`stream_persia.rpc.auth`), a connection serves requests only
  after the handshake; a peer that does not complete it within
  ``ConnectionLimits.handshake_timeout_s``, sends a request first, or proves another
  secret gets an :class:`~stream_persia.errors.AuthError` frame and is closed
  (``auth_refused``; logged at most every 10 s). Frames before the handshake are limited
  to 1 KiB. Without a secret the server binds loopback only.
- At most ``max_connections`` connections are open; one more is answered with a
  ``PeerUnavailable`` frame and closed (``connections_refused``), unless a connection is
  still in its handshake: the oldest such one is closed to make room, with a retriable
  ``PeerUnavailable`` (``connections_refused``),
  so strangers cannot keep every slot taken; authenticated ones are never displaced.
- A connection with no request in flight and none received for ``idle_timeout_s`` is
  sent a *goaway* frame (``idle_closed``): the client opens a new connection for its next
  call and closes this one once its own calls have their replies; a request already on
  its way is still served. A peer that keeps it open anyway is closed
  ``GOAWAY_GRACE_S`` later.
- A peer that stops reading its replies is held back by TCP (at most
  ``max_in_flight_per_conn`` replies queue per connection, error replies included); one
  that takes no bytes of them for ``idle_timeout_s`` (checked every second) is aborted
  (``write_stalled``); a slow but steady reader is not.

Size: one module past 500 lines on purpose: one protocol role, the server end of the
RPC (one module per role, as aiokafka does). The bounds above all act on the one
connection table of :class:`RpcServer`; framing, authentication and the Unix socket
already live beside it (``framing``, ``auth``, ``local``).
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import inspect
import logging
import math
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from stream_persia.core.backoff import wait_bounded
from stream_persia.errors import (
    AuthError,
    ConfigError,
    InternalError,
    Misuse,
    PeerUnavailable,
    PersiaError,
    WireError,
)
from stream_persia.rpc import auth, framing, unix
from stream_persia.rpc.framing import wire
from stream_persia.rpc.transport import FrameProtocol

__all__ = ["CONNECTION_COUNTERS", "ConnectionLimits", "GOAWAY_GRACE_S", "RpcServer"]

log = logging.getLogger(__name__)

Handler = Callable[[Any], Awaitable[Any]]

#: upper bounds (seconds) of the latency histogram kept per method
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                     10.0)

#: how long a connection sent a goaway may stay open before the server closes it
GOAWAY_GRACE_S = 10.0
#: keys of :meth:`RpcServer.connection_stats` that only grow (exported as counters)
CONNECTION_COUNTERS = frozenset({"connections", "connections_refused", "auth_refused",
                                 "idle_closed", "frames_rejected", "write_stalled"})
_LOG_EVERY_S = 10.0
#: how long a connection refused over the cap stays half-open for its reason to be read
_REFUSED_LINGER_S = 1.0
#: how often a paused writer checks that its peer still takes bytes (see ``_drain``)
_DRAIN_SLICE_S = 1.0
try:   # the kernel's unsent bytes of a socket (Linux); elsewhere the write buffer only
    import fcntl
    import termios
    _OUTQ: int | None = termios.TIOCOUTQ
except (ImportError, AttributeError):
    _OUTQ = None


@dataclass(frozen=True)
class ConnectionLimits:
    """Bounds on the connections of one :class:`RpcServer`.

    Args:
        max_connections: connections open at once; more are refused (counted).
        idle_timeout_s: a connection with no request in flight and none received for
            this long is closed (after a goaway frame), and one whose peer reads too
            little of its replies to drain them for this long is aborted;
            ``math.inf``: never.
        handshake_timeout_s: how long a new connection may take to authenticate (with a
            role secret).

    Raises:
        ConfigError: a bound is not positive.
    """

    max_connections: int = 1024
    idle_timeout_s: float = 300.0
    handshake_timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if (isinstance(self.max_connections, bool) or not isinstance(self.max_connections, int)
                or self.max_connections < 1):
            raise ConfigError(f"max_connections must be an integer >= 1, got "
                              f"{self.max_connections!r}", field="max_connections")
        for name in ("idle_timeout_s", "handshake_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{name} must be a number of seconds > 0, got {value!r}",
                                  field=name)
        if not math.isfinite(self.handshake_timeout_s):
            raise ConfigError("handshake_timeout_s must be finite", field="handshake_timeout_s")


class _Throttled:
    """Warnings at most once per ``_LOG_EVERY_S`` per key, saying how many were held back
    (a scan of the port must not flood the log)."""

    def __init__(self) -> None:
        self._state: dict[str, tuple[float, int]] = {}

    def warning(self, key: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        last, held = self._state.get(key, (-math.inf, 0))
        if now - last < _LOG_EVERY_S:
            self._state[key] = (last, held + 1)
            return
        self._state[key] = (now, 0)
        if held:
            msg += f" ({held} more like it in the last {_LOG_EVERY_S:g} s)"
        log.warning(msg, *args)


def _is_async_callable(obj: Any) -> bool:
    return inspect.iscoroutinefunction(obj) or (
        callable(obj) and inspect.iscoroutinefunction(type(obj).__call__))


class _MethodStats:
    __slots__ = ("calls", "errors", "in_flight", "latency_sum_s", "latency_max_s", "buckets")

    def __init__(self) -> None:
        self.calls = 0
        self.errors = 0
        self.in_flight = 0
        self.latency_sum_s = 0.0
        self.latency_max_s = 0.0
        self.buckets = [0] * (len(LATENCY_BUCKETS_S) + 1)  # last one is +Inf

    def observe(self, seconds: float, failed: bool) -> None:
        self.in_flight -= 1
        self.errors += failed
        self.latency_sum_s += seconds
        self.latency_max_s = max(self.latency_max_s, seconds)
        self.buckets[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1

    def as_dict(self) -> dict[str, Any]:
        cumulative, acc = {}, 0
        for le, n in zip((*LATENCY_BUCKETS_S, float("inf")), self.buckets, strict=True):
            acc += n
            cumulative[le] = acc
        return {"calls": self.calls, "errors": self.errors, "in_flight": self.in_flight,
                "latency_s_sum": self.latency_sum_s, "latency_s_max": self.latency_max_s,
                "latency_s_buckets": cumulative}


class _Conn:
    """One accepted connection: its protocol, its reader task and its handler tasks."""

    __slots__ = ("proto", "peer", "slots", "tasks", "reader_task", "reading", "authed",
                 "requests", "swept", "idle_sweeps", "goaway_at", "accepted_at")

    def __init__(self, proto: FrameProtocol, max_in_flight: int, authed: bool):
        self.proto = proto
        self.peer = proto.peer
        # Backpressure: the reader takes a slot before reading the next request, so at most
        # max_in_flight requests run per connection and a flooding peer is stopped by TCP.
        self.slots = asyncio.Semaphore(max_in_flight)
        self.tasks: set[asyncio.Task[None]] = set()
        self.reader_task: asyncio.Task[None] | None = None
        self.reading = True
        self.authed = authed          # handshake done (or no secret to check)
        self.requests = 0             # frames read, for the idle sweep
        self.swept = 0                # ``requests`` at the last sweep
        self.idle_sweeps = 0          # sweeps in a row that found it idle
        self.goaway_at: float | None = None
        self.accepted_at = time.monotonic()


class RpcServer:
    """Serves a mapping of method names to ``async def handler(params)`` coroutines.

    Requests on one connection run concurrently, at most ``max_in_flight_per_conn`` at a
    time; past that the server stops reading from that connection until one finishes.
    numpy arrays in a handler's result are sent from their own memory, not copied: a
    handler must not modify an array it returned (e.g. a buffer it reuses) afterwards.

    Args:
        handlers: method name → coroutine function taking the decoded params.
        host: interface to bind.
        port: TCP port; 0 lets the OS pick one (read it back from :attr:`port`).
        limits: wire limits enforced on every frame received.
        name: role name used in logs and error messages (e.g. "embedding-server-0").
        max_in_flight_per_conn: concurrent requests per connection before reading pauses.
        secret: the job's role secret every client must prove it holds
            (:mod:`stream_persia.rpc.auth`); default: ``PERSIA_ROLE_SECRET(_FILE)`` of this
            process; None: no authentication, loopback hosts only.
        connection_limits: connection cap, idle and handshake timeouts.

    Raises:
        Misuse: a handler is not a coroutine function, or a bound value is invalid.
        ConfigError: the role secret setting is invalid.
    """

    def __init__(self, handlers: Mapping[str, Handler], host: str = "127.0.0.1",
                 port: int = 0, *, limits: wire.WireLimits = wire.DEFAULT_LIMITS,
                 name: str = "rpc", max_in_flight_per_conn: int = 64,
                 secret: auth.SecretSetting = auth.FROM_ENV,
                 connection_limits: ConnectionLimits = ConnectionLimits()):
        for method, handler in handlers.items():
            if not isinstance(method, str):
                raise Misuse(f"RPC method names must be str, got {method!r}", field="handlers")
            if not _is_async_callable(handler):
                raise Misuse(f"handler for {method!r} must be an `async def` function, got "
                             f"{handler!r}", field="handlers",
                             hint="a blocking handler would stall every connection")
        if max_in_flight_per_conn < 1:
            raise Misuse(f"max_in_flight_per_conn must be >= 1, got {max_in_flight_per_conn}",
                         field="max_in_flight_per_conn")
        self._handlers = dict(handlers)
        self._host = host
        self._port = port
        self._limits = limits
        self.name = name
        self._max_in_flight = max_in_flight_per_conn
        self._server: asyncio.AbstractServer | None = None
        self._unix: asyncio.AbstractServer | None = None
        self._conns: set[_Conn] = set()
        self._stopping = False
        self._stopped: asyncio.Event | None = None
        self._stats: dict[str, _MethodStats] = {m: _MethodStats() for m in self._handlers}
        self._counters = {"connections_total": 0, "frames_rejected": 0, "unknown_method": 0,
                          "connections_refused": 0, "auth_refused": 0, "idle_closed": 0,
                          "write_stalled": 0}
        self._secret = auth.resolve(secret)
        self._conn_limits = connection_limits
        self._sweeper: asyncio.Task[None] | None = None
        self._warn = _Throttled()

    @property
    def secret(self) -> auth.RoleSecret | None:
        """The role secret clients must prove (None: none, loopback only)."""
        return self._secret

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Bind and start accepting connections.

        Raises:
            ConfigError: no role secret and ``host`` is not a loopback address.
        """
        if self._server is not None:
            raise Misuse(f"RpcServer {self.name!r} is already started")
        auth.check_bind(self._host, self._secret, self.name)
        self._server = await asyncio.get_running_loop().create_server(
            lambda: FrameProtocol(self._limits, self._accept), self._host,
            self._port, reuse_address=True)
        sockname = self._server.sockets[0].getsockname()
        self._port = sockname[1]
        # Same-host clients connect through a Unix socket instead (rpc/unix.py).
        self._unix = await unix.listen(lambda: FrameProtocol(self._limits, self._accept),
                                        self._host, self._port)
        if math.isfinite(self._conn_limits.idle_timeout_s):
            self._sweeper = asyncio.get_running_loop().create_task(
                self._sweep_idle(), name=f"{self.name} idle sweep")
        log.info("%s: serving %d methods on %s (%s)", self.name, len(self._handlers),
                 self.address, "role secret required" if self._secret is not None
                 else "no role secret: loopback only")

    @property
    def port(self) -> int:
        """The bound port (the OS's choice when constructed with port 0)."""
        return self._port

    @property
    def address(self) -> str:
        """``host:port`` for :class:`RpcClient` (``[v6addr]:port`` for IPv6 hosts)."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"{host}:{self._port}"

    async def stop(self, drain_timeout_s: float = 10.0) -> None:
        """Stop accepting, let in-flight requests finish, then close every connection.

        Requests still running after ``drain_timeout_s`` are cancelled; their callers get
        :class:`PeerUnavailable`. Idempotent.
        """
        if self._server is None:
            return
        if self._stopping:
            assert self._stopped is not None
            await self._stopped.wait()
            return
        self._stopping = True
        self._stopped = asyncio.Event()
        try:
            await self._shutdown(drain_timeout_s)
        finally:
            self._stopped.set()

    async def _shutdown(self, drain_timeout_s: float) -> None:
        assert self._server is not None
        self._server.close()
        if self._unix is not None:
            self._unix.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        conns = list(self._conns)
        readers = [c.reader_task for c in conns if c.reader_task is not None]
        for task in readers:
            task.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
        running = {t for c in conns for t in c.tasks}
        if running:
            _, late = await asyncio.wait(running, timeout=drain_timeout_s)
            if late:
                log.warning("%s: cancelling %d requests still running after the %.1f s drain",
                            self.name, len(late), drain_timeout_s)
                for task in late:
                    task.cancel()
                await asyncio.gather(*late, return_exceptions=True)
        for conn in conns:
            conn.proto.close()
        closing = [c.proto.wait_closed() for c in conns]
        try:
            await asyncio.wait_for(asyncio.gather(*closing, return_exceptions=True), 2.0)
        except asyncio.TimeoutError:  # a peer that stopped reading cannot be flushed to
            for conn in conns:
                conn.proto.abort()
        self._conns.clear()
        await self._server.wait_closed()
        if self._unix is not None:
            await self._unix.wait_closed()
        log.info("%s: stopped", self.name)

    async def __aenter__(self) -> RpcServer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    def stats(self) -> dict[str, Any]:
        """Counters for metrics: per-method calls, errors, in-flight and latency histogram;
        connections open, accepted (``connections_total``), refused over the cap
        (``connections_refused``), refused authentication (``auth_refused``), closed idle
        (``idle_closed``), aborted for not reading their replies (``write_stalled``)."""
        return {"name": self.name, "address": self.address,
                "connections_open": len(self._conns), **self._counters,
                "methods": {m: s.as_dict() for m, s in self._stats.items()}}

    def connection_stats(self) -> dict[str, float]:
        """The connection figures of :meth:`stats` for a role's metrics
        (``RoleMetrics.add_callback("rpc", ..., counters=CONNECTION_COUNTERS)``)."""
        c = self._counters
        return {"connections_open": float(len(self._conns)),
                "connections": float(c["connections_total"]),
                "connections_refused": float(c["connections_refused"]),
                "auth_refused": float(c["auth_refused"]),
                "idle_closed": float(c["idle_closed"]),
                "frames_rejected": float(c["frames_rejected"]),
                "write_stalled": float(c["write_stalled"])}

    # -- connections -----------------------------------------------------------------

    def _accept(self, proto: FrameProtocol) -> None:
        # A plain callback (not a coroutine) so the reader task is ours to own and cancel.
        if self._stopping:
            proto.close()
            return
        cap = self._conn_limits.max_connections
        if len(self._conns) >= cap and not self._displace_a_stranger():
            self._counters["connections_refused"] += 1
            self._warn.warning("cap", "%s: refused a connection from %s: max_connections=%d "
                               "are open", self.name, proto.peer, cap)
            err = PeerUnavailable(f"{self.name} at {self.address} has max_connections={cap} "
                                  "connections open and refused another",
                                  field="max_connections",
                                  hint="retry later, or raise rpc.max_connections")
            proto.write(framing.encode_parts(framing.error_reply(None, err), self._limits,
                                             "error reply"))
            # Half-close, and close only a moment later: a client that writes its request
            # at once would otherwise get a reset, and lose the reason with it.
            with contextlib.suppress(Exception):
                if proto.transport is not None:
                    proto.transport.write_eof()
            asyncio.get_running_loop().call_later(_REFUSED_LINGER_S, proto.abort)
            return
        conn = _Conn(proto, self._max_in_flight, authed=self._secret is None)
        if self._secret is not None:
            proto.limits = auth.HANDSHAKE_LIMITS   # a stranger's frames stay tiny
        self._conns.add(conn)
        self._counters["connections_total"] += 1
        conn.reader_task = asyncio.get_running_loop().create_task(
            self._read_loop(conn), name=f"{self.name} reader {conn.peer}")

    def _displace_a_stranger(self) -> bool:
        """At the cap, close the oldest connection still in its handshake to make room:
        else anyone who reaches the port could keep every slot taken with connections
        that never authenticate (each held for ``handshake_timeout_s``) and lock the
        job's own roles out. An authenticated connection is never displaced."""
        strangers = [c for c in self._conns if not c.authed]
        if not strangers:
            return False
        oldest = min(strangers, key=lambda c: c.accepted_at)
        self._conns.discard(oldest)   # its reader ends once the transport is closed
        # Not an AuthError: the displaced one may well hold the secret (two roles
        # connecting at once at the cap), and a PeerUnavailable is what clients retry.
        self._refuse(oldest, PeerUnavailable(
            f"{self.name} has max_connections={self._conn_limits.max_connections} open "
            f"and closed the connection from {oldest.peer}, which had not authenticated "
            "yet, for a newer one", field="max_connections",
            hint="retry later, or raise rpc.max_connections"), counter="connections_refused")
        asyncio.get_running_loop().call_later(_REFUSED_LINGER_S, oldest.proto.abort)
        return True

    async def _read_loop(self, conn: _Conn) -> None:
        try:
            if not conn.authed and not await self._handshake(conn):
                return
            while True:
                await conn.slots.acquire()
                if not await self._read_one(conn):
                    conn.slots.release()
                    return
        except asyncio.CancelledError:
            pass  # stop(): in-flight requests are drained by stop() itself
        except Exception:  # a bug here must not take the server down
            log.exception("%s: connection from %s failed", self.name, conn.peer)
            conn.proto.close()
        finally:
            conn.reading = False
            if not conn.tasks and not self._stopping:
                self._close(conn)

    async def _handshake(self, conn: _Conn) -> bool:
        """Authenticate ``conn`` (:mod:`stream_persia.rpc.auth`); False when it was
        refused or went away."""
        secret = self._secret
        assert secret is not None
        proto = conn.proto

        async def exchange() -> None:
            client_nonce = auth.check_hello(await self._handshake_frame(conn), conn.peer,
                                            self.name)
            server_nonce = auth.new_nonce()
            proto.write(framing.encode_parts(
                auth.challenge(secret, client_nonce, server_nonce), self._limits, "challenge"))
            auth.check_proof(await self._handshake_frame(conn), secret, client_nonce,
                             server_nonce, conn.peer, self.name)

        timeout_s = self._conn_limits.handshake_timeout_s
        try:
            # wait_bounded, not wait_for: stop() cancels this reader, and wait_for (before
            # 3.12) loses that cancellation when the proof arrives in the same iteration:
            # the reader would go on to read requests, and stop() wait for the peer.
            await wait_bounded(exchange(), timeout_s)
        except AuthError as exc:
            self._refuse(conn, exc)
            return False
        except TimeoutError:   # before OSError: TimeoutError is one
            self._refuse(conn, AuthError(
                f"{self.name} requires the job's role secret, and the client at {conn.peer} "
                f"did not authenticate within {timeout_s:g} s", field=auth.SETTING,
                hint=auth.SAME_SECRET_HINT))
            return False
        except (asyncio.IncompleteReadError, OSError):
            return False   # it went away first (e.g. a TCP health probe): nothing to refuse
        proto.limits = self._limits
        proto.write(framing.encode_parts(auth.welcome(), self._limits, "welcome"))
        conn.authed = True
        return True

    async def _handshake_frame(self, conn: _Conn) -> Any:
        """The next frame of a handshake, decoded; anything that is not a small valid
        frame is what a client without the secret sends (its first request)."""
        try:
            return wire.unpack(await conn.proto.read_frame(), auth.HANDSHAKE_LIMITS)
        except WireError:   # over the handshake's limits, or undecodable
            return None     # not a handshake message: check_hello / check_proof refuse it

    def _refuse(self, conn: _Conn, err: AuthError | PeerUnavailable,
                counter: str = "auth_refused") -> None:
        """Answer a failed handshake with ``err`` and close the connection."""
        self._counters[counter] += 1
        self._warn.warning("auth" if counter == "auth_refused" else "cap",
                           "%s: refused the connection from %s: %s", self.name,
                           conn.peer, err.message)
        self._reply_now(conn, framing.error_reply(None, err))
        conn.proto.close()

    async def _read_one(self, conn: _Conn) -> bool:
        """Read and dispatch one request; False when the connection is done."""
        try:
            body = await conn.proto.read_frame()
        except (asyncio.IncompleteReadError, OSError):
            return False  # the peer went away (or reset); any partial frame is moot
        except framing.Unidentifiable as exc:
            self._reject(conn, exc)
            return False
        conn.requests += 1
        try:
            msg = wire.unpack(body, self._limits)
        except WireError as exc:  # undecodable: no id to answer to
            self._reject(conn, exc)
            return False
        try:
            req = framing.parse_request(msg, conn.peer)
        except framing.MalformedRequest as exc:
            await self._reply_in_turn(conn, framing.error_reply(exc.request_id, exc))
            return True
        except WireError as exc:  # no id to answer to
            if auth.is_hello(msg):   # a client with a secret: this server has none
                self._refuse(conn, AuthError(
                    f"{self.name} has no role secret, but the client at {conn.peer} "
                    "presented one", field=auth.SETTING,
                    hint=auth.SAME_SECRET_HINT))
            else:
                self._reject(conn, exc)
            return False
        handler = self._handlers.get(req.method)
        if handler is None:
            self._counters["unknown_method"] += 1
            err = Misuse(f"{self.name} has no RPC method {req.method!r}", field="m",
                         hint=f"known methods: {', '.join(sorted(self._handlers)) or 'none'}")
            await self._reply_in_turn(conn, framing.error_reply(req.id, err))
            return True
        task = asyncio.get_running_loop().create_task(self._serve(conn, req, handler))
        conn.tasks.add(task)
        task.add_done_callback(lambda t: self._request_done(conn, t))
        return True

    def _request_done(self, conn: _Conn, task: asyncio.Task[None]) -> None:
        conn.tasks.discard(task)
        conn.slots.release()
        if not task.cancelled() and task.exception() is not None:  # _serve catches all
            log.error("%s: request task failed", self.name, exc_info=task.exception())
        if not conn.reading and not conn.tasks and not self._stopping:
            self._close(conn)

    def _close(self, conn: _Conn) -> None:
        conn.proto.close()
        self._conns.discard(conn)

    async def _sweep_idle(self) -> None:
        """Close connections idle for ``idle_timeout_s`` (goaway first), and those that
        outstay their goaway by ``GOAWAY_GRACE_S``.

        Every tick (half the timeout, at most ``GOAWAY_GRACE_S``), a connection is idle
        when it has no request running and read none since the tick before; once it was
        found idle for a whole timeout's worth of ticks it had been idle for between one
        timeout and one tick more. Nothing is timed per request."""
        loop = asyncio.get_running_loop()
        timeout_s = self._conn_limits.idle_timeout_s
        tick = min(timeout_s / 2, GOAWAY_GRACE_S)
        while True:
            await asyncio.sleep(tick)
            now = loop.time()
            for conn in list(self._conns):
                if conn.goaway_at is not None:
                    if now - conn.goaway_at > GOAWAY_GRACE_S and not conn.tasks:
                        conn.proto.close()
                    continue
                if conn.tasks or conn.requests != conn.swept or not conn.authed:
                    conn.swept, conn.idle_sweeps = conn.requests, 0
                    continue
                conn.idle_sweeps += 1
                if conn.idle_sweeps * tick >= timeout_s:
                    self._goaway(conn, now)

    def _goaway(self, conn: _Conn, now: float) -> None:
        self._counters["idle_closed"] += 1
        conn.goaway_at = now
        err = PeerUnavailable(f"{self.name} closes connections idle for "
                              f"{self._conn_limits.idle_timeout_s:g} s",
                              field="idle_timeout_s", hint="the client reconnects by itself")
        self._reply_now(conn, {**framing.error_reply(None, err), "goaway": True})

    def _reject(self, conn: _Conn, exc: PersiaError) -> None:
        """Answer a frame we cannot tie to a request, then close the connection."""
        self._counters["frames_rejected"] += 1
        log.warning("%s: closing connection from %s: %s", self.name, conn.peer, exc)
        self._reply_now(conn, framing.error_reply(None, exc))
        conn.proto.close()

    # -- requests --------------------------------------------------------------------

    def _reply_now(self, conn: _Conn, msg: dict[str, Any]) -> None:
        """Queue a small reply without waiting for the transport to drain."""
        if not conn.proto.is_closing():
            conn.proto.write(framing.encode_parts(msg, self._limits, "error reply"))

    async def _reply_in_turn(self, conn: _Conn, msg: dict[str, Any]) -> None:
        """Answer a request refused before it ran, holding its slot until the reply is
        drained: a peer that pipelines bad requests and never reads the answers is held
        back by TCP, as one whose requests run is, instead of growing our write buffer
        by one reply per request without bound."""
        try:
            self._reply_now(conn, msg)
            await self._drain(conn)
        finally:
            conn.slots.release()

    async def _drain(self, conn: _Conn) -> None:
        """Wait until ``conn`` takes our replies; a peer that takes none of them for
        ``idle_timeout_s`` is aborted (``write_stalled``): a client that stopped reading
        would otherwise hold its connection, and every reply queued on it, for as long as
        it stays connected. What counts is progress, not the total time: a peer that
        reads a large reply slowly but steadily is not aborted however long it takes."""
        timeout_s = self._conn_limits.idle_timeout_s
        if not conn.proto.write_paused or not math.isfinite(timeout_s):   # no timer
            with contextlib.suppress(ConnectionError):
                await conn.proto.drain()
            return
        loop = asyncio.get_running_loop()
        slice_s = min(_DRAIN_SLICE_S, timeout_s)
        last = self._write_backlog(conn)
        progress_at = loop.time()
        drained = asyncio.ensure_future(conn.proto.drain())   # one waiter, polled
        try:
            while True:
                done, _ = await asyncio.wait({drained}, timeout=slice_s)
                if done:
                    if not drained.cancelled():
                        with contextlib.suppress(ConnectionError):
                            drained.result()
                    return
                now = loop.time()
                backlog = self._write_backlog(conn)
                if backlog < last:   # the peer took some bytes; a newer reply may add some
                    progress_at = now
                last = backlog
                if now - progress_at >= timeout_s:
                    break
        finally:
            drained.cancel()
        self._counters["write_stalled"] += 1
        self._warn.warning("stall", "%s: aborted the connection from %s: it read none of "
                           "its replies for %g s (idle_timeout_s) with %d bytes queued",
                           self.name, conn.peer, timeout_s, last)
        conn.proto.abort()

    @staticmethod
    def _write_backlog(conn: _Conn) -> int:
        """Bytes of replies ``conn``'s peer has not taken yet: our write buffer, and the
        kernel's send queue (Linux ``SIOCOUTQ``): the write buffer alone moves only when
        the kernel wakes the writer, after half of a send buffer of megabytes drained, so
        a slow reader would show no progress for seconds at a time."""
        transport = conn.proto.transport
        if transport is None:
            return 0
        size = transport.get_write_buffer_size()
        sock = transport.get_extra_info("socket")
        if sock is not None and _OUTQ is not None:
            with contextlib.suppress(OSError, ValueError):
                size += int.from_bytes(fcntl.ioctl(sock.fileno(), _OUTQ, bytes(4)),
                                       sys.byteorder, signed=True)
        return size

    async def _serve(self, conn: _Conn, req: framing.Request, handler: Handler) -> None:
        stats = self._stats[req.method]
        stats.calls += 1
        stats.in_flight += 1
        t0 = time.perf_counter()
        err: PersiaError | None = None
        parts: list[bytes | memoryview] = []
        try:
            result = await handler(req.params)
            try:
                # Arrays of the result are sent from their own memory, not copied.
                parts = framing.encode_parts(
                    {"id": req.id, "r": result}, self._limits,
                    f"{self.name} cannot send the reply to {req.method!r}")
            except WireError as exc:
                log.error("%s", exc)
                err = exc
        except PersiaError as exc:
            err = exc
        except asyncio.CancelledError:
            if not self._stopping:  # the handler's own await was cancelled, not this task
                log.exception("%s: handler for %r was cancelled", self.name, req.method)
                err = InternalError(f"{self.name}: handler for {req.method!r} was cancelled")
            else:  # stop() gave up on it: tell the caller rather than leave it waiting
                stats.observe(time.perf_counter() - t0, True)
                self._reply_now(conn, framing.error_reply(req.id, PeerUnavailable(
                    f"{self.name} at {self.address} is shutting down and cancelled "
                    f"{req.method!r} after its drain timeout",
                    hint="retry on another replica or after the server restarts")))
                raise
        except Exception as exc:
            log.exception("%s: handler for %r raised", self.name, req.method)
            err = InternalError(f"{self.name}: handler for {req.method!r} raised "
                                f"{type(exc).__name__}: {exc}",
                                hint="the traceback is in that server's log")
        stats.observe(time.perf_counter() - t0, err is not None)
        if err is not None:
            parts = framing.encode_parts(framing.error_reply(req.id, err), self._limits,
                                         "error reply")
        if conn.proto.is_closing():
            return  # the caller is gone; it already saw PeerUnavailable
        conn.proto.write(parts)
        await self._drain(conn)
