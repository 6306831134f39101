"""Reload and restore name checkpoints under the checkpoint directory only, and a
checkpoint that cannot be loaded is a 422, never a 500 that closes the connection.

Issue 17: ``POST /v1/model/reload`` (token needed) read paths outside the root,
``file://`` and ``simplecache::`` URLs, and fetched ``webhdfs://127.0.0.1:PORT`` (the API
sent an HTTP request there); unsupported protocols and a ``dense.pt`` with a valid
checksum but garbage content gave 500, after which the client's next request on the same
keep-alive connection failed. Requests here go over one hand-spoken HTTP/1.1 connection,
so a connection the server closes shows.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import socket
from typing import Any

import pytest
from api_helpers import TOKEN, TwoHeads, settings_for, write_checkpoint
from api_helpers import LiveApi as _LiveApi
from stream_persia.api.checkpoint_root import CheckpointDir

from stream_persia.errors import BadInput, ConfigError

HOSTILE = [
    # path traversal and paths outside the root
    "{root}/../outside/ckpt-x", "{root}/ckpt-a/../../outside/ckpt-x", "../outside/ckpt-x",
    "..", "{outside}/ckpt-x", "/etc", "{root}", "{root}/ckpt-a/nested",
    # a symbolic link in the root that leads out of it, by id and by path
    "escape", "{root}/escape",
    # other protocols and chained URLs, even to the root itself
    "file://{outside}/ckpt-x", "file://{root}/ckpt-a", "simplecache::file://{root}/ckpt-a",
    "simplecache::{root}/ckpt-a", "webhdfs://127.0.0.1:{port}/ckpt",
    "http://127.0.0.1:{port}/ckpt", "s3://bucket/ckpt", "hdfs://namenode/ckpt", "tar://x",
    "memory://ckpt", "ckpt-a::file:///etc",
]


class Connection:
    """One HTTP/1.1 keep-alive connection to the API, spoken by hand: every request goes
    on it, so a connection the server closed after a response fails the next request."""

    def __init__(self, url: str):
        self.host, port = url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)

    async def __aenter__(self) -> Connection:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.writer.close()

    async def request(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        data = b"" if body is None else json.dumps(body).encode()
        head = (f"{method} {path} HTTP/1.1\r\nHost: {self.host}\r\n"
                f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(data)}\r\n\r\n")
        self.writer.write(head.encode() + data)
        await self.writer.drain()
        async with asyncio.timeout(20):
            status = await self.reader.readline()
            assert status, f"the server closed the connection ({method} {path})"
            length = 0
            while (line := await self.reader.readline()) not in (b"\r\n", b""):
                name, _, value = line.decode().partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            payload = await self.reader.readexactly(length)
        return int(status.split()[1]), json.loads(payload) if payload else None


def garbage(src: str, dst: str, name: str, drop: str) -> None:
    """A copy of checkpoint ``src`` whose file ``name`` holds garbage that matches its
    recorded checksum and size, without the file ``drop``."""
    shutil.copytree(src, dst)
    m = json.load(open(f"{dst}/manifest.json"))
    data = b"\x80\x02garbage, not a torch file" * 40
    with open(f"{dst}/{name}", "wb") as f:
        f.write(data)
    m["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    os.remove(f"{dst}/{drop}")
    del m["files"][drop]
    m["dense_filename" if drop == "dense.pt" else "jit_filename"] = None
    json.dump(m, open(f"{dst}/manifest.json", "w"))


@pytest.fixture
async def tree(job, tmp_path):
    """root/{ckpt-a, ckpt-b, escape -> outside/ckpt-x, bad-dense, bad-jit}, outside/ckpt-x."""
    await job.train(3)
    root, outside = tmp_path / "ckpts", tmp_path / "outside"
    for name in ("ckpt-a", "ckpt-b"):
        await write_checkpoint(job, str(root / name), TwoHeads(seed=1))
    await write_checkpoint(job, str(outside / "ckpt-x"), TwoHeads(seed=2))
    os.symlink(outside / "ckpt-x", root / "escape")
    garbage(str(root / "ckpt-a"), str(root / "bad-dense"), "dense.pt", "jit_dense.pt")
    garbage(str(root / "ckpt-a"), str(root / "bad-jit"), "jit_dense.pt", "dense.pt")
    return job, str(root), str(outside)


@pytest.fixture
def listener():
    """A real listening socket: no request may make the API connect to it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    sock.setblocking(False)
    yield sock
    sock.close()


def connected(sock: socket.socket) -> bool:
    try:
        conn, _ = sock.accept()   # the kernel queues a completed connection for accept
    except BlockingIOError:
        return False
    conn.close()
    return True


def LiveApi(job, root: str, **kw: Any) -> _LiveApi:
    return _LiveApi(settings_for(job, model_checkpoint=f"{root}/ckpt-a", embeddings="local",
                                 checkpoint_dir=root, **kw))


async def test_reload_takes_only_checkpoints_under_the_root(tree, listener):
    job, root, outside = tree
    port = listener.getsockname()[1]
    async with LiveApi(job, root) as api, Connection(api.url) as conn:
        for target in HOSTILE:
            target = target.format(root=root, outside=outside, port=port)
            status, body = await conn.request("POST", "/v1/model/reload",
                                              {"checkpoint": target})
            assert status == 422, (target, body)
            assert body["error"]["field"] == "checkpoint", (target, body)
            status, model = await conn.request("GET", "/v1/model")
            assert status == 200 and model["version"] == "ckpt-a", (target, model)
        assert not connected(listener), "a reload target made the API open a connection"
        # What is accepted: an id, or the full path right under the root.
        for target, version in (("ckpt-b", "ckpt-b"), (f"{root}/ckpt-a", "ckpt-a"),
                                (f"{root}/ckpt-b/", "ckpt-b")):
            status, body = await conn.request("POST", "/v1/model/reload",
                                              {"checkpoint": target})
            assert status == 200 and body["version"] == version, (target, body)


async def test_a_reload_without_a_checkpoint_directory_is_refused(tree):
    job, root, _ = tree
    settings = settings_for(job, model_checkpoint=f"{root}/ckpt-a", embeddings="local")
    async with _LiveApi(settings) as api:    # the model served at start-up may be anywhere
        r = await api.client.post("/v1/model/reload", json={"checkpoint": f"{root}/ckpt-b"},
                                  headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 422 and r.json()["error"]["field"] == "checkpoint"
        assert "PERSIA_CHECKPOINT_DIR" in r.json()["error"]["hint"]


@pytest.mark.parametrize("bad,file", [("bad-dense", "dense.pt"), ("bad-jit", "jit_dense.pt")])
async def test_a_checksummed_garbage_file_is_422_and_the_connection_lives(tree, bad, file):
    job, root, _ = tree
    async with LiveApi(job, root, model_class="api_helpers:TwoHeads") as api, \
            Connection(api.url) as conn:
        status, body = await conn.request("POST", "/v1/model/reload", {"checkpoint": bad})
        assert status == 422, body
        assert body["error"]["field"] == "checkpoint" and file in body["error"]["message"]
        # The next request on the same keep-alive connection is served; so is inference.
        status, model = await conn.request("GET", "/v1/model")
        assert status == 200 and model["version"] == "ckpt-a"
        status, out = await conn.request("POST", "/v1/predict", {
            "id_type_features": {"user": [[1]], "item": [2], "tags": [[3]]},
            "non_id_type_features": {"dense": [[0.1, 0.2, 0.3]]}})
        assert status == 200 and out["checkpoint"] == "ckpt-a", out


async def test_an_unexpected_error_is_500_and_the_connection_lives(tree):
    """Starlette's outermost error middleware re-raises after its 500, and uvicorn then
    closes the connection; the API answers bugs itself so that it stays open."""
    job, root, _ = tree
    api = LiveApi(job, root)

    async def bug() -> None:
        raise RuntimeError("a bug")

    api.app.add_api_route("/v1/test-bug", bug, methods=["GET"])
    async with api, Connection(api.url) as conn:
        status, body = await conn.request("GET", "/v1/test-bug")
        assert status == 500 and body["error"]["kind"] == "internal", body
        status, _ = await conn.request("GET", "/healthz")
        assert status == 200


async def test_restore_inspect_and_delete_refuse_a_link_out_of_the_root(tree):
    job, root, outside = tree
    async with LiveApi(job, root) as api, Connection(api.url) as conn:
        for method, path in (("POST", "/v1/checkpoints/escape/restore"),
                             ("GET", "/v1/checkpoints/escape"),
                             ("DELETE", "/v1/checkpoints/escape")):
            status, body = await conn.request(method, path)
            assert status == 422, (method, path, body)
            assert body["error"]["field"] == "checkpoint", body
        status, listed = await conn.request("GET", "/v1/checkpoints")
        assert status == 200
        assert "escape" not in [c["id"] for c in listed["checkpoints"]]
        for path in ("/v1/checkpoints/..%2Foutside/restore", "/v1/checkpoints/.hidden"):
            status, body = await conn.request("POST" if "restore" in path else "GET", path)
            assert status in (404, 422), (path, body)
    assert os.path.isfile(f"{outside}/ckpt-x/manifest.json")


def test_a_remote_root_takes_ids_and_urls_under_its_prefix_only():
    """With an fsspec root (``memory://`` here, ``s3://bucket/ckpt`` in production) a
    request may give an id or a URL right under that prefix, spelled as configured or as
    fsspec writes it; the decision is made on the text, before any filesystem is used."""
    root = CheckpointDir("memory://ckpts")
    assert root.resolve("ckpt-1") == "memory:///ckpts/ckpt-1"
    assert root.resolve("memory://ckpts/ckpt-1") == "memory:///ckpts/ckpt-1"
    assert root.resolve("memory:///ckpts/ckpt-1/") == "memory:///ckpts/ckpt-1"
    for bad in ("memory://ckpts/../x", "memory://ckpts", "memory://other/ckpt-1",
                "memory://ckpts/a/b", "simplecache::memory://ckpts/ckpt-1",
                "s3://ckpts/ckpt-1", "/ckpts/ckpt-1", "webhdfs://127.0.0.1:1/ckpts/ckpt-1"):
        with pytest.raises(BadInput) as err:
            root.resolve(bad)
        assert err.value.field == "checkpoint", bad
    assert root.id_of("memory:///ckpts/ckpt-1") == "ckpt-1"
    assert root.id_of("memory:///elsewhere/ckpt-1") is None
    with pytest.raises(BadInput, match="PERSIA_CHECKPOINT_DIR|no checkpoint directory"):
        CheckpointDir(None).resolve("ckpt-1")


@pytest.mark.parametrize("bad", ["simplecache::s3://bucket/ckpt", "s3://bucket/../ckpt"])
def test_a_checkpoint_directory_that_cannot_be_a_root_is_refused_naming_it(bad):
    """The roles' confinement refuses such a root, so the API does too, at start-up and
    naming its own setting."""
    with pytest.raises(ConfigError) as err:
        CheckpointDir(bad)
    assert err.value.field == "checkpoint_dir"
