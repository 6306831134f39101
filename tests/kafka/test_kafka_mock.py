"""The Kafka test broker: librdkafka's mock cluster as a child process, and its fixtures."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from stream_persia.errors import ConfigError, Misuse, PeerUnavailable, RemoteError
from stream_persia.kafka import topic_partitions
from stream_persia.testing import pytest_plugin
from stream_persia.testing.kafka_mock import MockKafkaCluster, find_librdkafka
from stream_persia.testing.pytest_plugin import ExternalKafka

pytestmark = [pytest.mark.kafka, pytest.mark.timeout(60)]


def _gone(pid: int, within_s: float = 5.0) -> bool:
    """True once ``pid`` no longer runs (reaped, or a zombie awaiting its reaper)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.05)
    return False


def _connects(address: str) -> bool:
    host, _, port = address.partition(",")[0].rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


async def _partitions(bootstrap: str, topic: str) -> int:
    return await topic_partitions(bootstrap, topic)


def test_library_is_found_in_the_confluent_kafka_wheel():
    path = find_librdkafka()
    assert path.is_file() and path.name.startswith("librdkafka")


def test_library_override_must_exist(monkeypatch, tmp_path):
    monkeypatch.setenv("STREAM_PERSIA_LIBRDKAFKA", str(tmp_path / "nope.so"))
    with pytest.raises(ConfigError, match="STREAM_PERSIA_LIBRDKAFKA"):
        find_librdkafka()


def test_starts_on_loopback_and_stops_leaving_no_process():
    cluster = MockKafkaCluster(brokers=2).start()
    pid = cluster.pid
    try:
        addresses = cluster.bootstrap_servers.split(",")
        assert len(addresses) == 2
        assert all(a.startswith("127.0.0.1:") for a in addresses)
        assert _connects(cluster.bootstrap_servers)
        assert cluster.start_seconds is not None and cluster.start_seconds > 0
        cluster.ping()
    finally:
        cluster.stop()
    assert pid is not None and _gone(pid)
    assert not cluster.is_running()
    assert not _connects(addresses[0])
    cluster.stop()  # idempotent
    with pytest.raises(Misuse):
        _ = cluster.bootstrap_servers


def test_context_manager_stops_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with MockKafkaCluster() as cluster:
            pid = cluster.pid
            raise RuntimeError("boom")
    assert _gone(pid)


async def test_created_topic_has_its_partitions_in_aiokafka_metadata():
    with MockKafkaCluster() as cluster:
        assert cluster.create_topic("six", 6) is True
        assert cluster.create_topic("six", 6) is False  # idempotent
        assert await asyncio.wait_for(_partitions(cluster.bootstrap_servers, "six"), 10) == 6


async def test_produce_and_fetch_over_tcp():
    with MockKafkaCluster() as cluster:
        cluster.create_topic("rt", 1)

        async def round_trip() -> list[bytes]:
            producer = AIOKafkaProducer(bootstrap_servers=cluster.bootstrap_servers,
                                        acks="all", enable_idempotence=True)
            await producer.start()
            try:
                for i in range(5):
                    await producer.send("rt", f"m{i}".encode(), partition=0)
                await producer.flush()
            finally:
                await producer.stop()
            consumer = AIOKafkaConsumer("rt", bootstrap_servers=cluster.bootstrap_servers,
                                        auto_offset_reset="earliest", fetch_max_wait_ms=50)
            await consumer.start()
            try:
                got: list[bytes] = []
                while len(got) < 5:
                    for records in (await consumer.getmany(timeout_ms=200)).values():
                        got += [r.value for r in records]
                return got
            finally:
                await consumer.stop()

        assert await asyncio.wait_for(round_trip(), 20) == [f"m{i}".encode() for i in range(5)]


async def test_a_broker_killed_and_replaced_behind_its_advertised_address():
    """``advertise`` names a proxy's address in metadata, so that every client goes through
    it; a new broker behind it (LateProxy.retarget) is, to a producer that outlives the
    kill, the old one restarted at its address: empty, and taking records again."""
    from stream_persia.testing.proxy import LateProxy

    proxy = LateProxy("127.0.0.1:1")
    proxy.start()
    old = MockKafkaCluster().start()
    new = None
    producer = AIOKafkaProducer(bootstrap_servers=proxy.address)
    try:
        old.advertise(proxy.address)
        old.create_topic("t", 1)
        proxy.retarget(old.bootstrap_servers)
        await producer.start()
        assert {(b.host, b.port) for b in producer.client.cluster.brokers()} == \
            {("127.0.0.1", proxy.port)}
        for i in range(3):
            await producer.send_and_wait("t", b"%d" % i, partition=0)
        old.kill()
        new = MockKafkaCluster().start()
        new.advertise(proxy.address)
        new.create_topic("t", 1)
        proxy.retarget(new.bootstrap_servers)
        meta = await asyncio.wait_for(producer.send_and_wait("t", b"after", partition=0), 30)
        assert meta.offset == 0        # the old broker's records died with it
        consumer = AIOKafkaConsumer("t", bootstrap_servers=proxy.address,
                                    auto_offset_reset="earliest")
        await consumer.start()
        try:
            got = await consumer.getmany(timeout_ms=5000)
        finally:
            await consumer.stop()
        assert [r.value for rs in got.values() for r in rs] == [b"after"]
    finally:
        await producer.stop()
        old.kill()
        if new is not None:
            new.stop()
        proxy.close()


def test_bad_commands_are_refused_with_the_reason():
    with MockKafkaCluster() as cluster:
        with pytest.raises(ConfigError, match="partitions"):
            cluster.create_topic("t", 0)
        with pytest.raises(ConfigError, match="topic name"):
            cluster.create_topic("has space", 1)
        with pytest.raises(ConfigError, match="refused"):
            cluster.broker_down(99)  # no such broker
        cluster.ping()  # still serving


def test_dead_child_is_reported_with_its_log():
    with MockKafkaCluster() as cluster:
        os.kill(cluster.pid, 9)
        with pytest.raises(PeerUnavailable, match="exited|gone"):
            cluster.create_topic("t", 1)


@pytest.mark.parametrize("from_thread", [False, True], ids=["main-thread", "other-thread"])
def test_child_exits_when_its_parent_is_killed(from_thread):
    # The parent starts the mock (on its main thread: PR_SET_PDEATHSIG; on another
    # thread: EOF on stdin), prints the child's pid and dies without cleaning up.
    code = textwrap.dedent(f"""
        import os, threading
        from stream_persia.testing.kafka_mock import MockKafkaCluster
        box = []
        start = lambda: box.append(MockKafkaCluster().start())
        if {from_thread}:
            t = threading.Thread(target=start); t.start(); t.join()
        else:
            start()
        print(box[0].pid, flush=True)
        os.kill(os.getpid(), 9)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30)
    pid = int(out.stdout.split()[0])
    assert _gone(pid), f"mock cluster {pid} outlived its parent"


def test_cli_creates_topics_and_prints_the_address():
    proc = subprocess.Popen([sys.executable, "-m", "stream_persia.testing.kafka_mock",
                             "--topic", "cli:3"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline().split()
        assert line[0] == "bootstrap"
        assert asyncio.run(asyncio.wait_for(_partitions(line[1], "cli"), 10)) == 3
    finally:
        proc.communicate("quit\n", timeout=10)
    assert proc.returncode == 0


# ---------------------------------------------------------------------- fixtures

def test_fixture_gives_a_running_broker_and_marks_the_test(kafka_broker, request):
    assert _connects(kafka_broker.bootstrap_servers)
    assert request.node.get_closest_marker("kafka") is not None


def test_topic_factory_makes_unique_topics(kafka_topic, kafka_broker):
    a, b = kafka_topic(3), kafka_topic(3, prefix="x")
    assert a != b and b.startswith("x-")
    found = asyncio.run(asyncio.wait_for(_partitions(kafka_broker.bootstrap_servers, a), 10))
    assert found == 3


def test_external_broker_accepts_existing_topics_and_reports_admin_failures():
    # The mock stands in for an external broker; it lacks the admin API, which shows
    # that existing topics are accepted without it and that failures are reported.
    with MockKafkaCluster() as cluster:
        cluster.create_topic("existing", 4)
        external = ExternalKafka(cluster.bootstrap_servers, timeout_s=20)
        assert external.create_topic("existing", 4) is False
        with pytest.raises(ConfigError, match="4 partitions"):
            external.create_topic("existing", 8)
        with pytest.raises(RemoteError, match="CreateTopics"):
            external.create_topic("missing", 2)


def test_plugin_uses_kafka_bootstrap_servers_when_set(tmp_path: Path):
    with MockKafkaCluster() as cluster:
        cluster.create_topic("given", 2)
        (tmp_path / "test_inner.py").write_text(textwrap.dedent(f"""
            from stream_persia.testing.pytest_plugin import ExternalKafka

            def test_env_broker(kafka_broker):
                assert isinstance(kafka_broker, ExternalKafka)
                assert kafka_broker.bootstrap_servers == {cluster.bootstrap_servers!r}
                assert kafka_broker.create_topic("given", 2) is False
        """))
        env = {**os.environ, pytest_plugin.ENV: cluster.bootstrap_servers}
        out = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "stream_persia.testing.pytest_plugin",
             "-p", "no:cacheprovider", "-c", os.devnull, "--rootdir", str(tmp_path),
             str(tmp_path / "test_inner.py")],
            capture_output=True, text=True, env=env, timeout=60, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 passed" in out.stdout
