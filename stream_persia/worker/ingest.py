"""Kafka ingest for an embedding worker: static partitions → validated, planned batches.

One task owns the :class:`~stream_persia.kafka.SampleConsumer`. For each record it
records the offset in the worker's frontier, decodes and plans the batch, and puts it in
the worker's bounded ready buffer. While that buffer is full the owned partitions are
paused, so fetched-but-unserved data stays bounded; they resume when it drains.

A record that cannot be decoded or validated goes to the dead-letter topic with the
reason and is settled in the frontier (a checkpoint never replays it). If the dead-letter
topic cannot be written, ingest retries with backoff rather than move past the record:
an outage stalls ingest visibly, it never loses a sample silently.

Offsets the broker no longer has (retention, gaps, a truncated log) are never skipped
silently: by default the consumer stops that partition and the status reports it
(``kafka.stopped``); the others go on, and the frontier of the stopped one stays where
the loss starts (:mod:`stream_persia.kafka.loss`).

Partitions added to the topic while it is read (the consumer adopts its new ones:
:meth:`SampleConsumer.take_added <stream_persia.kafka.SampleConsumer.take_added>`) are
tracked in the frontier from their start offset before anything is read from them, so a
checkpoint cut records them from then on.

Failure: when no broker answers for ``kafka.broker_timeout_ms`` (while waiting for
records, or while retrying a dead letter), the ingest task ends with
:class:`~stream_persia.kafka.liveness.KafkaUnavailable` naming the bootstrap servers
(:attr:`KafkaIngest.task`; the worker's supervision turns that into a failed role).

Before it reads anything (at start, and on each ``reset_stream``), the ingest asks every
embedding server how far it applied each partition (its stream watermarks,
:mod:`stream_persia.core.watermarks`), waiting for the servers as it waits for the brokers (up
to ``kafka.startup_timeout_ms``). A partition without a start offset whose watermarks all
come from a restore starts at the restored cut, checked against the checkpoint's
fingerprints the servers keep with it (a topic recreated since the restore is refused
there as the restore refuses it: :mod:`stream_persia.kafka.fingerprint`); a partition
whose start is at or below a
watermark is *refused*: held (never read, so never served), listed in :meth:`status`
(``refused``), and reported to the worker (``EmbeddingWorker.stream_checked``: health
not ok and ``next_batch`` raises ``StreamReplay`` until a restore resets the stream).
Every update of a batch carries its ``(topic, partition, offset)`` and this stream's
``writer`` id, so the servers advance the watermarks and refuse another stream's replay.

Lag (:mod:`stream_persia.worker.kafka_lag`): each batch accepted records its event time
for its partition (:attr:`KafkaIngest.lag`) and for the worker's ``ingested`` stage
watermark; a probe task owned by :attr:`KafkaIngest.lag` (started and stopped with the
ingest) reads the end offsets and the newest record of lagging partitions every
``lag_probe_interval_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

from stream_persia.core import watermarks
from stream_persia.core.backoff import retry_startup, wait_bounded
from stream_persia.core.data import PersiaBatch
from stream_persia.errors import BadInput, Misuse, PeerUnavailable, RemoteTimeout
from stream_persia.kafka import DeadLetterWriter, KafkaUnavailable, SampleConsumer
from stream_persia.kafka.fingerprint import Fingerprint
from stream_persia.worker.frontier import Frontier
from stream_persia.worker.kafka_lag import PROBE_INTERVAL_S, KafkaLag

log = logging.getLogger(__name__)

__all__ = ["KafkaIngest"]

STATUS_LAG_TIMEOUT_S = 1.0


class KafkaIngest:
    """Feeds ``worker`` from its partitions of the samples topic.

    Args:
        worker: the :class:`~stream_persia.worker.service.EmbeddingWorker` to feed.
        consumer: a not-yet-started consumer for this worker's replica.
        dead_letters: a not-yet-started writer for the dead-letter topic.
        start_offsets: partition → first offset to read (from a checkpoint).
        max_records: records taken per poll (bounds fetched-but-unplanned work).
        lag_probe_interval_s: seconds between two probes of the partitions' ends
            (:mod:`stream_persia.worker.kafka_lag`).
    """

    def __init__(self, worker: Any, consumer: SampleConsumer, dead_letters: DeadLetterWriter,
                 *, start_offsets: dict[int, int] | None = None, max_records: int = 32,
                 lag_probe_interval_s: float = PROBE_INTERVAL_S):
        self.worker = worker
        self.consumer = consumer
        self.dead_letters = dead_letters
        self.start_offsets = dict(start_offsets or {})
        # The checkpoint's fingerprints of the records below start_offsets (set by the
        # worker's reset_stream; None: not a checkpoint's, nothing compared).
        self.start_fingerprints: dict[int, Fingerprint] | None = None
        self.max_records = max_records
        self.backpressure_pauses = 0
        self._task: asyncio.Task | None = None
        # This stream's id on the servers' watermarks, and the partitions it refused.
        self.writer: str | None = None
        self.refused: list[watermarks.Refusal] = []
        self._stream: tuple[str, str] | None = None
        self.lag = KafkaLag(consumer, probe_interval_s=lag_probe_interval_s)

    #: The keys of :meth:`stats` that only grow (``consumer_partitions`` is a level).
    COUNTERS = frozenset({*(f"consumer_{k}" for k in SampleConsumer.COUNTERS),
                          *(f"dlq_{k}" for k in DeadLetterWriter.COUNTERS),
                          "backpressure_pauses", "lag_probe_failures"})

    def stats(self) -> dict[str, float]:
        """Counts and levels for the worker's metrics (the worker registers them once, and
        carries the counts of a replaced ingest over); :attr:`COUNTERS` are the counts."""
        stats = {f"consumer_{k}": v for k, v in self.consumer.stats().items()}
        stats.update({f"dlq_{k}": v for k, v in self.dead_letters.stats().items()})
        stats["backpressure_pauses"] = self.backpressure_pauses
        stats["lag_probe_failures"] = self.lag.probe_failures
        return stats

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        worker, consumer = self.worker, self.consumer
        topic = consumer.topic
        await self.dead_letters.start()
        await consumer.start(self.start_offsets, self.start_fingerprints)
        marks = await self._watermarks()
        resumed = {p: o for p, o in watermarks.resume_points(marks).items()
                   if p in consumer.partitions and p not in self.start_offsets}
        if resumed:
            # The record below each is the one the checkpoint was cut at, or the topic was
            # recreated since the restore (KafkaDataLoss with on_data_loss: fail).
            await consumer.seek(resumed, self._resume_fingerprints(marks, resumed))
            log.info("worker %d: partitions %s of %s resume at the cut restored into the "
                     "embedding servers (nothing applied since): %s", worker.replica_index,
                     sorted(resumed), topic, resumed)
        positions = await consumer.positions()
        self.writer = worker.new_stream_writer()
        self._stream = (topic, self.writer)
        self.refused = watermarks.refusals(topic, marks, positions)
        if self.refused:
            consumer.hold([r.partition for r in self.refused])
        worker.frontier = Frontier(positions, allow_gaps=consumer.on_data_loss == "skip")
        worker.stream_checked(self.refused)
        await self.lag.start(positions)
        self._task = asyncio.create_task(self._run(), name="kafka-ingest")
        log.info("worker %d consumes %s partitions %s from %s", self.worker.replica_index,
                 self.consumer.topic, self.consumer.partitions,
                 self.worker.frontier.offsets())

    def track_added(self) -> None:
        """Track the partitions the consumer adopted (added to the topic) in the worker's
        frontier from their start offsets: after each fetch, and before each frontier
        reply (the consumer counts a new partition as soon as it adopts it, inside a
        fetch: a cut read in between must not find the count without the partition)."""
        for partition, offset in self.consumer.take_added().items():
            self.worker.frontier.track(partition, offset)

    def _resume_fingerprints(self, marks: Mapping[int, watermarks.PartitionMark],
                             resumed: Mapping[int, int]) -> dict[int, Fingerprint]:
        """The restored fingerprints of the partitions resumed at a restored cut; one a
        server sent malformed is not checked (logged naming the server): a bad reply of
        a peer must not keep the worker from starting."""
        out: dict[int, Fingerprint] = {}
        for p, raw in watermarks.resume_fingerprints(marks).items():
            if p not in resumed:
                continue
            try:
                out[p] = Fingerprint.from_dict(raw, f"watermarks.{p}.fingerprint")
            except BadInput as e:
                log.warning("worker %d: embedding server %d's fingerprint of %s/%d is not "
                            "one (%s): the topic's identity there is not checked",
                            self.worker.replica_index, marks[p].server,
                            self.consumer.topic, p, e.message)
        return out

    async def _watermarks(self) -> dict[int, watermarks.PartitionMark]:
        """The servers' stream watermarks of this topic, waiting for every server to
        answer for up to ``kafka.startup_timeout_ms`` (a worker may start before them)."""
        router = self.worker.router

        def give_up(e: BaseException, attempts: int, spent: float) -> BaseException:
            return PeerUnavailable(
                f"embedding worker {self.worker.replica_index} cannot start reading "
                f"{self.consumer.topic!r}: embedding servers {router.addresses} did not all "
                f"answer how far they applied it within {spent:.0f} s ({attempts} attempts; "
                f"{e}); serving the stream without knowing could train batches twice",
                hint="are the embedding servers running? kafka.startup_timeout_ms bounds "
                     "the wait")

        return await retry_startup(
            lambda: router.watermarks(self.consumer.topic),
            what=f"embedding servers {', '.join(router.addresses)}",
            timeout_s=self.consumer.startup_timeout_s,
            retry_on=(PeerUnavailable, RemoteTimeout), give_up=give_up)

    @property
    def task(self) -> asyncio.Task | None:
        """The ingest task (None before :meth:`start`). It runs until :meth:`stop`, or
        ends with the error that stopped ingest: ``KafkaUnavailable`` when no broker
        answered for ``kafka.broker_timeout_ms``."""
        return self._task

    async def check_offsets(self, offsets: Mapping[int, int],
                            fingerprints: Mapping[int, Fingerprint] | None = None) -> None:
        """Raise as a restart at ``offsets`` would (``KafkaDataLoss``, ``BadInput``), with
        this ingest left as it is (see ``SampleConsumer.check_offsets``); a no-op when
        this ingest is not running (the restart checks them then)."""
        if self._task is not None and not self._task.done():
            await self.consumer.check_offsets(offsets, fingerprints)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception as e:   # it ended by itself; logged then, and seen by status
                log.debug("Kafka ingest had ended with %r", e)
        await self.lag.stop()
        await self.consumer.stop()
        await self.dead_letters.close()

    async def status(self) -> dict:
        """The ingest's state for the worker's ``status`` (and the API's ``/v1/status``):
        ``stopped`` maps each partition stopped on a data loss to the loss (``first``:
        the first offset not trained, where checkpoints stay; ``resume``; ``lost``;
        ``cause``; ``message``), ``lost_messages`` counts accepted losses per partition,
        ``error`` is why ingest ended, if it did."""
        consumer = self.consumer
        try:
            # Bounded: status must answer soon even while the broker is away (aiokafka
            # would wait its request timeout, 40 s).
            lag = await wait_bounded(consumer.lag(), STATUS_LAG_TIMEOUT_S)
        except Exception as e:
            log.debug("lag unavailable: %r", e)
            lag = {}
        try:
            paused = sorted(consumer.paused())
        except Misuse:          # not started (a restart at refused offsets), or stopped
            paused = []
        task = self._task
        error = (repr(task.exception()) if task is not None and task.done()
                 and not task.cancelled() and task.exception() is not None else None)
        return {"topic": consumer.topic, "partitions": consumer.partitions,
                "lag": {str(p): n for p, n in lag.items()},
                "paused": paused,
                "on_data_loss": consumer.on_data_loss,
                "stopped": {str(p): loss.to_dict() for p, loss in consumer.stopped().items()},
                "lost_messages": {str(p): n for p, n in consumer.lost_messages().items()},
                "refused": [r.to_dict() for r in self.refused],
                "running": task is not None and not task.done(),
                "error": error,
                "dead_lettered": self.dead_letters.stats().get("written", 0),
                "backpressure_pauses": self.backpressure_pauses}

    async def _run(self) -> None:
        worker = self.worker
        try:
            while True:
                if worker.ingest_paused.is_set():
                    self.consumer.pause()
                    while worker.ingest_paused.is_set():
                        await asyncio.sleep(0.05)
                    self.consumer.resume()
                records = await self.consumer.getmany(timeout_ms=200,
                                                      max_records=self.max_records)
                self.track_added()
                for partition, recs in records.items():
                    for rec in recs:
                        await self._one(partition, rec)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("Kafka ingest of worker %d stopped", worker.replica_index)
            raise

    async def _one(self, partition: int, rec: Any) -> None:
        worker = self.worker
        worker.frontier.read(partition, rec.offset)
        try:
            if rec.value is None:
                raise BadInput("the record has no value", field="value")
            pb = worker.prepare(PersiaBatch.from_bytes(rec.value),
                                source=(partition, rec.offset), stream=self._stream)
        except BadInput as e:
            await self._dead_letter(rec, e)
            worker.reject(type(e).__name__)
            worker.frontier.done(partition, rec.offset)
            self.lag.saw(partition, rec.offset, None)
            return
        if worker.ready.full(pb):   # by count, or this batch's bytes would not fit
            self.backpressure_pauses += 1
            self.consumer.pause()
            try:
                await worker.ready.put(pb)
            finally:
                if not worker.ingest_paused.is_set():
                    self.consumer.resume()
        else:
            await worker.ready.put(pb)
        self.lag.saw(partition, rec.offset, pb.batch.event_time)
        worker.accepted(pb)

    async def _dead_letter(self, rec: Any, err: BadInput) -> None:
        delay = 0.1
        first_failure = None
        bound_s = self.consumer.broker_timeout_s
        while not await self.dead_letters.write(
                rec.value or b"", str(err), (rec.topic, rec.partition, rec.offset),
                key=rec.key, kind=type(err).__name__):
            now = time.monotonic()
            first_failure = first_failure or now
            if now - first_failure >= bound_s:
                raise KafkaUnavailable(
                    f"the dead-letter topic {self.dead_letters.topic!r} could not be written "
                    f"for {now - first_failure:.0f} s (Kafka at "
                    f"{self.consumer.bootstrap_servers}); ingest stops rather than skip "
                    f"{rec.topic}/{rec.partition}@{rec.offset}",
                    servers=self.consumer.bootstrap_servers,
                    hint="is the broker up, and does the dead-letter topic exist? "
                         "kafka.broker_timeout_ms bounds the wait")
            log.error("dead-letter topic unavailable; retrying in %.1f s", delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
