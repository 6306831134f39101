"""Data the samples topic no longer has: how a loss is detected, recorded and reported.

Exactly-once training needs every offset of a partition, in order. Three things can take
offsets away from a consumer, and none may pass silently:

- **deleted**: the consumer's position (or a checkpoint's stored offset) is below the
  partition's log start offset: retention (or ``DeleteRecords``) removed data that was
  never read. The broker answers the fetch with ``OFFSET_OUT_OF_RANGE``; the consumer is
  built with ``auto_offset_reset="none"`` so that aiokafka raises it instead of jumping.
- **gap**: a record's offset is not the one after its predecessor's. Non-transactional
  producers on a non-compacted topic write contiguous offsets, which is what
  stream-persia's producers do (idempotent, not transactional). Transaction markers,
  the records of aborted transactions (never read: the consumer reads committed records
  only) and compaction leave holes that are not lost samples: on such topics set
  ``on_data_loss: skip`` (each hole is then counted as lost).
- **truncated**: the position is beyond the partition's end (the log was truncated by an
  unclean leader election, or the topic deleted and created again).
- **recreated**: a checkpoint's stored offset is within the log, but the record below it
  is not the one the checkpoint recorded (the topic was deleted and created again, and
  has grown past the offset since; :mod:`stream_persia.kafka.fingerprint`). Starting
  there would never train the new topic's records below it. The same while reading: a
  position found out of range and then in range again, a partition resumed after a long
  pause, a broker answering again after an outage or metadata without the topic is
  checked against the last record read (a broker back without its data, refilled past the
  position since), and every ``recheck_every_s`` a record read earlier is read again
  (:class:`~stream_persia.kafka.SampleConsumer`).

What happens then is the ``kafka.on_data_loss`` setting:

- ``fail`` (default): that partition stops. It is paused and never resumed (ingest of the
  worker's other partitions goes on), the loss is logged as an error naming the topic,
  partition and offsets, counted (``..._kafka_consumer_data_loss_events_total``), shown by
  the gauge ``..._kafka_consumer_partitions_stopped`` and in the worker's ``status``
  (``kafka.stopped``, which the API's ``/v1/status`` carries). The partition's checkpoint
  frontier stays at the first offset not trained (the records after a gap are never
  handed over), so a checkpoint records where the loss starts, never past it; restoring
  that checkpoint is refused for the same reason (its offset is below the log start)
  until the loss is accepted. A checkpoint's stored offsets below the log start are
  refused when the consumer starts (:class:`KafkaDataLoss`).
- ``skip``: the loss is accepted: logged as a warning, counted per partition
  (``..._kafka_consumer_offsets_lost_total``, ``status`` ``kafka.lost_messages``), and
  reading goes on at the first offset the broker still has.

Pure logic (no I/O): :func:`gaps` runs on every fetched batch of records and costs O(1)
when the batch is contiguous.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from stream_persia.config.kafka import ON_DATA_LOSS  # the values of kafka.on_data_loss
from stream_persia.errors import DataLost

__all__ = ["ON_DATA_LOSS", "DataLoss", "KafkaDataLoss", "gaps", "ON_DATA_LOSS_HINT"]

ON_DATA_LOSS_HINT = ("replay the lost range from elsewhere, restore a checkpoint the broker "
                     "still has the data for, or accept the loss with kafka.on_data_loss: "
                     "skip (--on-data-loss skip)")


@dataclass(frozen=True)
class DataLoss:
    """Offsets ``first`` up to (not including) ``resume`` of one partition, never read.

    ``resume`` is the first offset the broker still has after the loss (``None`` when the
    log was truncated below ``first``: then nothing is known to be missing, but offsets
    from the log end on will be written again).
    """

    topic: str
    partition: int
    first: int
    resume: int | None
    cause: str                  # "deleted" | "gap" | "truncated" | "recreated"
    accepted: bool              # on_data_loss=skip: counted and read on; else stopped
    at: float = field(default_factory=time.time, compare=False)
    detail: str | None = None   # "recreated": what was recorded and what the broker has
    #: "recreated": the offset whose record was compared (``first - 1`` unless a running
    #: consumer's periodic check compared an older record it had read).
    checked: int | None = None

    @property
    def lost(self) -> int:
        """Messages lost (0 when unknown: a truncated log)."""
        return max(0, self.resume - self.first) if self.resume is not None else 0

    def describe(self) -> str:
        where = f"{self.topic}/{self.partition}"
        if self.cause == "recreated":
            checked = self.first - 1 if self.checked is None else self.checked
            return (f"{where}: the record at offset {checked} is not the one the "
                    f"checkpoint recorded, or the one read there ({self.detail}): the topic "
                    f"was deleted and created "
                    f"again (or this is another cluster's): reading on at offset {self.first} "
                    f"would never train the records below it")
        if self.cause == "truncated" or self.resume is None:
            return (f"{where}: offset {self.first} is beyond the partition's end "
                    f"{self.resume} (the log was truncated, or the topic recreated)")
        what = {"deleted": "were deleted (retention) before they were read",
                "gap": "are missing from the log (a gap between records)"}[self.cause]
        return f"{where}: offsets {self.first}..{self.resume - 1} ({self.lost} messages) {what}"

    def to_dict(self) -> dict[str, Any]:
        return {"topic": self.topic, "partition": self.partition, "first": self.first,
                "resume": self.resume, "lost": self.lost, "cause": self.cause,
                "accepted": self.accepted, "at": round(self.at, 3),
                "message": self.describe()}


class KafkaDataLoss(DataLost):
    """Samples the job needs are gone from the broker (see :mod:`stream_persia.kafka.loss`).

    Attributes:
        losses: the :class:`DataLoss` records, one per partition.
    """

    def __init__(self, losses: Sequence[DataLoss], *, field: str | None = None,
                 hint: str | None = ON_DATA_LOSS_HINT):
        self.losses = list(losses)
        super().__init__("data lost in Kafka: " + "; ".join(d.describe() for d in losses),
                         field=field or "kafka.on_data_loss", hint=hint)


def gaps(records: Sequence[Any], expected: int) -> list[tuple[int, int]]:
    """Where a partition's records skip offsets: ``(index, first missing offset)`` per hole.

    Args:
        records: the records of one fetch, in order (objects with ``.offset``).
        expected: the offset the first record should have (the one after the last record
            handed over, or where the consumer was positioned).

    Record ``index`` is the first after the hole, so ``records[index].offset`` is where
    reading goes on. Offsets below ``expected`` are not holes (the frontier refuses them).
    """
    n = len(records)
    if n == 0:
        return []
    first, last = records[0].offset, records[-1].offset
    if first == expected and last - first == n - 1:   # offsets strictly increase
        return []
    out = []
    for i, rec in enumerate(records):
        if rec.offset > expected:
            out.append((i, expected))
        expected = rec.offset + 1
    return out
