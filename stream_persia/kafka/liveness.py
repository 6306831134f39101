"""Reaching the brokers: bounded start-up retries, and noticing a broker that is gone.

- :func:`start_client`: a producer or consumer started before Kafka is reachable keeps
  trying for ``kafka.startup_timeout_ms`` (default 60 s; exponential backoff, each failure
  logged, :mod:`stream_persia.core.backoff`), then fails with :class:`KafkaUnavailable` naming
  the bootstrap servers.
- :class:`BrokerWatch`: aiokafka never gives up on a broker that went away (its fetcher
  and sender reconnect forever), so a job would stall until an outer timeout. A waiting
  client asks its watch; after a second without a sign of life the watch sends a small
  metadata request (the samples topic only, no auto-creation) at most once a second,
  and once those fail for ``kafka.broker_timeout_ms`` (default 60 s) it raises
  :class:`KafkaUnavailable` naming the bootstrap servers. Records and acknowledgements
  count as signs of life, so a busy client never probes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from aiokafka.errors import KafkaConnectionError, KafkaError
from aiokafka.protocol.metadata import MetadataRequest

from stream_persia.core.backoff import retry_startup, wait_bounded
from stream_persia.errors import PeerUnavailable

__all__ = ["KafkaUnavailable", "start_client", "stop_client", "stop_producer", "BrokerWatch",
           "DEFAULT_STARTUP_TIMEOUT_S", "DEFAULT_BROKER_TIMEOUT_S"]

log = logging.getLogger(__name__)


class _Client(Protocol):
    """An aiokafka producer or consumer, as far as starting and stopping go."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


C = TypeVar("C", bound=_Client)

DEFAULT_STARTUP_TIMEOUT_S = 60.0   # KafkaConfig.startup_timeout_ms's default
DEFAULT_BROKER_TIMEOUT_S = 60.0    # KafkaConfig.broker_timeout_ms's default
_PROBE_EVERY_S = 1.0
_MAX_PROBE_S = 5.0


class KafkaUnavailable(PeerUnavailable):
    """No Kafka broker could be reached for longer than the configured bound.

    Attributes:
        servers: the bootstrap servers, as configured.
    """

    def __init__(self, message: str, *, servers: Any = None,
                 field: str = "kafka.bootstrap_servers", hint: str | None = None):
        self.servers = servers
        super().__init__(message, field=field, hint=hint)


def servers_text(servers: Any) -> str:
    return servers if isinstance(servers, str) else ",".join(map(str, servers))


async def start_client(make: Callable[[], C], servers: Any, *,
                       timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> C:
    """Build a client with ``make()`` and start it, retrying a fresh one while no broker
    answers, for up to ``timeout_s`` (see the module doc).

    Raises:
        KafkaUnavailable: no broker answered within ``timeout_s``; names the servers.
    """
    where = servers_text(servers)

    async def attempt() -> C:
        client = make()
        try:
            await client.start()
        except BaseException:
            await stop_client(client)
            raise
        return client

    def give_up(e: BaseException, attempts: int, spent: float) -> KafkaUnavailable:
        return KafkaUnavailable(
            f"cannot reach Kafka at {where}: {e or type(e).__name__} ({attempts} attempts in "
            f"{spent:.1f} s)", servers=servers,
            hint="is the broker running at that address? kafka.startup_timeout_ms bounds "
                 "how long a role waits for it at start")

    return await retry_startup(attempt, what=f"Kafka at {where}", timeout_s=timeout_s,
                               retry_on=(KafkaConnectionError, TimeoutError,
                                         asyncio.TimeoutError, OSError),
                               give_up=give_up)


async def stop_client(client: Any) -> None:
    """Stop an aiokafka producer or consumer.

    aiokafka 0.14's ``AIOKafkaConsumer.stop()`` raises a ``CancelledError`` of its own
    when a fetch was sleeping in its retry backoff (the broker is gone): it cancels that
    fetch and awaits it, and stops before closing its connections. That error is not a
    cancellation of the caller, so it is not passed on, and the connections are closed.
    """
    task = asyncio.current_task()
    try:
        await client.stop()
    except asyncio.CancelledError:
        cancelling = getattr(task, "cancelling", None)   # Python >= 3.11
        if cancelling is None or cancelling():
            raise
        log.debug("aiokafka's stop() raised its own CancelledError; closing the connections")
        inner = getattr(client, "_client", None)
        if inner is not None:
            await inner.close()


async def stop_producer(producer: Any, flush_timeout_s: float, servers: Any) -> bool:
    """Stop an aiokafka producer, waiting at most ``flush_timeout_s`` for what it holds
    to be delivered; returns False when records were left undelivered.

    ``AIOKafkaProducer.stop()`` alone waits for every pending record, forever when no
    broker answers: a role shutting down because the broker is gone would hang. So
    after the bound its sender task is stopped and the records still pending are failed
    with :class:`KafkaUnavailable` (their futures raise: a ``BatchProducer`` reports
    them, nothing is dropped silently), and then it stops.
    """
    delivered = False
    try:
        await wait_bounded(producer.flush(), flush_timeout_s)
        delivered = True
    except TimeoutError:
        pass
    finally:
        if not delivered:
            await _abandon(producer, flush_timeout_s, servers)
        await producer.stop()
    return delivered


async def _abandon(producer: Any, waited_s: float, servers: Any) -> None:
    """Stop aiokafka's sender task and fail what it still holds (aiokafka internals:
    cancelling the task alone would leave the records' futures pending for ever, and
    ``stop()`` would re-raise the task's cancellation if it were still running)."""
    sender = getattr(getattr(producer, "_sender", None), "sender_task", None)
    if sender is not None and not sender.done():
        sender.cancel()
        await asyncio.wait({sender}, timeout=5.0)
    producer._message_accumulator.fail_all(KafkaUnavailable(
        f"the producer stopped with records undelivered: no Kafka broker at "
        f"{servers_text(servers)} took them within {waited_s:g} s", servers=servers))


async def _probe(client: Any, topic: str) -> None:
    """One round trip to some broker (aiokafka's ``AIOKafkaClient``)."""
    request = MetadataRequest([topic], allow_auto_topic_creation=False)
    brokers = [b.nodeId for b in client.cluster.brokers()]
    error: BaseException | None = None
    for node_id in brokers:
        try:
            await client.send(node_id, request)
            return
        except (KafkaError, OSError) as e:
            error = e
    raise error or KafkaConnectionError("no broker is known")


class BrokerWatch:
    """Fails a waiting client once no broker has answered for ``timeout_s``.

    ``contact()`` records a sign of life (records fetched, a send acknowledged);
    ``await check(client, topic)``, called while the client waits, probes when due and
    raises :class:`KafkaUnavailable` when the brokers have been silent for too long.
    The bound: a broker that dies at ``t`` fails the check by ``t + timeout_s`` plus a
    probe interval and one probe (at most 5 s).
    """

    def __init__(self, servers: Any, timeout_s: float = DEFAULT_BROKER_TIMEOUT_S, *,
                 what: str = "Kafka client"):
        self.servers = servers
        self.timeout_s = timeout_s
        self.what = what
        self.probe_every_s = min(_PROBE_EVERY_S, timeout_s / 4)
        self._next_probe = time.monotonic() + self.probe_every_s
        self._down_since: float | None = None
        #: Times the brokers answered again after a probe had found none (a consumer
        #: checks its topic's identity after each: a broker can come back without its data).
        self.recoveries = 0

    def contact(self) -> None:
        self._next_probe = time.monotonic() + self.probe_every_s
        if self._down_since is not None:
            self.recoveries += 1
            log.info("%s: Kafka at %s answers again", self.what, servers_text(self.servers))
        self._down_since = None

    @property
    def down_s(self) -> float:
        """Seconds the brokers have not answered (0 while they do)."""
        return 0.0 if self._down_since is None else time.monotonic() - self._down_since

    async def check(self, client: Any, topic: str) -> None:
        """Probe a broker if none was heard from lately.

        Raises:
            KafkaUnavailable: probes have failed for ``timeout_s``.
        """
        now = time.monotonic()
        if now < self._next_probe:
            return
        self._next_probe = now + self.probe_every_s
        try:
            await wait_bounded(_probe(client, topic),
                               max(self.probe_every_s, min(_MAX_PROBE_S, self.timeout_s)))
        except (KafkaError, OSError, TimeoutError, asyncio.TimeoutError) as e:
            if self._down_since is None:
                self._down_since = now
                log.warning("%s: no Kafka broker at %s answers (%r); giving up after %g s",
                            self.what, servers_text(self.servers), e, self.timeout_s)
            down = time.monotonic() - self._down_since
            if down >= self.timeout_s:
                raise KafkaUnavailable(
                    f"{self.what}: no Kafka broker at {servers_text(self.servers)} answered "
                    f"for {down:.1f} s (last error: {e!r})", servers=self.servers,
                    hint="is the broker running? kafka.broker_timeout_ms bounds how long a "
                         "role waits for it") from e
            return
        self.contact()
