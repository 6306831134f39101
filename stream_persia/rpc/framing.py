"""RPC frames and messages: pure logic, no sockets (schema in :mod:`stream_persia.rpc`).

A frame is a 4-byte big-endian unsigned body length followed by the body, which is one
:func:`stream_persia.core.wire.pack` message. The length is checked against
``WireLimits.max_frame_bytes`` before a byte of the body is read, so a peer cannot make us
allocate more than the limit. :mod:`stream_persia.rpc.transport` moves frames over a
connection.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

from stream_persia.core import wire
from stream_persia.errors import PersiaError, WireError

__all__ = ["HEADER", "MalformedRequest", "Reply", "Request", "Unidentifiable", "check_length",
           "encode", "encode_parts", "error_reply", "parse_reply", "parse_request",
           "request_body"]

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


def encode_parts(msg: dict[str, Any], limits: wire.WireLimits, what: str
                 ) -> list[bytes | memoryview]:
    """Pack ``msg`` into one frame as pieces for ``FrameProtocol.write``: the length prefix
    and small data joined, large arrays referenced (see :func:`wire.pack_parts`; they must
    not be modified until the frame is written).

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
    """Pack ``msg`` into frame parts of contiguous bytes: the length prefix and the body,
    joined when small (:func:`encode_parts` is what the peers send with).

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
