"""A role's metrics port (stream_persia/launch/roles.py ``serve_metrics``) under a hostile
client: it may face the network unauthenticated, so idle connections must not pile up
threads. A real HTTP server on a real port, in this process."""

from __future__ import annotations

import contextlib
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


def test_a_client_trickling_bytes_cannot_keep_a_slot(monkeypatch, capfd):
    """The socket timeout bounds each read, not the connection: a peer that sent a byte
    every half timeout kept its slot for good, and METRICS_MAX_CONNECTIONS of them
    refused every scrape (uncounted). Now each connection is closed METRICS_TIMEOUT_S
    after it was accepted, and the refusals are counted."""
    # 3 s, not the fixture's 1 s: past the listen backlog (5) a connect waits for a SYN
    # retry (1 s), and the first drippers must still hold their slots by then
    monkeypatch.setattr(roles, "METRICS_TIMEOUT_S", 3.0)
    metrics = roles.serve_metrics(0, "127.0.0.1", lambda: b"persia_up 1\n")
    port = metrics.server_address[1]
    stop = threading.Event()
    cut = []

    def drip(sock: socket.socket) -> None:
        try:
            while not stop.wait(0.5):     # well inside the 3 s per-read timeout
                sock.sendall(b"G")        # never a whole request line
        except OSError:
            cut.append(sock)

    drippers = [socket.create_connection(("127.0.0.1", port), timeout=5)
                for _ in range(roles.METRICS_MAX_CONNECTIONS)]
    threads = [threading.Thread(target=drip, args=(s,), daemon=True) for s in drippers]
    for t in threads:
        t.start()
    try:
        # every slot is taken for now (a scrape may come first while the last drippers'
        # handshakes wait in the kernel for the listen backlog to make room)
        deadline = time.monotonic() + roles.METRICS_TIMEOUT_S / 2
        while metrics.refused == 0 and time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                _scrape(port)
            time.sleep(0.1)
        assert metrics.refused >= 1
        deadline = time.monotonic() + 3 * roles.METRICS_TIMEOUT_S
        while True:
            try:
                assert _scrape(port) == b"persia_up 1\n"
                break
            except OSError:
                assert time.monotonic() < deadline, "the drippers kept every slot"
                time.sleep(0.1)
        while len(cut) < len(drippers) and time.monotonic() < deadline:
            time.sleep(0.1)     # the last ones were accepted a SYN retry later
        assert len(cut) == len(drippers), "some drippers kept their slots"
        assert metrics.cut_off == len(drippers)
        time.sleep(0.5)   # the cut handlers' writes fail now: counted, not a traceback each
        assert "Exception occurred during processing" not in capfd.readouterr().err
    finally:
        stop.set()
        for t in threads:
            t.join(5)
        for s in drippers:
            s.close()
        metrics.shutdown()
        metrics.server_close()
