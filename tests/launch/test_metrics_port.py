"""A role's metrics port (stream_persia/launch/roles.py ``serve_metrics``) under a hostile
client: it may face the network unauthenticated, so idle connections must not pile up
threads. A real HTTP server on a real port, in this process."""

from __future__ import annotations

import socket
import threading
import time
import urllib.request

import pytest

from stream_persia.launch import roles


@pytest.fixture
def metrics(monkeypatch):
    monkeypatch.setattr(roles, "METRICS_TIMEOUT_S", 1.0)
    server = roles.serve_metrics(0, "127.0.0.1", lambda: b"persia_up 1\n")
    yield server
    server.shutdown()
    server.server_close()


def _scrape(port: int) -> bytes:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read()


def test_idle_connections_are_capped_and_timed_out(metrics):
    port = metrics.server_address[1]
    assert _scrape(port) == b"persia_up 1\n"
    before = threading.active_count()
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4 * roles.METRICS_MAX_CONNECTIONS)]
    time.sleep(0.5)
    # one thread per connection used to be spawned, held for as long as the peer stayed
    grown = threading.active_count() - before
    assert grown <= roles.METRICS_MAX_CONNECTIONS, f"{grown} threads for {len(idle)} idle peers"
    # the idle peers are dropped after the timeout, and scraping works again
    deadline = time.monotonic() + 10
    while True:
        try:
            assert _scrape(port) == b"persia_up 1\n"
            break
        except OSError:
            assert time.monotonic() < deadline, "the metrics port never served again"
            time.sleep(0.2)
    assert threading.active_count() - before <= roles.METRICS_MAX_CONNECTIONS
    for s in idle:
        s.close()
