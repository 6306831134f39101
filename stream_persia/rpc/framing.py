"""RPC frames and messages: pure logic, no sockets (schema in :mod:`stream_persia.rpc`).

A frame is a 4-byte big-endian unsigned body length followed by the body, which is one
:func:`stream_persia.wire.pack` message. The length is checked against
``WireLimits.max_frame_bytes`` before a byte of the body is read, so a peer cannot make us
allocate more than the limit.

:class:`FrameProtocol` is the connection both peers use. It receives with
``asyncio.BufferedProtocol``: small frames are cut out of one reusable scratch buffer, and
the body of a large one is read by the socket straight into a buffer of exactly its size,
which :func:`stream_persia.wire.unpack` then decodes without copying (arrays are views of
it; a fresh buffer per frame keeps them valid). ``StreamReader.readexactly`` instead
copies every byte twice (into its buffer, then out of it) and shifts the rest of the
buffer; on a 5 MB lookup reply that cost the embedding worker ~4 ms of CPU per batch.
It sends with :func:`stream_persia.wire.pack_parts` and ``writelines``, so arrays go
from their own memory to the socket (uvloop writes the pieces with one ``writev``).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import struct
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from stream_persia import wire
from stream_persia.errors import PersiaError, WireError

__all__ = ["HEADER", "FrameProtocol", "MalformedRequest", "Reply", "Request", "Unidentifiable",
           "check_length", "encode", "encode_parts", "error_reply", "parse_reply",
           "parse_request", "read_frame", "request_body", "write"]

HEADER = struct.Struct(">I")

# Below this size, joining header and body costs less than a second send() call; above
# it, header and body go to the transport separately so the body is not copied here.
_JOIN_BELOW_BYTES = 64 * 1024


class Unidentifiable(WireError):
    """A frame that cannot be tied to a request id; the connection must be closed."""


class MalformedRequest(WireError):
    """A malformed request whose id is known, so an error reply can be addressed to it."""

    def __init__(self, request_id: int, message: str, *, field: str | None = None):
        super().__init__(message, field=field)
        self.request_id = request_id


class Request(NamedTuple):
    id: int
    method: str
    params: Any


class Reply(NamedTuple):
    id: int | None
    result: Any
    error: dict[str, Any] | None


def check_length(length: int, limits: wire.WireLimits, peer: str) -> None:
    """Raise :class:`Unidentifiable` when a frame header announces too large a body."""
    if length > limits.max_frame_bytes:
        raise Unidentifiable(
            f"frame from {peer} announces {length} bytes, over max_frame_bytes="
            f"{limits.max_frame_bytes}", field="max_frame_bytes",
            hint="raise WireLimits.max_frame_bytes on both peers, or send smaller batches")
    if length == 0:
        raise Unidentifiable(f"empty frame from {peer}", field="length",
                             hint="every frame carries one wire.pack() message")


async def read_frame(reader: asyncio.StreamReader, limits: wire.WireLimits,
                     peer: str) -> bytes:
    """Read one frame body.

    Raises:
        asyncio.IncompleteReadError: the peer closed the connection (``partial`` is empty
            when it closed cleanly between frames).
        Unidentifiable: the announced length is 0 or over the limit (body left unread).
    """
    header = await reader.readexactly(HEADER.size)
    (length,) = HEADER.unpack(header)
    check_length(length, limits, peer)
    return await reader.readexactly(length)


def write(writer: asyncio.StreamWriter, parts: list[bytes]) -> None:
    """Queue one frame from :func:`encode` on ``writer``.

    Synchronous, so frames written by concurrent tasks never interleave. Parts go out as
    separate writes rather than ``writelines``, which joins them (copying the body) on
    the standard loop before Python 3.12.
    """
    for part in parts:
        writer.write(part)


def encode_parts(msg: dict[str, Any], limits: wire.WireLimits, what: str
                 ) -> list[bytes | memoryview]:
    """Pack ``msg`` into one frame as pieces for :meth:`FrameProtocol.write`: the length
    prefix and small data joined, large arrays referenced (see :func:`wire.pack_parts`;
    they must not be modified until the frame is written).

    Raises:
        WireError: the message cannot be encoded, or is over ``max_frame_bytes``.
    """
    try:
        parts = wire.pack_parts(msg, limits)  # checks every limit before assembling
    except WireError as exc:
        raise WireError(f"{what}: {exc.message}", field=exc.field, hint=exc.hint) from None
    n = sum(map(len, parts))  # pieces are bytes or 1-D uint8 memoryviews: len is bytes
    if n > limits.max_frame_bytes:  # pack_parts() promises this; the prefix must not overflow
        raise WireError(f"{what} encodes to {n} bytes, over max_frame_bytes="
                        f"{limits.max_frame_bytes}", field="max_frame_bytes")
    if len(parts[0]) < _JOIN_BELOW_BYTES:  # the first piece is bytes: header and body
        parts[0] = HEADER.pack(n) + parts[0]
    else:
        parts.insert(0, HEADER.pack(n))
    return parts


def encode(msg: dict[str, Any], limits: wire.WireLimits, what: str) -> list[bytes]:
    """Pack ``msg`` into frame parts for :func:`write`.

    Raises:
        WireError: the message cannot be encoded, or is over ``max_frame_bytes``.
    """
    try:
        body = wire.pack(msg, limits)  # checks every limit before assembling the frame
    except WireError as exc:
        raise WireError(f"{what}: {exc.message}", field=exc.field, hint=exc.hint) from None
    n = len(body)
    if n > limits.max_frame_bytes:  # pack() promises this; the prefix must not overflow
        raise WireError(f"{what} encodes to {n} bytes, over max_frame_bytes="
                        f"{limits.max_frame_bytes}", field="max_frame_bytes")
    if n < _JOIN_BELOW_BYTES:
        return [HEADER.pack(n) + body]
    return [HEADER.pack(n), body]


def request_body(req_id: int, method: str, params: Any) -> dict[str, Any]:
    return {"id": req_id, "m": method, "p": params}


def error_reply(req_id: int | None, err: PersiaError) -> dict[str, Any]:
    return {"id": req_id, "e": err.to_dict()}


def _is_id(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_request(msg: Any, peer: str) -> Request:
    """Validate a decoded request.

    Raises:
        Unidentifiable: no integer ``id`` (nothing to address a reply to).
        MalformedRequest: a malformed request whose ``id`` is known.
    """
    if not isinstance(msg, dict) or not _is_id(msg.get("id")):
        got = type(msg).__name__ if not isinstance(msg, dict) else f"keys {sorted(msg)}"
        raise Unidentifiable(f"request from {peer} has no integer 'id' (got {got})",
                             field="id", hint='requests are {"id": int, "m": str, "p": any}')
    req_id = msg["id"]
    method = msg.get("m")
    if not isinstance(method, str):
        raise MalformedRequest(
            req_id, f"request {req_id} from {peer}: 'm' must be a method name string, got "
            f"{type(method).__name__}", field="m")
    return Request(req_id, method, msg.get("p"))


def parse_reply(msg: Any, peer: str) -> Reply:
    """Validate a decoded reply. ``id`` None marks a connection-level error.

    Raises:
        WireError: not a reply this protocol produces.
    """
    if not isinstance(msg, dict) or not (msg.get("id") is None or _is_id(msg.get("id"))):
        raise WireError(f"reply from {peer} is not {{'id': int, 'r'|'e': ...}}", field="id")
    err = msg.get("e")
    if err is not None:
        if not isinstance(err, dict):
            raise WireError(f"reply from {peer}: 'e' must be an error dict, got "
                            f"{type(err).__name__}", field="e")
        return Reply(msg["id"], None, err)
    if "r" not in msg or msg["id"] is None:
        raise WireError(f"reply from {peer} carries neither 'r' nor 'e'", field="r")
    return Reply(msg["id"], msg["r"], None)


# -- the connection ---------------------------------------------------------------------

# Reads land in a scratch buffer unless a large frame's body is being filled, at most
# _SMALL_FRAME bytes at a time (the part of a large frame read there is copied once).
# Frames up to _SMALL_FRAME are cut out of it (one small copy each); a larger one gets
# its own buffer, and the socket reads the rest of it straight into place.
_SMALL_FRAME = 64 * 1024
_SCRATCH_BYTES = 4 * _SMALL_FRAME
# Received frames not yet taken by the reader task: past either bound, stop reading the
# socket (TCP then stops the peer) until the reader catches up.
_QUEUE_MAX_FRAMES = 64
_QUEUE_MAX_BYTES = 1 << 20


class FrameProtocol(asyncio.BufferedProtocol):
    """One framed connection: whole frames in (:meth:`read_frame`), frames out
    (:meth:`write`, :meth:`drain`).

    Frame bodies come out as writable buffers private to the frame (``bytearray`` or a
    ``memoryview`` of one), so arrays decoded from them stay valid as long as they are
    referenced, and nothing else ever writes to that memory.

    Args:
        limits: ``max_frame_bytes`` is checked on every length prefix before its body.
        on_connect: called with the protocol once the transport is attached (servers).
    """

    def __init__(self, limits: wire.WireLimits,
                 on_connect: Callable[[FrameProtocol], None] | None = None):
        self.limits = limits
        self.peer = "?"
        self.transport: asyncio.Transport | None = None
        self._on_connect = on_connect
        self._scratch = bytearray(_SCRATCH_BYTES)
        self._scratch_view = memoryview(self._scratch)
        self._start = 0          # unparsed bytes of the scratch buffer: [_start, _end)
        self._end = 0
        self._body: np.ndarray | None = None  # a large frame being filled, and how far
        self._body_view: memoryview | None = None
        self._filled = 0
        self._frames: collections.deque[memoryview | bytearray] = collections.deque()
        self._queued_bytes = 0
        self._error: BaseException | None = None  # raised once the queued frames are read
        self._eof = False
        self._read_paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._write_paused = False
        self._drain_waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._lost = False
        self._closed: asyncio.Future[None] | None = None

    # -- asyncio callbacks -----------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        self._closed = asyncio.get_running_loop().create_future()
        addr = transport.get_extra_info("peername")
        self.peer = f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)
        set_nodelay(transport)
        if self._on_connect is not None:
            self._on_connect(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body_view is not None:
            return self._body_view[self._filled:]
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._scratch) - self._end < 2 * _SMALL_FRAME:
            # Little room left: move the partial frame (<= _SMALL_FRAME + 4) to the front.
            n = self._end - self._start
            self._scratch_view[:n] = bytes(self._scratch_view[self._start:self._end])
            self._start, self._end = 0, n
        return self._scratch_view[self._end:self._end + _SMALL_FRAME]

    def buffer_updated(self, nbytes: int) -> None:
        if self._body_view is not None:
            self._filled += nbytes
            if self._filled == len(self._body_view):
                body, self._body, self._body_view = self._body_view, None, None
                self._push(body)
            return
        self._end += nbytes
        self._parse_scratch()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        return True  # keep the transport open: replies may still be written (half-close)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if exc is not None and self._error is None:
            self._error = exc
        self._eof = True
        self._wake()
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_exception(ConnectionResetError("Connection lost"))
        self._drain_waiters.clear()
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        for waiter in self._drain_waiters:
            if not waiter.done():
                waiter.set_result(None)
        self._drain_waiters.clear()

    # -- receiving -------------------------------------------------------------------

    def _parse_scratch(self) -> None:
        buf, start, end = self._scratch, self._start, self._end
        # Stops while the reader is behind; read_frame() parses the rest as it catches up.
        while end - start >= HEADER.size and self._error is None and not self._backlogged():
            (length,) = HEADER.unpack_from(buf, start)
            try:
                check_length(length, self.limits, self.peer)
            except Unidentifiable as exc:
                # Leave the body unread: nothing after a bad prefix can be trusted.
                self._error = exc
                self._pause_reading()
                self._wake()
                break
            have = end - start - HEADER.size
            if have >= length:
                body_at = start + HEADER.size
                self._push(buf[body_at:body_at + length])  # a copy: scratch is reused
                start = body_at + length
            elif length > _SMALL_FRAME:
                # np.empty: a buffer this size would be filled in at once, not zeroed first.
                self._body = np.empty(length, dtype=np.uint8)
                self._body_view = memoryview(self._body)
                self._body_view[:have] = self._scratch_view[start + HEADER.size:end]
                self._filled = have
                start = end
                break
            else:
                break  # a small frame still arriving: it fits in the scratch buffer
        self._start, self._end = start, end

    def _push(self, body: memoryview | bytearray) -> None:
        self._frames.append(body)
        self._queued_bytes += len(body)
        if self._backlogged():
            self._pause_reading()
        self._wake()

    def _backlogged(self, slack: int = 1) -> bool:
        # One frame of any size may wait; more than that within the bounds (/ slack).
        n = len(self._frames)
        return n > 1 and (n * slack >= _QUEUE_MAX_FRAMES
                          or self._queued_bytes * slack >= _QUEUE_MAX_BYTES)

    def _pause_reading(self) -> None:
        if not self._read_paused and self.transport is not None and not self._lost:
            self._read_paused = True
            self.transport.pause_reading()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def read_frame(self) -> memoryview | bytearray:
        """The next frame body.

        Raises:
            asyncio.IncompleteReadError: the peer closed the connection (``partial`` is
                empty when it closed cleanly between frames).
            Unidentifiable: the announced length is 0 or over the limit (body left unread).
            OSError: the connection failed.
        """
        while not self._frames:
            if self._error is not None:
                raise self._error
            if self._eof:
                partial = bytes(self._scratch_view[self._start:self._end])
                if self._body_view is not None:  # the part of a large frame received
                    partial = (HEADER.pack(len(self._body_view))
                               + bytes(self._body_view[:self._filled]))
                raise asyncio.IncompleteReadError(partial, None)
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        body = self._frames.popleft()
        self._queued_bytes -= len(body)
        if self._start != self._end and self._body_view is None:
            self._parse_scratch()  # frames left unparsed while the queue was full
        if (self._read_paused and self._error is None and not self.is_closing()
                and not self._backlogged(slack=2)):
            self._read_paused = False
            self.transport.resume_reading()
        return body

    # -- sending ---------------------------------------------------------------------

    def write(self, parts: list[bytes | memoryview]) -> None:
        """Queue one frame from :func:`encode_parts` (synchronous, so frames written by
        concurrent tasks never interleave)."""
        write_frame(self.transport, parts)

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below its high-water mark.

        Raises:
            ConnectionResetError: the connection was lost.
        """
        if self._lost:
            raise ConnectionResetError("Connection lost")
        if self.transport.is_closing():
            await asyncio.sleep(0)  # let connection_lost run, as StreamWriter.drain does
        if not self._write_paused:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(waiter)
        await waiter

    def is_closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    async def wait_closed(self) -> None:
        if self._closed is not None:
            await asyncio.shield(self._closed)


def _gathers(transport: asyncio.BaseTransport) -> bool:
    """Whether ``writelines`` sends the pieces as they are. uvloop's does (one ``writev``);
    the standard loop's joins them into one bytes before Python 3.12."""
    return type(transport).__module__.startswith("uvloop") or sys.version_info >= (3, 12)


def write_frame(transport: asyncio.WriteTransport, parts: list[bytes | memoryview]) -> None:
    """Queue one frame's pieces on ``transport`` without joining them."""
    if len(parts) == 1:
        transport.write(parts[0])
    elif _gathers(transport):
        transport.writelines(parts)
    else:
        for part in parts:
            transport.write(part)


def set_nodelay(transport: asyncio.BaseTransport) -> None:
    """Disable Nagle: frames must leave at once, not wait for the peer's ACK."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    with contextlib.suppress(OSError, AttributeError):  # not TCP (e.g. a unix socket)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
