"""One framed RPC connection (frames in :mod:`stream_persia.rpc.framing`), both peers.

Receiving uses ``asyncio.BufferedProtocol``: the socket reads into buffers this class
hands out. Small frames are cut out of one reusable scratch buffer; the body of a large
one gets a buffer of exactly its size, which the socket then fills directly and
:func:`stream_persia.core.wire.unpack` decodes without copying (arrays are views of it, and a
fresh buffer per frame keeps them valid). ``StreamReader.readexactly`` instead copies
every byte twice (into its buffer, then out of it) and shifts what follows; on the 5 MB
lookup reply of a 1024 x 26-slot batch that cost the embedding worker ~4 ms of CPU.

A large frame's buffer is reserved as its bytes arrive, not as its header announces: at
first at most :data:`_RESERVE_BYTES` (16 MiB), or the largest frame the connection has
already delivered whole if that is more, then doubling (with one copy of what came so
far) until it reaches the announced size. A header alone announcing 256 MiB used to
reserve all of it, so a peer holding many connections that each announced a large frame
and sent nothing more charged the role gigabytes of address space it never filled (1,024
connections: 256 GiB); now a connection reserves ahead only what its own traffic has
shown. Frames up to 16 MiB (the 5 MB lookup reply above, three times over), and larger
ones on a connection that carried one as large before, are still read straight into
their final buffer; only a connection's first frame past both pays the copies.

The scratch buffer starts lean (:data:`_LEAN_BYTES`, enough for the handshake and small
requests) and grows to its working size (256 KiB) only once the connection carries
traffic that needs it: a read that fills it, or a frame that does not fit. An idle or
unauthenticated connection therefore costs a few KiB, not 256 KiB (3,000 idle
connections used to hold ~745 MiB).

Sending takes the pieces of :func:`stream_persia.rpc.framing.encode_parts` (arrays as
views of their own memory) and hands them to ``writelines``, which uvloop writes with
one ``writev``: no copy of array data on the sending side either.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import sys
from collections.abc import Callable

import numpy as np

from stream_persia.core import wire
from stream_persia.rpc import unix
from stream_persia.rpc.framing import HEADER, Unidentifiable, check_length

__all__ = ["FrameProtocol", "set_nodelay", "write_frame"]

# Reads land in the scratch buffer, at most _SMALL_FRAME bytes at a time, unless a large
# frame's body is being filled (so at most that much of a large frame is copied once).
# Frames up to _SMALL_FRAME are cut out of it (one small copy each); a larger one gets
# its own buffer, and the socket reads the rest of it straight into place.
_SMALL_FRAME = 64 * 1024
_SCRATCH_BYTES = 4 * _SMALL_FRAME
# The most of a large frame's buffer reserved ahead of its bytes, unless the connection
# delivered a larger frame before: a frame past it doubles its buffer as it fills (one copy
# of what came so far at each step), so memory follows the bytes received.
_RESERVE_BYTES = 16 << 20
# A new connection's scratch buffer, until its traffic needs the full one.
_LEAN_BYTES = 4096
# Received frames not yet taken by the reader: past either bound, stop parsing and stop
# reading the socket (TCP then holds the peer back) until the reader catches up.
_QUEUE_MAX_FRAMES = 64
_QUEUE_MAX_BYTES = 1 << 20


class FrameProtocol(asyncio.BufferedProtocol):
    """One framed connection: whole frames in (:meth:`read_frame`, one reader at a
    time), frames out (:meth:`write`, :meth:`drain`).

    Frame bodies come out as writable buffers private to the frame (a ``bytearray``, or a
    ``memoryview`` of a new numpy buffer), so arrays decoded from them stay valid as long
    as they are referenced and nothing else ever writes to that memory.

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
        self._gathers = False
        self._scratch = bytearray(_LEAN_BYTES)
        self._scratch_view = memoryview(self._scratch)
        self._lean = True        # the scratch buffer is still the small first one
        self._outgrown = False   # ... and the traffic wants the full one
        self._start = 0          # unparsed bytes of the scratch buffer: [_start, _end)
        self._end = 0
        self._body: memoryview | None = None  # a large frame being filled, and how far
        self._filled = 0
        self._announced = 0      # ... and its size (the buffer is smaller while it grows)
        self._largest = 0        # the largest frame this connection delivered whole
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
        # uvloop's writelines sends the pieces with one writev; the standard loop's joins
        # them into one bytes before Python 3.12, so there each piece is written alone.
        self._gathers = (type(transport).__module__.startswith("uvloop")
                         or sys.version_info >= (3, 12))
        addr = transport.get_extra_info("peername")
        if isinstance(addr, tuple):
            self.peer = f"{addr[0]}:{addr[1]}"
        else:  # a Unix socket (rpc/unix.py): the accepting side sees no name
            self.peer = unix.describe_peer(transport)
        set_nodelay(transport)
        unix.widen_buffers(transport)
        if self._on_connect is not None:
            self._on_connect(self)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is not None:
            return self._body[self._filled:]
        if self._start == self._end:
            self._start = self._end = 0
        elif self._lean or len(self._scratch) - self._end < 2 * _SMALL_FRAME:
            # Little room left: move the partial frame (< _SMALL_FRAME + 4) to the front.
            n = self._end - self._start
            self._scratch_view[:n] = bytes(self._scratch_view[self._start:self._end])
            self._start, self._end = 0, n
        if self._lean:
            if not self._outgrown and self._end < len(self._scratch):
                return self._scratch_view[self._end:]
            self._grow()
        return self._scratch_view[self._end:self._end + _SMALL_FRAME]

    def _grow(self) -> None:
        """Swap the lean scratch buffer for the full one, keeping the unparsed bytes."""
        n = self._end - self._start
        scratch = bytearray(_SCRATCH_BYTES)
        scratch[:n] = self._scratch_view[self._start:self._end]
        self._scratch, self._scratch_view = scratch, memoryview(scratch)
        self._start, self._end = 0, n
        self._lean = False

    def buffer_updated(self, nbytes: int) -> None:
        if self._body is not None:
            self._filled += nbytes
            if self._filled == self._announced:
                body, self._body = self._body, None
                self._largest = max(self._largest, self._announced)
                self._push(body)
            elif self._filled == len(self._body):
                self._body = _grown(self._body, self._announced)
            return
        self._end += nbytes
        if self._lean and self._end == len(self._scratch):
            self._outgrown = True   # the read filled it: more is likely waiting
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
                # np.empty, not bytearray: the socket fills it at once, so no zeroing first.
                reserve = min(length, max(_RESERVE_BYTES, self._largest))
                self._body = np.empty(reserve, dtype=np.uint8).data
                self._body[:have] = self._scratch_view[start + HEADER.size:end]
                self._filled, self._announced = have, length
                start = end
                break
            else:
                # A small frame still arriving: it fits in the scratch buffer (the full
                # one: a lean one grows at the next read if the frame is larger).
                if self._lean and HEADER.size + length > len(buf):
                    self._outgrown = True
                break
        self._start, self._end = start, end

    def _push(self, body: memoryview | bytearray) -> None:
        self._frames.append(body)
        self._queued_bytes += len(body)
        if self._backlogged():
            self._pause_reading()
        self._wake()

    def _backlogged(self, slack: int = 1) -> bool:
        # One frame of any size may wait; more than one only within the bounds (/ slack).
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
                if self._body is not None:  # the part of a large frame received
                    partial = HEADER.pack(self._announced) + bytes(self._body[:self._filled])
                raise asyncio.IncompleteReadError(partial, None)
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        body = self._frames.popleft()
        self._queued_bytes -= len(body)
        if self._start != self._end and self._body is None:
            self._parse_scratch()  # frames left unparsed while the queue was full
        if (self._read_paused and self._error is None and self.transport is not None
                and not self.transport.is_closing() and not self._backlogged(slack=2)):
            self._read_paused = False
            self.transport.resume_reading()
        return body

    # -- sending ---------------------------------------------------------------------

    def write(self, parts: list[bytes | memoryview]) -> None:
        """Queue one frame from :func:`~stream_persia.rpc.framing.encode_parts`.

        Synchronous, so frames written by concurrent tasks never interleave. Array pieces
        are written from their own memory, possibly after this returns.
        """
        if self.transport is None:
            raise ConnectionResetError("Connection not made")
        write_frame(self.transport, parts, self._gathers)

    async def drain(self) -> None:
        """Wait until the transport's write buffer is below its high-water mark.

        Raises:
            ConnectionResetError: the connection was lost.
        """
        if self._lost:
            raise ConnectionResetError("Connection lost")
        if self.is_closing():
            await asyncio.sleep(0)  # let connection_lost run, as StreamWriter.drain does
        if not self._write_paused:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(waiter)
        await waiter

    def is_closing(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    @property
    def write_paused(self) -> bool:
        """The transport's write buffer is over its high-water mark: :meth:`drain` waits."""
        return self._write_paused

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    async def wait_closed(self) -> None:
        if self._closed is not None:
            await asyncio.shield(self._closed)


def _grown(body: memoryview, announced: int) -> memoryview:
    """A buffer twice ``body``'s size (at most ``announced``) holding ``body``'s bytes."""
    grown = np.empty(min(announced, 2 * len(body)), dtype=np.uint8).data
    grown[:len(body)] = body
    return grown


def write_frame(transport: asyncio.WriteTransport, parts: list[bytes | memoryview],
                gathers: bool) -> None:
    """Queue one frame's pieces on ``transport`` without joining them; ``gathers``:
    whether the transport's ``writelines`` keeps them apart."""
    if len(parts) == 1:
        transport.write(parts[0])
    elif gathers:
        transport.writelines(parts)
    else:
        for part in parts:
            transport.write(part)


# TCP keepalive: a peer whose host went away (power, network) with a call waiting on it is
# noticed within about KEEPALIVE_IDLE_S + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL_S (30 s),
# not when the call's own timeout ends (a data loader's ingest waits up to its
# timeout_ms, 600 s by default, for room on a lone worker). A dead process is seen at once
# (its kernel resets the connection); a Unix socket's peer is on this host.
KEEPALIVE_IDLE_S = 15
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_COUNT = 3


def set_nodelay(transport: asyncio.BaseTransport) -> None:
    """Disable Nagle (frames must leave at once, not wait for the peer's ACK) and turn
    TCP keepalive on (above)."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return
    with contextlib.suppress(OSError, AttributeError):  # not TCP (e.g. a unix socket)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
                            ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                            ("TCP_KEEPCNT", KEEPALIVE_COUNT)):
            if hasattr(socket, name):   # Linux; elsewhere the system's defaults
                sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)
