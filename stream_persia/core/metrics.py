"""Prometheus metrics for every role.

Each role instance owns its own :class:`prometheus_client.CollectorRegistry` so several
roles can live in one process (tests, the embedded topology) without name clashes.
Values that a component already counts (the store's statistics, buffer depths) are read
at scrape time through :class:`CallbackCollector` instead of being mirrored by hand. The
keys a component declares as counters (they only grow, so ``rate()`` applies) are exported
as counters, named ``<prefix>_<key>_total``; every other key is a gauge ``<prefix>_<key>``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from stream_persia.errors import Misuse

__all__ = ["RoleMetrics", "CallbackCollector", "CONTENT_TYPE"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class CallbackCollector(Collector):
    """Exposes ``{name: value}`` from a callback: the names in ``counters`` as counters
    ``<prefix>_<name>_total``, the others as gauges ``<prefix>_<name>``.

    Every name in ``counters`` must be a key of what the callback returns now (it is
    called once here): a misspelt name would otherwise export the key as a gauge unnoticed.
    A counter's key must then stay in the callback's reply and never decrease.

    Raises:
        Misuse: ``counters`` is a bare string, or names a key the callback does not return.
    """

    def __init__(self, prefix: str, callback: Callable[[], dict[str, float]],
                 labels: dict[str, str] | None = None, *,
                 counters: Iterable[str] = frozenset()):
        if isinstance(counters, str):
            raise Misuse(f"counters of {prefix!r} must be a collection of key names, got the "
                         f"string {counters!r}", field="counters",
                         hint=f"write frozenset({{{counters!r}}})")
        self._prefix = prefix
        self._callback = callback
        self._labels = dict(labels or {})
        self._counters = frozenset(counters)
        returned = set(callback())
        unknown = self._counters - returned
        if unknown:
            raise Misuse(f"counters of {prefix!r} name {sorted(unknown)}, which its callback "
                         f"does not return; it returns {sorted(returned)}",
                         field="counters", hint="declare only the keys that only grow")

    def collect(self) -> Iterable[Metric]:
        for name, value in sorted(self._callback().items()):
            family = CounterMetricFamily if name in self._counters else GaugeMetricFamily
            fam = family(f"{self._prefix}_{name}", f"{self._prefix} {name}",
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

    def add_callback(self, name: str, callback: Callable[[], dict[str, float]], *,
                     counters: Iterable[str] = frozenset()) -> None:
        """Export what ``callback`` returns at each scrape as ``<role prefix>_<name>_<key>``:
        the keys in ``counters`` as counters (``..._total``), the others as gauges (see
        :class:`CallbackCollector`, which raises :class:`Misuse` for an unknown counter)."""
        self.registry.register(CallbackCollector(f"{self._prefix}_{name}", callback,
                                                 counters=counters))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric of this role."""
        return generate_latest(self.registry)
