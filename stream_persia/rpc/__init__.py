"""Framed msgpack RPC over TCP, spoken by every role (DESIGN.md §1, §5).

Wire schema (version 1)
-----------------------
A connection carries frames both ways::

    frame   = length body
    length  = 4-byte big-endian unsigned int: the byte length of body (1 .. max_frame_bytes)
    body    = stream_persia.core.wire.pack(message)       (format version inside; numpy arrays
                                                      as ext types, decoded without copying)

    request = {"id": int, "m": str, "p": any}        client -> server; "p" is the handler's
                                                      params (None when omitted)
    reply   = {"id": int, "r": any}                  server -> client, success
            | {"id": int, "e": error}                server -> client, the handler failed
            | {"id": None, "e": error}               server -> client, a frame could not be
                                                      tied to a request, or the connection
                                                      is refused (``kind`` "auth": no or
                                                      another role secret; "unavailable":
                                                      over max_connections): the server
                                                      closes the connection after it
            | {"id": None, "e": error, "goaway": true}
                                                      server -> client, the connection was
                                                      idle: send no new request on it (the
                                                      ones sent are still answered)
    error   = PersiaError.to_dict() = {"kind", "type", "message", "field", "hint"};
              rebuilt by stream_persia.errors.error_from_dict (same family, same fields)

When the server holds the job's role secret, a connection starts with the handshake of
:mod:`stream_persia.rpc.auth` (four small frames, before any request; nothing after it
costs anything per request). Connection bounds (cap, idle and handshake timeouts) are in
:mod:`stream_persia.rpc.server`.

Request ids are chosen by the client and unique per connection, so any number of calls
share one connection and replies may come back in any order (pipelining). Every received
frame is checked against ``WireLimits``: the length before its body is read, the body by
``wire.unpack``. A server answers a malformed request whose id it can read with an error
reply; anything else it cannot decode gets the ``id: None`` reply and a closed connection,
never a crash. Unknown methods get a ``Misuse`` reply listing the known ones; a handler's
unexpected exception gets an ``InternalError`` reply and is logged with its traceback.
"""

from stream_persia.rpc.client import RpcClient, parse_address
from stream_persia.rpc.server import RpcServer

__all__ = ["RpcClient", "RpcServer", "parse_address"]
