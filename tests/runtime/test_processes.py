"""The launcher and the broker-less path, with every role a real child process.

``stream-persia launch <role>`` as users run it: flags checked before anything starts,
PERSIA's ``embedding-parameter-server`` alias, Prometheus metrics over HTTP, SIGTERM
draining to exit code 0, and broker-less ingest (``DataCtx(embedding_workers=...)`` from
this process, and the ``data-loader`` role running a user script) pulled back by a test
NN client. One broker-less job (a server and two workers) serves the whole module.
"""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from collections import Counter
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from stream_persia.errors import BadInput, PeerUnavailable
from stream_persia.launch.memory import KEEP_FREED_ENV
from stream_persia.launch.processes import RoleProcess
from stream_persia.loader.data_ctx import DataCtx
from stream_persia.rpc import RpcClient
from stream_persia.testing.samples import EMBEDDING_YAML, make_batch

SLOTS = ("user", "item", "tags")


def free_port() -> int:
    """A port nothing listens on now. ``--metrics-port 0`` would work but is not reported
    anywhere a test can read it, so the test asks the OS for a port first."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "stream_persia.launch.cli", "launch", *args],
                          capture_output=True, text=True, timeout=60)


def scrape_text(port: int) -> str:
    """GET /metrics: the Prometheus text exposition."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/plain")
        return resp.read().decode()


def scrape(port: int) -> dict[str, float]:
    """GET /metrics; samples by name (labels dropped, the last value wins)."""
    return {s.name: s.value for fam in text_string_to_metric_families(scrape_text(port))
            for s in fam.samples}


@pytest.mark.parametrize(("args", "message"), [
    (("embedding-server", "--replica-index", "3", "--replica-size", "2"),
     "--replica-index 3 must be in [0, --replica-size=2)"),
    (("embedding-parameter-server", "--replica-size", "0"), "--replica-size"),
    (("embedding-server", "--capacity", "0"),
     "argument --capacity: must be an integer in [1, 1073741824], got '0'"),
    (("embedding-server", "--store-threads", "0"),
     "argument --store-threads: must be an integer in [1, 256], got '0'"),
    (("embedding-server", "--store-threads", "4", "--capacity", "2"),
     "4 store threads cannot share a capacity of 2 rows"),
    (("embedding-worker", "--embedding-servers", "127.0.0.1:7000,nonsense"),
     "--embedding-servers: 'nonsense' is not host:port"),
])
def test_bad_flags_exit_2_naming_the_flag(args, message):
    result = launch(*args)
    assert result.returncode == 2
    assert message in result.stderr
    assert "Traceback" not in result.stderr


def test_busy_ports_are_reported_not_raised():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        for flag in ("--port", "--metrics-port"):
            result = launch("embedding-server", flag, port)
            assert result.returncode != 0
            assert f"{flag} {port}: cannot listen" in result.stderr
            assert "Traceback" not in result.stderr


async def test_parameter_server_alias_serves_rpc_and_http_metrics_and_drains(tmp_path):
    """Also: the global config's restore_stage_ttl_s reaches the server (a staged restore
    is dropped after it)."""
    port = free_port()
    (tmp_path / "global_config.yml").write_text(
        "embedding_parameter_server_config:\n  restore_stage_ttl_s: 1\n")
    role = RoleProcess("embedding-parameter-server",
                       ["--replica-index", "1", "--replica-size", "2", "--metrics-port", str(port),
                        "--global-config", str(tmp_path / "global_config.yml"),
                        "--checkpoint-root", str(tmp_path)])
    try:
        await asyncio.to_thread(role.start().wait_ready, 30)
        async with RpcClient(role.address, timeout_ms=5000) as client:
            health = await client.call("health")
            assert (health["role"], health["replica_index"], health["replica_size"]) == (
                "embedding-server", 1, 2)
            await client.call("size")
            shard = await client.call("dump", {"dir": str(tmp_path)})
            staged = await client.call("load", {"dir": str(tmp_path), "files": [shard["file"]],
                                                "stage": True})
            await asyncio.sleep(1.5)
            with pytest.raises(BadInput, match=r"dropped after stage_ttl_s=1 s"):
                await client.call("commit_load", {"token": staged["token"]})
        metrics = await asyncio.to_thread(scrape, port)
        assert metrics['persia_embedding_server_requests_total'] >= 1
        assert "persia_embedding_server_store_lookups_total" in metrics
        # the metrics port counts its own refusals and cut-off connections
        assert metrics["persia_embedding_server_metrics_port_refused_total"] == 0
        assert metrics["persia_embedding_server_metrics_port_cut_off_total"] == 0
    finally:
        code = await asyncio.to_thread(role.stop)
    assert code == 0, role.log_tail()


# ------------------------------------------------------------------ broker-less job
def loads_torch(pid: int) -> bool:
    """Whether process ``pid`` has torch's native library mapped (Linux /proc)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.fixture(scope="module")
def direct_job(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("direct-job")
    (tmp / "embedding_config.yml").write_text(EMBEDDING_YAML)
    metrics_port, server_metrics_port = free_port(), free_port()
    # The server keeps 64 MiB of freed memory, worker 0 glibc's defaults (the metric
    # malloc_keep_freed_bytes says which each applied).
    server = RoleProcess("embedding-server", ["--capacity", "100000", "--store-threads", "2",
                                              "--metrics-port", str(server_metrics_port)],
                         env={KEEP_FREED_ENV: "64"}, log_path=tmp / "server.log")
    procs = [server]
    try:
        server.start().wait_ready(30)
        workers = [RoleProcess("embedding-worker", [
            "--replica-index", str(i), "--replica-size", "2",
            "--embedding-config", str(tmp / "embedding_config.yml"),
            "--embedding-servers", server.address,
            *(["--metrics-port", str(metrics_port)] if i == 0 else []),
        ], name=f"embedding-worker-{i}", env={KEEP_FREED_ENV: "0"} if i == 0 else None,
            log_path=tmp / f"worker-{i}.log") for i in range(2)]
        procs += workers
        for w in workers:
            w.start()
        for w in workers:
            w.wait_ready(60)
        torch_when_ready = [loads_torch(w.proc.pid) if sys.platform.startswith("linux")
                            else None for w in workers]
        yield {"server": server, "workers": workers, "tmp": tmp, "metrics_port": metrics_port,
               "server_metrics_port": server_metrics_port, "torch_when_ready": torch_when_ready}
    finally:
        for p in reversed(procs):
            p.stop()


async def pull_all(addresses: list[str], want: int, timeout_s: float = 20.0) -> list:
    """Pull ``want`` batches from the workers, releasing each; then check none is left."""
    clients = [RpcClient(a, timeout_ms=10_000) for a in addresses]
    got: list[tuple[int, dict]] = []
    try:
        deadline = time.monotonic() + timeout_s
        turn = 0
        while len(got) < want:
            assert time.monotonic() < deadline, f"only {len(got)} of {want} batches served"
            w = turn % len(clients)
            turn += 1
            served = await clients[w].call("next_batch", {"timeout_ms": 100})
            if served is not None:
                got.append((w, served))
                await clients[w].call("push_gradients", {"batch_id": served["batch_id"],
                                                         "grads": dict.fromkeys(SLOTS)})
        for c in clients:
            assert await c.call("next_batch", {"timeout_ms": 200}) is None
    finally:
        for c in clients:
            await c.close()
    return got


def send_direct(addresses: list[str], batches) -> int:
    with DataCtx(embedding_workers=addresses) as ctx:
        assert ctx.mode == "direct"
        for b in batches:
            ctx.send_data(b)
        return ctx.sent


async def test_data_ctx_sends_straight_to_worker_processes(direct_job):
    addresses = [w.address for w in direct_job["workers"]]
    batches = [make_batch(i, seed=11) for i in range(10)]
    assert await asyncio.to_thread(send_direct, addresses, batches) == 10
    got = await pull_all(addresses, 10)
    assert Counter(s["meta"] for _, s in got) == Counter(b.meta for b in batches)
    assert Counter(w for w, _ in got) == {0: 5, 1: 5}, "round-robin over the workers"
    for _, served in got:
        assert {e["name"] for e in served["embeddings"]} == set(SLOTS)

    metrics = await asyncio.to_thread(scrape, direct_job["metrics_port"])
    assert metrics["persia_embedding_worker_batches_served_total"] >= 5
    assert metrics["persia_embedding_worker_buffer_ready"] == 0


async def test_the_server_runs_the_store_threads_its_flag_asks_for(direct_job):
    async with RpcClient(direct_job["server"].address, timeout_ms=10_000) as client:
        assert (await client.call("health"))["store_threads"] == 2


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")
async def test_launched_roles_report_the_freed_memory_they_keep(direct_job):
    """``launch`` applies STREAM_PERSIA_KEEP_FREED_MB in the role's process and says so."""
    server = await asyncio.to_thread(scrape, direct_job["server_metrics_port"])
    assert server["persia_embedding_server_malloc_keep_freed_bytes"] == 64 << 20
    worker = await asyncio.to_thread(scrape, direct_job["metrics_port"])
    assert worker["persia_embedding_worker_malloc_keep_freed_bytes"] == 0


async def test_counts_are_scraped_as_counters_and_levels_as_gauges(direct_job):
    server = await asyncio.to_thread(scrape_text, direct_job["server_metrics_port"])
    worker = await asyncio.to_thread(scrape_text, direct_job["metrics_port"])
    for text, counter, gauge in (
            (server, "persia_embedding_server_store_lookups", "persia_embedding_server_store_rows"),
            (worker, "persia_embedding_worker_batches_ingested",
             "persia_embedding_worker_buffer_ready")):
        assert f"# TYPE {counter}_total counter\n" in text
        assert re.search(rf"^{counter}_total \S+$", text, re.M)
        assert not re.search(rf"^{counter} ", text, re.M), "a count is no gauge any more"
        assert f"# TYPE {gauge} gauge\n" in text
    # Broker-less: the worker has no consumer, so no Kafka series (test_kafka_runtime
    # scrapes them from workers launched with --kafka).
    assert "persia_embedding_worker_kafka" not in worker


async def test_data_loader_role_runs_a_user_script(direct_job):
    script = direct_job["tmp"] / "loader.py"
    script.write_text(textwrap.dedent("""\
        from stream_persia.ctx import DataCtx
        from stream_persia.testing.samples import make_batch

        with DataCtx() as ctx:  # workers from --embedding-workers (PERSIA_EMBEDDING_WORKERS)
            for i in range(100, 106):
                ctx.send_data(make_batch(i))
    """))
    addresses = [w.address for w in direct_job["workers"]]
    loader = RoleProcess("data-loader", [str(script), "--embedding-workers", ",".join(addresses)],
                         log_path=direct_job["tmp"] / "loader.log")
    loader.start()
    try:
        code = await asyncio.to_thread(loader.proc.wait, 60)
    finally:
        loader.stop()  # removes its temp dir
    assert code == 0, loader.log_tail()
    got = await pull_all(addresses, 6)
    assert sorted(s["meta"] for _, s in got) == sorted(f"batch-{i}".encode()
                                                      for i in range(100, 106))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/maps")
async def test_sigterm_drains_a_data_loader_to_exit_code_zero(direct_job):
    """SIGTERM in the middle of a loader script: what it sent is delivered, exit 0."""
    script = direct_job["tmp"] / "endless_loader.py"
    script.write_text(textwrap.dedent("""\
        import time
        from stream_persia.ctx import DataCtx
        from stream_persia.testing.samples import make_batch

        ctx = DataCtx()
        try:
            with ctx:
                for i in range(1000):
                    ctx.send_data(make_batch(200 + i))
                    if i == 3:
                        print("sending", flush=True)
                    time.sleep(0.05)
        finally:
            stats = ctx.stats()
            print(f"sent {stats['sent']} acked {stats['acked']}", flush=True)
    """))
    addresses = [w.address for w in direct_job["workers"]]
    loader = RoleProcess("data-loader", [str(script), "--embedding-workers", ",".join(addresses)],
                         log_path=direct_job["tmp"] / "endless_loader.log")
    loader.start()
    try:
        deadline = time.monotonic() + 60
        while "sending" not in loader.log_tail() and time.monotonic() < deadline:
            assert loader.alive(), loader.log_tail()
            await asyncio.sleep(0.1)
        code = await asyncio.to_thread(loader.stop, 15)   # SIGTERM, then SIGKILL after 15 s
    finally:
        loader.stop()
    assert code == 0, loader.log_tail()
    sent, acked = map(int, re.search(r"sent (\d+) acked (\d+)", loader.log_tail()).groups())
    assert 4 <= sent == acked < 1000, loader.log_tail()
    # every batch it sent reached a worker (and the buffers are empty again after)
    assert len(await pull_all(addresses, sent)) == sent


def test_a_worker_pooling_slots_itself_loads_torch_at_start(direct_job):
    """The job's ``tags`` slot is raw (pooled on the worker, by torch's segment sums): the
    worker imports torch while starting, not inside its first batch."""
    assert direct_job["torch_when_ready"] == [True, True]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/<pid>/maps")
async def test_a_worker_whose_slots_all_pool_on_the_servers_never_loads_torch(tmp_path):
    """Summation slots pool on the servers: serving them never needs torch, so the worker
    does not pay its ~1 s and ~190 MB of import."""
    (tmp_path / "embedding_config.yml").write_text(
        "feature_index_prefix_bit: 8\nslots_config:\n  user: {dim: 8}\n"
        "  item: {dim: 8, sqrt_scaling: true}\n")
    with RoleProcess("embedding-server", [], log_path=tmp_path / "server.log") as server:
        with RoleProcess("embedding-worker", [
                "--embedding-config", str(tmp_path / "embedding_config.yml"),
                "--embedding-servers", server.address],
                log_path=tmp_path / "worker.log") as worker:
            batch = make_batch(0)
            batch.id_type_features = [f for f in batch.id_type_features if f.name != "tags"]
            assert await asyncio.to_thread(send_direct, [worker.address], [batch]) == 1
            async with RpcClient(worker.address, timeout_ms=10_000) as client:
                served = await client.call("next_batch", {"timeout_ms": 10_000})
                assert {e["name"] for e in served["embeddings"]} == {"user", "item"}
                await client.call("push_gradients", {
                    "batch_id": served["batch_id"],
                    "grads": {"user": None, "item": None}})
            assert not loads_torch(worker.proc.pid), worker.log_tail()


async def test_sigterm_drains_roles_to_exit_code_zero(direct_job):
    worker = direct_job["workers"][0]
    async with RpcClient(worker.address, timeout_ms=10_000) as client:
        # An NN worker waiting for data while the job stops gets an answer, not a hang.
        waiting = asyncio.ensure_future(client.call("next_batch", {"timeout_ms": 1500}))
        await asyncio.sleep(0.2)
        codes = await asyncio.to_thread(
            lambda: [p.stop(grace_s=15) for p in [*direct_job["workers"],
                                                   direct_job["server"]]])
        try:
            assert await asyncio.wait_for(waiting, 10) is None
        except PeerUnavailable as e:
            assert "shutting down" in str(e) or "closed" in str(e)
    assert codes == [0, 0, 0], [p.log_tail() for p in direct_job["workers"]]


# ------------------------------------------------------------ worker config reaches it
async def test_worker_config_bounds_its_buffer_and_concurrent_lookups(tmp_path):
    """embedding_worker_config.forward_buffer_size (PERSIA's name for the ready buffer) and
    max_inflight_lookups reach a launched worker and do what they say: a 3-batch buffer,
    and at most 2 lookups on the servers at once however many are asked for."""
    import numpy as np

    from stream_persia.rpc import RpcServer

    active = peak = 0

    async def lookup(params: dict) -> dict:
        nonlocal active, peak
        active += 1
        peak = max(peak, active)
        try:
            await asyncio.sleep(0.3)   # long enough for every request to pile up
        finally:
            active -= 1
        rows = [np.zeros((len(g["offsets"]) - 1 if "offsets" in g else len(g["ids"]),
                          g["dim"]), np.float32) for g in params["groups"]]
        return {"rows": rows, "missing": 0, "config": None}

    async def get_config(params: object) -> None:
        return None

    async def health(params: object) -> dict:   # a worker asks it before its first lookup
        return {"ok": True}

    # A peer that counts the lookups it is serving at once (a real RPC server on loopback).
    server = RpcServer({"lookup": lookup, "get_config": get_config, "health": health})
    await server.start()
    (tmp_path / "embedding_config.yml").write_text(EMBEDDING_YAML)
    (tmp_path / "global_config.yml").write_text(
        "embedding_worker_config:\n  forward_buffer_size: 3\n  max_inflight_lookups: 2\n")
    worker = RoleProcess("embedding-worker", [
        "--embedding-config", str(tmp_path / "embedding_config.yml"),
        "--global-config", str(tmp_path / "global_config.yml"),
        "--embedding-servers", server.address], log_path=tmp_path / "worker.log")
    try:
        await asyncio.to_thread(worker.start().wait_ready, 60)
        async with RpcClient(worker.address, timeout_ms=30_000) as client:
            status = await client.call("status")
            assert status["ready_capacity"] == 3, status
            replies = await asyncio.gather(*(
                client.call("lookup_batch", {"batch": make_batch(i).to_wire(), "mode": "eval"})
                for i in range(6)))
        assert len(replies) == 6
        assert peak == 2, f"{peak} lookups ran at once with max_inflight_lookups: 2"
    finally:
        code = await asyncio.to_thread(worker.stop)
        await server.stop()
    assert code == 0, worker.log_tail()


def test_a_role_started_nice_runs_at_that_priority(tmp_path):
    """``stream-persia run``'s serving replica yields the CPU to training: a RoleProcess
    with ``nice`` runs the role itself (the pid it reports) at that niceness."""
    import os

    with pytest.raises(ValueError, match="nice"):
        RoleProcess("embedding-server", nice=20)
    base = os.getpriority(os.PRIO_PROCESS, 0)
    proc = RoleProcess("embedding-server", ["--capacity", "1000", "--port", "0"],
                       log_path=tmp_path / "s.log", nice=7).start()
    try:
        proc.wait_ready()
        assert os.getpriority(os.PRIO_PROCESS, proc.proc.pid) == min(19, base + 7)
        assert "stream_persia.launch.cli" in Path(f"/proc/{proc.proc.pid}/cmdline").read_text()
    finally:
        proc.stop()
