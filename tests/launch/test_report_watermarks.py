"""``report.json`` carries the job's stage watermarks over the run (issue 19, item 3):
the launcher's :class:`WatermarkWatch` polls a real HTTP server's ``/v1/status`` (with the
bearer token), and the report, its plot and the printed summary show the result."""

from __future__ import annotations

import io
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from stream_persia.launch.report import build_report, plot_report, print_report
from stream_persia.launch.topology import Topology
from stream_persia.launch.watermark_watch import WatermarkWatch

T0 = 1_700_000_000.0
TOKEN = "s3cret"


def _status(i: int) -> dict:
    """The i-th /v1/status: the lags grow with i; Kafka lag only on the second."""
    return {"watermarks": {
        "produced": None,
        "ingested": {"event_time": T0 + i, "lag_s": 1.0 + i},
        "trained": {"event_time": T0 + i - 1, "lag_s": 2.0 + i},
        "applied": None, "served": None,
        "kafka_lag": ([{"topic": "t", "partition": 0, "worker": 0, "messages": 7,
                        "seconds": 1.5},
                       {"topic": "t", "partition": 1, "worker": 0, "messages": 3,
                        "seconds": None}] if i == 1 else []),
        "progressive": {}}}


@pytest.fixture
def api():
    calls = {"n": 0, "unauthorized": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):   # noqa: N802 (http.server's name)
            if self.headers.get("Authorization") != f"Bearer {TOKEN}":
                calls["unauthorized"] += 1
                self.send_response(401)
                self.end_headers()
                return
            body = json.dumps(_status(calls["n"]) if self.path == "/v1/status" else {})
            calls["n"] += 1
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", calls
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_the_report_has_the_watermarks_watched_over_the_run(api, tmp_path):
    address, calls = api
    watch = WatermarkWatch(address, TOKEN, every_s=0.0)
    for _ in range(3):
        watch.poll()
    assert calls["n"] == 3 and calls["unauthorized"] == 0 and watch.errors == 0
    summary = watch.summary()
    assert summary == {
        "ingested": {"event_time": T0 + 2, "lag_s": {"p50": 2.0, "max": 3.0}},
        "trained": {"event_time": T0 + 1, "lag_s": {"p50": 3.0, "max": 4.0}},
        "kafka_lag": {"messages_max": 7, "seconds_max": 1.5}}
    metrics = {"train": {"samples": 3000, "samples_per_s": 10.0}, "auc": {"click": 0.7},
               "eval_curve": [[3000, {"click": 0.7}]], "loss_curve": [[1000, 0.6]],
               "watermarks": summary}
    report = build_report(Topology(Path(tmp_path), "t"), metrics, None, tmp_path, 1.0, "m")
    assert report["watermarks"] == summary
    assert build_report(Topology(Path(tmp_path), "t"), {}, None, tmp_path, 1.0,
                        "m")["watermarks"] == {}
    curve = watch.curve()
    assert [lag for _, lag in curve["ingested"]] == [1.0, 2.0, 3.0]
    plot_report({**metrics, "stage_lag_curve": curve}, tmp_path / "report.png", "t")
    plot_report(metrics, tmp_path / "plain.png", "t")
    # One more panel (wider) with the stage lags.
    assert _png_width(tmp_path / "report.png") > _png_width(tmp_path / "plain.png")
    out = io.StringIO()
    print_report(report, out)
    text = out.getvalue()
    assert "stage ingested    lag p50 2.0 s, max 3.0 s" in text
    assert "Kafka lag         max 7 messages, 1.5 s" in text


def test_the_served_stage_comes_from_the_serving_replica(api):
    """Only the replica knows what it serves: the watch asks its /v1/status too, and
    takes nothing else from it (its other stages are the job's, already in the sample)."""
    address, _ = api

    class Replica(BaseHTTPRequestHandler):
        def do_GET(self):   # noqa: N802 (http.server's name)
            ok = self.headers.get("Authorization") == f"Bearer {TOKEN}"
            body = json.dumps({"watermarks": {
                "served": {"event_time": T0 - 5, "lag_s": 9.0},
                "ingested": {"event_time": T0 - 100, "lag_s": 99.0}}})
            self.send_response(200 if ok else 401)
            self.end_headers()
            self.wfile.write(body.encode() if ok else b"{}")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Replica)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        watch = WatermarkWatch(address, TOKEN, every_s=0.0,
                               replica=f"127.0.0.1:{server.server_address[1]}")
        watch.poll()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    summary = watch.summary()
    assert summary["served"] == {"event_time": T0 - 5, "lag_s": {"p50": 9.0, "max": 9.0}}
    assert summary["ingested"]["event_time"] == T0        # the job API's, not the replica's
    # A replica that does not answer leaves the job's sample as it is.
    gone = WatermarkWatch(address, TOKEN, every_s=0.0, replica="127.0.0.1:1")
    gone.poll()
    assert gone.errors == 0 and "served" not in gone.summary()


def test_a_wrong_token_or_no_api_is_counted_not_raised(api):
    address, calls = api
    watch = WatermarkWatch(address, "wrong", every_s=0.0)
    watch.poll()
    assert calls["unauthorized"] == 1 and watch.errors == 1 and watch.samples == []
    gone = WatermarkWatch("127.0.0.1:1", TOKEN, every_s=0.0)
    gone.poll()
    assert gone.errors == 1 and gone.summary() == {}


def test_the_series_stays_bounded_over_a_long_run():
    watch = WatermarkWatch("unused:0", TOKEN, every_s=2.0, max_samples=8)
    for i in range(100):
        watch.add(float(i), {"ingested": {"event_time": T0 + i, "lag_s": float(i)}})
    assert len(watch.samples) <= 8 and watch.every_s > 2.0
    assert watch.samples[0]["t"] == 0.0            # the whole run's span is kept
    assert watch.summary()["ingested"]["event_time"] == T0 + 99
    assert watch.summary()["ingested"]["lag_s"]["max"] == 99.0


def _png_width(path: Path) -> int:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big")
