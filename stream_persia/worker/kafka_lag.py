"""Kafka lag of an embedding worker, per partition, in messages and in seconds, and the
``produced`` stage watermark (:mod:`stream_persia.core.stages`).

Per partition the worker reads (:class:`KafkaLag`, owned by its
:class:`~stream_persia.worker.ingest.KafkaIngest`):

- **messages**: the end offset (high watermark) minus the worker's position: the offset
  after the last record its ingest handled (accepted or dead-lettered), so records fetched
  but still waiting for room in the ready buffer count as lag. The high
  watermark comes free with every fetch response (aiokafka's ``highwater``); a paused
  partition (backpressure) is not fetched, so the probe task below also asks the brokers
  for the end offsets (one ListOffsets request for all the worker's partitions) every
  ``probe_interval_s``, and the larger of the two is used.
- **seconds**: the event time of the newest record of the partition minus the event time
  of the newest record this worker ingested from it (0 when caught up). The ingest
  records the newest ``PersiaBatch.event_time`` per partition as it accepts a batch (a
  comparison per batch it already decodes: no other per-record work). The newest record's
  event time: when caught up, the last one ingested; when behind, the probe task reads
  it every ``probe_interval_s`` with a consumer of its own, one record batch per lagging
  partition (:class:`~stream_persia.kafka.TailProbe`), and decodes its event time.
  Nothing is known about a lagging partition until the first probe, or before this worker
  ingested anything from it: no sample then.

The producer does not stamp the Kafka record timestamp with the event time, so the probe
decodes the record instead: a record's timestamp drives the topic's time-based retention,
and a replayed historical dataset (event times years old) would be deleted at once.

Error bounds. While a partition lags, its seconds and the ``produced`` watermark are as of
the last probe: they miss at most what was appended in one ``probe_interval_s`` (5 s).
Messages use the high watermark of the last fetch or ListOffsets, at most
``probe_interval_s`` old for a paused partition. On Tansu, ListOffsets "latest" (and the
high watermark) is the last record batch's base offset + 1, so messages may undercount by
the records of one producer batch minus one; the probe reads that whole batch, so seconds
are not affected.

Bounds: one probe consumer per worker (connections to the partitions' leaders), at most
one record batch per lagging partition fetched per probe, state of a few numbers per
partition.

Exported (:class:`KafkaLagCollector`) as ``persia_embedding_worker_kafka_lag_messages
{topic,partition}`` and ``persia_embedding_worker_kafka_lag_seconds{topic,partition}``.
A probe that fails (brokers down or slow: it gives up after 2 s, and the next one comes a
``probe_interval_s`` later) leaves both as last known; the worker counts the failures in
``persia_embedding_worker_kafka_lag_probe_failures_total`` (:class:`~stream_persia.worker.
ingest.KafkaIngest` ``stats``), and logs a warning when probes start failing. As last
known may well read 0 (a worker caught up when the brokers went away stays "caught up"),
so the figures carry their age: ``persia_embedding_worker_kafka_lag_probe_age_seconds``,
the seconds since the last probe that succeeded (since the probing started before the
first one); the ``PersiaKafkaLagUnknown`` alert fires on it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, TypedDict

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from stream_persia.core import wire
from stream_persia.core.backoff import wait_bounded
from stream_persia.core.data import check_event_time
from stream_persia.core.stages import newer
from stream_persia.errors import Misuse

if TYPE_CHECKING:   # a broker-less worker (which exports no lag) never loads aiokafka
    from stream_persia.kafka import SampleConsumer, TailProbe

__all__ = ["KafkaLag", "KafkaLagCollector", "LagRow", "PROBE_INTERVAL_S"]

log = logging.getLogger(__name__)

#: Seconds between two probes (end offsets, and the tail of lagging partitions).
PROBE_INTERVAL_S = 5.0
MESSAGES_METRIC = "persia_embedding_worker_kafka_lag_messages"
SECONDS_METRIC = "persia_embedding_worker_kafka_lag_seconds"
AGE_METRIC = "persia_embedding_worker_kafka_lag_probe_age_seconds"


class LagRow(TypedDict):
    """One partition's lag (``status``'s ``kafka_lag``; None: not known yet), and
    ``probe_age_s``: how old the figures may be (:meth:`KafkaLag.probe_age_s`)."""

    topic: str
    partition: int
    messages: int | None
    seconds: float | None
    probe_age_s: float | None


def record_event_time(value: bytes | None) -> float | None:
    """The event time of an encoded batch (None when it has none or is not a batch)."""
    if not value:
        return None
    try:
        d = wire.unpack(value)
        return check_event_time(d.get("event_time")) if isinstance(d, dict) else None
    except Exception:          # a record the ingest will dead-letter: no event time
        return None


class KafkaLag:
    """One Kafka ingest's lag per partition (module docstring).

    Args:
        consumer: the ingest's consumer (started before :meth:`start`).
        probe_interval_s: seconds between two probes.
    """

    def __init__(self, consumer: SampleConsumer, *,
                 probe_interval_s: float = PROBE_INTERVAL_S):
        self.consumer = consumer
        self.topic = consumer.topic
        self.probe_interval_s = probe_interval_s
        self.ingested: dict[int, float] = {}   # newest event time ingested, per partition
        self._position: dict[int, int] = {}    # offset after the last record handled
        self._ends: dict[int, int] = {}        # end offsets of the last ListOffsets
        self._tail: dict[int, float] = {}      # newest event time probed, per partition
        self._probe: TailProbe | None = None
        self._task: asyncio.Task | None = None
        #: probes that failed (a broker down or slow); the worker exports the count
        self.probe_failures = 0
        self._failing = False
        self._clock = time.monotonic
        self._probed_at: float | None = None   # last probe that succeeded (or the start)

    def saw(self, partition: int, offset: int, event_time: float | None) -> None:
        """The record at ``offset`` of ``partition`` was handled: ingested (with its
        batch's ``event_time``) or dead-lettered (None)."""
        self._position[partition] = offset + 1
        if event_time is not None:
            cur = self.ingested.get(partition)
            if cur is None or event_time > cur:
                self.ingested[partition] = event_time

    def _tail_now(self) -> dict[int, tuple[int, int | None]]:
        try:
            return self.consumer.tail_now()
        except Misuse:      # not started, or stopped
            return {}

    def rows(self) -> list[LagRow]:
        """Every owned partition's lag now (no request)."""
        out: list[LagRow] = []
        age = self.probe_age_s()
        for p, (fetched, highwater) in sorted(self._tail_now().items()):
            position = self._position.get(p, fetched)
            ends = [e for e in (highwater, self._ends.get(p)) if e is not None]
            messages = max(0, max(ends) - position) if ends else None
            seconds: float | None = None
            if messages == 0:
                seconds = 0.0
            elif messages is not None:
                tail, got = self._tail.get(p), self.ingested.get(p)
                if tail is not None and got is not None:
                    seconds = max(0.0, tail - got)
            out.append({"topic": self.topic, "partition": p, "messages": messages,
                        "seconds": seconds, "probe_age_s": age})
        return out

    def probe_age_s(self) -> float | None:
        """Seconds since the last probe that succeeded, or since :meth:`start` before the
        first one: how old the lag figures may be (None before :meth:`start`)."""
        if self._probed_at is None:
            return None
        return max(0.0, self._clock() - self._probed_at)

    def produced(self) -> float | None:
        """The ``produced`` watermark: the newest event time known in the partitions."""
        mark: float | None = None
        for t in (*self.ingested.values(), *self._tail.values()):
            mark = newer(mark, t)
        return mark

    async def start(self, positions: Mapping[int, int]) -> None:
        """Start probing; ``positions``: where the ingest starts each partition."""
        from stream_persia.kafka import TailProbe

        self._position.update(positions)
        self._probed_at = self._clock()

        self._probe = TailProbe(self.consumer.side_client_kwargs(), self.topic,
                                timeout_s=min(2.0, self.probe_interval_s))
        self._task = asyncio.create_task(self._run(), name="kafka-lag-probe")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._probe is not None:
            await self._probe.stop()
            self._probe = None

    async def probe(self) -> None:
        """One probe: the end offsets, then the newest record of each lagging partition."""
        self._ends = await wait_bounded(self.consumer.end_offsets(), 2.0)
        lagging = {p: e for p, e in self._ends.items() if e > self._position.get(p, e)}
        if not lagging or self._probe is None:
            return
        for p, rec in (await self._probe.newest(lagging)).items():
            t = record_event_time(rec.value)
            cur = self._tail.get(p)
            if t is not None and (cur is None or t > cur):
                self._tail[p] = t

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            try:
                await self.probe()
            except asyncio.CancelledError:
                raise
            except Exception as e:    # the next probe may succeed; lag stays as it was
                if not self._failing:
                    log.warning("Kafka lag probe of %s failed: %r; the lag stays as last "
                                "known until a probe succeeds (counted in "
                                "kafka_lag_probe_failures)", self.topic, e)
                self._failing = True
                self.probe_failures += 1
            else:
                self._probed_at = self._clock()
                if self._failing:
                    log.info("Kafka lag probe of %s succeeds again", self.topic)
                self._failing = False


class KafkaLagCollector(Collector):
    """Exports ``rows()`` as the two ``persia_embedding_worker_kafka_lag_*`` families
    (a partition whose figure is unknown has no sample), and ``age()`` (seconds since the
    last probe that succeeded; None: no sample) as ``..._kafka_lag_probe_age_seconds``."""

    def __init__(self, rows: Callable[[], Iterable[LagRow]],
                 age: Callable[[], float | None] = lambda: None):
        self._rows = rows
        self._age = age

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily(MESSAGES_METRIC, "", labels=["topic", "partition"]),
                GaugeMetricFamily(SECONDS_METRIC, "", labels=["topic", "partition"]),
                GaugeMetricFamily(AGE_METRIC, "")]

    def collect(self) -> Iterable[Metric]:
        msgs = GaugeMetricFamily(MESSAGES_METRIC, "messages between the partition's end "
                                 "offset and this worker's position",
                                 labels=["topic", "partition"])
        secs = GaugeMetricFamily(SECONDS_METRIC, "event time of the partition's newest "
                                 "record minus that of the newest record this worker "
                                 "ingested from it", labels=["topic", "partition"])
        any_m = any_s = False
        for row in self._rows():
            labels = [row["topic"], str(row["partition"])]
            if row["messages"] is not None:
                msgs.add_metric(labels, float(row["messages"]))
                any_m = True
            if row["seconds"] is not None:
                secs.add_metric(labels, row["seconds"])
                any_s = True
        if any_m:
            yield msgs
        if any_s:
            yield secs
        age = self._age()
        if age is not None:
            yield GaugeMetricFamily(AGE_METRIC, "seconds since the last Kafka lag probe "
                                    "that succeeded: how old the lag figures may be",
                                    value=age)
