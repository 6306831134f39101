"""A loopback TCP port where nothing listens until :meth:`LateProxy.start`, which then
forwards every connection to a target: a peer (a Kafka broker, an embedding worker) that
comes up after the role that needs it, for start-up tests.

Clients that learn other addresses from the target (Kafka metadata names the brokers'
own ports) reach those directly once they got through the proxy.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

__all__ = ["LateProxy", "free_port"]


def free_port() -> int:
    """A loopback port nothing listens on now (the OS picked it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LateProxy:
    """A loopback port where nothing listens until :meth:`start`, then forwards to
    ``target`` (``host:port``; the first of a comma-separated list). Threads, so that
    sync and async tests can use it alike; :meth:`close` stops everything."""

    def __init__(self, target: str):
        self.target = target.split(",")[0].rsplit(":", 1)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self._server: socket.socket | None = None
        self._threads: list[threading.Thread] = []
        self._conns: list[socket.socket] = []

    def start(self) -> None:
        self._server = socket.create_server(("127.0.0.1", self.port))
        self._spawn(self._accept, self._server)

    def retarget(self, target: str) -> None:
        """Forward new connections to ``target`` from now on (a peer restarted at another
        port); connections open now stay with the old one."""
        self.target = target.split(",")[0].rsplit(":", 1)

    def _spawn(self, fn: Callable[..., None], *args: object) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        self._threads.append(t)
        t.start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection((self.target[0], int(self.target[1])))
            except OSError:
                client.close()
                continue
            self._conns += [client, upstream]
            self._spawn(self._pipe, client, upstream)
            self._spawn(self._pipe, upstream, client)

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        if self._server is not None:
            try:
                self._server.shutdown(socket.SHUT_RDWR)   # wakes the blocked accept()
            except OSError:
                pass
            self._server.close()
        for c in self._conns:
            c.close()
        for t in self._threads:
            t.join(5)
