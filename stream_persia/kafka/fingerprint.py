"""Which topic a checkpoint's offsets belong to: a fingerprint of the record below each.

A checkpoint records, per partition of the samples topic, the next offset to train ``N``.
Offsets alone do not say *which* log they count: if the topic was deleted and created
again (a pipeline re-run, a new cluster, a topic renamed back) and the new one has grown
to ``N`` records or more, seeking to ``N`` is accepted by every offset check
(:mod:`stream_persia.kafka.loss`) and the new topic's records ``0..N-1`` are silently
never trained. So a Kafka cut also records a :class:`Fingerprint` of the record at
``N - 1`` (its offset, Kafka timestamp, and a short digest of its key and value), read
from the broker when the checkpoint is taken (:meth:`SampleConsumer.fingerprints
<stream_persia.kafka.SampleConsumer.fingerprints>`), and every start at stored offsets
reads that record again and compares (:meth:`SampleConsumer.start`, ``seek``,
``check_offsets``: the worker's ``check_stream`` and ``reset_stream``).

- Same record: the same topic; the restore goes on.
- Another record, or none at ``N - 1`` although the log start is at or below it: the
  topic was recreated (or this is another cluster's). A :class:`DataLoss` of cause
  ``"recreated"``: with ``kafka.on_data_loss: fail`` the restore is refused
  (:class:`~stream_persia.kafka.loss.KafkaDataLoss` naming topic, partition, offset, what
  was recorded and what the broker has, with :data:`RECREATED_HINT`); with ``skip`` it is
  logged as a warning, counted (``..._kafka_consumer_fingerprint_mismatches_total`` and
  ``..._data_loss_events_total``) and the stream starts at ``N`` as asked.
- ``N - 1`` below the log start (retention deleted it): the record cannot be compared.
  That alone is no sign of a recreated topic; it is logged and the start goes on (the
  checks of :mod:`~stream_persia.kafka.loss` still apply).
- No fingerprint for a partition (a checkpoint from before fingerprints, or one whose
  record at ``N - 1`` could not be read when it was cut), or one of another offset (the
  checkpoint's offsets edited by hand, on purpose): not checked (logged).

Where: each embedding worker fingerprints its own partitions (its ``fingerprints`` RPC,
which :func:`stream_persia.checkpoint.read_cut`, the one cut NN rank 0 and the API both
take, calls once the cut is known): the worker holds the brokers' addresses and client
settings. A broker that does not answer then leaves the checkpoint without fingerprints
(:func:`~stream_persia.checkpoint.read_cut` logs it; its restore is not checked), rather
than fail it: a SIGTERM's last checkpoint during a broker outage keeps what was trained. Every
restore path (the API's, ``load_checkpoint``, ``reset_stream``) sends the manifest's
fingerprints with its offsets, and the consumer compares them where it checks any stored
offset (``SampleConsumer._plan``).

While reading, the consumer makes the same comparison against the last record it handed
over, for a partition resumed after a long pause or found out of range and then in range
again (``SampleConsumer(recheck_after_pause_s=...)``), read once the brokers answer again
after an outage (``BrokerWatch.recoveries``: a broker back without its data), or after
metadata that lacks the topic or names another leader for the partition (aiokafka's
metadata listener): a topic re-created under a running job and refilled past its
position. aiokafka 0.14 speaks Metadata v5 and Fetch below v13, so no topic id reaches
the client to compare. With none of those signs (deleted, created and refilled between
two fetches), the periodic check catches it: every ``recheck_every_s`` (30 s) of
reading, the record each partition had last handed over at the previous check is read
again and compared before more are handed over; the new topic's records read in between
are trained already (at most one period's), and the loss is at the partition's position.
There, only another record at the anchor's offset is a loss: none there (the log cleaner
compacted it away on a compacted topic) is logged and the next check anchors afresh,
rather than stop the partition at every check after a cleaner pass. The restore and
resume checks above keep treating a missing record as a re-creation: they run once per
restore or long pause, on the operator's demand, where refusing is the safe side.

``on_data_loss`` decides because a recreated topic is data the job would lose (the new
records below the offsets): ``fail`` refuses, as it refuses offsets retention deleted;
``skip`` is the operator's "go on regardless".

Cost: one short-lived side consumer (no group) per call, one fetch request per broker
for all the partitions asked (each seeks to ``N - 1`` and keeps the first record; at
most ``max_partition_fetch_bytes`` per partition), bounded by ``timeout_s``. Nothing
loops over the log. On Tansu, whose fetch at ``N - 1`` may return the whole record batch
holding it, the record is picked by its offset.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError, OffsetOutOfRangeError

from stream_persia.core.watermarks import FINGERPRINT_DIGEST_HEX, check_fingerprint
from stream_persia.errors import BadInput
from stream_persia.kafka.liveness import KafkaUnavailable, servers_text, start_client, stop_client
from stream_persia.kafka.loss import DataLoss

log = logging.getLogger(__name__)

__all__ = ["Fingerprint", "RECREATED_HINT", "read_records", "parse_fingerprints", "take",
           "recreated"]

DIGEST_HEX = FINGERPRINT_DIGEST_HEX   # 64 bits of sha256: no collision by chance
FINGERPRINT_TIMEOUT_S = 5.0
RECREATED_HINT = ("restore a checkpoint taken of this topic (on this cluster), or train the "
                  "new topic from its start on purpose (a fresh job, or the checkpoint's "
                  "manifest offsets set by hand); kafka.on_data_loss: skip restores it "
                  "anyway, counting the mismatch")


def record_digest(key: bytes | None, value: bytes | None) -> str:
    """A short sha256 of a record's key and value (an absent key or value is told apart
    from an empty one)."""
    h = hashlib.sha256()
    for part in (key, value):
        h.update(b"-1:" if part is None else b"%d:" % len(part))
        h.update(part or b"")
    return h.hexdigest()[:DIGEST_HEX]


@dataclass(frozen=True)
class Fingerprint:
    """The record at ``offset`` (a stored offset - 1): its Kafka timestamp (ms) and
    :func:`record_digest`."""

    offset: int
    timestamp: int
    digest: str

    @classmethod
    def of(cls, record: Any) -> Fingerprint:
        return cls(int(record.offset), int(record.timestamp),
                   record_digest(record.key, record.value))

    def to_dict(self) -> dict[str, Any]:
        return {"offset": self.offset, "timestamp": self.timestamp, "digest": self.digest}

    def describe(self) -> str:
        return f"timestamp {self.timestamp}, digest {self.digest}"

    @classmethod
    def from_dict(cls, d: Any, where: str = "fingerprints") -> Fingerprint:
        """Parse ``{"offset", "timestamp", "digest"}``; BadInput naming ``where``
        (:func:`stream_persia.core.watermarks.check_fingerprint`)."""
        d = check_fingerprint(d, where)
        return cls(d["offset"], d["timestamp"], d["digest"])


def parse_fingerprints(raw: Any, where: str = "fingerprints") -> dict[int, Fingerprint]:
    """partition → :class:`Fingerprint` from ``{partition (int or decimal str): {...}}``
    (None: none); BadInput naming the field."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise BadInput(f"{where} must map partition -> fingerprint, got "
                       f"{type(raw).__name__}", field=where)
    out: dict[int, Fingerprint] = {}
    for p, d in raw.items():
        key = str(p) if isinstance(p, int) and not isinstance(p, bool) else p
        if not (isinstance(key, str) and key.isdigit()):
            raise BadInput(f"{where} partition must be a number >= 0, got {p!r}", field=where)
        out[int(key)] = Fingerprint.from_dict(d, f"{where}.{key}")
    return out


async def read_records(client_kwargs: Mapping[str, Any], topic: str,
                       offsets: Mapping[int, int], *,
                       timeout_s: float = FINGERPRINT_TIMEOUT_S) -> tuple[dict[int, Any], set[int]]:
    """The record at exactly ``offsets[p]`` of each partition, by one side consumer
    (no group, commits nothing) within ``timeout_s``.

    Returns:
        ``(records, absent)``: partition → the record at that offset; and the
        partitions whose first record fetched lies *after* the offset (the broker has
        no record there). Partitions with neither are left out (nothing came in time).
    """
    if not offsets:
        return {}, set()
    kw = {**client_kwargs, "group_id": None, "enable_auto_commit": False,
          "auto_offset_reset": "none"}
    consumer = await start_client(lambda: AIOKafkaConsumer(**kw), kw["bootstrap_servers"],
                                  timeout_s=timeout_s)
    records: dict[int, Any] = {}
    absent: set[int] = set()
    gone_parts: set[int] = set()
    try:
        tps = {p: TopicPartition(topic, p) for p in offsets}
        consumer.assign(list(tps.values()))
        for p, tp in tps.items():
            consumer.seek(tp, offsets[p])
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while len(records) + len(absent) + len(gone_parts) < len(tps):
            left = deadline - loop.time()
            if left <= 0:
                break
            want = [tp for p, tp in tps.items()
                    if p not in records and p not in absent and p not in gone_parts]
            try:
                got = await consumer.getmany(*want, timeout_ms=max(1, int(left * 1000)),
                                             max_records=len(want) * 64)
            except OffsetOutOfRangeError as e:   # retention moved the log start past it
                gone = e.args[0] if e.args and isinstance(e.args[0], dict) else {}
                for tp in gone:
                    consumer.pause(tp)
                    gone_parts.add(tp.partition)
                if not gone:
                    raise
                continue
            for tp, recs in got.items():
                p = tp.partition
                at = [r for r in recs if r.offset >= offsets[p]]
                if not at:
                    continue
                if at[0].offset == offsets[p]:
                    records[p] = at[0]
                else:
                    absent.add(p)
                consumer.pause(tp)   # no more fetches of it
    finally:
        await stop_client(consumer)
    return records, absent


async def _read(client_kwargs: Mapping[str, Any], topic: str, offsets: Mapping[int, int],
                timeout_s: float, why: str) -> tuple[dict[int, Any], set[int]]:
    """:func:`read_records`, a broker that does not answer raised as KafkaUnavailable."""
    try:
        return await read_records(client_kwargs, topic, offsets, timeout_s=timeout_s)
    except (KafkaError, OSError) as e:
        servers = client_kwargs["bootstrap_servers"]
        raise KafkaUnavailable(
            f"the Kafka brokers at {servers_text(servers)} did not return the records of "
            f"{topic!r} at offsets {dict(offsets)} {why} ({e!r})", servers=servers,
            hint="is the broker running? kafka.broker_timeout_ms bounds the wait") from e


async def take(client_kwargs: Mapping[str, Any], topic: str, offsets: Mapping[int, int], *,
               timeout_s: float = FINGERPRINT_TIMEOUT_S) -> dict[int, Fingerprint]:
    """The fingerprint of the record below each of ``offsets`` (partition → next offset;
    0 is left out), read from the brokers. A partition whose record is not read (deleted,
    not a record, or not in time) is left out and logged: a restore cannot check it.

    Raises:
        KafkaUnavailable: the brokers did not answer.
    """
    want = {p: o - 1 for p, o in offsets.items() if o > 0}
    records, _ = await _read(client_kwargs, topic, want, timeout_s, "to fingerprint")
    missed = sorted(set(want) - set(records))
    if missed:
        log.warning("%s: no record read at offsets %s: a restore of this cut cannot check "
                    "the topic's identity there", topic, {p: want[p] for p in missed})
    return {p: Fingerprint.of(r) for p, r in records.items()}


async def recreated(client_kwargs: Mapping[str, Any], topic: str, offsets: Mapping[int, int],
                    fingerprints: Mapping[int, Fingerprint], begin: Mapping[int, int], *,
                    skip: bool, timeout_s: float = FINGERPRINT_TIMEOUT_S,
                    absent_is_loss: bool = True) -> list[DataLoss]:
    """Read the record below each of ``offsets`` (partition → stored offset) again and
    compare it with its fingerprint; one :class:`DataLoss` of cause ``"recreated"``
    (``accepted`` = ``skip``) per partition that differs (the module docstring says
    which cannot be compared, and why that is logged and let go).

    Args:
        begin: each partition's log start offset now.
        absent_is_loss: whether no record at the offset (the broker's first one after it)
            is a loss; False: it cannot be compared (compacted away, or a transaction
            marker), logged at INFO. Only a different record there is a loss then.

    Raises:
        KafkaUnavailable: the brokers did not answer.
    """
    want: dict[int, int] = {}
    unchecked: list[int] = []
    for p, offset in offsets.items():
        if offset == 0:
            continue
        fp = fingerprints.get(p)
        if fp is None:
            unchecked.append(p)
        elif fp.offset != offset - 1:   # the offsets were edited by hand, on purpose
            log.warning("%s/%d: the checkpoint's fingerprint is of offset %d, not of %d "
                        "(below its stored offset %d): the topic's identity is not checked "
                        "there", topic, p, fp.offset, offset - 1, offset)
        elif offset - 1 < begin[p]:
            log.info("%s/%d: the record at offset %d is deleted (the log starts at %d): the "
                     "topic's identity cannot be checked there", topic, p, offset - 1,
                     begin[p])
        else:
            want[p] = offset - 1
    if unchecked:
        log.info("%s: partitions %s have no fingerprint of the record below their stored "
                 "offset (a checkpoint from before fingerprints): the topic's identity "
                 "cannot be checked there", topic, sorted(unchecked))
    records, absent = await _read(client_kwargs, topic, want, timeout_s,
                                  "to compare with the checkpoint's fingerprints")
    losses = []
    for p, at in want.items():
        fp = fingerprints[p]
        if p in records:
            now = Fingerprint.of(records[p])
            if now == fp:
                continue
            detail = f"recorded {fp.describe()}; the broker has {now.describe()}"
        elif p in absent and not absent_is_loss:
            log.info("%s/%d: the broker has no record at offset %d now (compacted?): the "
                     "topic's identity cannot be checked there", topic, p, at)
            continue
        elif p in absent:
            detail = f"recorded {fp.describe()}; the broker has no record at offset {at} now"
        else:
            log.warning("%s/%d: the record at offset %d did not come within %g s: the "
                        "topic's identity cannot be checked there", topic, p, at, timeout_s)
            continue
        losses.append(DataLoss(topic, p, at + 1, None, "recreated", skip, detail=detail))
    return losses
