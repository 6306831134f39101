"""Kafka roles as real processes: an embedding worker started before the broker, one with
no broker ever, ``stream-persia run --kafka`` without ``--topic`` on the test broker, and
a run whose broker deletes samples before they are trained.

The broker is a mock cluster of each test's own (the end-to-end run fills it past its
~5 MiB per partition); "started before the broker" is a loopback port where nothing
listens until the test starts forwarding it to the broker
(:class:`~stream_persia.testing.proxy.LateProxy`).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from stream_persia.errors import ConfigError
from stream_persia.kafka import topic_partitions
from stream_persia.launch.processes import RoleProcess
from stream_persia.launch.samples_topic import ensure_topic
from stream_persia.testing.kafka_mock import MockKafkaCluster
from stream_persia.testing.proxy import LateProxy, free_port
from stream_persia.testing.samples import EMBEDDING_YAML

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.kafka, pytest.mark.client_settings]


def worker_args(tmp: Path, bootstrap: str, startup_timeout_ms: int,
                servers: str | None = None) -> list[str]:
    (tmp / "embedding_config.yml").write_text(EMBEDDING_YAML)
    (tmp / "global_config.yml").write_text(
        f"kafka:\n  startup_timeout_ms: {startup_timeout_ms}\n")
    return ["--embedding-config", str(tmp / "embedding_config.yml"),
            "--global-config", str(tmp / "global_config.yml"),
            # Once the broker answers, a worker asks its servers how far they applied the
            # topic (stream_persia.core.watermarks) before it reads it.
            "--embedding-servers", servers or f"127.0.0.1:{free_port()}",
            "--kafka", bootstrap, "--topic", "samples"]


@pytest.mark.timeout(120)
def test_a_worker_started_before_the_broker_starts_when_it_comes(tmp_path):
    with MockKafkaCluster() as cluster:
        cluster.create_topic("samples", 2)
        cluster.create_topic("samples.dlq", 1)
        proxy = LateProxy(cluster.bootstrap_servers)
        server = RoleProcess("embedding-server", log_path=tmp_path / "server.log").start()
        worker = RoleProcess("embedding-worker", worker_args(tmp_path, proxy.address, 60_000,
                                                             server.wait_ready()))
        try:
            worker.start()
            deadline = time.monotonic() + 60     # until it has tried (and logged it)
            while "not reachable yet" not in worker.log_tail(20_000):
                assert worker.alive() and time.monotonic() < deadline, worker.log_tail()
                time.sleep(0.1)
            assert worker.alive() and not worker.ready_file.exists()   # waiting
            proxy.start()
            worker.wait_ready(60)
        finally:
            worker.stop()
            server.stop()
            proxy.close()


def _fails_naming(worker: RoleProcess, text: str) -> float:
    """Start ``worker``, wait for it to exit non-zero with ``text`` in its log: the seconds
    it took."""
    t0 = time.monotonic()
    worker.start()
    worker.proc.wait(60)
    took = time.monotonic() - t0
    assert worker.proc.returncode != 0
    assert text in worker.log_tail(20_000), worker.log_tail()
    return took


@pytest.mark.timeout(120)
def test_a_worker_with_no_broker_ever_exits_within_the_bound_naming_it(tmp_path):
    servers = f"127.0.0.1:{free_port()}"
    worker = RoleProcess("embedding-worker", worker_args(tmp_path, servers, 2000))
    try:
        took = _fails_naming(worker, f"cannot reach Kafka at {servers}")
        assert 2 <= took < 30      # the 2 s bound, plus a Python start-up or two
    finally:
        worker.stop()


@pytest.mark.timeout(60)
def test_run_makes_its_topic_on_a_broker_without_the_admin_api():
    """``stream-persia run --kafka`` without ``--topic``: the mock has no working
    CreateTopics (aiokafka's admin client fails with an AttributeError); the broker's
    auto-creation makes it instead."""
    with MockKafkaCluster() as cluster:
        topic = f"fresh-{uuid.uuid4().hex[:8]}.samples"
        assert ensure_topic(cluster.bootstrap_servers, topic, 8, create=True) == 4
        import asyncio
        assert asyncio.run(topic_partitions(cluster.bootstrap_servers, topic)) == 4
        # Too few partitions for the workers is a flag error, not a stuck worker.
        with pytest.raises(ConfigError) as err:
            ensure_topic(cluster.bootstrap_servers, topic, 8, create=True, min_partitions=5)
        assert err.value.field == "--partitions" and "fewer than the 5" in str(err.value)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("flag", [["--on-data-loss", "skip"], ["--broker-timeout-s", "5"]])
def test_kafka_only_run_flags_are_refused_without_kafka(tmp_path, flag):
    proc = subprocess.run([sys.executable, "-m", "stream_persia.launch.cli", "run",
                           "topologies/synthetic_ctr", "--output-dir", str(tmp_path), *flag],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert flag[0] in proc.stderr and "Kafka only" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_whose_broker_deleted_unread_samples_fails_naming_the_loss(tmp_path):
    """The issue's run: 3e5 samples through a broker that keeps ~5 MiB per partition, no
    ``--topic``. The data loader outruns training, the broker drops samples nobody read,
    and the run must end with exit 1 naming them (not train on, then gate on accuracy),
    and its checkpoints must not claim them."""
    with MockKafkaCluster() as cluster:
        t0 = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "stream_persia.launch.cli", "run", "topologies/synthetic_ctr",
             "--samples", "3e5", "--predict-samples", "0",
             "--kafka", cluster.bootstrap_servers, "--output-dir", str(tmp_path)],
            cwd=ROOT, capture_output=True, text=True, timeout=540)
        took = time.monotonic() - t0
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert "Kafka data was lost" in proc.stderr and "were deleted (retention)" in proc.stderr
    assert "--on-data-loss skip" in proc.stderr
    assert "accuracy gate" not in proc.stderr
    assert took < 240, took     # not the NN worker's 120 s idle wait plus a report
    for manifest in tmp_path.glob("**/manifest.json"):
        # A checkpoint (if one was written) stops at the loss on every stopped partition.
        offsets = json.loads(manifest.read_text())["offsets"]
        assert sum(sum(parts.values()) for parts in offsets.values()) < 293  # batches


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_whose_broker_is_killed_fails_in_bounded_time_naming_it(tmp_path):
    """The broker is killed (SIGKILL) while the NN worker trains: the worker's ingest gives up after
    ``--broker-timeout-s`` and the run fails naming the broker, instead of waiting for the
    NN worker's idle timeout or ``--timeout-s`` (an hour)."""
    cluster = MockKafkaCluster().start()
    # 16 partitions keep ~80 MiB, all of the 2e5 samples: nothing is lost to retention.
    cluster.create_topic("killed.samples", 16)
    cluster.create_topic("killed.samples.dlq", 1)
    proc = subprocess.Popen(
        [sys.executable, "-m", "stream_persia.launch.cli", "run", "topologies/synthetic_ctr",
         "--samples", "2e5", "--predict-samples", "0", "--broker-timeout-s", "5",
         "--kafka", cluster.bootstrap_servers, "--topic", "killed.samples",
         "--output-dir", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:      # until training is under way
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read()
            try:
                if json.loads((tmp_path / "metrics.json").read_text())["train"]["samples"]:
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        servers = cluster.bootstrap_servers
        cluster.kill()
        t0 = time.monotonic()
        out, _ = proc.communicate(timeout=240)
        took = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        cluster.stop()
    assert proc.returncode == 1, out[-4000:]
    assert f"no Kafka broker at {servers}" in out, out[-4000:]
    assert took < 90, took      # 5 s without a broker, the roles' shutdown, a margin


@pytest.mark.timeout(180)
def test_a_worker_started_before_its_servers_waits_and_without_them_exits_naming_them(
        tmp_path):
    """Before it reads a partition a worker asks its servers how far they applied it
    (stream_persia.core.watermarks): one started before them (pod start order) waits, within
    ``kafka.startup_timeout_ms``, and starts when they come; with none ever it exits
    non-zero naming them instead of serving a stream it cannot check."""
    with MockKafkaCluster() as cluster:
        cluster.create_topic("samples", 1)
        cluster.create_topic("samples.dlq", 1)
        port = free_port()
        late = tmp_path / "late"
        late.mkdir()
        worker = RoleProcess("embedding-worker", worker_args(
            late, cluster.bootstrap_servers, 60_000, f"127.0.0.1:{port}"),
            log_path=late / "worker.log")
        server = RoleProcess("embedding-server", ["--port", str(port)],
                             log_path=late / "server.log")
        try:
            worker.start()
            time.sleep(3)                      # it waits for the servers, it does not exit
            assert worker.alive(), worker.log_tail()
            server.start().wait_ready()
            worker.wait_ready(60)
        finally:
            worker.stop()
            server.stop()

        never = tmp_path / "never"
        never.mkdir()
        servers = f"127.0.0.1:{free_port()}"
        worker = RoleProcess("embedding-worker", worker_args(
            never, cluster.bootstrap_servers, 2000, servers), log_path=never / "worker.log")
        try:
            took = _fails_naming(worker, f"embedding servers ['{servers}'] did not all answer")
            assert 2 <= took < 30
        finally:
            worker.stop()
