"""``stream-persia launch api``: a real process on uvicorn (uvloop, httptools) that drains
on SIGTERM and exits 0, and refuses to start on a public address without a token."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys

import httpx
import pytest

from stream_persia.launch.processes import RoleProcess
from stream_persia.rpc import RpcServer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PERSIA_")}
    env.update(extra)
    return env


async def test_launch_api_serves_and_drains_on_sigterm(tmp_path):
    async def health(params):
        return {"ok": True}

    async def slow_status(params):
        await asyncio.sleep(1.0)
        return {"replica_index": 0, "ready": 0, "inflight": 0}

    async def metrics(params):
        return b""

    worker = RpcServer({"health": health, "status": slow_status, "metrics": metrics},
                       name="slow-worker")
    await worker.start()
    token_file = tmp_path / "token"
    token_file.write_text("tok-0123456789abcdef\n")
    proc = RoleProcess("api", ["--port", "0", "--checkpoint-dir", str(tmp_path)],
                       env=_env(PERSIA_API_TOKEN_FILE=str(token_file),
                                PERSIA_EMBEDDING_WORKERS=worker.address))
    proc.start()
    try:
        url = "http://" + await asyncio.to_thread(proc.wait_ready, 60)
        auth = {"Authorization": "Bearer tok-0123456789abcdef"}
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            assert (await client.get("/healthz")).json() == {"status": "ok"}
            assert (await client.get("/v1/status")).status_code == 401
            assert "loop uvloop, http httptools" in proc.log_tail()
            # A request in flight when SIGTERM arrives still gets its answer.
            slow = asyncio.create_task(client.get("/v1/status", headers=auth))
            await asyncio.sleep(0.3)
            os.killpg(proc.proc.pid, signal.SIGTERM)
            r = await slow
            assert r.status_code == 200, r.text
            assert r.json()["workers"][0]["healthy"]
        assert await asyncio.to_thread(proc.proc.wait, 30) == 0, proc.log_tail()
    finally:
        await asyncio.to_thread(proc.stop)
        await worker.stop()


def test_launch_api_refuses_a_public_address_without_a_token():
    cmd = [sys.executable, "-m", "stream_persia.launch.cli", "launch", "api", "--host", "0.0.0.0",
           "--port", "0"]
    out = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert "PERSIA_API_TOKEN" in out.stderr


def test_launch_api_refuses_a_short_token_at_start_up():
    cmd = [sys.executable, "-m", "stream_persia.launch.cli", "launch", "api", "--port", "0"]
    out = subprocess.run(cmd, env=_env(PERSIA_API_TOKEN="tok"), capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2, out.stderr
    assert "PERSIA_API_TOKEN: the API token must be at least 16 characters" in out.stderr


def test_launch_api_names_a_port_already_taken():
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "stream_persia.launch.cli", "launch", "api", "--port",
               str(port)]
        out = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert f"--port {port}: the API cannot listen on 127.0.0.1:{port}" in out.stderr
    assert "Traceback" not in out.stderr


async def test_launch_api_reads_role_addresses_from_the_environment(tmp_path):
    async def health(params):
        return {"ok": True}

    fake_worker = RpcServer({"health": health}, name="worker")
    await fake_worker.start()
    proc = RoleProcess("api", ["--port", "0"], env=_env(
        PERSIA_EMBEDDING_WORKERS=fake_worker.address))
    proc.start()
    try:
        address = await asyncio.to_thread(proc.wait_ready, 60)
        async with httpx.AsyncClient() as client:
            r = await client.get(f"http://{address}/readyz")
        assert r.status_code == 200, r.text
        assert [x["address"] for x in r.json()["roles"]] == [fake_worker.address]
    finally:
        await asyncio.to_thread(proc.stop)
        await fake_worker.stop()
