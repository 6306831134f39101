"""Unix-socket shortcut for RPC peers on the same host.

Every RPC server bound to a loopback or wildcard address also listens on a Linux abstract
Unix socket named after its TCP port (``\\0stream-persia-rpc-<port>``), and a client of a
loopback address (:func:`stream_persia.core.hosts.is_loopback`: ``127.x.x.x``, ``localhost``,
``::1``) connects there first, falling back
to TCP when nothing listens. Nothing changes for users: addresses stay ``host:port``.

Why: co-located roles (an embedding worker and its server, a worker and the NN process)
exchange megabytes per batch, and a Unix socket with wide buffers (:func:`widen_buffers`)
moves them faster than TCP loopback: a 1 MiB echo runs at 1.69x TCP's rate in
load_tests/bench_rpc.py (2-core machine).

Abstract sockets live in the network namespace, as loopback ports do, so the name is as
unique as the port; no file is created or left behind. A server bound to one non-loopback
address does not take the name: a loopback server on the same port may hold it.
``STREAM_PERSIA_RPC_UNIX=0`` (or false, no, off) turns the shortcut off for servers and clients;
another value than a switch is a ConfigError naming it (:mod:`stream_persia.core.switches`).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import sys
from collections.abc import Callable
from typing import Any

from stream_persia.core.hosts import is_loopback
from stream_persia.core.switches import env_switch

log = logging.getLogger(__name__)

__all__ = ["BUFFER_BYTES", "describe_peer", "enabled", "listen", "name_for",
           "open_connection", "widen_buffers"]


def enabled() -> bool:
    """Whether the shortcut may be used here: Linux, and not switched off."""
    return (sys.platform.startswith("linux") and hasattr(socket, "AF_UNIX")
            and env_switch("STREAM_PERSIA_RPC_UNIX", True))


#: socket buffer asked for on Unix-socket connections: without it a stream socket moves
#: at most ``net.core.wmem_default`` (about 208 KiB) per wake-up, and a megabyte frame
#: takes many event-loop round trips (TCP loopback autotunes to megabytes). The kernel caps
#: it at ``net.core.wmem_max`` / ``rmem_max``.
BUFFER_BYTES = 4 << 20


def widen_buffers(transport: asyncio.BaseTransport) -> None:
    """Ask for :data:`BUFFER_BYTES` of send and receive buffer on a Unix-socket transport
    (nothing for other transports)."""
    sock = transport.get_extra_info("socket")
    if sock is None or sock.family != socket.AF_UNIX:
        return
    for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        try:
            sock.setsockopt(socket.SOL_SOCKET, opt, BUFFER_BYTES)
        except OSError:  # pragma: no cover - refused: keep the default
            pass


def describe_peer(transport: asyncio.BaseTransport) -> str:
    """How logs name the other end of a Unix-socket connection: its process and user
    (``SO_PEERCRED``), since every same-host client connects to the same name."""
    sock = transport.get_extra_info("socket")
    try:
        pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                          struct.calcsize("3i")))
        return f"unix:pid={pid},uid={uid}"
    except (OSError, AttributeError, struct.error):   # not Linux, or no socket object
        name = transport.get_extra_info("peername") or transport.get_extra_info("sockname")
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        return f"unix:{str(name or '').lstrip(chr(0))}"


def name_for(port: int) -> str:
    """The abstract socket name of the RPC server on TCP ``port``."""
    return f"\0stream-persia-rpc-{port}"


def _serves_loopback(host: str) -> bool:
    return is_loopback(host) or host in ("", "0.0.0.0", "::")


async def listen(factory: Callable[[], asyncio.BaseProtocol], host: str, port: int
                 ) -> asyncio.AbstractServer | None:
    """Start the Unix-socket twin of the TCP server on ``host:port``; None when the
    shortcut is off, the host is neither loopback nor a wildcard, or the name is taken."""
    if not (enabled() and _serves_loopback(host)):
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(name_for(port))
        sock.listen(128)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        log.debug("no unix socket for port %d: %s", port, exc)
        return None
    return await asyncio.get_running_loop().create_unix_server(factory, sock=sock)


async def open_connection(factory: Callable[[], asyncio.BaseProtocol], host: str, port: int
                          ) -> tuple[Any, Any] | None:
    """Connect to the Unix-socket twin of ``host:port``; None when the shortcut is off,
    the host is not loopback, or nothing listens there (the caller uses TCP)."""
    if not (enabled() and is_loopback(host)):
        return None
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, name_for(port))
    except OSError:
        sock.close()
        return None
    return await loop.create_unix_connection(factory, sock=sock)
