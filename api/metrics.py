"""``GET /metrics``: the API's own request metrics plus what every role reports.

The API counts requests and observes latency per route template (``/v1/checkpoints/{id}``,
never the raw path, so label cardinality stays bounded) with a plain ASGI middleware. At
scrape time it also asks every embedding worker and server for its metrics over RPC,
labels each sample with ``role`` and ``replica`` (roles render without them, since each
owns its registry) and merges same-named families, so one scrape of the API covers the
job. A role that does not answer is reported in ``persia_api_role_up`` instead of failing
the scrape.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from stream_persia.core.metrics import RoleMetrics

__all__ = ["ApiMetrics", "HttpMetricsMiddleware", "merge_role_metrics"]

_LATENCY_BUCKETS = (.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10)


class ApiMetrics:
    """The API process's own metrics (one registry per app, so tests can run several)."""

    def __init__(self) -> None:
        m = self.role = RoleMetrics("api")
        self.requests = m.counter("requests_total", "HTTP requests", ("method", "route", "status"))
        self.latency = m.histogram("request_seconds", "HTTP request latency",
                                   ("method", "route"), buckets=_LATENCY_BUCKETS)
        self.in_flight = m.gauge("requests_in_flight", "HTTP requests being served")
        self.predict_rows = m.histogram("predict_rows", "samples per inference request",
                                        buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096))
        self.batch_rows = m.histogram("predict_batch_rows", "samples per micro-batch forward",
                                      buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024, 4096))
        self.batch_requests = m.histogram("predict_batch_requests",
                                          "requests merged into one micro-batch",
                                          buckets=(1, 2, 4, 8, 16, 32, 64, 128))
        self.missing_ids = m.counter("predict_missing_ids_total",
                                     "ids of inference requests absent from the tables")
        self.reloads = m.counter("model_reloads_total", "model swaps", ("outcome",))
        self.checkpoints_deleted = m.counter(
            "checkpoints_deleted_total", "checkpoints deleted from the checkpoint directory "
            "(reason: retention after a checkpoint, or request: DELETE)", ("reason",))
        self.role_up = m.gauge("role_up", "whether a role answered the last scrape",
                               ("role", "replica"))

    def render(self) -> bytes:
        return self.role.render()


class HttpMetricsMiddleware:
    """Counts requests and observes their latency, labelled by route template."""

    def __init__(self, app: ASGIApp, metrics: ApiMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        t0 = time.perf_counter()

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        m = self.metrics
        m.in_flight.inc()
        try:
            await self.app(scope, receive, send_status)
        finally:
            m.in_flight.dec()
            route = scope.get("route")
            path = getattr(route, "path", None) or "<unmatched>"
            method = scope.get("method", "")
            m.requests.labels(method, path, str(status)).inc()
            m.latency.labels(method, path).observe(time.perf_counter() - t0)


class _Families:
    """A registry-shaped holder of already-collected families (for ``generate_latest``)."""

    def __init__(self, families: Iterable[Metric]):
        self._families = list(families)

    def collect(self) -> Iterable[Metric]:
        return iter(self._families)


def merge_role_metrics(reports: list[tuple[str, int, bytes | str]]) -> bytes:
    """Merge ``[(role, replica, prometheus text)]`` into one exposition.

    Each sample gains ``role`` and ``replica`` labels; families of the same name from
    several replicas become one family. Text that does not parse is skipped (a role's
    bug must not break the API's scrape).
    """
    merged: dict[str, Metric] = {}
    for role, replica, text in reports:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        try:
            families = list(text_string_to_metric_families(text))
        except ValueError:
            continue
        extra = {"role": role, "replica": str(replica)}
        for fam in families:
            target = merged.get(fam.name)
            if target is None:
                target = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type,
                                                   fam.unit)
            elif target.type != fam.type:
                continue
            target.samples.extend(s._replace(labels={**s.labels, **extra})
                                  for s in fam.samples)
    return generate_latest(_Families(merged.values()))
