"""The model update stream on Kafka: the topic ``<job>.model.updates``.

Partition ``i`` of ``S`` embedding servers carries server ``i``'s update log
(:mod:`stream_persia.server.updates`: ``reset``, ``tombstones``, ``rows``, ``mark``
messages, numbered by ``seq`` within one server process, its ``incarnation``); partition
``S`` carries the dense model (``dense`` messages: the chunks of one versioned blob and its
publisher's lineage, relayed by embedding server 0 as NN rank 0 publishes it:
:class:`stream_persia.server.updates.DenseRelay`). The topic needs ``S + 1`` partitions.

Records::

    key     "<shard>:<incarnation>:<seq>" (UTF-8)
    value   the message in the project's wire format (stream_persia.core.wire)

A reader keeps, per partition, the (incarnation, seq) it applied last: a record it has
applied already (a producer retry) is skipped, a gap in ``seq`` or a new incarnation
joined in the middle of its log makes it skip to the next ``reset`` (and ask the server
for a full pass), so nothing is applied twice and nothing is missed silently.

:class:`UpdateSink` produces a server's messages to its partition in order, waiting for
every acknowledgement; a failed send is retried from the first unacknowledged message on
the next call (the server keeps its log in memory meanwhile).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Iterable
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from stream_persia.config.kafka import resolve_bootstrap_servers, resolve_idempotence
from stream_persia.core import wire
from stream_persia.core.backoff import wait_bounded
from stream_persia.errors import BadInput, ConfigError, RemoteError
from stream_persia.kafka._client import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ProducerUser,
    topic_partitions,
    validate_topic,
)

__all__ = ["UpdateSink", "updates_topic", "record_key", "server_sink", "UPDATES_SUFFIX"]

log = logging.getLogger(__name__)

UPDATES_SUFFIX = ".model.updates"
#: Offsets of acknowledged messages remembered (for the checkpoint's positions).
OFFSETS_KEPT = 65_536


def updates_topic(job: str) -> str:
    """The update stream's topic of job ``job``."""
    return validate_topic(f"{job}{UPDATES_SUFFIX}", "kafka.job_name")


def record_key(msg: dict[str, Any]) -> bytes:
    return f"{msg['shard']}:{msg['incarnation']}:{msg['seq']}".encode()


class UpdateSink(ProducerUser):
    """Produces update messages to one partition of the update topic, in order.

    Args:
        topic: the update topic (:func:`updates_topic`).
        partition: the server's shard (or the shard count, for the dense model).
        bootstrap_servers / producer: as for the other producers of :mod:`stream_persia.kafka`.
    """

    def __init__(self, topic: str, partition: int, *,
                 bootstrap_servers: str | Iterable[str] | None = None,
                 producer: AIOKafkaProducer | None = None, send_timeout_s: float = 30.0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, **producer_kwargs: Any):
        if isinstance(partition, bool) or not isinstance(partition, int) or partition < 0:
            raise BadInput(f"partition must be an int >= 0, got {partition!r}",
                           field="partition")
        producer_kwargs["max_message_bytes"] = max_message_bytes
        super().__init__(topic, bootstrap_servers=bootstrap_servers, producer=producer,
                         send_timeout_s=send_timeout_s, producer_kwargs=producer_kwargs)
        self.partition = partition
        self.max_message_bytes = max_message_bytes
        self._offsets: collections.OrderedDict[tuple[str, int], int] = \
            collections.OrderedDict()
        self.last_offset: int | None = None
        self.counts = {"sent": 0, "bytes": 0, "failures": 0}

    async def publish(self, messages: list[dict[str, Any]], *,
                      partition: int | None = None) -> None:
        """Send ``messages`` in order and wait until the brokers have them all (to
        ``partition``, default the sink's: the dense model's go to the last one).

        Raises:
            RemoteError: a send failed or was not acknowledged (nothing after it was
                sent; call again with the messages from the first one not acknowledged).
            BadInput: a message does not fit ``max_message_bytes``.
        """
        producer = self._live()
        futures = []
        try:
            for msg in messages:
                value = wire.pack(msg)
                if len(value) > self.max_message_bytes:
                    raise BadInput(f"update message of {len(value)} bytes exceeds "
                                   f"max_message_bytes {self.max_message_bytes}",
                                   field="kafka.max_batch_bytes")
                futures.append((msg, await producer.send(
                    self.topic, value, key=record_key(msg),
                    partition=self.partition if partition is None else partition)))
                self.counts["bytes"] += len(value)
            for msg, fut in futures:
                meta = await wait_bounded(fut, self.send_timeout_s)
                if partition is None:   # the update log's positions (checkpoints)
                    self._remember(msg, meta.offset)
                self.counts["sent"] += 1
        except (KafkaError, TimeoutError) as e:
            self.counts["failures"] += 1
            raise RemoteError(f"cannot publish model updates to {self.topic!r} partition "
                              f"{self.partition}: {e!r}", field="kafka.bootstrap_servers") \
                from e

    def _remember(self, msg: dict[str, Any], offset: int) -> None:
        self._offsets[(str(msg["incarnation"]), int(msg["seq"]))] = offset
        while len(self._offsets) > OFFSETS_KEPT:
            self._offsets.popitem(last=False)
        self.last_offset = offset

    def offset_of(self, incarnation: str, seq: int) -> int | None:
        """A Kafka offset at or before message ``seq`` of ``incarnation`` (None: unknown,
        read the partition from its start)."""
        known = self._offsets.get((incarnation, seq))
        if known is not None:
            return known
        if self._offsets and seq > next(reversed(self._offsets))[1]:
            return None if self.last_offset is None else self.last_offset + 1
        return None


async def server_sink(gc: Any, replica_index: int, replica_size: int) -> UpdateSink | None:
    """The Kafka sink of an embedding server's update log when the job has brokers
    (``<job>.model.updates``, which needs a partition per server plus one), else None."""
    bootstrap = resolve_bootstrap_servers(gc.kafka, None)
    if not bootstrap or not gc.model_updates.enabled:
        return None
    topic = updates_topic(gc.kafka.job_name)
    have = await topic_partitions(bootstrap, topic, security_kwargs=gc.kafka.security_kwargs(),
                                  startup_timeout_s=gc.kafka.startup_timeout_ms / 1000)
    if have < replica_size + 1:
        raise ConfigError(f"the model update topic {topic!r} has {have} partition(s); "
                          f"{replica_size} embedding servers need {replica_size + 1}",
                          field="kafka.job_name",
                          hint=f"create {topic} with {replica_size + 1} partitions "
                               f"(stream-persia run does it)")
    return UpdateSink(topic, replica_index, bootstrap_servers=bootstrap,
                      security_kwargs=gc.kafka.security_kwargs(),
                      max_message_bytes=gc.kafka.max_batch_bytes,
                      startup_timeout_s=gc.kafka.startup_timeout_ms / 1000,
                      enable_idempotence=resolve_idempotence(gc.kafka))
