"""The samples consumer: :class:`SampleConsumer`, by static assignment (see
:mod:`stream_persia.kafka`), which never skips an offset silently
(:mod:`stream_persia.kafka.loss`) and fails when the brokers are gone
(:mod:`stream_persia.kafka.liveness`).

Size: one module past 500 lines on purpose: one class, whose assignment, seeking, loss
handling and pausing all act on one aiokafka consumer and its per-partition state; the
loss rules and broker liveness already live beside it (``loss``, ``liveness``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError, OffsetOutOfRangeError

from stream_persia.core.backoff import wait_bounded
from stream_persia.errors import BadInput, ConfigError, Misuse
from stream_persia.kafka._client import (
    DEFAULT_FETCH_MAX_WAIT_MS,
    DEFAULT_MAX_MESSAGE_BYTES,
    check_replica,
    client_kwargs,
    config_servers,
    partitions_for_replica,
    partitions_of,
    validate_topic,
)
from stream_persia.kafka.fingerprint import (
    FINGERPRINT_TIMEOUT_S,
    RECREATED_HINT,
    Fingerprint,
    recreated,
    take,
)
from stream_persia.kafka.liveness import (
    DEFAULT_BROKER_TIMEOUT_S,
    DEFAULT_STARTUP_TIMEOUT_S,
    BrokerWatch,
    KafkaUnavailable,
    servers_text,
    start_client,
    stop_client,
)
from stream_persia.kafka.loss import (
    ON_DATA_LOSS,
    ON_DATA_LOSS_HINT,
    DataLoss,
    KafkaDataLoss,
    gaps,
)
from stream_persia.kernels.sharding import static_partitions

log = logging.getLogger(__name__)

MAX_LOSSES_KEPT = 32   # accepted losses kept for status (each is also logged and counted)
#: How often the client refreshes the topic's metadata, so how soon partitions added to
#: the samples topic while it runs are read (aiokafka's own default is 5 minutes).
DEFAULT_METADATA_MAX_AGE_MS = 30_000
#: A partition resumed after a pause this long is checked (the record below its position
#: is still the last one read) before its records are handed over.
RECHECK_AFTER_PAUSE_S = 10.0
#: How often a reading consumer reads again a record it read earlier, per partition, to
#: notice the topic deleted and created again under it with no other sign.
RECHECK_EVERY_S = 30.0


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
            offset start. It is never applied to a partition that is already being read:
            an offset the broker no longer has is a data loss (``on_data_loss``).
        on_data_loss: "fail" (stop the partition) or "skip" (count the loss and read on);
            see :mod:`stream_persia.kafka.loss`.
        metadata_timeout_s: how long :meth:`start` waits for the topic to exist.
        startup_timeout_s: how long :meth:`start` keeps trying to reach a broker.
        broker_timeout_s: how long :meth:`getmany` may go without any broker answering
            before it raises :class:`~stream_persia.kafka.liveness.KafkaUnavailable`.
        recheck_after_pause_s: a partition resumed after a pause at least this long, or
            found out of range and then in range again, has the record below its position
            compared with the last one read before its records are handed over: the topic
            deleted and created again meanwhile (a broker back without its data) and
            refilled past the position is a loss of cause ``"recreated"``, not a place
            to read on from. So is a partition after the brokers answer again following an
            outage (a broker back without its data), after metadata that lacks the topic
            or names another leader for it.
        recheck_every_s: with no such sign (the topic re-created between two fetches),
            every this many seconds of reading the consumer reads again, by a side
            client, the record each partition had last handed over at the previous
            check, before it hands over more: another record there stops the partition
            (cause ``"recreated"``, at its position) or, with ``on_data_loss="skip"``, is
            counted. Records of the new topic read in between are handed over already,
            so this bounds how long a re-creation goes unnoticed, it does not undo it.
        **consumer_kwargs: passed to ``AIOKafkaConsumer`` (not auto-commit settings).
    """

    def __init__(self, bootstrap_servers: str | Iterable[str], topic: str, *,
                 replica_index: int = 0, replica_size: int = 1, group_id: str | None = None,
                 fetch_max_wait_ms: int = DEFAULT_FETCH_MAX_WAIT_MS,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 auto_offset_reset: str = "earliest", on_data_loss: str = "fail",
                 metadata_timeout_s: float = 30.0,
                 startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
                 broker_timeout_s: float = DEFAULT_BROKER_TIMEOUT_S,
                 expected_partitions: int | None = None,
                 recheck_after_pause_s: float = RECHECK_AFTER_PAUSE_S,
                 recheck_every_s: float = RECHECK_EVERY_S,
                 security_kwargs: Mapping[str, Any] | None = None,
                 client_id: str | None = None,
                 **consumer_kwargs: Any):
        self.topic = validate_topic(topic)
        check_replica(replica_index, replica_size)
        if auto_offset_reset not in ("earliest", "latest"):
            raise ConfigError(f"auto_offset_reset = {auto_offset_reset!r}",
                              field="auto_offset_reset", hint="'earliest' or 'latest'")
        if on_data_loss not in ON_DATA_LOSS:
            raise ConfigError(f"kafka.on_data_loss = {on_data_loss!r}",
                              field="kafka.on_data_loss", hint="'fail' or 'skip'")
        if consumer_kwargs.get("auto_offset_reset") is not None:
            raise ConfigError("auto_offset_reset is SampleConsumer's own argument",
                              field="auto_offset_reset")
        if consumer_kwargs.get("enable_auto_commit"):
            raise ConfigError("enable_auto_commit=True", field="enable_auto_commit",
                              hint="offsets are committed only by checkpoints")
        self.replica_index, self.replica_size = replica_index, replica_size
        self.group_id = group_id
        self.auto_offset_reset = auto_offset_reset
        self.on_data_loss = on_data_loss
        self.metadata_timeout_s = metadata_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.expected_partitions = expected_partitions
        self.recheck_after_pause_s = recheck_after_pause_s
        if not recheck_every_s > 0:
            raise ConfigError(f"recheck_every_s = {recheck_every_s!r}", field="recheck_every_s",
                              hint="seconds > 0")
        self.recheck_every_s = float(recheck_every_s)
        self._kwargs = client_kwargs(bootstrap_servers, security_kwargs, client_id)
        # "none": aiokafka raises OffsetOutOfRangeError instead of jumping to the log
        # start or end (a loss it would only log at INFO); the start positions are
        # sought explicitly in _assign_and_seek.
        # read_committed: records of an aborted transaction are never handed over
        # (aiokafka's default, read_uncommitted, trains them).
        self._kwargs.update(group_id=group_id, enable_auto_commit=False,
                            auto_offset_reset="none", isolation_level="read_committed",
                            metadata_max_age_ms=DEFAULT_METADATA_MAX_AGE_MS,
                            fetch_max_wait_ms=fetch_max_wait_ms,
                            max_partition_fetch_bytes=max_message_bytes)
        self._kwargs.update(consumer_kwargs)
        self.bootstrap_servers = self._kwargs["bootstrap_servers"]
        self.broker_timeout_s = broker_timeout_s
        self._watch = BrokerWatch(self.bootstrap_servers, broker_timeout_s,
                                  what=f"consumer of {topic!r}")
        self._consumer: AIOKafkaConsumer | None = None
        self._tps: dict[int, TopicPartition] = {}
        self._next: dict[int, int] = {}          # offset the next record must have
        self._stopped: dict[int, DataLoss] = {}  # partitions stopped on a loss
        self._held: set[int] = set()             # partitions never to be read (hold())
        self._lost: dict[int, int] = {}          # messages lost (accepted), per partition
        self._accepted: list[DataLoss] = []      # the latest accepted losses (bounded)
        self._last: dict[int, ConsumerRecord] = {}  # the last record handed over
        self._paused_at: dict[int, float] = {}   # when each paused partition was paused
        self._recheck: set[int] = set()          # compare the record below before reading
        self._anchor: dict[int, Fingerprint] = {}  # read again every recheck_every_s
        self._anchor_due = 0.0                   # when the anchors are next read again
        self._recoveries = 0                     # broker outages already rechecked
        self._leaders: dict[int, int] = {}       # partition -> leader, as metadata said
        self._added: dict[int, int] = {}         # adopted partitions not yet taken
        self.num_partitions = 0
        self._counts = dict(records=0, bytes=0, commits=0, commit_failures=0,
                            commits_skipped=0, offsets_lost=0, data_loss_events=0,
                            fingerprint_mismatches=0, partitions_added=0)

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
        kwargs.setdefault("on_data_loss", kafka.on_data_loss)
        kwargs.setdefault("startup_timeout_s", kafka.startup_timeout_ms / 1000)
        kwargs.setdefault("broker_timeout_s", kafka.broker_timeout_ms / 1000)
        return cls(config_servers(kafka, bootstrap_servers), kafka.samples_topic,
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

    async def start(self, start_offsets: Mapping[int, int] | None = None,
                    fingerprints: Mapping[int, Fingerprint] | None = None) -> None:
        """Assign this replica's partitions and seek.

        Args:
            start_offsets: partition -> next offset to read, from a checkpoint (other
                replicas' partitions are ignored). Partitions without one start at
                ``auto_offset_reset``; group-committed offsets are never used.
            fingerprints: partition -> the checkpoint's fingerprint of the record below
                its offset (:mod:`stream_persia.kafka.fingerprint`), compared with the
                record the broker has there now. None: the offsets are not a
                checkpoint's (nothing compared); partitions missing from it are not
                compared (logged).

        Raises:
            ConfigError: the topic does not exist within ``metadata_timeout_s``, or has
                fewer partitions than replicas.
            BadInput: a stored offset is beyond the partition's end (wrong topic/cluster).
            KafkaDataLoss: with ``on_data_loss="fail"``, a stored offset is below the
                partition's log start: the messages in between were never read; or the
                record below it is not the one fingerprinted (a recreated topic).
            KafkaUnavailable: no broker answered within ``startup_timeout_s``.
        """
        if self._consumer is not None:
            raise Misuse("SampleConsumer.start() called twice")
        consumer = await start_client(lambda: AIOKafkaConsumer(**self._kwargs),
                                      self.bootstrap_servers, timeout_s=self.startup_timeout_s)
        try:
            await self._assign_and_seek(consumer, dict(start_offsets or {}), fingerprints)
        except BaseException:
            await stop_client(consumer)
            raise
        self._consumer = consumer
        self._anchor_due = time.monotonic() + self.recheck_every_s
        self._on_metadata(consumer._client.cluster)
        consumer._client.cluster.add_listener(self._on_metadata)

    async def _assign_and_seek(self, consumer: AIOKafkaConsumer, start_offsets: dict[int, int],
                               fingerprints: Mapping[int, Fingerprint] | None) -> None:
        deadline = time.monotonic() + self.metadata_timeout_s
        while not (found := await partitions_of(consumer, self.topic)):
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
        begin, end = await self._log_bounds(consumer, tps)
        starts, losses = await self._plan(start_offsets, fingerprints, begin, end)
        refused = [loss for loss in losses if not loss.accepted]
        if refused:
            for loss in refused:
                log.error("refusing to start at a stored offset: %s", loss.describe())
            raise self._refusal(refused)
        for loss in losses:
            self._accept(loss)
        for p, tp in self._tps.items():
            offset = starts.get(p)
            if offset is None:
                offset = begin[tp] if self.auto_offset_reset == "earliest" else end[tp]
            consumer.seek(tp, offset)
            self._next[p] = offset

    def _plan_starts(self, offsets: Mapping[int, int], begin: Mapping[TopicPartition, int],
                     end: Mapping[TopicPartition, int]) -> tuple[dict[int, int], list[DataLoss]]:
        """Where the owned partitions of ``offsets`` start, given the brokers' log start
        and end offsets, and the losses that implies (a stored offset below the log
        start: messages deleted before they were read).

        Raises:
            BadInput: an offset beyond the partition's end (a checkpoint of another topic).
        """
        starts: dict[int, int] = {}
        losses: list[DataLoss] = []
        for p, tp in self._tps.items():
            offset = offsets.get(p)
            if offset is None:
                continue
            if offset > end[tp]:
                raise BadInput(f"stored offset {offset} of {self.topic}/{p} is beyond its end "
                               f"{end[tp]}", field=f"start_offsets[{p}]",
                               hint="the checkpoint belongs to another topic or cluster")
            if offset < begin[tp]:
                losses.append(DataLoss(self.topic, p, offset, begin[tp], "deleted",
                                       accepted=self.on_data_loss == "skip"))
                offset = begin[tp]
            starts[p] = offset
        return starts, losses

    async def _plan(self, offsets: Mapping[int, int],
                    fingerprints: Mapping[int, Fingerprint] | None,
                    begin: Mapping[TopicPartition, int], end: Mapping[TopicPartition, int]
                    ) -> tuple[dict[int, int], list[DataLoss]]:
        """:meth:`_plan_starts`, and the owned partitions whose record below the stored
        offset is not the one fingerprinted (cause ``"recreated"``). The one check every
        start at stored offsets makes (:meth:`start`, :meth:`seek`,
        :meth:`check_offsets`)."""
        starts, losses = self._plan_starts(offsets, begin, end)
        if fingerprints is not None:
            losses += await recreated(
                self._kwargs, self.topic, {p: o for p, o in offsets.items() if p in self._tps},
                fingerprints, {tp.partition: b for tp, b in begin.items()},
                skip=self.on_data_loss == "skip", timeout_s=self._fingerprint_timeout_s)
        return starts, losses

    @staticmethod
    def _refusal(refused: list[DataLoss]) -> KafkaDataLoss:
        if all(loss.cause == "recreated" for loss in refused):
            return KafkaDataLoss(refused, field="start_offsets", hint=RECREATED_HINT)
        return KafkaDataLoss(refused, field="start_offsets")

    async def fingerprints(self, offsets: Mapping[int, int]) -> dict[int, Fingerprint]:
        """The fingerprint of the record below each offset of ``offsets`` (partition →
        next offset, > 0) of the partitions this replica owns, read from the brokers (a
        checkpoint records them: :mod:`stream_persia.kafka.fingerprint`). A partition
        whose record is not read (deleted, not a record, or not in time) is left out and
        logged: a restore cannot check it.

        Raises:
            KafkaUnavailable: the brokers did not answer.
        """
        return await take(self._kwargs, self.topic,
                          {p: o for p, o in offsets.items() if p in self._tps},
                          timeout_s=self._fingerprint_timeout_s)

    @property
    def _fingerprint_timeout_s(self) -> float:
        return min(FINGERPRINT_TIMEOUT_S, self.broker_timeout_s)

    async def seek(self, offsets: Mapping[int, int],
                   fingerprints: Mapping[int, Fingerprint] | None = None) -> None:
        """Move owned partitions to ``offsets`` before anything was read from them (an
        embedding worker resuming at the cut restored into its servers), checked as
        :meth:`start` checks stored offsets.

        Raises:
            BadInput, KafkaDataLoss: as :meth:`start` (nothing moved).
        """
        consumer = self._live()
        tps = self._owned(offsets)
        begin, end = await self._log_bounds(consumer, tps)
        starts, losses = await self._plan(offsets, fingerprints, begin, end)
        refused = [loss for loss in losses if not loss.accepted]
        if refused:
            raise self._refusal(refused)
        for loss in losses:
            self._accept(loss)
        for p, offset in starts.items():
            consumer.seek(self._tps[p], offset)
            self._next[p] = offset
            # Checked here; the next record read is the anchor (the last one handed over
            # before the move is of another place, maybe of a log since replaced).
            self._anchor.pop(p, None)
            self._last.pop(p, None)

    async def check_offsets(self, offsets: Mapping[int, int],
                            fingerprints: Mapping[int, Fingerprint] | None = None) -> None:
        """Check stored offsets (and their fingerprints) against the brokers as
        :meth:`start` would, changing nothing (a restore checks before it drops what the
        worker holds).

        Raises:
            BadInput, KafkaDataLoss: as :meth:`start`.
        """
        tps = list(self._tps.values())
        begin, end = await self._log_bounds(self._live(), tps)
        _, losses = await self._plan(offsets, fingerprints, begin, end)
        refused = [loss for loss in losses if not loss.accepted]
        if refused:
            raise self._refusal(refused)

    async def _log_bounds(self, consumer: AIOKafkaConsumer, tps: list[TopicPartition]
                          ) -> tuple[dict[TopicPartition, int], dict[TopicPartition, int]]:
        """The log start and end offsets of ``tps``, within ``broker_timeout_s``.

        Raises:
            KafkaUnavailable: the brokers did not answer (names them).
        """
        try:
            begin = await wait_bounded(consumer.beginning_offsets(tps), self.broker_timeout_s)
            end = await wait_bounded(consumer.end_offsets(tps), self.broker_timeout_s)
        except (KafkaError, TimeoutError, asyncio.TimeoutError) as e:
            raise KafkaUnavailable(
                f"consumer of {self.topic!r}: no Kafka broker at "
                f"{servers_text(self.bootstrap_servers)} answered with the log start and end "
                f"offsets of partitions {sorted(tp.partition for tp in tps)} within "
                f"{self.broker_timeout_s:g} s ({e!r})",
                servers=self.bootstrap_servers,
                hint="is the broker running? kafka.broker_timeout_ms bounds the wait") from e
        return begin, end

    async def _log_starts(self, tps: list[TopicPartition]) -> dict[int, int]:
        """The log start offset of each of ``tps``, by partition, within
        ``FINGERPRINT_TIMEOUT_S`` (the periodic check: ingest waits on it).

        Raises:
            KafkaUnavailable: the brokers did not answer in time.
        """
        timeout_s = self._fingerprint_timeout_s
        try:
            begin = await wait_bounded(self._live().beginning_offsets(tps), timeout_s)
        except (KafkaError, TimeoutError, asyncio.TimeoutError) as e:
            raise KafkaUnavailable(
                f"consumer of {self.topic!r}: no Kafka broker at "
                f"{servers_text(self.bootstrap_servers)} answered with the log start "
                f"offsets of partitions {sorted(tp.partition for tp in tps)} within "
                f"{timeout_s:g} s ({e!r})", servers=self.bootstrap_servers,
                hint="is the broker running? kafka.broker_timeout_ms bounds the wait") from e
        return {tp.partition: b for tp, b in begin.items()}

    # --------------------------------------------------------------- data loss
    def _accept(self, loss: DataLoss) -> None:
        """on_data_loss=skip: count and log a loss, and read on."""
        self._counts["data_loss_events"] += 1
        if loss.cause == "recreated":
            self._counts["fingerprint_mismatches"] += 1
        # Reading goes on in the log as it is now: the next record read is the anchor of
        # the periodic check, not one of a log the loss replaced (nor the last one
        # handed over before it, which a check due now would take as the anchor).
        self._anchor.pop(loss.partition, None)
        self._last.pop(loss.partition, None)
        self._counts["offsets_lost"] += loss.lost
        self._lost[loss.partition] = self._lost.get(loss.partition, 0) + loss.lost
        self._accepted = [*self._accepted[-(MAX_LOSSES_KEPT - 1):], loss]
        log.warning("data loss accepted (kafka.on_data_loss=skip): %s", loss.describe())

    def _stop(self, loss: DataLoss) -> None:
        """on_data_loss=fail: stop reading the partition before the loss, for good."""
        consumer = self._live()
        tp = self._tps[loss.partition]
        self._counts["data_loss_events"] += 1
        self._stopped[loss.partition] = loss
        consumer.pause(tp)
        # Nothing from ``first`` on was handed over; the position says so (lag counts the
        # loss), and a paused partition is never fetched.
        consumer.seek(tp, loss.first)
        self._next[loss.partition] = loss.first
        log.error("Kafka ingest of %s/%d stopped: %s. Other partitions go on; checkpoints "
                  "record offset %d for this one (hint: %s)", self.topic, loss.partition,
                  loss.describe(), loss.first, ON_DATA_LOSS_HINT)

    def _lose(self, loss: DataLoss) -> bool:
        """Handle a detected loss; True when reading goes on past it."""
        if loss.accepted:
            self._accept(loss)
            return True
        self._stop(loss)
        return False

    async def _out_of_range(self, error: OffsetOutOfRangeError) -> None:
        consumer = self._live()
        positions = error.args[0] if error.args and isinstance(error.args[0], dict) else {}
        tps = [tp for tp in positions if tp.partition in self._tps and
               tp.partition not in self._stopped]
        if not tps:
            return
        # A broker going away can answer a last fetch with OFFSET_OUT_OF_RANGE (the mock
        # does as it shuts down): then this fails as a lost broker, not as a data loss.
        begin, end = await self._log_bounds(consumer, tps)
        skip = self.on_data_loss == "skip"
        for tp in tps:
            position = positions[tp]
            if position < begin[tp]:
                loss = DataLoss(self.topic, tp.partition, position, begin[tp], "deleted", skip)
                resume = begin[tp]
            elif position > end[tp]:
                loss = DataLoss(self.topic, tp.partition, position, end[tp], "truncated", skip)
                resume = end[tp]
            else:   # in range again: a leader change, or the topic created again since
                log.warning("%s/%d: offset %d was out of range, and is not any more",
                            self.topic, tp.partition, position)
                self._recheck.add(tp.partition)
                consumer.seek(tp, position)
                continue
            if self._lose(loss):
                consumer.seek(tp, resume)
                self._next[tp.partition] = resume

    async def _recheck_below(self, partitions: list[int]) -> None:
        """Stop (or, with ``on_data_loss="skip"``, count) each of ``partitions`` whose
        record below its position is not the last one handed over any more
        (``recheck_after_pause_s``; one side client for all of them). The topic deleted and created again (a broker back
        without its data) and refilled past the position meanwhile is in range too, and
        reading on would never train the new records below it. A mismatch is a loss of
        cause ``"recreated"`` (``on_data_loss="skip"`` counts it and reads on)."""
        self._recheck.difference_update(partitions)
        below = {p: Fingerprint.of(self._last[p]) for p in partitions
                 if p in self._last and self._last[p].offset == self._next[p] - 1}
        if not below:
            return
        tps = [self._tps[p] for p in below]
        begin, _ = await self._log_bounds(self._live(), tps)
        losses = await recreated(self._kwargs, self.topic,
                                 {p: fp.offset + 1 for p, fp in below.items()}, below,
                                 {tp.partition: b for tp, b in begin.items()},
                                 skip=self.on_data_loss == "skip",
                                 timeout_s=self._fingerprint_timeout_s)
        for loss in losses:
            self._lose(loss)

    async def getmany(self, timeout_ms: int = 100,
                      max_records: int | None = None) -> dict[int, list[ConsumerRecord]]:
        """Records fetched so far (waits up to ``timeout_ms`` for some), by partition.

        The records of a partition always continue exactly where the previous ones (or
        the start position) left off; a loss is handled as ``on_data_loss`` says (a
        stopped partition returns nothing more).

        Raises:
            KafkaUnavailable: no broker has answered for ``broker_timeout_s``.
        """
        consumer = self._live()
        found = consumer._client.cluster.partitions_for_topic(self.topic) or ()
        if len(found) > self.num_partitions:
            self._adopt(consumer, len(found))
        try:
            fetched = await consumer.getmany(timeout_ms=timeout_ms, max_records=max_records)
        except OffsetOutOfRangeError as e:
            self._watch.contact()   # the broker answered, with an error
            await self._out_of_range(e)
            return {}
        out: dict[int, list[ConsumerRecord]] = {}
        if fetched:
            self._watch.contact()
        if self._watch.recoveries != self._recoveries:   # a broker back, maybe empty
            self._recoveries = self._watch.recoveries
            self._recheck_all("the brokers answer again after an outage")
        recheck = [tp.partition for tp, records in fetched.items()
                   if records and tp.partition in self._recheck]
        if recheck:
            await self._recheck_below(recheck)
        if fetched and time.monotonic() >= self._anchor_due:
            await self._check_anchors()
        for tp, records in fetched.items():
            p = tp.partition
            if not records or p in self._stopped or p in self._held:
                continue
            holes = gaps(records, self._next[p])
            if holes:
                records = self._after_gaps(p, records, holes)
                if not records:
                    continue
            self._next[p] = records[-1].offset + 1
            self._last[p] = records[-1]
            if p not in self._anchor:
                self._anchor[p] = Fingerprint.of(records[-1])
            out[p] = records
            self._counts["records"] += len(records)
            self._counts["bytes"] += sum(r.serialized_value_size for r in records)
        if not fetched:
            await self._watch.check(consumer._client, self.topic)
        return out

    def _recheck_all(self, why: str) -> None:
        """Compare every read partition's record below its position with the last one
        read before its next records are handed over (:meth:`_recheck_below`)."""
        live = [p for p in self._last if p not in self._stopped and p not in self._held]
        if live:
            log.info("%s: %s: the records below partitions %s are read again before more "
                     "are handed over (the topic may have been created again)", self.topic,
                     why, sorted(live))
            self._recheck.update(live)

    def _on_metadata(self, cluster: Any) -> None:
        """aiokafka's metadata listener: metadata without the topic (deleted), or naming
        another leader for a partition (a broker replaced, a topic re-created), makes
        the partitions concerned compare their record below before reading on. Costs
        nothing per record; runs once per metadata update."""
        found = cluster.partitions_for_topic(self.topic)
        if not found:
            if self._leaders:
                self._leaders = {}
                self._recheck_all("the brokers' metadata lacks the topic")
            return
        moved = []
        for p in self._tps:
            leader = cluster.leader_for_partition(self._tps[p])
            if leader is None or leader < 0:   # -1: an election under way; keep the last
                continue
            if self._leaders.get(p, leader) != leader:
                moved.append(p)
            self._leaders[p] = leader
        moved = [p for p in moved if p in self._last and p not in self._stopped and
                 p not in self._held]
        if moved:
            log.info("%s: partitions %s have another leader: the records below their "
                     "positions are read again before more are handed over", self.topic,
                     sorted(moved))
            self._recheck.update(moved)

    async def _check_anchors(self) -> None:
        """Every ``recheck_every_s`` of reading: read again, by one side client, the
        record each partition had last handed over at the previous check (its anchor),
        and stop (or count) a partition where it is another record. An anchor gone
        although retention did not delete it (compacted) cannot be compared (logged). Then
        the last records read become the anchors. Brokers or a side client that do not
        answer within ``FINGERPRINT_TIMEOUT_S`` leave the check to the next round
        (logged): ingest hands nothing over meanwhile."""
        self._anchor_due = time.monotonic() + self.recheck_every_s
        anchors = {p: fp for p, fp in self._anchor.items()
                   if p not in self._stopped and p not in self._held and p in self._last}
        if anchors:
            try:
                tps = [self._tps[p] for p in anchors]
                begin = await self._log_starts(tps)
                losses = await recreated(
                    self._kwargs, self.topic, {p: fp.offset + 1 for p, fp in anchors.items()},
                    anchors, begin, skip=self.on_data_loss == "skip",
                    timeout_s=self._fingerprint_timeout_s, absent_is_loss=False)
            except KafkaUnavailable as e:
                log.warning("%s: the records read at %s could not be read again to check "
                            "the topic was not created again (tried again in %g s): %s",
                            self.topic, {p: fp.offset for p, fp in anchors.items()},
                            self.recheck_every_s, e)
                return
            for loss in losses:
                p = loss.partition
                first = self._next[p]
                since = (f"; offsets {anchors[p].offset + 1}..{first - 1} were read and "
                         f"handed over since, maybe from the new topic"
                         if first > anchors[p].offset + 1 else "")
                self._lose(dataclasses.replace(loss, first=first, checked=anchors[p].offset,
                                               detail=f"{loss.detail}{since}"))
        for p, record in self._last.items():
            if p in self._stopped or p in self._held:
                continue
            if record.offset == self._next[p] - 1:
                self._anchor[p] = Fingerprint.of(record)
            else:   # moved since it was read: the next record read is the anchor
                self._anchor.pop(p, None)

    def _adopt(self, consumer: AIOKafkaConsumer, num_partitions: int) -> None:
        """The topic grew to ``num_partitions`` (CreatePartitions while the job runs):
        read the new partitions this replica owns (``p % replica_size``: no partition
        changes owner) from offset 0. Every record of them was written after this
        consumer started, so none may be skipped; one the broker no longer has is a
        loss like any other (``on_data_loss``). The others keep their positions and
        pauses."""
        old, self.num_partitions = self.num_partitions, num_partitions
        self._counts["partitions_added"] += num_partitions - old
        new = [p for p in static_partitions(num_partitions, self.replica_index,
                                            self.replica_size) if p not in self._tps]
        log.warning("%r grew from %d to %d partitions while it was read; replica %d reads "
                    "its new partitions %s from offset 0%s", self.topic, old, num_partitions,
                    self.replica_index, new,
                    "" if self.expected_partitions in (None, num_partitions) else
                    f" (a restart refuses the topic until kafka.num_partitions is "
                    f"{num_partitions})")
        if not new:
            return
        paused = {tp.partition for tp in consumer.paused()}
        # A pause of every partition (backpressure, an API pause) that a resume will lift
        # holds the new ones too; stopped and held partitions are paused for good and say
        # nothing about it (the new ones would never be read, their samples never trained).
        live = set(self._tps) - set(self._stopped) - self._held
        all_paused = bool(live) and paused >= live
        for p in new:
            self._tps[p] = TopicPartition(self.topic, p)
            self._next[p] = self._added[p] = 0
        # assign() forgets positions and pauses (and drops what was fetched but not
        # handed over): every partition goes back to where the next record is owed.
        consumer.assign(list(self._tps.values()))
        for p, tp in self._tps.items():
            consumer.seek(tp, self._next[p])
        again = paused | (set(new) if all_paused else set())
        if again:
            consumer.pause(*(self._tps[p] for p in again))

    def take_added(self) -> dict[int, int]:
        """Partitions added to the topic and adopted since the last call, with the offset
        each starts at (a worker's checkpoint frontier tracks them from there)."""
        added, self._added = self._added, {}
        return added

    def _after_gaps(self, p: int, records: list[ConsumerRecord],
                    holes: list[tuple[int, int]]) -> list[ConsumerRecord]:
        """The records to hand over from a fetch with holes: all of them when the losses
        are accepted, else those before the first hole (and the partition stops)."""
        for index, first_missing in holes:
            loss = DataLoss(self.topic, p, first_missing, records[index].offset, "gap",
                            accepted=self.on_data_loss == "skip")
            if not self._lose(loss):
                return records[:index]
        return records

    def pause(self, partitions: Iterable[int] | None = None) -> None:
        """Stop fetching ``partitions`` (all owned ones when None) until resumed."""
        tps = self._owned(partitions)
        now = time.monotonic()
        for tp in tps:
            self._paused_at.setdefault(tp.partition, now)
        self._live().pause(*tps)

    def resume(self, partitions: Iterable[int] | None = None) -> None:
        """Fetch ``partitions`` again (all owned ones when None), except those stopped on
        a data loss or held: nothing resumes them. One paused for
        ``recheck_after_pause_s`` or longer is checked before it is read on."""
        tps = [tp for tp in self._owned(partitions)
               if tp.partition not in self._stopped and tp.partition not in self._held]
        now = time.monotonic()
        for tp in tps:
            since = self._paused_at.pop(tp.partition, None)
            if since is not None and now - since >= self.recheck_after_pause_s:
                self._recheck.add(tp.partition)
        self._live().resume(*tps)

    def hold(self, partitions: Iterable[int]) -> None:
        """Never read ``partitions`` again (their stream would replay data the embedding
        servers applied already: :mod:`stream_persia.core.watermarks`); nothing resumes them,
        and records of them fetched already are dropped."""
        tps = self._owned(partitions)
        self._held.update(tp.partition for tp in tps)
        self._live().pause(*tps)

    def stopped(self) -> dict[int, DataLoss]:
        """Partitions stopped on a data loss (``on_data_loss="fail"``), with the loss."""
        return dict(self._stopped)

    def lost_messages(self) -> dict[int, int]:
        """Messages lost and accepted (``on_data_loss="skip"``), per partition."""
        return dict(self._lost)

    def accepted_losses(self) -> list[DataLoss]:
        """The latest accepted losses (at most ``MAX_LOSSES_KEPT``)."""
        return list(self._accepted)

    def paused(self) -> set[int]:
        return {tp.partition for tp in self._live().paused()}

    async def positions(self) -> dict[int, int]:
        """Next offset :meth:`getmany` will return, per owned partition."""
        consumer = self._live()
        return {p: await consumer.position(tp) for p, tp in self._tps.items()}

    def tail_now(self) -> dict[int, tuple[int, int | None]]:
        """Per owned partition, ``(next offset, high watermark)`` as known now, without a
        request: the high watermark comes with every fetch response (None before the
        first one, and stale while the partition is paused)."""
        consumer = self._live()
        return {p: (self._next[p], consumer.highwater(tp)) for p, tp in self._tps.items()}

    def side_client_kwargs(self) -> dict[str, Any]:
        """This consumer's client settings (brokers, security, fetch sizes), for a side
        client such as :class:`~stream_persia.kafka.probe.TailProbe`."""
        return dict(self._kwargs)

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

    #: The keys of :meth:`stats` that only grow; ``partitions``, ``partitions_stopped``
    #: and ``broker_down_seconds`` are levels. ``offsets_lost``: messages lost and
    #: accepted (``on_data_loss="skip"``); ``data_loss_events``: losses detected,
    #: accepted or not; ``fingerprint_mismatches``: starts at stored offsets whose record
    #: below did not match the checkpoint's fingerprint (or, while reading, a record
    #: read before: ``recheck_after_pause_s``, ``recheck_every_s``), accepted (a
    #: recreated topic);
    #: ``partitions_added``: partitions the topic gained while it was read.
    COUNTERS = frozenset({"records", "bytes", "commits", "commit_failures", "commits_skipped",
                          "offsets_lost", "data_loss_events", "fingerprint_mismatches",
                          "partitions_added"})

    def stats(self) -> dict[str, float]:
        """Counts and levels for metrics (``RoleMetrics.add_callback``; see :attr:`COUNTERS`)."""
        return {**self._counts, "partitions": len(self._tps),
                "partitions_stopped": len(self._stopped),
                "broker_down_seconds": self._watch.down_s}

    async def stop(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            await stop_client(consumer)

    async def __aenter__(self) -> SampleConsumer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()
