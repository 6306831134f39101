"""``python -m stream_persia.launch.torchrun <torchrun arguments>``: torchrun (what
``launch nn-worker`` runs) whose rendezvous store listens on loopback when the job is on
one host.

torchrun's static rendezvous starts a c10d ``TCPStore`` server on node 0 at
``--master-addr:--master-port``, but that server binds every interface (``*:port``)
whatever the address, and it is unauthenticated: anyone who reaches the port can read and
write the keys the ranks rendezvous through. With a loopback ``--master-addr`` (one host,
``launch nn-worker``'s default) node 0 binds the port on that address first and hands the
socket to a multi-tenant ``TCPStore`` server, which torchrun's rendezvous then reuses
(c10d keeps one multi-tenant server per port in a process). A master address that is not
loopback is left to torch: the nodes must reach the store, which then faces the network
unauthenticated (the role secret does not cover it).
"""

from __future__ import annotations

import datetime
import socket
import sys
from typing import Any

from stream_persia.core.hosts import is_loopback

__all__ = ["main", "loopback_store"]

#: The store of this process (kept alive: torchrun's rendezvous reuses its server).
_STORE: Any = None


def _flag(argv: list[str], name: str) -> str | None:
    """``--name=value`` among torchrun's own arguments (those before ``--module``)."""
    for arg in argv:
        if arg in ("--module", "-m") or not arg.startswith("-"):
            break
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
    return None


def loopback_store(argv: list[str]) -> Any:
    """On node 0 with a loopback ``--master-addr`` and a ``--master-port``: the
    multi-tenant TCPStore server on that address only (None otherwise)."""
    addr, port = _flag(argv, "--master-addr"), _flag(argv, "--master-port")
    if addr is None or port is None or not port.isdigit() or int(port) == 0 \
            or (_flag(argv, "--node-rank") or "0") != "0" or not is_loopback(addr):
        return None
    import torch.distributed as dist

    host = addr.strip().strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port)))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    # The store owns the socket from here (detached: Python must not close it under it).
    return dist.TCPStore(host, int(port), None, True, datetime.timedelta(minutes=30),
                         wait_for_workers=False, multi_tenant=True,
                         master_listen_fd=sock.detach())


def main(argv: list[str] | None = None) -> None:
    global _STORE
    argv = list(sys.argv[1:] if argv is None else argv)
    _STORE = loopback_store(argv)
    from torch.distributed.run import main as torchrun

    torchrun(argv)


if __name__ == "__main__":
    main()
