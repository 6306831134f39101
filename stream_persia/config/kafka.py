"""The ``kafka`` section of ``global_config.yml`` (stream-persia's own; PERSIA used NATS).

Partition assignment is **static by replica index**: embedding worker ``i`` of ``W``
consumes partitions ``p`` with ``p % W == i`` (:func:`stream_persia.kernels.sharding.
static_partitions`). There is no consumer group: offsets are committed only inside a
checkpoint (exactly once, with the embeddings they produced), a restarted replica takes
its own partitions back, and no rebalance can move a partition in the middle of a batch.
A ``consumer_group``/``group_id`` key is therefore refused rather than ignored.

Bootstrap servers are resolved by :func:`resolve_bootstrap_servers` with the precedence
explicit argument (CLI ``--kafka``) > environment ``KAFKA_BOOTSTRAP_SERVERS`` > file. None
everywhere means the embedded, broker-less mode (DESIGN §8). Producer idempotence
(``enable_idempotence``) is resolved the same way by :func:`resolve_idempotence`: explicit
argument (``run --no-kafka-idempotence``) > environment ``KAFKA_ENABLE_IDEMPOTENCE`` > file.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from stream_persia.config._base import (
    check_bool,
    check_choice,
    check_int,
    check_str,
    error,
    parse_addresses,
    section_to_dict,
)
from stream_persia.config.files import read_secret_file
from stream_persia.core.switches import parse_switch
from stream_persia.errors import ConfigError, Misuse

log = logging.getLogger(__name__)
#: overrides already logged (:func:`_overrides`); a process resolves a handful at most
_WARNED: set[tuple[object, ...]] = set()

__all__ = ["KafkaConfig", "resolve_bootstrap_servers", "resolve_idempotence",
           "parse_switch", "ENV_KAFKA_BOOTSTRAP_SERVERS", "ENV_KAFKA_ENABLE_IDEMPOTENCE"]

ENV_KAFKA_BOOTSTRAP_SERVERS = "KAFKA_BOOTSTRAP_SERVERS"
ENV_KAFKA_ENABLE_IDEMPOTENCE = "KAFKA_ENABLE_IDEMPOTENCE"

COMPRESSION_TYPES = ("none", "gzip", "snappy", "lz4", "zstd")
ON_DATA_LOSS = ("fail", "skip")  # kafka.on_data_loss: see stream_persia.kafka.loss
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
# OAUTHBEARER needs a token-provider object, which a YAML file cannot hold.
SASL_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "GSSAPI")
# The topic names Kafka accepts: 1-249 of these characters, but not "." or "..". Use it
# with fullmatch (a "$" would let a trailing newline through); stream_persia.kafka does.
TOPIC_RE = re.compile(r"(?!\.\.?\Z)[A-Za-z0-9._-]{1,249}")
TOPIC_HINT = "use 1-249 characters from a-z A-Z 0-9 . _ - (not . or .. alone)"
_STATIC = ("stream-persia assigns partitions statically by replica index (partition p goes "
           "to embedding worker p mod W) and commits offsets only with checkpoints, so there "
           "is no consumer group to configure: remove it")


def _check_topic(obj: Any, name: str) -> None:
    check_str(obj, name)
    value = getattr(obj, name)
    if not TOPIC_RE.fullmatch(value):
        raise error(name, f"{value!r} is not a valid Kafka topic name", TOPIC_HINT)


@dataclass(frozen=True)
class KafkaConfig:
    """Kafka data plane.

    Args:
        bootstrap_servers: ``host:port[,host:port]``; None = embedded mode (no broker).
        job_name: names the topics by default; Kafka topic characters only.
        samples_topic: default ``<job_name>.samples``.
        dlq_topic: undecodable/invalid messages with the reason; default
            ``<samples_topic>.dlq``.
        num_partitions: expected partitions of the samples topic; None = read from the
            broker's metadata (topics are never created by stream-persia).
        compression_type: none|gzip|snappy|lz4|zstd (snappy, lz4 and zstd come from
            ``cramjam``, a dependency; its presence is checked here).
        security_protocol: PLAINTEXT|SSL|SASL_PLAINTEXT|SASL_SSL.
        sasl_mechanism: PLAIN|SCRAM-SHA-256|SCRAM-SHA-512|GSSAPI (SASL_* only; default
            PLAIN).
        sasl_username, sasl_password, sasl_password_file: credentials for PLAIN/SCRAM;
            the password either inline or read from a file (a mounted secret).
        ssl_cafile, ssl_certfile, ssl_keyfile: PEM files for SSL/SASL_SSL (cert and key
            for mutual TLS).
        fetch_max_wait_ms: longest a fetch waits for data (50 cuts end-to-end latency to
            ~17 ms against ~365 ms with the client default of 500).
        max_batch_bytes: largest encoded batch a producer sends (the broker's
            ``message.max.bytes`` must allow it).
        on_data_loss: fail|skip: what an embedding worker does when offsets of the samples
            topic are gone before it read them (retention, a gap between records, a
            truncated log, a checkpoint's offset below the log start). ``fail`` (default)
            stops that partition and reports it (metrics, ``status``, ``/v1/status``, an
            error log); checkpoints never record offsets past the loss. ``skip`` accepts
            the loss: counted per partition and logged (see
            :mod:`stream_persia.kafka.loss`).
        startup_timeout_ms: how long a Kafka client (embedding worker, data loader) keeps
            trying to reach a broker when it starts (exponential backoff, each attempt
            logged); then it fails naming the bootstrap servers.
        broker_timeout_ms: how long a running consumer or producer may go without any
            broker answering before it fails naming the bootstrap servers (aiokafka
            itself would retry forever).
        enable_idempotence: every producer stream-persia starts (data loaders, dead-letter
            writers, the model update stream) is idempotent (default true): the broker
            drops a batch a producer retries after it had already written it. Off, a
            retry (a lost acknowledgement, a broker restart) may write a batch twice,
            and the embedding workers then train on it twice. Turn it off only for a
            broker that refuses idempotent producers (Tansu 0.6 refuses aiokafka's
            InitProducerId); the environment variable ``KAFKA_ENABLE_IDEMPOTENCE``
            (true/false) overrides the file.
    """

    bootstrap_servers: str | None = None
    job_name: str = "persia"
    samples_topic: str | None = None
    dlq_topic: str | None = None
    num_partitions: int | None = None
    compression_type: str = "none"
    security_protocol: str = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = field(default=None, repr=False)
    sasl_password_file: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    fetch_max_wait_ms: int = 50
    max_batch_bytes: int = 1_048_576
    on_data_loss: str = "fail"
    startup_timeout_ms: int = 60_000
    broker_timeout_ms: int = 60_000
    enable_idempotence: bool = True

    _REJECTED: ClassVar[dict[str, str]] = {
        k: _STATIC for k in ("consumer_group", "group_id", "group", "consumer_group_id",
                             "group_instance_id", "partition_assignment_strategy")
    } | {k: "offsets are committed only as part of a checkpoint, never by timer: remove it"
         for k in ("enable_auto_commit", "auto_commit", "auto_commit_interval_ms")}
    _SECRETS: ClassVar[tuple[str, ...]] = ("sasl_password",)

    def __post_init__(self) -> None:
        servers = parse_addresses(self.bootstrap_servers, "bootstrap_servers")
        if servers is None and self.bootstrap_servers is not None:
            # "" (an unexpanded ${KAFKA}, say) would silently mean the broker-less mode.
            raise error("bootstrap_servers", f"is empty ({self.bootstrap_servers!r})",
                        "name the brokers (host:port[,host:port...]), or write null or "
                        "remove the key for the embedded, broker-less mode")
        object.__setattr__(self, "bootstrap_servers", servers)
        _check_topic(self, "job_name")
        if self.samples_topic is None:
            object.__setattr__(self, "samples_topic", f"{self.job_name}.samples")
        _check_topic(self, "samples_topic")
        if self.dlq_topic is None:
            object.__setattr__(self, "dlq_topic", f"{self.samples_topic}.dlq")
        _check_topic(self, "dlq_topic")
        if self.dlq_topic == self.samples_topic:
            raise error("dlq_topic", f"is the samples topic {self.samples_topic!r}",
                        "dead letters need their own topic, e.g. <samples_topic>.dlq")
        check_int(self, "num_partitions", lo=1, hi=1_000_000, optional=True)
        check_choice(self, "compression_type", COMPRESSION_TYPES)
        self._check_codec()
        check_choice(self, "security_protocol", SECURITY_PROTOCOLS)
        check_int(self, "fetch_max_wait_ms", lo=0, hi=300_000)
        check_int(self, "max_batch_bytes", lo=1024, hi=1 << 31)
        check_choice(self, "on_data_loss", ON_DATA_LOSS)
        check_int(self, "startup_timeout_ms", lo=0, hi=86_400_000,
                  hint="0 tries once; e.g. 60000 waits up to a minute for the brokers")
        check_int(self, "broker_timeout_ms", lo=1000, hi=86_400_000)
        check_bool(self, "enable_idempotence",
                   hint="false only for a broker that refuses idempotent producers (a "
                        "retry may then duplicate a batch)")
        for name in ("sasl_username", "sasl_password", "sasl_password_file", "ssl_cafile",
                     "ssl_certfile", "ssl_keyfile"):
            check_str(self, name, optional=True)
        self._check_security()

    def _check_codec(self) -> None:
        if self.compression_type in ("none", "gzip"):
            return
        try:
            from aiokafka import codec
        except ImportError:  # aiokafka is a dependency; without it nothing produces anyway
            return
        if not getattr(codec, f"has_{self.compression_type}")():
            # aiokafka's snappy, lz4 and zstd all come from cramjam, a dependency.
            raise error("compression_type", f"{self.compression_type!r} needs the "
                        "'cramjam' package, which is not installed",
                        "pip install cramjam (stream-persia depends on it), or use gzip "
                        "or none")

    def _check_security(self) -> None:
        sasl = self.security_protocol.startswith("SASL_")
        ssl = self.security_protocol.endswith("SSL")
        if not sasl:
            for name in ("sasl_mechanism", "sasl_username", "sasl_password",
                         "sasl_password_file"):
                if getattr(self, name) is not None:
                    raise error(name, f"is set but security_protocol is "
                                f"{self.security_protocol}",
                                "use SASL_SSL or SASL_PLAINTEXT, or remove it")
        if not ssl:
            for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
                if getattr(self, name) is not None:
                    raise error(name, f"is set but security_protocol is "
                                f"{self.security_protocol}", "use SSL or SASL_SSL, or remove it")
        if (self.ssl_certfile is None) != (self.ssl_keyfile is None):
            missing = "ssl_keyfile" if self.ssl_keyfile is None else "ssl_certfile"
            raise error(missing, "is missing: mutual TLS needs both ssl_certfile and "
                        "ssl_keyfile")
        if not sasl:
            return
        if self.sasl_mechanism is None:
            object.__setattr__(self, "sasl_mechanism", "PLAIN")
        check_choice(self, "sasl_mechanism", SASL_MECHANISMS)
        if self.sasl_password is not None and self.sasl_password_file is not None:
            raise error("sasl_password_file", "is given together with sasl_password",
                        "keep one of them")
        if self.sasl_mechanism != "GSSAPI":
            if self.sasl_username is None:
                raise error("sasl_username", f"is required by sasl_mechanism "
                            f"{self.sasl_mechanism}")
            if self.sasl_password is None and self.sasl_password_file is None:
                raise error("sasl_password", f"is required by sasl_mechanism "
                            f"{self.sasl_mechanism}",
                            "set sasl_password, or sasl_password_file to a mounted secret")

    @property
    def embedded(self) -> bool:
        """True when no broker is configured (in this section alone; see
        :func:`resolve_bootstrap_servers` for the environment and CLI)."""
        return self.bootstrap_servers is None

    def read_sasl_password(self) -> str | None:
        """The SASL password, from the file when ``sasl_password_file`` is set."""
        if self.sasl_password_file is None:
            return self.sasl_password
        return read_secret_file(self.sasl_password_file, "kafka.sasl_password_file",
                                "write the password into the file")

    def security_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for aiokafka's producer and consumer (security only)."""
        kw: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.security_protocol.endswith("SSL"):
            from aiokafka.helpers import create_ssl_context

            kw["ssl_context"] = create_ssl_context(
                cafile=self.ssl_cafile, certfile=self.ssl_certfile, keyfile=self.ssl_keyfile)
        if self.security_protocol.startswith("SASL_"):
            kw["sasl_mechanism"] = self.sasl_mechanism
            if self.sasl_mechanism != "GSSAPI":
                kw["sasl_plain_username"] = self.sasl_username
                kw["sasl_plain_password"] = self.read_sasl_password()
        return kw

    def to_dict(self, *, redact: bool = False) -> dict[str, Any]:
        """The section's mapping with resolved topic names; ``redact`` blanks secrets."""
        return section_to_dict(self, redact, self._SECRETS)


def resolve_bootstrap_servers(config: Any = None, cli_value: str | None = None) -> str | None:
    """Bootstrap servers to use: ``cli_value`` > env ``KAFKA_BOOTSTRAP_SERVERS`` > file.

    Args:
        config: a ``GlobalConfig``, a :class:`KafkaConfig` or None.
        cli_value: an explicit address (``--kafka``); None or "" when not given.

    Returns:
        The normalised ``host:port[,...]`` string, or None for the embedded mode.
    """
    kafka = _kafka_section(config)
    in_file = kafka.bootstrap_servers if kafka is not None else None
    explicit = parse_addresses(cli_value, "--kafka") if cli_value else None
    if explicit:
        _overrides("--kafka", explicit, "kafka.bootstrap_servers", in_file)
        return explicit
    env = os.environ.get(ENV_KAFKA_BOOTSTRAP_SERVERS, "")
    if env.strip():
        try:
            servers = parse_addresses(env, ENV_KAFKA_BOOTSTRAP_SERVERS)
        except ConfigError as err:
            raise ConfigError(f"environment {err.message}", field=ENV_KAFKA_BOOTSTRAP_SERVERS,
                              hint=err.hint) from None
        _overrides(f"environment {ENV_KAFKA_BOOTSTRAP_SERVERS}", servers,
                   "kafka.bootstrap_servers", in_file)
        return servers
    return in_file


def _overrides(what: str, value: object, key: str, in_file: object) -> None:
    """Say so when a flag or the environment overrides a different value of the global
    config (it wins by design, but a file that reads one way and runs another is a trap)."""
    seen = (value, key, in_file)   # not ``what``: a value resolved once is passed on
    if in_file is not None and value != in_file and seen not in _WARNED:
        _WARNED.add(seen)   # once per process: several clients resolve the same values
        log.warning("%s = %r overrides %s = %r of the global config", what, value, key,
                    in_file)


def resolve_idempotence(config: Any = None, explicit: bool | None = None) -> bool:
    """Whether producers are idempotent: ``explicit`` > env ``KAFKA_ENABLE_IDEMPOTENCE`` >
    the file's ``kafka.enable_idempotence`` > true.

    Args:
        config: a ``GlobalConfig``, a :class:`KafkaConfig` or None.
        explicit: a value given in code or by a flag; None when not given.
    """
    kafka = _kafka_section(config)
    in_file = kafka.enable_idempotence if kafka is not None else None
    if explicit is not None:
        return bool(explicit)
    env = os.environ.get(ENV_KAFKA_ENABLE_IDEMPOTENCE, "")
    if env.strip():
        value = parse_switch(env, ENV_KAFKA_ENABLE_IDEMPOTENCE)
        _overrides(f"environment {ENV_KAFKA_ENABLE_IDEMPOTENCE}", value,
                   "kafka.enable_idempotence", in_file)
        return value
    return in_file if in_file is not None else True


def _kafka_section(config: Any) -> KafkaConfig | None:
    """The :class:`KafkaConfig` of ``config`` (a ``GlobalConfig``, a KafkaConfig or None)."""
    kafka = getattr(config, "kafka", config)
    if kafka is not None and not isinstance(kafka, KafkaConfig):
        raise Misuse(f"config must be a GlobalConfig, KafkaConfig or None, got "
                     f"{type(config).__name__}", field="config")
    return kafka
