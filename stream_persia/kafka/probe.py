"""The tail probe: the newest record of some partitions, read by a consumer of its own.

An embedding worker's Kafka lag in seconds needs the event time of the newest record of
each partition it lags on (:mod:`stream_persia.worker.kafka_lag`). The worker's own
consumer reads in order, so it cannot see the tail while behind. :class:`TailProbe` keeps
one extra consumer (no group: it commits nothing and joins nothing), assigns the
partitions asked about, seeks each to its end offset - 1, fetches once, and pauses them
again, so it holds at most one fetch per partition and one set of broker connections.

Its caller bounds how often it runs (a few seconds apart, lagging partitions only). The
record read is the newest *up to the end offset given*; records appended since may be
returned too (the newest of them is taken). On Tansu, whose ListOffsets "latest" is the
last record batch's base offset + 1, end - 1 is the first record of the last batch: the
fetch returns that whole batch, so the newest record is still read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, ConsumerRecord, TopicPartition

from stream_persia.kafka.liveness import start_client, stop_client

__all__ = ["TailProbe"]


class TailProbe:
    """Reads the newest record of partitions of ``topic``.

    Args:
        client_kwargs: the worker consumer's client settings (brokers, security, fetch
            sizes: ``SampleConsumer.side_client_kwargs``); the group is dropped.
        topic: the topic.
        timeout_s: how long one :meth:`newest` waits for the records.
    """

    def __init__(self, client_kwargs: Mapping[str, Any], topic: str, *,
                 timeout_s: float = 2.0):
        self._kwargs = {**client_kwargs, "group_id": None, "enable_auto_commit": False,
                        "auto_offset_reset": "latest"}
        self.topic = topic
        self.timeout_s = timeout_s
        self._consumer: AIOKafkaConsumer | None = None
        self.probes = 0

    async def newest(self, ends: Mapping[int, int]) -> dict[int, ConsumerRecord]:
        """Per partition of ``ends`` (partition → end offset, > 0), the newest record at or
        after ``end - 1`` fetched within ``timeout_s``; partitions without one are left
        out."""
        ends = {p: e for p, e in ends.items() if e > 0}
        if not ends:
            return {}
        if self._consumer is None:
            self._consumer = await start_client(lambda: AIOKafkaConsumer(**self._kwargs),
                                                self._kwargs["bootstrap_servers"],
                                                timeout_s=self.timeout_s)
        consumer = self._consumer
        tps = {p: TopicPartition(self.topic, p) for p in ends}
        consumer.assign(list(tps.values()))
        for p, tp in tps.items():
            consumer.seek(tp, ends[p] - 1)
        self.probes += 1
        out: dict[int, ConsumerRecord] = {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        try:
            while len(out) < len(tps):
                left = deadline - loop.time()
                if left <= 0:
                    break
                want = [tp for p, tp in tps.items() if p not in out]
                got = await consumer.getmany(*want, timeout_ms=int(left * 1000))
                for tp, records in got.items():
                    if records:
                        out[tp.partition] = records[-1]
        finally:
            consumer.pause(*tps.values())   # no prefetch between probes
        return out

    async def stop(self) -> None:
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            await stop_client(consumer)
