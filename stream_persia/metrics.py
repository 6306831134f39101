"""Prometheus metrics for every role.

Each role instance owns its own :class:`prometheus_client.CollectorRegistry` so several
roles can live in one process (tests, the embedded topology) without name clashes.
Values that a component already counts (the store's statistics, buffer depths) are read
at scrape time through :class:`CallbackCollector` instead of being mirrored by hand.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["RoleMetrics", "CallbackCollector", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class CallbackCollector(Collector):
    """Exposes ``{name: value}`` from a callback as gauges named ``<prefix>_<name>``."""

    def __init__(self, prefix: str, callback: Callable[[], dict[str, float]],
                 labels: dict[str, str] | None = None):
        self._prefix = prefix
        self._callback = callback
        self._labels = dict(labels or {})

    def collect(self) -> Iterable[GaugeMetricFamily]:
        for name, value in sorted(self._callback().items()):
            fam = GaugeMetricFamily(f"{self._prefix}_{name}", f"{self._prefix} {name}",
                                    labels=list(self._labels))
            fam.add_metric(list(self._labels.values()), float(value))
            yield fam


class RoleMetrics:
    """The metrics of one role instance (``role`` like ``embedding_server``)."""

    def __init__(self, role: str, replica_index: int = 0):
        self.role = role
        self.replica_index = replica_index
        self.registry = CollectorRegistry(auto_describe=True)
        self._prefix = f"persia_{role}"

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(f"{self._prefix}_{name}", doc, labels, registry=self.registry)

    def gauge(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(f"{self._prefix}_{name}", doc, labels, registry=self.registry)

    def histogram(self, name: str, doc: str, labels: tuple[str, ...] = (),
                  buckets: tuple[float, ...] = Histogram.DEFAULT_BUCKETS) -> Histogram:
        return Histogram(f"{self._prefix}_{name}", doc, labels, registry=self.registry,
                         buckets=buckets)

    def add_callback(self, name: str, callback: Callable[[], dict[str, float]]) -> None:
        self.registry.register(CallbackCollector(f"{self._prefix}_{name}", callback))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric of this role."""
        return generate_latest(self.registry)
