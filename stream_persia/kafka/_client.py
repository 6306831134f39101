"""Kafka clients: addresses, topic names, static partition assignment, topic metadata and
the producer every writer starts (idempotent unless ``kafka.enable_idempotence`` is off) (see :mod:`stream_persia.kafka`)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import (
    AuthenticationFailedError,
    KafkaConnectionError,
    KafkaError,
    SaslAuthenticationFailed,
)

from stream_persia.config.kafka import (
    TOPIC_HINT,
    TOPIC_RE,
    resolve_bootstrap_servers,
    resolve_idempotence,
)
from stream_persia.errors import BadInput, ConfigError, Misuse
from stream_persia.kafka.liveness import (
    DEFAULT_STARTUP_TIMEOUT_S,
    start_client,
    stop_client,
    stop_producer,
)
from stream_persia.kernels.sharding import static_partitions

log = logging.getLogger(__name__)

DEFAULT_FETCH_MAX_WAIT_MS = 50
DEFAULT_MAX_MESSAGE_BYTES = 1024 * 1024  # KafkaConfig.max_batch_bytes's default
COMPRESSION_TYPES = (None, "gzip", "snappy", "lz4", "zstd")
_REQUEST_OVERHEAD_BYTES = 64 * 1024  # record batch + request headers around one message
MAX_REASON_BYTES = 4096
H_REASON, H_KIND = "persia-reason", "persia-error-kind"
H_TOPIC, H_PARTITION, H_OFFSET = ("persia-source-topic", "persia-source-partition",
                                  "persia-source-offset")


def partitions_for_replica(num_partitions: int, replica_index: int,
                           replica_size: int) -> list[int]:
    """Partitions owned by one embedding worker: every ``p`` with ``p % replica_size ==
    replica_index`` (:func:`stream_persia.kernels.sharding.static_partitions`), checked as flags.

    Raises:
        ConfigError: naming ``--replica-index``/``--replica-size`` when they are out of
            range, or when there are more replicas than partitions (a replica would idle).
    """
    check_replica(replica_index, replica_size)
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


def check_replica(replica_index: int, replica_size: int) -> None:
    if replica_size < 1:
        raise ConfigError(f"--replica-size must be >= 1, got {replica_size}",
                          field="--replica-size")
    if not 0 <= replica_index < replica_size:
        raise ConfigError(f"--replica-index must be in [0, {replica_size}), got "
                          f"{replica_index}", field="--replica-index")


def validate_topic(name: str, field_name: str = "kafka.samples_topic") -> str:
    """Return ``name`` if Kafka accepts it as a topic name, else raise ConfigError."""
    if not isinstance(name, str) or not TOPIC_RE.fullmatch(name):
        raise ConfigError(f"{field_name} = {name!r} is not a valid Kafka topic name",
                          field=field_name,
                          hint=TOPIC_HINT)
    return name


def _bootstrap(servers: str | Iterable[str]) -> str | list[str]:
    items = [servers] if isinstance(servers, str) else list(servers)
    hosts = [h.strip() for item in items for h in str(item).split(",") if h.strip()]
    if not hosts or not all(h.rpartition(":")[2].isdigit() for h in hosts):
        raise ConfigError(f"kafka.bootstrap_servers = {servers!r} is not a host:port list",
                          field="kafka.bootstrap_servers",
                          hint="e.g. 'kafka-0:9092,kafka-1:9092'")
    return hosts


def client_kwargs(bootstrap_servers: str | Iterable[str],
                  security_kwargs: Mapping[str, Any] | None,
                  client_id: str | None) -> dict[str, Any]:
    kw = dict(security_kwargs or {})
    kw["bootstrap_servers"] = _bootstrap(bootstrap_servers)
    if client_id:
        kw["client_id"] = client_id
    return kw


def config_servers(kafka: Any, bootstrap_servers: str | None) -> str:
    servers = resolve_bootstrap_servers(kafka, bootstrap_servers)
    if servers is None:
        raise ConfigError("no Kafka bootstrap servers are configured",
                          field="kafka.bootstrap_servers",
                          hint="set kafka.bootstrap_servers, KAFKA_BOOTSTRAP_SERVERS or --kafka")
    return servers


async def partitions_of(consumer: AIOKafkaConsumer, topic: str) -> set[int]:
    # Metadata for *all* topics: asking for one by name makes brokers with auto-creation
    # (the mock among them) create it. consumer.topics() fetches the same but drops the
    # partitions, hence the client.
    cluster = await consumer._client.fetch_all_metadata()
    return cluster.partitions_for_topic(topic) or set()


async def topic_partitions(bootstrap_servers: str | Iterable[str], topic: str, *,
                           security_kwargs: Mapping[str, Any] | None = None,
                           startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S) -> int:
    """Number of partitions of ``topic`` (0 if it does not exist); never creates it.

    Raises:
        KafkaUnavailable: no broker answered within ``startup_timeout_s``.
    """
    kw = client_kwargs(bootstrap_servers, security_kwargs, None)
    consumer = await start_client(lambda: AIOKafkaConsumer(**kw), bootstrap_servers,
                                  timeout_s=startup_timeout_s)
    try:
        return len(await partitions_of(consumer, topic))
    finally:
        await stop_client(consumer)


# ------------------------------------------------------------------------ producer

async def create_producer(bootstrap_servers: str | Iterable[str], *,
                          compression_type: str | None = None,
                          max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                          linger_ms: int = 5,
                          security_kwargs: Mapping[str, Any] | None = None,
                          client_id: str | None = "stream-persia",
                          startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
                          enable_idempotence: bool | None = None,
                          **kwargs: Any) -> AIOKafkaProducer:
    """Start an ``acks=all`` producer sized for ``max_message_bytes`` messages.

    It is idempotent unless ``enable_idempotence`` is False (None: the environment's
    ``KAFKA_ENABLE_IDEMPOTENCE``, else true; see
    :func:`~stream_persia.config.kafka.resolve_idempotence`). Without idempotence a
    retried send may write its batch twice.

    Raises:
        ConfigError: a bad compression type, size or address (names the field); or the
            broker refused an idempotent producer (names ``kafka.enable_idempotence`` and
            how to turn it off).
        KafkaUnavailable: no broker answered within ``startup_timeout_s`` (a
            ``PeerUnavailable``).
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
    kw = client_kwargs(bootstrap_servers, security_kwargs, client_id)
    kw.update(acks="all", enable_idempotence=resolve_idempotence(None, enable_idempotence),
              compression_type=compression_type,
              linger_ms=linger_ms, max_request_size=max_message_bytes + _REQUEST_OVERHEAD_BYTES,
              max_batch_size=min(max_message_bytes, 1024 * 1024))
    kw.update(kwargs)
    try:
        return await start_client(lambda: AIOKafkaProducer(**kw), kw["bootstrap_servers"],
                                  timeout_s=startup_timeout_s)
    except KafkaError as e:
        if not kw["enable_idempotence"] or isinstance(e, _NOT_A_REFUSAL):
            raise
        raise idempotence_refused(bootstrap_servers, e) from e


# Errors an idempotent producer's start can meet that are not the broker refusing
# InitProducerId (the one request a plain producer's start does not make).
_NOT_A_REFUSAL = (KafkaConnectionError, AuthenticationFailedError, SaslAuthenticationFailed)
IDEMPOTENCE_HINT = ("if this broker cannot give producers an id (Tansu 0.6 refuses "
                    "InitProducerId), turn producer idempotence off: "
                    "kafka.enable_idempotence: false in global_config.yml, "
                    "KAFKA_ENABLE_IDEMPOTENCE=false, or stream-persia run "
                    "--no-kafka-idempotence (a retried send may then write a batch twice)")


def idempotence_refused(servers: Any, error: BaseException) -> ConfigError:
    """The error for a broker that refused to start an idempotent producer."""
    where = servers if isinstance(servers, str) else ",".join(map(str, servers))
    return ConfigError(f"the Kafka broker at {where} refused an idempotent producer "
                       f"(InitProducerId failed: {error!r})", field="kafka.enable_idempotence",
                       hint=IDEMPOTENCE_HINT)


def encode_key(key: object) -> bytes | None:
    if key is None or isinstance(key, bytes):
        return key
    if isinstance(key, (bytearray, memoryview)):
        return bytes(key)
    if isinstance(key, (str, int)):
        return str(key).encode()
    raise BadInput(f"batch key of type {type(key).__name__}", field="key",
                   hint="bytes, str or int (the batch id)")


class ProducerUser:
    """Owns an AIOKafkaProducer (or borrows one already started): the producer handling
    that BatchProducer and DeadLetterWriter share."""

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
        """Flush what was sent, then stop the producer if this object started it; waits
        at most ``send_timeout_s`` for the brokers to take what is pending (records
        still pending then fail)."""
        if self._closed:
            return
        self._closed = True
        if self._producer is None:
            return
        if self._owns_producer:
            if not await stop_producer(self._producer, self.send_timeout_s,
                                       self._servers):
                log.error("%s for %r: records were still undelivered after %g s when it "
                          "stopped", type(self).__name__, self.topic, self.send_timeout_s)
        else:
            await self._producer.flush()

    async def __aenter__(self):
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()
