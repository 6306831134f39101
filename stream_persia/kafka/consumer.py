"""The samples consumer: :class:`SampleConsumer`, by static assignment (see
:mod:`stream_persia.kafka`)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition
from aiokafka.errors import KafkaError

from stream_persia.errors import BadInput, ConfigError, Misuse
from stream_persia.kafka._client import (
    DEFAULT_FETCH_MAX_WAIT_MS,
    DEFAULT_MAX_MESSAGE_BYTES,
    check_replica,
    client_kwargs,
    config_servers,
    partitions_for_replica,
    partitions_of,
    start_client,
    validate_topic,
)

log = logging.getLogger(__name__)


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
        check_replica(replica_index, replica_size)
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
        self._kwargs = client_kwargs(bootstrap_servers, security_kwargs, client_id)
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
        await start_client(consumer, self._kwargs["bootstrap_servers"])
        try:
            await self._assign_and_seek(consumer, dict(start_offsets or {}))
        except BaseException:
            await consumer.stop()
            raise
        self._consumer = consumer

    async def _assign_and_seek(self, consumer: AIOKafkaConsumer,
                               start_offsets: dict[int, int]) -> None:
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
