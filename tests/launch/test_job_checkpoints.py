"""The launcher's checkpoint on Ctrl-C against an API whose answers race it.

A real HTTP server on loopback plays the job's control API in the order that failed a CI
run: the POST meets a checkpoint being taken (409), which ends before the launcher looks
at the list. The launcher must ask again, not give up with the 409.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from stream_persia.launch.job_checkpoints import checkpoint_and_wait


class _Api(BaseHTTPRequestHandler):
    posts: list[int]          # status answered to each POST, in order (set per server)
    lists: int

    def log_message(self, *args):     # keep pytest's output clean
        pass

    def _answer(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        assert self.headers["Authorization"] == "Bearer t0k"
        code = self.server.script.pop(0) if self.server.script else 202
        self.server.posts.append(code)
        if code == 409:
            self._answer(409, {"error": {"message": "checkpoint bootstrap is running; one "
                                         "at a time"}})
        else:
            self._answer(202, {"id": "ckpt-ours", "state": "pending"})

    def do_GET(self):
        if self.path == "/v1/checkpoints":
            self.server.lists += 1      # the other one has ended already: nothing busy
            self._answer(200, {"checkpoints": [{"id": "bootstrap", "state": "done"}]})
        else:
            self._answer(200, {"id": "ckpt-ours", "state": "done"})


def _serve(script: list[int]):
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Api)
    srv.script, srv.posts, srv.lists = list(script), [], 0
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_a_409_whose_checkpoint_ended_before_the_list_is_asked_again():
    srv = _serve([409])
    try:
        ident = checkpoint_and_wait(f"127.0.0.1:{srv.server_port}", "t0k", 10.0)
    finally:
        srv.shutdown()
    assert ident == "ckpt-ours"
    assert srv.posts == [409, 202] and srv.lists == 1


def test_a_409_that_persists_with_nothing_busy_is_said_not_retried_forever(capsys):
    srv = _serve([409] * 50)
    try:
        ident = checkpoint_and_wait(f"127.0.0.1:{srv.server_port}", "t0k", 10.0)
    finally:
        srv.shutdown()
    assert ident is None
    assert srv.posts == [409, 409, 409]
    err = capsys.readouterr().err
    assert "refused: HTTP 409" in err and "one at a time" in err
