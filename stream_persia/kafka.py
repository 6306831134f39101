"""Kafka plumbing: static partition assignment, the samples consumer, producer and DLQ.

Partitions are shared by **static assignment from the replica index** (DESIGN §6):
partition ``p`` of the samples topic belongs to embedding worker ``p mod W``. We chose it
over a consumer group because a rebalance can move a partition in the middle of a batch
whose gradients are not applied yet, which breaks the consistent cut a checkpoint needs
(§7); with static assignment a restarted replica takes exactly its partitions back and
resumes at the checkpoint's offsets. :class:`SampleConsumer` therefore never subscribes
or joins a group (there is no option to), and ``group_id`` only *records* offsets when a
checkpoint calls :meth:`SampleConsumer.commit`: the checkpoint manifest is the source of
truth, the group's committed offsets are a courtesy for lag monitors. Nothing commits by
timer.

Samples topic records (written by :class:`BatchProducer`)::

    key     batch id as UTF-8 text (or absent)
    value   PersiaBatch.to_bytes()  (stream_persia.wire format, DESIGN §5)

Dead-letter records (``<samples topic>.dlq``, written by :class:`DeadLetterWriter`)::

    key     the original key
    value   the original bytes, unchanged
    headers persia-reason (UTF-8, at most 4 KiB), persia-source-topic,
            persia-source-partition, persia-source-offset (decimal text),
            persia-error-kind (only when known, e.g. "wire")

Brokers must accept messages of ``max_message_bytes`` (topic ``max.message.bytes``);
batches can be megabytes. snappy, lz4 and zstd compression come from ``cramjam`` (a
dependency); gzip runs at aiokafka's level 9 and is far slower.
Quirks of the test broker are listed in :mod:`stream_persia.testing.kafka_mock`.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaConnectionError, KafkaError
from aiokafka.structs import RecordMetadata

from stream_persia.errors import (
    Backpressure,
    BadInput,
    ConfigError,
    Misuse,
    PeerUnavailable,
    RemoteError,
    RemoteTimeout,
)
from stream_persia.sharding import static_partitions

__all__ = [
    "DEFAULT_FETCH_MAX_WAIT_MS", "DEFAULT_MAX_MESSAGE_BYTES", "COMPRESSION_TYPES",
    "partitions_for_replica", "topic_partitions",
    "validate_topic", "create_producer", "SampleConsumer", "BatchProducer",
    "DeadLetterWriter", "DeadLetter", "parse_dead_letter",
]

log = logging.getLogger(__name__)

DEFAULT_FETCH_MAX_WAIT_MS = 50
DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024  # KafkaConfig.max_batch_bytes's default
COMPRESSION_TYPES = (None, "gzip", "snappy", "lz4", "zstd")
_REQUEST_OVERHEAD_BYTES = 64 * 1024  # record batch + request headers around one message
_TOPIC_RE = re.compile(r"^[A-Za-z0-9._-]{1,249}$")
_MAX_REASON_BYTES = 4096
H_REASON, H_KIND = "persia-reason", "persia-error-kind"
H_TOPIC, H_PARTITION, H_OFFSET = ("persia-source-topic", "persia-source-partition",
                                  "persia-source-offset")


# ------------------------------------------------------------------- pure helpers

def partitions_for_replica(num_partitions: int, replica_index: int,
                           replica_size: int) -> list[int]:
    """Partitions owned by one embedding worker: every ``p`` with ``p % replica_size ==
    replica_index`` (:func:`stream_persia.sharding.static_partitions`), checked as flags.

    Raises:
        ConfigError: naming ``--replica-index``/``--replica-size`` when they are out of
            range, or when there are more replicas than partitions (a replica would idle).
    """
    _check_replica(replica_index, replica_size)
    if num_partitions < 1:
        raise ConfigError(f"kafka.samples_topic must have >= 1 partition, got {num_partitions}",
                          field="kafka.samples_topic")
    if replica_size > num_partitions:
        raise ConfigError(
            f"--replica-size {replica_size} exceeds the samples topic's {num_partitions} "
            "partitions, so some embedding workers would get no data",
            field="--replica-size",
            hint=f"run at most {num_partitions} embedding workers or add partitions")
    return static_partitions(num_partitions, replica_index, replica_size)


def _check_replica(replica_index: int, replica_size: int) -> None:
    if replica_size < 1:
        raise ConfigError(f"--replica-size must be >= 1, got {replica_size}",
                          field="--replica-size")
    if not 0 <= replica_index < replica_size:
        raise ConfigError(f"--replica-index must be in [0, {replica_size}), got "
                          f"{replica_index}", field="--replica-index")


def validate_topic(name: str, field_name: str = "kafka.samples_topic") -> str:
    """Return ``name`` if Kafka accepts it as a topic name, else raise ConfigError."""
    if not isinstance(name, str) or not _TOPIC_RE.match(name) or name in (".", ".."):
        raise ConfigError(f"{field_name} = {name!r} is not a valid Kafka topic name",
                          field=field_name,
                          hint="use 1-249 characters from [A-Za-z0-9._-]")
    return name


def _bootstrap(servers: str | Iterable[str]) -> str | list[str]:
    items = [servers] if isinstance(servers, str) else list(servers)
    hosts = [h.strip() for item in items for h in str(item).split(",") if h.strip()]
    if not hosts or not all(h.rpartition(":")[2].isdigit() for h in hosts):
        raise ConfigError(f"kafka.bootstrap_servers = {servers!r} is not a host:port list",
                          field="kafka.bootstrap_servers",
                          hint="e.g. 'kafka-0:9092,kafka-1:9092'")
    return hosts


def _client_kwargs(bootstrap_servers: str | Iterable[str],
                   security_kwargs: Mapping[str, Any] | None,
                   client_id: str | None) -> dict[str, Any]:
    kw = dict(security_kwargs or {})
    kw["bootstrap_servers"] = _bootstrap(bootstrap_servers)
    if client_id:
        kw["client_id"] = client_id
    return kw


def _config_servers(kafka: Any, bootstrap_servers: str | None) -> str:
    from stream_persia.config import resolve_bootstrap_servers

    servers = resolve_bootstrap_servers(kafka, bootstrap_servers)
    if servers is None:
        raise ConfigError("no Kafka bootstrap servers are configured",
                          field="kafka.bootstrap_servers",
                          hint="set kafka.bootstrap_servers, KAFKA_BOOTSTRAP_SERVERS or --kafka")
    return servers


async def _start_client(client: AIOKafkaProducer | AIOKafkaConsumer, servers: Any) -> None:
    try:
        await client.start()
    except KafkaConnectionError as e:
        await client.stop()
        raise PeerUnavailable(f"cannot reach Kafka at {servers}: {e}",
                              field="kafka.bootstrap_servers") from e


async def _partitions_of(consumer: AIOKafkaConsumer, topic: str) -> set[int]:
    # Metadata for *all* topics: asking for one by name makes brokers with auto-creation
    # (the mock among them) create it. consumer.topics() fetches the same but drops the
    # partitions, hence the client.
    cluster = await consumer._client.fetch_all_metadata()
    return cluster.partitions_for_topic(topic) or set()


async def topic_partitions(bootstrap_servers: str | Iterable[str], topic: str, *,
                           security_kwargs: Mapping[str, Any] | None = None) -> int:
    """Number of partitions of ``topic`` (0 if it does not exist); never creates it."""
    consumer = AIOKafkaConsumer(**_client_kwargs(bootstrap_servers, security_kwargs, None))
    await _start_client(consumer, bootstrap_servers)
    try:
        return len(await _partitions_of(consumer, topic))
    finally:
        await consumer.stop()


# ------------------------------------------------------------------------ producer

async def create_producer(bootstrap_servers: str | Iterable[str], *,
                          compression_type: str | None = None,
                          max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                          linger_ms: int = 5,
                          security_kwargs: Mapping[str, Any] | None = None,
                          client_id: str | None = "stream-persia",
                          **kwargs: Any) -> AIOKafkaProducer:
    """Start an idempotent ``acks=all`` producer sized for ``max_message_bytes`` messages.

    Raises:
        ConfigError: a bad compression type, size or address (names the field).
        PeerUnavailable: no broker answered.
    """
    if compression_type == "none":  # the config file's spelling
        compression_type = None
    if compression_type not in COMPRESSION_TYPES:
        raise ConfigError(f"kafka.compression_type = {compression_type!r}",
                          field="kafka.compression_type", hint=f"one of {COMPRESSION_TYPES}")
    if compression_type not in (None, "gzip"):
        from aiokafka import codec
        if not codec.has_zstd():  # one library (cramjam) brings snappy, lz4 and zstd
            raise ConfigError(f"kafka.compression_type = {compression_type!r} needs cramjam",
                              field="kafka.compression_type",
                              hint="pip install cramjam, or use 'gzip' or none")
    if max_message_bytes < 1024:
        raise ConfigError(f"kafka.max_batch_bytes = {max_message_bytes} is too small",
                          field="kafka.max_batch_bytes", hint="at least 1024")
    kw = _client_kwargs(bootstrap_servers, security_kwargs, client_id)
    kw.update(acks="all", enable_idempotence=True, compression_type=compression_type,
              linger_ms=linger_ms, max_request_size=max_message_bytes + _REQUEST_OVERHEAD_BYTES,
              max_batch_size=min(max_message_bytes, 1024 * 1024))
    kw.update(kwargs)
    producer = AIOKafkaProducer(**kw)
    await _start_client(producer, kw["bootstrap_servers"])
    return producer


def _encode_key(key: object) -> bytes | None:
    if key is None or isinstance(key, bytes):
        return key
    if isinstance(key, (bytearray, memoryview)):
        return bytes(key)
    if isinstance(key, (str, int)):
        return str(key).encode()
    raise BadInput(f"batch key of type {type(key).__name__}", field="key",
                   hint="bytes, str or int (the batch id)")


class _ProducerUser:
    """Owns an AIOKafkaProducer (or borrows one already started)."""

    def __init__(self, topic: str, *, bootstrap_servers: str | Iterable[str] | None,
                 producer: AIOKafkaProducer | None, send_timeout_s: float,
                 producer_kwargs: dict[str, Any]):
        self.topic = validate_topic(topic, "topic")
        if (bootstrap_servers is None) == (producer is None):
            raise Misuse("pass exactly one of bootstrap_servers and producer")
        self.send_timeout_s = send_timeout_s
        self._servers = bootstrap_servers
        self._producer = producer
        self._owns_producer = producer is None
        self._producer_kwargs = producer_kwargs
        self._closed = False

    async def start(self) -> None:
        if self._producer is None:
            assert self._servers is not None
            self._producer = await create_producer(self._servers, **self._producer_kwargs)

    def _live(self) -> AIOKafkaProducer:
        if self._closed or self._producer is None:
            raise Misuse(f"{type(self).__name__} for {self.topic!r} is not started or closed",
                         hint="await start() first (or use 'async with')")
        return self._producer

    async def close(self) -> None:
        """Flush what was sent, then stop the producer if this object started it."""
        if self._closed:
            return
        self._closed = True
        if self._producer is None:
            return
        if self._owns_producer:
            await self._producer.stop()  # aiokafka flushes pending batches first
        else:
            await self._producer.flush()

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()


class BatchProducer(_ProducerUser):
    """The data loader's Kafka sink: produces encoded batches with bounded in-flight sends.

    At most ``max_in_flight`` sends (and ``max_in_flight_bytes``, except that one message
    always fits) are unacknowledged at once; :meth:`send` waits for room, which slows the
    data loader, and raises :class:`Backpressure` after ``send_timeout_s``. A failed
    delivery is raised from the next :meth:`send` or :meth:`flush`.
    """

    def __init__(self, topic: str, *, bootstrap_servers: str | Iterable[str] | None = None,
                 producer: AIOKafkaProducer | None = None, max_in_flight: int = 64,
                 max_in_flight_bytes: int = 256 * 1024 * 1024, send_timeout_s: float = 60.0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, **producer_kwargs: Any):
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
        self._counts = dict(sent=0, acked=0, failed=0, bytes=0, waits=0, timeouts=0)

    @classmethod
    def from_config(cls, kafka: Any, *, bootstrap_servers: str | None = None,
                    **kwargs: Any) -> BatchProducer:
        """A producer for ``kafka.samples_topic`` (``kafka`` is a ``KafkaConfig``;
        ``bootstrap_servers`` overrides it as ``--kafka`` does)."""
        kwargs.setdefault("compression_type", kafka.compression_type)
        kwargs.setdefault("max_message_bytes", kafka.max_batch_bytes)
        kwargs.setdefault("security_kwargs", kafka.security_kwargs())
        return cls(kafka.samples_topic,
                   bootstrap_servers=_config_servers(kafka, bootstrap_servers), **kwargs)

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
                try:
                    if remaining <= 0:
                        raise asyncio.TimeoutError
                    await asyncio.wait_for(self._room.wait(), remaining)
                except asyncio.TimeoutError:
                    self._counts["timeouts"] += 1
                    raise Backpressure(
                        f"{self.in_flight} sends to {self.topic!r} stayed unacknowledged "
                        f"for {timeout_s} s", field="send_timeout_s",
                        hint="the brokers are slow or unreachable") from None
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
                ``batch_id`` is the key when ``key`` is None).
            key: the batch id (bytes, str or int).
            timeout_s: how long to wait for room (default ``send_timeout_s``).
        """
        producer = self._live()
        self._raise_delivery_error()
        if isinstance(batch, (bytes, bytearray, memoryview)):
            value = bytes(batch)
        elif hasattr(batch, "to_bytes"):
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
        key_bytes = _encode_key(key)
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
        """Wait until every queued batch is acknowledged; raises a failed delivery."""
        try:
            await asyncio.wait_for(self._live().flush(), timeout_s or self.send_timeout_s)
        except asyncio.TimeoutError:
            raise RemoteTimeout(f"flushing {self.in_flight} batches to {self.topic!r} took "
                                "too long", field="send_timeout_s") from None
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


class DeadLetter(NamedTuple):
    """A record read back from a dead-letter topic."""

    reason: str
    kind: str | None
    source_topic: str
    source_partition: int
    source_offset: int
    key: bytes | None
    value: bytes


def parse_dead_letter(record: ConsumerRecord) -> DeadLetter:
    """Decode the headers :class:`DeadLetterWriter` writes (BadInput if they are missing)."""
    headers = {k: v for k, v in (record.headers or ())}
    try:
        return DeadLetter(headers[H_REASON].decode(errors="replace"),
                          headers[H_KIND].decode() if H_KIND in headers else None,
                          headers[H_TOPIC].decode(), int(headers[H_PARTITION]),
                          int(headers[H_OFFSET]), record.key, record.value)
    except (KeyError, ValueError) as e:
        raise BadInput(f"record at {record.topic}/{record.partition}@{record.offset} is not a "
                       f"stream-persia dead letter ({e!r})", field="headers") from e


class DeadLetterWriter(_ProducerUser):
    """Sends undecodable or invalid samples to the dead-letter topic, with the reason.

    :meth:`write` never raises for broker trouble: it logs, counts and returns False, so
    a bad message can never stop the worker. False means "not confirmed within
    ``send_timeout_s``": the producer keeps retrying, so the record may still land.
    """

    def __init__(self, topic: str, *, bootstrap_servers: str | Iterable[str] | None = None,
                 producer: AIOKafkaProducer | None = None, send_timeout_s: float = 30.0,
                 **producer_kwargs: Any):
        super().__init__(topic, bootstrap_servers=bootstrap_servers, producer=producer,
                         send_timeout_s=send_timeout_s, producer_kwargs=producer_kwargs)
        self.written = 0
        self.failed = 0

    @classmethod
    def from_config(cls, kafka: Any, *, producer: AIOKafkaProducer | None = None,
                    bootstrap_servers: str | None = None, **kwargs: Any) -> DeadLetterWriter:
        """A writer for ``kafka.dlq_topic``, sharing ``producer`` when given."""
        if producer is not None:
            return cls(kafka.dlq_topic, producer=producer, **kwargs)
        kwargs.setdefault("security_kwargs", kafka.security_kwargs())
        kwargs.setdefault("max_message_bytes", kafka.max_batch_bytes)
        return cls(kafka.dlq_topic,
                   bootstrap_servers=_config_servers(kafka, bootstrap_servers), **kwargs)

    async def write(self, raw_value: bytes, reason: str, source: tuple[str, int, int], *,
                    key: bytes | None = None, kind: str | None = None) -> bool:
        """Dead-letter one message; ``source`` is its (topic, partition, offset)."""
        producer = self._live()
        topic, partition, offset = source
        headers = [(H_REASON, reason.encode(errors="replace")[:_MAX_REASON_BYTES]),
                   (H_TOPIC, str(topic).encode()), (H_PARTITION, str(int(partition)).encode()),
                   (H_OFFSET, str(int(offset)).encode())]
        if kind:
            headers.append((H_KIND, kind.encode()))
        try:
            await asyncio.wait_for(
                producer.send_and_wait(self.topic, bytes(raw_value), key=key, headers=headers),
                self.send_timeout_s)
        except (KafkaError, asyncio.TimeoutError, OSError) as e:
            self.failed += 1
            log.error("could not dead-letter %s/%s@%s (%s) to %r: %r", topic, partition,
                      offset, reason, self.topic, e)
            return False
        self.written += 1
        log.warning("dead-lettered %s/%s@%s to %r: %s", topic, partition, offset,
                    self.topic, reason)
        return True

    #: The keys of :meth:`stats` that only grow (all of them).
    COUNTERS = frozenset({"written", "failed"})

    def stats(self) -> dict[str, float]:
        return {"written": self.written, "failed": self.failed}


# ------------------------------------------------------------------------ consumer

class SampleConsumer:
    """One embedding worker's reader of the samples topic, by static assignment.

    Args:
        bootstrap_servers: brokers.
        topic: the samples topic (it must exist; it is never created here).
        replica_index, replica_size: this worker's place; it reads partitions
            ``p`` with ``p % replica_size == replica_index``.
        group_id: where :meth:`commit` records offsets; None makes commit a no-op.
        fetch_max_wait_ms: how long a broker may hold a fetch waiting for data.
        auto_offset_reset: "earliest" or "latest": where partitions without a stored
            offset start.
        metadata_timeout_s: how long :meth:`start` waits for the topic to exist.
        **consumer_kwargs: passed to ``AIOKafkaConsumer`` (not auto-commit settings).
    """

    def __init__(self, bootstrap_servers: str | Iterable[str], topic: str, *,
                 replica_index: int = 0, replica_size: int = 1, group_id: str | None = None,
                 fetch_max_wait_ms: int = DEFAULT_FETCH_MAX_WAIT_MS,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 auto_offset_reset: str = "earliest", metadata_timeout_s: float = 30.0,
                 expected_partitions: int | None = None,
                 security_kwargs: Mapping[str, Any] | None = None,
                 client_id: str | None = None,
                 **consumer_kwargs: Any):
        self.topic = validate_topic(topic)
        _check_replica(replica_index, replica_size)
        if auto_offset_reset not in ("earliest", "latest"):
            raise ConfigError(f"auto_offset_reset = {auto_offset_reset!r}",
                              field="auto_offset_reset", hint="'earliest' or 'latest'")
        if consumer_kwargs.get("enable_auto_commit"):
            raise ConfigError("enable_auto_commit=True", field="enable_auto_commit",
                              hint="offsets are committed only by checkpoints")
        self.replica_index, self.replica_size = replica_index, replica_size
        self.group_id = group_id
        self.auto_offset_reset = auto_offset_reset
        self.metadata_timeout_s = metadata_timeout_s
        self.expected_partitions = expected_partitions
        self._kwargs = _client_kwargs(bootstrap_servers, security_kwargs, client_id)
        self._kwargs.update(group_id=group_id, enable_auto_commit=False,
                            auto_offset_reset=auto_offset_reset,
                            fetch_max_wait_ms=fetch_max_wait_ms,
                            max_partition_fetch_bytes=max_message_bytes)
        self._kwargs.update(consumer_kwargs)
        self._consumer: AIOKafkaConsumer | None = None
        self._tps: dict[int, TopicPartition] = {}
        self.num_partitions = 0
        self._counts = dict(records=0, bytes=0, commits=0, commit_failures=0,
                            commits_skipped=0, offsets_lost=0)

    @classmethod
    def from_config(cls, kafka: Any, *, replica_index: int, replica_size: int,
                    group_id: str | None = "", bootstrap_servers: str | None = None,
                    **kwargs: Any) -> SampleConsumer:
        """A consumer of ``kafka.samples_topic`` for one replica.

        ``group_id`` defaults to ``<job_name>.embedding-workers``: it only records the
        checkpoint offsets for lag monitors (``kafka-consumer-groups --describe``); pass
        None to record nothing.
        """
        if group_id == "":
            group_id = f"{kafka.job_name}.embedding-workers"
        kwargs.setdefault("fetch_max_wait_ms", kafka.fetch_max_wait_ms)
        kwargs.setdefault("max_message_bytes", kafka.max_batch_bytes)
        kwargs.setdefault("expected_partitions", kafka.num_partitions)
        kwargs.setdefault("security_kwargs", kafka.security_kwargs())
        return cls(_config_servers(kafka, bootstrap_servers), kafka.samples_topic,
                   replica_index=replica_index, replica_size=replica_size,
                   group_id=group_id, **kwargs)

    @property
    def partitions(self) -> list[int]:
        """Partitions this replica owns (empty before :meth:`start`)."""
        return list(self._tps)

    def _live(self) -> AIOKafkaConsumer:
        if self._consumer is None:
            raise Misuse(f"SampleConsumer for {self.topic!r} is not started",
                         hint="await start() first (or use 'async with')")
        return self._consumer

    def _owned(self, partitions: Iterable[int] | None) -> list[TopicPartition]:
        if partitions is None:
            return list(self._tps.values())
        out = []
        for p in partitions:
            if p not in self._tps:
                raise Misuse(f"partition {p} of {self.topic!r} is not assigned to replica "
                             f"{self.replica_index}", field="partitions",
                             hint=f"this replica owns {sorted(self._tps)}")
            out.append(self._tps[p])
        return out

    async def start(self, start_offsets: Mapping[int, int] | None = None) -> None:
        """Assign this replica's partitions and seek.

        Args:
            start_offsets: partition -> next offset to read, from a checkpoint (other
                replicas' partitions are ignored). Partitions without one start at
                ``auto_offset_reset``; group-committed offsets are never used.

        Raises:
            ConfigError: the topic does not exist within ``metadata_timeout_s``, or has
                fewer partitions than replicas.
            BadInput: a stored offset is beyond the partition's end (wrong topic/cluster).
        """
        if self._consumer is not None:
            raise Misuse("SampleConsumer.start() called twice")
        consumer = AIOKafkaConsumer(**self._kwargs)
        await _start_client(consumer, self._kwargs["bootstrap_servers"])
        try:
            await self._assign_and_seek(consumer, dict(start_offsets or {}))
        except BaseException:
            await consumer.stop()
            raise
        self._consumer = consumer

    async def _assign_and_seek(self, consumer: AIOKafkaConsumer,
                               start_offsets: dict[int, int]) -> None:
        deadline = time.monotonic() + self.metadata_timeout_s
        while not (found := await _partitions_of(consumer, self.topic)):
            if time.monotonic() > deadline:
                raise ConfigError(f"topic {self.topic!r} does not exist",
                                  field="kafka.samples_topic",
                                  hint="create it with as many partitions as the parallelism"
                                       " you want")
            await asyncio.sleep(0.2)
        self.num_partitions = len(found)
        if self.expected_partitions not in (None, self.num_partitions):
            raise ConfigError(f"topic {self.topic!r} has {self.num_partitions} partitions, "
                              f"the config expects {self.expected_partitions}",
                              field="kafka.num_partitions",
                              hint="fix kafka.num_partitions or remove it to accept any count")
        bad = [p for p in start_offsets if not 0 <= p < self.num_partitions]
        if bad:
            raise BadInput(f"stored offsets name partitions {bad} but {self.topic!r} has "
                           f"{self.num_partitions}", field="start_offsets")
        owned = partitions_for_replica(self.num_partitions, self.replica_index,
                                       self.replica_size)
        self._tps = {p: TopicPartition(self.topic, p) for p in owned}
        tps = list(self._tps.values())
        consumer.assign(tps)
        begin = await consumer.beginning_offsets(tps)
        end = await consumer.end_offsets(tps)
        for p, tp in self._tps.items():
            offset = start_offsets.get(p)
            if offset is None:
                offset = begin[tp] if self.auto_offset_reset == "earliest" else end[tp]
            elif offset > end[tp]:
                raise BadInput(f"stored offset {offset} of {self.topic}/{p} is beyond its end "
                               f"{end[tp]}", field=f"start_offsets[{p}]",
                               hint="the checkpoint belongs to another topic or cluster")
            elif offset < begin[tp]:
                lost = begin[tp] - offset
                self._counts["offsets_lost"] += lost
                log.warning("%s/%d: offsets %d..%d were deleted by retention before they "
                            "were read; %d messages are lost", self.topic, p, offset,
                            begin[tp] - 1, lost)
                offset = begin[tp]
            consumer.seek(tp, offset)

    async def getmany(self, timeout_ms: int = 100,
                      max_records: int | None = None) -> dict[int, list[ConsumerRecord]]:
        """Records fetched so far (waits up to ``timeout_ms`` for some), by partition."""
        fetched = await self._live().getmany(timeout_ms=timeout_ms, max_records=max_records)
        out: dict[int, list[ConsumerRecord]] = {}
        for tp, records in fetched.items():
            if records:
                out[tp.partition] = records
                self._counts["records"] += len(records)
                self._counts["bytes"] += sum(r.serialized_value_size for r in records)
        return out

    def pause(self, partitions: Iterable[int] | None = None) -> None:
        """Stop fetching ``partitions`` (all owned ones when None) until resumed."""
        self._live().pause(*self._owned(partitions))

    def resume(self, partitions: Iterable[int] | None = None) -> None:
        self._live().resume(*self._owned(partitions))

    def paused(self) -> set[int]:
        return {tp.partition for tp in self._live().paused()}

    async def positions(self) -> dict[int, int]:
        """Next offset :meth:`getmany` will return, per owned partition."""
        consumer = self._live()
        return {p: await consumer.position(tp) for p, tp in self._tps.items()}

    async def end_offsets(self) -> dict[int, int]:
        """High watermark per owned partition."""
        end = await self._live().end_offsets(list(self._tps.values()))
        return {tp.partition: off for tp, off in end.items()}

    async def lag(self) -> dict[int, int]:
        """Messages not yet returned, per owned partition."""
        end, pos = await self.end_offsets(), await self.positions()
        return {p: max(0, end[p] - pos[p]) for p in self._tps}

    async def commit(self, offsets: Mapping[int, int]) -> bool:
        """Record checkpoint offsets in ``group_id`` (best effort; returns success)."""
        consumer = self._live()
        tps = self._owned(offsets)
        if self.group_id is None:
            self._counts["commits_skipped"] += 1
            return False
        try:
            await consumer.commit({tp: offsets[tp.partition] for tp in tps})
        except (KafkaError, OSError) as e:
            self._counts["commit_failures"] += 1
            log.warning("committing offsets of %r to group %r failed (the checkpoint still "
                        "holds them): %r", self.topic, self.group_id, e)
            return False
        self._counts["commits"] += 1
        return True

    async def committed(self) -> dict[int, int | None]:
        """Offsets last committed to ``group_id`` (None where there is none)."""
        consumer = self._live()
        if self.group_id is None:
            return dict.fromkeys(self._tps)
        return {p: await consumer.committed(tp) for p, tp in self._tps.items()}

    #: The keys of :meth:`stats` that only grow; ``partitions`` is a level.
    COUNTERS = frozenset({"records", "bytes", "commits", "commit_failures", "commits_skipped",
                          "offsets_lost"})

    def stats(self) -> dict[str, float]:
        """Counts and levels for metrics (``RoleMetrics.add_callback``; see :attr:`COUNTERS`)."""
        return {**self._counts, "partitions": len(self._tps)}

    async def stop(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            await consumer.stop()

    async def __aenter__(self) -> SampleConsumer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()
