"""Stage watermarks: the event time of the newest sample that reached each stage of the
job, and its age, as every role exports them.

One definition of event time (DESIGN): ``PersiaBatch.event_time``, seconds since the Unix
epoch of the batch's newest sample. A *stage watermark* is the newest event time that
reached a stage at one role:

- ``produced``: the newest event time in the Kafka partitions an embedding worker reads
  (:mod:`stream_persia.worker.kafka_lag`);
- ``ingested``: the newest batch an embedding worker accepted (Kafka or direct);
- ``trained``: the newest batch NN rank 0 ran a backward on, relayed by its heartbeat to
  embedding worker 0 (:mod:`stream_persia.worker.mailbox`);
- ``applied``: an embedding server's ``trained_through``;
- ``served``: a serving replica's ``trained_through`` (the API).

Exported (:class:`StageCollector`) as ``persia_stage_event_time_seconds{stage}`` and
``persia_stage_lag_seconds{stage}`` (scrape time minus the watermark: the age of the newest
sample at that stage; it grows while the stream is idle, by definition). A stage without a
watermark yet exports no sample. The names carry no role prefix: the API's ``/metrics``
adds ``role`` and ``replica`` to every role's samples.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

__all__ = ["STAGES", "StageCollector", "EVENT_TIME_METRIC", "LAG_METRIC", "newer"]

STAGES = ("produced", "ingested", "trained", "applied", "served")
EVENT_TIME_METRIC = "persia_stage_event_time_seconds"
LAG_METRIC = "persia_stage_lag_seconds"


def newer(current: float | None, event_time: float | None) -> float | None:
    """The watermark after seeing ``event_time`` (never lowered; None and non-finite
    event times are ignored)."""
    if event_time is None or not math.isfinite(event_time):
        return current
    return event_time if current is None or event_time > current else current


class StageCollector(Collector):
    """Exports ``callback()`` (stage → event time or None) as the two stage families.

    Args:
        callback: the role's watermarks now, read at each scrape.
        clock: wall-clock seconds (the lag's "now").
    """

    def __init__(self, callback: Callable[[], Mapping[str, float | None]],
                 clock: Callable[[], float] = time.time):
        self._callback = callback
        self._clock = clock

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily(EVENT_TIME_METRIC, "", labels=["stage"]),
                GaugeMetricFamily(LAG_METRIC, "", labels=["stage"])]

    def collect(self) -> Iterable[Metric]:
        marks = {s: t for s, t in self._callback().items()
                 if t is not None and math.isfinite(t)}
        if not marks:
            return
        now = self._clock()
        at = GaugeMetricFamily(EVENT_TIME_METRIC, "event time (Unix seconds) of the newest "
                               "sample that reached the stage at this role", labels=["stage"])
        lag = GaugeMetricFamily(LAG_METRIC, "seconds since the event time of the newest "
                                "sample that reached the stage at this role", labels=["stage"])
        for stage, t in sorted(marks.items()):
            at.add_metric([stage], t)
            lag.add_metric([stage], now - t)
        yield at
        yield lag
