"""The roles' RPC ports against a hostile client (issue 17): an embedding server and an
embedding worker with the job's role secret, on real sockets, given the calls a plain
client could make before: ``clear`` every row, ``configure`` lr=1e30, ``dump`` a shard
into any directory, ``load`` from ``/etc`` (whose error echoed ``/etc/passwd``), and queue
a checkpoint to any path through the worker's mailbox. Unauthenticated or with another
secret, each is refused and changes nothing; with the secret, paths outside the
checkpoint root are refused naming the field."""

from __future__ import annotations

import asyncio
import os
import struct

import numpy as np
import pytest

from stream_persia.embedding.optim import SGD
from stream_persia.errors import AuthError, BadInput, Misuse
from stream_persia.launch.processes import RoleProcess
from stream_persia.rpc import RpcClient, auth
from stream_persia.rpc.auth import RoleSecret
from stream_persia.server.service import EmbeddingServer
from stream_persia.testing.samples import SCHEMA
from stream_persia.worker.service import EmbeddingWorker

SECRET = RoleSecret("correct-horse-battery-staple-0123")
OTHER = RoleSecret("another-jobs-secret-456789abcdef")
IDS = np.arange(1, 101, dtype=np.uint64)


class Job:
    def __init__(self, root, outside):
        self.root, self.outside = root, outside
        self.server = EmbeddingServer(10_000, SGD(lr=0.1), checkpoint_root=str(root),
                                      secret=SECRET)
        self.worker: EmbeddingWorker | None = None

    async def start(self) -> None:
        await self.server.start()
        self.worker = EmbeddingWorker(SCHEMA, [self.server.address],
                                      checkpoint_root=str(self.root), secret=SECRET)
        await self.worker.start()
        self.admin = {"server": RpcClient(self.server.address, secret=SECRET),
                      "worker": RpcClient(self.worker.address, secret=SECRET)}
        await self.admin["server"].call("configure", {"optimizer": SGD(lr=0.1).to_dict()})
        await self.admin["server"].call("lookup", {"mode": "train",
                                                   "groups": [{"dim": 4, "ids": IDS}]})

    async def state(self) -> dict:
        """What the hostile calls must leave unchanged."""
        server, worker = self.admin["server"], self.admin["worker"]
        return {"rows": await server.call("size"),
                "config": await server.call("get_config"),
                "checkpoint": await worker.call("checkpoint_status", {"id": "evil"}),
                "paused": (await worker.call("status"))["ingest_paused"],
                "outside": sorted(os.listdir(self.outside)),
                "etc": os.path.exists("/etc/embedding-shard-00000-of-00001.bin")}

    async def stop(self) -> None:
        for c in self.admin.values():
            await c.close()
        await self.worker.stop()
        await self.server.stop()


@pytest.fixture
async def job(tmp_path):
    root, outside = tmp_path / "ckpt", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    j = Job(root, outside)
    await j.start()
    try:
        yield j
    finally:
        await j.stop()


def hostile_calls(outside) -> list[tuple[str, str, object]]:
    return [
        ("server", "clear", None),
        ("server", "configure", {"optimizer": SGD(lr=1e30).to_dict()}),
        ("server", "dump", {"dir": str(outside)}),
        ("server", "load", {"dir": "/etc", "files": ["passwd"]}),
        ("worker", "checkpoint_request", {"id": "evil", "dst": str(outside / "evil")}),
        ("worker", "pause_ingest", None),
    ]


@pytest.mark.parametrize("secret", [None, OTHER], ids=["no-secret", "wrong-secret"])
async def test_hostile_calls_without_the_secret_are_refused_and_change_nothing(job, secret):
    before = await job.state()
    assert before["rows"] == len(IDS) and before["config"]["optimizer"]["lr"] == 0.1
    for role, method, params in hostile_calls(job.outside):
        address = job.server.address if role == "server" else job.worker.address
        async with RpcClient(address, secret=secret) as client:
            with pytest.raises(AuthError) as e:
                await client.call(method, params, timeout_ms=3000)
            assert auth.SECRET_ENV in str(e.value), (role, method)
            assert "root:" not in str(e.value)
    await asyncio.sleep(0.05)
    assert await job.state() == before
    for role in (job.server, job.worker):
        text = role.metrics.render().decode()
        refused = [line for line in text.splitlines()
                   if line.startswith(f"persia_{role.metrics.role}_rpc_auth_refused_total")]
        assert refused and float(refused[0].split()[-1]) >= 1, text


async def test_with_the_secret_the_same_calls_work_inside_the_root(job):
    server, worker = job.admin["server"], job.admin["worker"]
    shard = await server.call("dump", {"dir": str(job.root / "a")})
    assert shard["rows"] == len(IDS) and (job.root / "a" / shard["file"]).is_file()
    await server.call("clear")
    assert await server.call("size") == 0
    assert (await server.call("load", {"dir": str(job.root / "a"),
                                       "files": [shard["file"]]}))["rows"] == len(IDS)
    rec = await worker.call("checkpoint_request", {"id": "ok", "dst": str(job.root / "ok")})
    assert rec["state"] == "pending" and rec["dst"] == str(job.root / "ok")


def outside_dirs(root, outside) -> list[str]:
    link = root / "escape"
    if not link.exists():
        link.symlink_to(outside, target_is_directory=True)
    return [
        str(outside),                              # absolute, elsewhere
        f"{root}/../outside",                      # climbs out
        str(link / "x"),                           # a symlink inside the root points out
        f"file://{outside}",                       # same place, as a URL
        "memory://x",                              # another filesystem
        f"simplecache::{root}/x",                  # a chained URL
        "http://127.0.0.1:9/x",                    # a network protocol
        "webhdfs://127.0.0.1:9/x",
        "ckpt/x",                                  # relative (to the cwd): outside
        "",
    ]


async def test_dump_and_load_are_confined_to_the_checkpoint_root(job):
    server = job.admin["server"]
    before = await job.state()
    for d in outside_dirs(job.root, job.outside):
        for method, params in (("dump", {"dir": d}),
                               ("load", {"dir": d, "files": ["embedding-shard.bin"]}),
                               ("load", {"dir": d, "files": ["x"], "stage": True})):
            with pytest.raises(BadInput) as e:
                await server.call(method, params)
            assert e.value.field == "dir", (method, d, e.value)
    assert await job.state() == before
    assert os.listdir(job.outside) == []


async def test_load_from_etc_is_refused_without_echoing_the_file(job):
    with pytest.raises(BadInput) as e:
        await job.admin["server"].call("load", {"dir": "/etc", "files": ["passwd"]})
    assert e.value.field == "dir" and "root:" not in str(e.value)


async def test_a_bad_file_inside_the_root_is_refused_without_quoting_it(job):
    """A file that is not a shard file (its first record does not decode): the error
    names the file and the record, not its bytes (it used to quote them)."""
    content = b"ZQ-private-notes-of-the-operator"
    (job.root / "notes.bin").write_bytes(struct.pack(">I", len(content)) + content)
    with pytest.raises(BadInput) as e:
        await job.admin["server"].call("load", {"dir": str(job.root), "files": ["notes.bin"]})
    assert e.value.field == "files[0]" and "notes.bin" in str(e.value)
    assert "ZQ" not in str(e.value) and "private" not in str(e.value)


async def test_the_mailbox_only_queues_checkpoints_under_the_root(job):
    worker = job.admin["worker"]
    for dst in outside_dirs(job.root, job.outside):
        with pytest.raises(BadInput) as e:
            await worker.call("checkpoint_request", {"id": "evil", "dst": dst})
        assert e.value.field == "dst", (dst, e.value)
    assert await worker.call("checkpoint_status", {"id": "evil"}) is None


async def test_a_role_without_a_checkpoint_root_refuses_checkpoint_requests(tmp_path):
    server = EmbeddingServer(100, secret=None)
    await server.start()
    try:
        async with RpcClient(server.address, secret=None) as client:
            with pytest.raises(Misuse, match="no checkpoint root") as e:
                await client.call("dump", {"dir": str(tmp_path)})
            assert e.value.field == "checkpoint_root"
    finally:
        await server.stop()
    assert os.listdir(tmp_path) == []


async def test_a_launched_server_with_a_secret_listens_beyond_loopback(tmp_path):
    """The CLI's edge: the secret from the environment (a file), --host 0.0.0.0, the
    checkpoint root from PERSIA_CHECKPOINT_ROOT."""
    (tmp_path / "secret").write_text(SECRET.value)
    root = tmp_path / "ckpt"
    role = RoleProcess("embedding-server", ["--host", "0.0.0.0"], env={
        "PERSIA_ROLE_SECRET_FILE": str(tmp_path / "secret"), "PERSIA_ROLE_SECRET": "",
        "PERSIA_CHECKPOINT_ROOT": str(root), "PERSIA_CHECKPOINT_DIR": ""})
    try:
        address = await asyncio.to_thread(role.start().wait_ready, 60)
        port = address.rsplit(":", 1)[1]
        async with RpcClient(f"127.0.0.1:{port}", secret=None) as stranger:
            with pytest.raises(AuthError):
                await stranger.call("clear", timeout_ms=3000)
        async with RpcClient(f"127.0.0.1:{port}", secret=SECRET) as client:
            assert (await client.call("health"))["ok"]
            await client.call("dump", {"dir": str(root / "1")})
            with pytest.raises(BadInput):
                await client.call("dump", {"dir": str(tmp_path / "elsewhere")})
        assert (root / "1").is_dir() and not (tmp_path / "elsewhere").exists()
    finally:
        code = await asyncio.to_thread(role.stop)
    assert code == 0, role.log_tail()
