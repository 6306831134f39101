"""RPC client: many concurrent calls pipelined over one lazily (re)connected TCP connection
(a Unix socket when the server is on this host: :mod:`stream_persia.rpc.unix`).

With the job's role secret (:mod:`stream_persia.rpc.auth`, ``PERSIA_ROLE_SECRET(_FILE)`` of
the process by default), every new connection is authenticated (both ways) before its
first request; a refusal fails the call with :class:`~stream_persia.errors.AuthError`
naming the setting. A server's *goaway* (it closes idle connections) retires the
connection: the next call opens a new one, and calls already sent get their replies.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
from collections.abc import Callable
from typing import Any

from stream_persia.core.aio import run_until
from stream_persia.errors import (
    AuthError,
    BadInput,
    InternalError,
    Misuse,
    PeerUnavailable,
    PersiaError,
    RemoteTimeout,
    WireError,
    error_from_dict,
)
from stream_persia.rpc import auth, framing, unix
from stream_persia.rpc.framing import wire
from stream_persia.rpc.transport import FrameProtocol

__all__ = ["RpcClient", "parse_address"]

log = logging.getLogger(__name__)

_FIRST_BACKOFF_S = 0.05
#: how long a call whose send failed waits for the reader to find the server's reason
_CAUSE_WAIT_S = 1.0

Failure = Callable[[str], PersiaError]  # method name -> the error its pending call gets


def parse_address(address: str) -> tuple[str, int]:
    """Split ``host:port`` (or ``[v6addr]:port``).

    Raises:
        BadInput: not of that form, or the port is not in 1..65535.
    """
    host, sep, port = str(address).rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise BadInput(f"RPC address must be 'host:port' with a port in 1..65535, got "
                       f"{address!r}", field="address", hint="e.g. '127.0.0.1:7000'")
    return host, int(port)


class _Conn:
    __slots__ = ("proto", "pending", "reader_task", "alive", "failure")

    def __init__(self, proto: FrameProtocol):
        self.proto = proto
        self.pending: dict[int, tuple[asyncio.Future[Any], str]] = {}
        self.reader_task: asyncio.Task[None] | None = None
        self.alive = True
        self.failure: Failure | None = None   # why it was dropped, for late callers


class RpcClient:
    """Calls methods of one :class:`RpcServer`.

    Concurrent calls share one connection; a reader task owned by the client hands
    replies to the waiting calls by request id. The connection is opened on the first
    call and reopened after it drops, with exponential backoff between failed attempts.
    A client belongs to the event loop of its first call.

    Args:
        address: ``host:port`` of the server.
        timeout_ms: default per-call timeout, connecting included.
        connect_timeout_ms: how long one connection attempt may take.
        max_reconnect_backoff_ms: cap of the wait between failed connection attempts.
        limits: wire limits enforced on every frame received (and on requests sent).
        name: role of the peer for error messages, e.g. "embedding-server".
        secret: the job's role secret, proven to the server on every new connection
            (which must prove it back); default: ``PERSIA_ROLE_SECRET(_FILE)`` of this
            process; None: none (only servers without a secret accept the client).

    Raises:
        BadInput: ``address`` is not ``host:port``.
        Misuse: a timeout or backoff is not positive.
        ConfigError: the role secret setting is invalid.
    """

    def __init__(self, address: str, *, timeout_ms: float = 10000,
                 connect_timeout_ms: float = 3000, max_reconnect_backoff_ms: float = 2000,
                 limits: wire.WireLimits = wire.DEFAULT_LIMITS, name: str | None = None,
                 secret: auth.SecretSetting = auth.FROM_ENV):
        self.host, self.port = parse_address(address)
        for field, value in (("timeout_ms", timeout_ms),
                             ("connect_timeout_ms", connect_timeout_ms),
                             ("max_reconnect_backoff_ms", max_reconnect_backoff_ms)):
            if not value > 0:
                raise Misuse(f"RpcClient {field} must be > 0, got {value!r}", field=field)
        self.address = address
        self.name = name
        self.peer = f"{name} {address}" if name else f"RPC peer {address}"
        self.timeout_ms = timeout_ms
        self._connect_timeout_s = connect_timeout_ms / 1000
        self._max_backoff_s = max_reconnect_backoff_ms / 1000
        self._limits = limits
        self._secret = auth.resolve(secret)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conn: _Conn | None = None
        self._retired: set[_Conn] = set()   # sent a goaway, still answering calls
        self._connecting: asyncio.Task[_Conn] | None = None
        self._closed = False
        self._ids = itertools.count(1)
        self._backoff_s = 0.0
        self._next_attempt_at = 0.0
        self._last_failure: PersiaError | None = None
        self._counters = {"calls": 0, "errors": 0, "timeouts": 0, "connects": 0,
                          "connect_failures": 0, "disconnects": 0, "goaways": 0}

    # -- calls -----------------------------------------------------------------------

    async def call(self, method: str, params: Any = None, timeout_ms: float | None = None) -> Any:
        """Call ``method`` on the peer and return its result.

        numpy arrays in ``params`` are sent from their own memory, not copied: do not
        modify them until the call returns. Arrays in the result are read-only views of
        the reply frame.

        Raises:
            PeerUnavailable: the peer cannot be reached, or the connection dropped while
                the call was in flight.
            RemoteTimeout: no reply within ``timeout_ms`` (default: the client's).
            PersiaError: the error the handler raised, rebuilt with its type and fields
                (an unexpected handler exception arrives as :class:`InternalError`).
            WireError: the request cannot be encoded or is over ``max_frame_bytes``.
            Misuse: the client is closed or bound to another event loop.
        """
        loop = self._bind_loop()
        timeout_ms = self.timeout_ms if timeout_ms is None else timeout_ms
        deadline = loop.time() + timeout_ms / 1000
        req_id = next(self._ids)
        self._counters["calls"] += 1
        phase = ["connecting"]
        try:
            # Arrays in params are sent from their own memory, not copied.
            parts = framing.encode_parts(framing.request_body(req_id, method, params),
                                         self._limits, f"request {method!r} to {self.peer}")
            return await run_until(self._call(req_id, method, parts, deadline, phase), deadline)
        except RemoteTimeout:
            self._counters["errors"] += 1
            raise
        except TimeoutError:
            self._counters["timeouts"] += 1
            self._counters["errors"] += 1
            what = {"connecting": "could not be connected to for",
                    "sending": "did not read the request for",
                    "waiting": "did not answer"}[phase[0]]
            raise RemoteTimeout(f"{self.peer} {what} {method!r} within {timeout_ms:g} ms",
                                field="timeout_ms",
                                hint="the peer may be overloaded or stuck; raise timeout_ms "
                                     "if the call is legitimately slow") from None
        except PersiaError:
            self._counters["errors"] += 1
            raise

    async def _call(self, req_id: int, method: str, parts: list[bytes | memoryview],
                    deadline: float, phase: list[str]) -> Any:
        conn = self._conn
        if conn is None or not conn.alive or conn.proto.is_closing():
            conn = await self._connected(deadline)
            if not conn.alive and conn.failure is not None:   # refused as it opened
                raise conn.failure(method)
        phase[0] = "sending"
        fut = asyncio.get_running_loop().create_future()
        conn.pending[req_id] = (fut, method)
        try:
            try:
                conn.proto.write(parts)
                await conn.proto.drain()
            except (ConnectionError, RuntimeError):  # RuntimeError: uvloop, transport closed
                if not fut.done() and conn.reader_task is not None:
                    # The server may have said why before closing (a refusal frame): the
                    # reader fails the call with it once it reaches the frame.
                    await asyncio.wait({fut, conn.reader_task}, timeout=_CAUSE_WAIT_S,
                                       return_when=asyncio.FIRST_COMPLETED)
                if fut.done():  # the reader failed it with the precise cause
                    return fut.result()
                if conn.failure is not None:   # ... or had, before this call was pending
                    raise conn.failure(method) from None
                raise PeerUnavailable(f"{self.peer} dropped the connection while {method!r} "
                                      "was being sent") from None
            phase[0] = "waiting"
            return await fut
        finally:
            conn.pending.pop(req_id, None)
            if not conn.alive and not conn.pending:
                conn.proto.close()   # retired by a goaway: its last call is answered

    # -- connection ------------------------------------------------------------------

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._closed:
            raise Misuse(f"RpcClient for {self.peer} is closed",
                         hint="create a new client after close()")
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:
            raise Misuse(f"RpcClient for {self.peer} is bound to another event loop",
                         hint="use one client per loop; from sync code, run calls on an "
                              "aio.LoopThread")
        return loop

    async def _connected(self, deadline: float) -> _Conn:
        """The live connection, joining or starting a connection attempt."""
        if self._connecting is None:
            loop = asyncio.get_running_loop()
            last = self._last_failure
            if last is not None and self._next_attempt_at > deadline:
                wait_ms = (self._next_attempt_at - loop.time()) * 1000
                raise type(last)(
                    f"{last.message}; the next attempt is in {wait_ms:.0f} ms "
                    "(reconnect backoff), after this call's deadline",
                    field=last.field, hint=last.hint)
            task = loop.create_task(self._connect(), name=f"connect {self.peer}")
            # Callers may all time out before the attempt ends; don't log its error then.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            self._connecting = task
        return await asyncio.shield(self._connecting)

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            delay = self._next_attempt_at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            try:
                _, proto = await asyncio.wait_for(self._open(), self._connect_timeout_s)
            except PersiaError as exc:   # refused by the server, or failed its handshake
                raise self._connect_failed(exc) from None
            except asyncio.IncompleteReadError:
                raise self._connect_failed(PeerUnavailable(
                    f"{self.peer} closed the connection during the handshake",
                    hint="the peer may be restarting, or may not be a stream-persia RPC "
                         "server")) from None
            except ConnectionRefusedError:
                raise self._connect_failed(PeerUnavailable(
                    f"{self.peer} refused the connection (nothing listening on that port)",
                    hint="is the process running, and is the address right?")) from None
            except asyncio.TimeoutError:
                raise self._connect_failed(PeerUnavailable(
                    f"{self.peer} did not accept the connection within "
                    f"{self._connect_timeout_s * 1000:g} ms",
                    hint="the host may be down or a firewall may drop packets")) from None
            except OSError as exc:
                raise self._connect_failed(PeerUnavailable(
                    f"{self.peer} could not be reached: {exc}",
                    hint="check the host name and the network")) from None
            conn = _Conn(proto)
            conn.reader_task = loop.create_task(self._read_loop(conn),
                                                name=f"reader {self.peer}")
            self._conn = conn
            self._backoff_s = 0.0
            self._next_attempt_at = 0.0
            self._last_failure = None
            self._counters["connects"] += 1
            return conn
        finally:
            self._connecting = None

    async def _open(self) -> tuple[Any, Any]:
        """A Unix socket to a same-host server (rpc/unix.py), else TCP; authenticated
        when the client has a role secret."""
        def factory() -> FrameProtocol:
            return FrameProtocol(self._limits)
        pair = await unix.open_connection(factory, self.host, self.port)
        if pair is None:
            pair = await asyncio.get_running_loop().create_connection(factory, self.host,
                                                                      self.port)
        if self._secret is not None:
            try:
                await self._authenticate(pair[1])
            except BaseException:
                pair[1].close()   # after what was written (a mismatch notice) is sent
                raise
        return pair

    async def _authenticate(self, proto: FrameProtocol) -> None:
        """The client's half of the handshake (:mod:`stream_persia.rpc.auth`)."""
        secret = self._secret
        assert secret is not None
        client_nonce = auth.new_nonce()
        proto.write(framing.encode_parts(auth.hello(client_nonce), self._limits, "hello"))
        try:
            server_nonce = auth.check_challenge(await self._handshake_reply(proto), secret,
                                                client_nonce, self.peer)
        except AuthError:   # tell the server, so that it counts and logs the mismatch too
            proto.write(framing.encode_parts(auth.mismatch(), self._limits, "mismatch"))
            raise
        proto.write(framing.encode_parts(auth.client_proof(secret, client_nonce, server_nonce),
                                         self._limits, "proof"))
        auth.check_welcome(await self._handshake_reply(proto), self.peer)

    async def _handshake_reply(self, proto: FrameProtocol) -> Any:
        """The server's next handshake frame; its refusal (an error frame) raised."""
        msg = wire.unpack(await proto.read_frame(), self._limits)
        if isinstance(msg, dict) and msg.get("id", 0) is None and isinstance(msg.get("e"), dict):
            err = error_from_dict(msg["e"])
            raise type(err)(f"{self.peer} refused the connection: {err.message}",
                            field=err.field, hint=err.hint)
        return msg

    def _connect_failed(self, err: PersiaError) -> PersiaError:
        self._counters["connect_failures"] += 1
        self._backoff_s = min(max(2 * self._backoff_s, _FIRST_BACKOFF_S), self._max_backoff_s)
        jitter = 0.8 + 0.4 * random.random()  # de-synchronise clients of a restarted peer
        self._next_attempt_at = asyncio.get_running_loop().time() + self._backoff_s * jitter
        self._last_failure = err
        return err

    async def _read_loop(self, conn: _Conn) -> None:
        peer = self.peer
        failure: Failure
        try:
            while True:
                body = await conn.proto.read_frame()
                msg = wire.unpack(body, self._limits)
                reply = framing.parse_reply(msg, peer)
                if reply.id is None:  # the server rejected a frame and closes the connection
                    if msg.get("goaway"):   # ... or asks us to stop using this one
                        self._retire(conn)
                        continue
                    rejected = error_from_dict(reply.error or {})
                    cls = type(rejected)
                    what = ("refused {m!r} and closed the connection"
                            if isinstance(rejected, (AuthError, PeerUnavailable)) else
                            "rejected a frame on the connection {m!r} was using and closed it")

                    def failure(m: str, r: PersiaError = rejected, c: type = cls,
                                w: str = what) -> PersiaError:
                        return c(f"{peer} {w.format(m=m)}: {r.message}", field=r.field,
                                 hint=r.hint)
                    return
                entry = conn.pending.pop(reply.id, None)
                if entry is None or entry[0].done():
                    continue  # its caller timed out or was cancelled: drop the late reply
                fut, _ = entry
                if reply.error is not None:
                    fut.set_exception(error_from_dict(reply.error))
                else:
                    fut.set_result(reply.result)
        except asyncio.CancelledError:
            def failure(m: str) -> PersiaError:
                return PeerUnavailable(f"the RpcClient for {peer} was closed while {m!r} was "
                                       "in flight")
            raise
        except (asyncio.IncompleteReadError, ConnectionError, OSError) as exc:
            cause = "closed the connection" if isinstance(
                exc, asyncio.IncompleteReadError) else f"dropped the connection ({exc})"

            def failure(m: str) -> PersiaError:
                return PeerUnavailable(f"{peer} {cause} while {m!r} was in flight",
                                       hint="the peer may have crashed or restarted; the "
                                            "next call reconnects")
        except WireError as exc:
            log.warning("%s: invalid reply frame, closing the connection: %s", peer, exc)
            bad = exc

            def failure(m: str) -> PersiaError:
                return WireError(f"{peer} sent an invalid reply frame while {m!r} was in "
                                 f"flight: {bad.message}", field=bad.field, hint=bad.hint)
        except Exception as exc:  # a bug: fail the calls rather than leave them hanging
            log.exception("%s: RPC reader failed", peer)
            bug = exc

            def failure(m: str) -> PersiaError:
                return InternalError(f"RPC reader for {peer} failed while {m!r} was in "
                                     f"flight: {bug!r}")
        finally:
            self._drop(conn, failure)

    def _retire(self, conn: _Conn) -> None:
        """The server sent a goaway: new calls go to a new connection; this one closes
        once the calls already sent on it are answered (they still will be)."""
        conn.alive = False
        self._counters["goaways"] += 1
        if self._conn is conn:
            self._conn = None
        self._retired.add(conn)
        if not conn.pending:
            conn.proto.close()

    def _drop(self, conn: _Conn, failure: Failure) -> None:
        """Fail every call pending on ``conn`` and forget it; the next call reconnects."""
        conn.alive = False
        conn.failure = failure
        conn.proto.close()
        self._retired.discard(conn)
        pending, conn.pending = conn.pending, {}
        for fut, method in pending.values():
            if not fut.done():
                fut.set_exception(failure(method))
        if self._conn is conn:
            self._conn = None
            self._counters["disconnects"] += 1
            # The peer was up a moment ago: retry at once (backoff starts on failure).
            self._backoff_s = 0.0
            self._next_attempt_at = 0.0

    # -- readiness and lifecycle -----------------------------------------------------

    async def wait_ready(self, timeout_s: float, *, probe: str | None = None) -> None:
        """Retry connecting (and calling ``probe``, if given) until it works.

        Raises:
            PeerUnavailable: still not reachable after ``timeout_s``; names the last error.
        """
        loop = self._bind_loop()
        deadline = loop.time() + timeout_s
        last: PersiaError | None = None
        while True:
            try:
                conn = self._conn
                if conn is None or not conn.alive or conn.proto.is_closing():
                    await run_until(self._connected(deadline), deadline)
                if probe is not None:
                    remaining_ms = max(1.0, (deadline - loop.time()) * 1000)
                    await self.call(probe, None, timeout_ms=remaining_ms)
                return
            except (PeerUnavailable, RemoteTimeout) as exc:
                last = exc
            except TimeoutError:
                pass
            now = loop.time()
            if now >= deadline or self._next_attempt_at > deadline:
                break
            if self._next_attempt_at <= now and self._connecting is None:
                # Connected but the probe failed: pace the retries like reconnects.
                await asyncio.sleep(min(_FIRST_BACKOFF_S, deadline - now))
        raise PeerUnavailable(f"{self.peer} was not ready within {timeout_s:g} s"
                              + (f": {last.message}" if last is not None else ""),
                              hint=last.hint if last is not None else None)

    @property
    def connected(self) -> bool:
        """Whether a connection is open now (calls connect lazily either way)."""
        return self._conn is not None and self._conn.alive

    def stats(self) -> dict[str, Any]:
        """Counters: calls, errors, timeouts, connects, connect failures, disconnects."""
        in_flight = len(self._conn.pending) if self._conn is not None else 0
        return {"peer": self.peer, "connected": self.connected, "in_flight": in_flight,
                **self._counters}

    async def close(self) -> None:
        """Close the connection; calls still in flight fail with PeerUnavailable."""
        if self._closed:
            return
        self._closed = True
        connecting = self._connecting
        if connecting is not None:
            connecting.cancel()
            await asyncio.gather(connecting, return_exceptions=True)
        for conn in [self._conn, *self._retired]:
            if conn is not None and conn.reader_task is not None:
                conn.reader_task.cancel()
                await asyncio.gather(conn.reader_task, return_exceptions=True)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(conn.proto.wait_closed(), 1.0)

    async def __aenter__(self) -> RpcClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
