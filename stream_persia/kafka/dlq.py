"""The dead-letter topic: :class:`DeadLetterWriter` and :func:`parse_dead_letter` (record
format in :mod:`stream_persia.kafka`)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any, NamedTuple

from aiokafka import AIOKafkaProducer, ConsumerRecord
from aiokafka.errors import KafkaError

from stream_persia.config.kafka import resolve_idempotence
from stream_persia.core.backoff import wait_bounded
from stream_persia.errors import BadInput
from stream_persia.kafka._client import (
    H_KIND,
    H_OFFSET,
    H_PARTITION,
    H_REASON,
    H_TOPIC,
    MAX_REASON_BYTES,
    ProducerUser,
    config_servers,
)

log = logging.getLogger(__name__)


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


class DeadLetterWriter(ProducerUser):
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
        kwargs.setdefault("enable_idempotence", resolve_idempotence(kafka))
        kwargs.setdefault("max_message_bytes", kafka.max_batch_bytes)
        kwargs.setdefault("startup_timeout_s", kafka.startup_timeout_ms / 1000)
        return cls(kafka.dlq_topic,
                   bootstrap_servers=config_servers(kafka, bootstrap_servers), **kwargs)

    async def write(self, raw_value: bytes, reason: str, source: tuple[str, int, int], *,
                    key: bytes | None = None, kind: str | None = None) -> bool:
        """Dead-letter one message; ``source`` is its (topic, partition, offset)."""
        producer = self._live()
        topic, partition, offset = source
        headers = [(H_REASON, reason.encode(errors="replace")[:MAX_REASON_BYTES]),
                   (H_TOPIC, str(topic).encode()), (H_PARTITION, str(int(partition)).encode()),
                   (H_OFFSET, str(int(offset)).encode())]
        if kind:
            headers.append((H_KIND, kind.encode()))
        try:
            # wait_bounded, not wait_for: ingest is cancelled while it waits here, and
            # wait_for can lose that cancellation (see stream_persia.core.backoff).
            await wait_bounded(
                producer.send_and_wait(self.topic, bytes(raw_value), key=key, headers=headers),
                self.send_timeout_s)
        except (KafkaError, asyncio.TimeoutError, TimeoutError, OSError) as e:
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
