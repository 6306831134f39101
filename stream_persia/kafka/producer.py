"""Producers of the samples topic (:class:`BatchProducer`; see :mod:`stream_persia.kafka`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterable
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError
from aiokafka.structs import RecordMetadata

from stream_persia.config.kafka import resolve_idempotence
from stream_persia.core.backoff import wait_bounded
from stream_persia.core.data import PersiaBatch
from stream_persia.errors import (
    Backpressure,
    BadInput,
    ConfigError,
    RemoteError,
    RemoteTimeout,
)
from stream_persia.kafka._client import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ProducerUser,
    config_servers,
    encode_key,
)
from stream_persia.kafka.liveness import DEFAULT_BROKER_TIMEOUT_S, BrokerWatch

log = logging.getLogger(__name__)


class BatchProducer(ProducerUser):
    """The data loader's Kafka sink: produces encoded batches with bounded in-flight sends.

    At most ``max_in_flight`` sends (and ``max_in_flight_bytes``, except that one message
    always fits) are unacknowledged at once; :meth:`send` waits for room, which slows the
    data loader, and raises :class:`Backpressure` after ``send_timeout_s``. A failed
    delivery is raised from the next :meth:`send` or :meth:`flush`.

    While :meth:`send` or :meth:`flush` waits, the brokers are watched
    (:class:`~stream_persia.kafka.liveness.BrokerWatch`): when none has answered for
    ``broker_timeout_s`` they raise
    :class:`~stream_persia.kafka.liveness.KafkaUnavailable` naming the bootstrap servers,
    however long ``send_timeout_s`` is. ``startup_timeout_s`` bounds how long
    :meth:`start` keeps trying to reach a broker.
    """

    def __init__(self, topic: str, *, bootstrap_servers: str | Iterable[str] | None = None,
                 producer: AIOKafkaProducer | None = None, max_in_flight: int = 64,
                 max_in_flight_bytes: int = 256 * 1024 * 1024, send_timeout_s: float = 60.0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 broker_timeout_s: float = DEFAULT_BROKER_TIMEOUT_S, **producer_kwargs: Any):
        if max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be >= 1, got {max_in_flight}",
                              field="max_in_flight")
        producer_kwargs["max_message_bytes"] = max_message_bytes
        super().__init__(topic, bootstrap_servers=bootstrap_servers, producer=producer,
                         send_timeout_s=send_timeout_s, producer_kwargs=producer_kwargs)
        self.max_in_flight = max_in_flight
        self.max_in_flight_bytes = max_in_flight_bytes
        self.max_message_bytes = max_message_bytes
        self.in_flight = 0
        self.in_flight_bytes = 0
        self.peak_in_flight = 0
        self._room = asyncio.Event()
        self._error: BaseException | None = None
        self._watch = BrokerWatch(bootstrap_servers if bootstrap_servers is not None else
                                  "the shared producer's brokers", broker_timeout_s,
                                  what=f"producer of {topic!r}")
        self._counts = dict(sent=0, acked=0, failed=0, bytes=0, waits=0, timeouts=0)

    @classmethod
    def from_config(cls, kafka: Any, *, bootstrap_servers: str | None = None,
                    **kwargs: Any) -> BatchProducer:
        """A producer for ``kafka.samples_topic`` (``kafka`` is a ``KafkaConfig``;
        ``bootstrap_servers`` overrides it as ``--kafka`` does)."""
        kwargs.setdefault("compression_type", kafka.compression_type)
        kwargs.setdefault("enable_idempotence", resolve_idempotence(kafka))
        kwargs.setdefault("max_message_bytes", kafka.max_batch_bytes)
        kwargs.setdefault("security_kwargs", kafka.security_kwargs())
        kwargs.setdefault("startup_timeout_s", kafka.startup_timeout_ms / 1000)
        kwargs.setdefault("broker_timeout_s", kafka.broker_timeout_ms / 1000)
        return cls(kafka.samples_topic,
                   bootstrap_servers=config_servers(kafka, bootstrap_servers), **kwargs)

    def _has_room(self, size: int) -> bool:
        return self.in_flight == 0 or (self.in_flight < self.max_in_flight and
                                       self.in_flight_bytes + size <= self.max_in_flight_bytes)

    async def _reserve(self, size: int, timeout_s: float) -> None:
        if not self._has_room(size):
            self._counts["waits"] += 1
            deadline = time.monotonic() + timeout_s
            while not self._has_room(size):
                self._room.clear()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._counts["timeouts"] += 1
                    raise Backpressure(
                        f"{self.in_flight} sends to {self.topic!r} stayed unacknowledged "
                        f"for {timeout_s} s", field="send_timeout_s",
                        hint="the brokers are slow or unreachable")
                try:
                    await wait_bounded(self._room.wait(),
                                       min(remaining, self._watch.probe_every_s))
                except TimeoutError:
                    await self._watch.check(self._live().client, self.topic)
        self.in_flight += 1
        self.in_flight_bytes += size
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)

    def _release(self, size: int) -> None:
        self.in_flight -= 1
        self.in_flight_bytes -= size
        self._room.set()

    def _raise_delivery_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise RemoteError(f"delivery to {self.topic!r} failed: {err!r}",
                              field="kafka.bootstrap_servers") from err

    async def send(self, batch: Any, *, key: object = None,
                   timeout_s: float | None = None) -> asyncio.Future[RecordMetadata]:
        """Queue one batch; returns a future for its delivery.

        Args:
            batch: encoded bytes, or a ``PersiaBatch`` (encoded with ``to_bytes()``; its
                ``batch_id`` is the key when ``key`` is None; without an ``event_time``
                it goes with this process's clock, as ``DataCtx`` sends it).
            key: the batch id (bytes, str or int).
            timeout_s: how long to wait for room (default ``send_timeout_s``).
        """
        producer = self._live()
        self._raise_delivery_error()
        if isinstance(batch, (bytes, bytearray, memoryview)):
            value = bytes(batch)
        elif hasattr(batch, "to_bytes"):
            if isinstance(batch, PersiaBatch):
                batch = batch.stamped(time.time())
            value = batch.to_bytes()
            if key is None:
                key = getattr(batch, "batch_id", None)
        else:
            raise BadInput(f"cannot send a {type(batch).__name__}", field="batch",
                           hint="a PersiaBatch or its to_bytes()")
        if len(value) > self.max_message_bytes:
            raise BadInput(f"batch of {len(value)} bytes exceeds max_message_bytes "
                           f"{self.max_message_bytes}", field="batch",
                           hint="send smaller batches or raise kafka.max_batch_bytes "
                                "(and the topic's max.message.bytes)")
        key_bytes = encode_key(key)
        size = len(value)
        await self._reserve(size, self.send_timeout_s if timeout_s is None else timeout_s)
        try:
            fut = await producer.send(self.topic, value, key=key_bytes)
        except KafkaError as e:
            self._release(size)
            raise RemoteError(f"cannot send to {self.topic!r}: {e!r}",
                              field="kafka.samples_topic") from e
        except BaseException:
            self._release(size)
            raise
        self._counts["sent"] += 1
        self._counts["bytes"] += size
        fut.add_done_callback(lambda f: self._on_delivered(f, size))
        return fut

    def _on_delivered(self, fut: asyncio.Future[RecordMetadata], size: int) -> None:
        self._release(size)
        if fut.cancelled():
            exc: BaseException | None = asyncio.CancelledError()
        else:
            exc = fut.exception()
        if exc is None:
            self._counts["acked"] += 1
            self._watch.contact()
            return
        self._counts["failed"] += 1
        log.error("delivery of a batch to %r failed: %r", self.topic, exc)
        if self._error is None:
            self._error = exc

    async def send_and_wait(self, batch: Any, *, key: object = None,
                            timeout_s: float | None = None) -> RecordMetadata:
        """Like :meth:`send`, then wait until the brokers acknowledge it."""
        fut = await self.send(batch, key=key, timeout_s=timeout_s)
        try:
            return await fut
        finally:
            self._error = None  # the caller sees this failure directly

    async def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every queued batch is acknowledged; raises a failed delivery.

        Raises:
            RemoteTimeout: not all acknowledged within ``timeout_s`` (default
                ``send_timeout_s``).
            KafkaUnavailable: no broker answered for ``broker_timeout_s`` meanwhile.
        """
        producer = self._live()
        deadline = time.monotonic() + (timeout_s or self.send_timeout_s)
        flushing = asyncio.ensure_future(producer.flush())
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise RemoteTimeout(f"flushing {self.in_flight} batches to {self.topic!r} "
                                        "took too long", field="send_timeout_s")
                done, _ = await asyncio.wait(
                    {flushing}, timeout=min(remaining, self._watch.probe_every_s))
                if done:
                    flushing.result()
                    break
                await self._watch.check(producer.client, self.topic)
        finally:
            if not flushing.done():
                flushing.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await flushing
        self._raise_delivery_error()

    async def close(self) -> None:
        """Flush and stop; raises if a batch could not be delivered."""
        await super().close()
        self._raise_delivery_error()

    #: The keys of :meth:`stats` that only grow; ``in_flight``, ``in_flight_bytes`` and
    #: ``peak_in_flight`` (a high-water mark) are levels.
    COUNTERS = frozenset({"sent", "acked", "failed", "bytes", "waits", "timeouts"})

    def stats(self) -> dict[str, float]:
        """Counts and levels for metrics (``RoleMetrics.add_callback``; see :attr:`COUNTERS`)."""
        return {**self._counts, "in_flight": self.in_flight,
                "in_flight_bytes": self.in_flight_bytes, "peak_in_flight": self.peak_in_flight}
