"""Zero-config single host (issue 23, item 1): roles launched one by one with no addresses
meet on their well-known local ports (:mod:`stream_persia.rpc.local_ports`).

Real processes throughout. Every test moves the job's well-known ports to a range of its
own (``PERSIA_BASE_PORT``, below the OS's ephemeral ports), so that tests running beside
each other, or a job on this machine, never meet.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stream_persia.errors import ConfigError
from stream_persia.launch.processes import RoleProcess
from stream_persia.rpc import RpcClient, local_ports

ROOT = Path(__file__).resolve().parents[2]
#: summed slots only: the worker pools nothing itself and never imports torch
EMBEDDING_YAML = "slots_config:\n  user: {dim: 8}\n  item: {dim: 8}\n"
TOPOLOGY = "topologies/synthetic_ctr"
#: addresses and secrets the calling shell may have: a zero-config role must not see them
ADDRESS_ENV = ("PERSIA_EMBEDDING_SERVERS", "PERSIA_EMBEDDING_WORKERS", "KAFKA_BOOTSTRAP_SERVERS",
               "PERSIA_ROLE_SECRET", "PERSIA_ROLE_SECRET_FILE", "PERSIA_GLOBAL_CONFIG",
               "PERSIA_EMBEDDING_CONFIG", "REPLICA_INDEX", "REPLICA_SIZE", "MASTER_PORT",
               "PERSIA_CHECKPOINT_ROOT", "PERSIA_CHECKPOINT_DIR")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_base() -> int:
    """A base whose first ports of both roles are free (20000-30000: no ephemeral port)."""
    for _ in range(200):
        base = random.randrange(20000, 30000 - 200)
        if all(_free(base + off + i) for off in (0, local_ports.MAX_REPLICAS) for i in range(3)):
            return base
    raise RuntimeError("no free port range")


def zero_env(base: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ADDRESS_ENV}
    return {**env, local_ports.BASE_PORT_ENV: str(base), "PYTHONUNBUFFERED": "1", **extra}


def launch(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """``stream-persia launch ...`` as a Procfile line runs it: no ready file, no port."""
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, "-m", "stream_persia.launch.cli", "launch",
                                 *args], cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def wait_for(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.1)


# ----------------------------------------------------------------- the port plan (pure)
def test_port_plan_and_its_base_are_checked():
    assert local_ports.well_known_port("embedding-server", 2, 10000) == 10002
    assert local_ports.well_known_port("embedding-worker", 0, 10000) == 10100
    assert local_ports.base_port({}) == local_ports.DEFAULT_BASE_PORT == 10000
    assert local_ports.base_port({"PERSIA_BASE_PORT": "20000"}) == 20000
    for bad in ("80", "65500", "x"):
        with pytest.raises(ConfigError) as e:
            local_ports.base_port({"PERSIA_BASE_PORT": bad})
        assert e.value.field == "PERSIA_BASE_PORT"
    with pytest.raises(ConfigError, match="replicas 0..99"):
        local_ports.well_known_port("embedding-server", 100, 10000)


# ------------------------------------------------------------------ a job, role by role
PROCFILE = ROOT / "deploy" / "Procfile.zero-config"
PROCFILE_OUT = "runs/zero-config"


def procfile() -> dict[str, list[str]]:
    """deploy/Procfile.zero-config: each line's ``stream-persia`` arguments (up to ``&&``)."""
    lines = {}
    for line in PROCFILE.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, cmd = line.partition(":")
            argv = shlex.split(cmd.split("&&")[0])
            assert argv[:2] == ["stream-persia", "launch"], line
            lines[name] = argv[2:]
    return lines


def test_the_zero_config_procfile_gives_no_address_port_or_environment():
    lines = procfile()
    assert sorted(lines) == ["data_loader", "embedding_server", "embedding_worker",
                             "nn_worker"], "PERSIA's Procfile: one of each"
    for argv in lines.values():
        assert not any(a.startswith(("--port", "--embedding-servers", "--embedding-workers",
                                     "--host", "--kafka", "--base-port")) for a in argv), argv
    assert "=" not in "".join(ln.split(":", 1)[1].split("&&")[0]
                              for ln in PROCFILE.read_text().splitlines()
                              if ln.strip() and not ln.startswith("#")), "no VAR=value"


@pytest.mark.timeout(180)
def test_a_job_launched_role_by_role_with_no_addresses_trains_to_completion(tmp_path):
    """deploy/Procfile.zero-config's commands (PERSIA's Procfile, ``persia-launcher``
    replaced by ``stream-persia launch``), no address anywhere. The data loader and NN
    worker start first and wait; then two embedding servers (the Procfile's line with
    ``--replica-index i --replica-size 2``: the worker learns how many from server 0) and
    the worker. Only the sample count, the outputs and the port base differ."""
    base = free_base()
    samples = 4096
    env = zero_env(base, STREAM_PERSIA_SAMPLES=str(samples), STREAM_PERSIA_EVAL_SAMPLES="2048",
                   STREAM_PERSIA_SYNTHETIC_VOCAB="20000")
    out = tmp_path / "out"
    lines = {name: [str(out) if a == PROCFILE_OUT else a for a in argv]
             for name, argv in procfile().items()}
    server = lines["embedding_server"]
    at = server.index("--replica-index")
    assert server[at:at + 4] == ["--replica-index", "0", "--replica-size", "1"]
    logs = {name: tmp_path / f"{name}.log" for name in ("loader", "nn", "s0", "s1", "worker")}
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs["loader"] = launch(lines["data_loader"], env, logs["loader"])
        procs["nn"] = launch(lines["nn_worker"], env, logs["nn"])
        worker_port = base + local_ports.MAX_REPLICAS
        wait_for(lambda: f"waiting for embedding worker 0 at 127.0.0.1:{worker_port}"
                 in logs["loader"].read_text(), 30, "the data loader says what it waits for")
        for i in (0, 1):
            procs[f"s{i}"] = launch([*server[:at], "--replica-index", str(i), "--replica-size",
                                     "2", *server[at + 4:]], env, logs[f"s{i}"])
        procs["worker"] = launch(lines["embedding_worker"], env, logs["worker"])
        assert procs["nn"].wait(150) == 0, logs["nn"].read_text()[-4000:]
        assert procs["loader"].wait(30) == 0, logs["loader"].read_text()[-4000:]
        for name in ("s0", "s1", "worker"):
            assert procs[name].poll() is None, logs[name].read_text()[-3000:]

        servers = f"127.0.0.1:{base},127.0.0.1:{base + 1}"
        assert f"found 2 embedding server(s) on well-known local ports: {servers}" \
            in logs["worker"].read_text()
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["train"]["samples"] == samples and metrics["train"]["done"], metrics
        assert (out / "checkpoint" / "manifest.json").is_file()

        async def rows() -> list[int]:
            counts = []
            for port in (base, base + 1):
                async with RpcClient(f"127.0.0.1:{port}") as c:
                    counts.append((await c.call("health"))["rows"])
            return counts

        assert all(n > 0 for n in asyncio.run(rows())), "both shards trained"
    finally:
        stop(list(procs.values()))
    for name in ("s0", "s1", "worker"):
        assert procs[name].returncode == 0, logs[name].read_text()[-3000:]


# ------------------------------------------------------------------- a port that is taken
@pytest.mark.parametrize("role,offset", [("embedding-server", 0),
                                         ("embedding-worker", local_ports.MAX_REPLICAS)])
def test_a_taken_well_known_port_fails_at_once_naming_it(tmp_path, role, offset):
    """Never a random port its peers would not find; the worker, which waits for its
    servers before it listens, checks its own port first."""
    base = free_base()
    (tmp_path / "emb.yml").write_text(EMBEDDING_YAML)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", base + offset))
        holder.listen()
        proc = subprocess.run([sys.executable, "-m", "stream_persia.launch.cli", "launch", role,
                               "--embedding-config", str(tmp_path / "emb.yml")],
                              env=zero_env(base), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"well-known port {base + offset} on 127.0.0.1 is taken" in proc.stderr
    assert "PERSIA_BASE_PORT" in proc.stderr and "--port" in proc.stderr
    assert "waiting for" not in proc.stderr


def test_a_worker_waits_for_its_servers_then_gives_up_naming_them(tmp_path):
    base = free_base()
    (tmp_path / "emb.yml").write_text(EMBEDDING_YAML)
    proc = subprocess.run([sys.executable, "-m", "stream_persia.launch.cli", "launch",
                           "embedding-worker", "--embedding-config", str(tmp_path / "emb.yml"),
                           "--peer-timeout-s", "2"],
                          env=zero_env(base), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"waiting for embedding server 0 at 127.0.0.1:{base}" in proc.stderr
    assert f"no embedding server 0 answered at 127.0.0.1:{base} within 2 s" in proc.stderr


def test_servers_started_with_different_replica_sizes_are_refused_by_name(tmp_path):
    """The worker takes the count from server 0 and checks every server against it: a
    shard left out (or one too many) would train a job with a wrong id -> shard map."""
    base = free_base()
    (tmp_path / "emb.yml").write_text(EMBEDDING_YAML)
    env = zero_env(base)
    servers = [launch(["embedding-server", "--replica-index", str(i), "--replica-size", size],
                      env, tmp_path / f"s{i}.log") for i, size in ((0, "2"), (1, "3"))]
    try:
        proc = subprocess.run([sys.executable, "-m", "stream_persia.launch.cli", "launch",
                               "embedding-worker", "--embedding-config",
                               str(tmp_path / "emb.yml"), "--peer-timeout-s", "30"],
                              env=env, capture_output=True, text=True, timeout=60)
    finally:
        stop(servers)
    assert proc.returncode == 2, proc.stderr
    assert (f"127.0.0.1:{base + 1} answers as embedding-server 1 of 3, where the well-known "
            "local ports put embedding server 1 of 2") in proc.stderr
    assert "PERSIA_EMBEDDING_SERVERS" in proc.stderr


def test_sigterm_while_a_worker_waits_for_its_servers_stops_it_cleanly(tmp_path):
    base = free_base()
    (tmp_path / "emb.yml").write_text(EMBEDDING_YAML)
    log = tmp_path / "worker.log"
    proc = launch(["embedding-worker", "--embedding-config", str(tmp_path / "emb.yml")],
                  zero_env(base), log)
    try:
        wait_for(lambda: "waiting for embedding server 0" in log.read_text(), 30,
                 "the worker waits")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0, log.read_text()
    finally:
        stop([proc])


# --------------------------------------------------------------- addresses still override
def test_explicit_ports_and_addresses_override_the_well_known_ones(tmp_path):
    """``--port`` wins over the plan, and a worker given its servers (the flag or
    ``PERSIA_EMBEDDING_SERVERS``) looks nowhere else."""
    base = free_base()
    (tmp_path / "emb.yml").write_text(EMBEDDING_YAML)
    port = base + 7
    assert _free(port)
    env = zero_env(base)
    server = RoleProcess("embedding-server", ["--port", str(port)], env=env,
                         log_path=tmp_path / "server.log")
    by_flag = RoleProcess("embedding-worker", [
        "--embedding-config", str(tmp_path / "emb.yml"),
        "--embedding-servers", f"127.0.0.1:{port}"], env=env, name="w-flag",
        log_path=tmp_path / "w-flag.log")
    by_env = RoleProcess("embedding-worker", ["--embedding-config", str(tmp_path / "emb.yml"),
                                              "--peer-timeout-s", "1", "--replica-index", "1",
                                              "--replica-size", "2"],
                         env={**env, "PERSIA_EMBEDDING_SERVERS": f"127.0.0.1:{port}"},
                         name="w-env", log_path=tmp_path / "w-env.log")
    try:
        server.start()
        assert server.wait_ready() == f"127.0.0.1:{port}"
        for worker in (by_flag.start(), by_env.start()):
            address = worker.wait_ready(30)
            assert address not in (f"127.0.0.1:{base + local_ports.MAX_REPLICAS + i}"
                                   for i in (0, 1)), "RoleProcess runs it on an OS port"

            async def servers(address: str = address) -> list[str]:
                async with RpcClient(address) as c:
                    return list(await c.call("servers"))

            assert asyncio.run(servers()) == [f"127.0.0.1:{port}"]
        assert _free(base), "nothing took the well-known server port"
    finally:
        for role in (by_env, by_flag, server):
            role.stop()
