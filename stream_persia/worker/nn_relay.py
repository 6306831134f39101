"""What NN rank 0's heartbeat relays to embedding worker 0, besides the checkpoint mailbox:
the ``trained`` stage watermark and the progressive validation figures.

NN ranks are clients nothing scrapes, so rank 0 adds to its ``nn_heartbeat``
(:mod:`stream_persia.worker.mailbox`; sent at most every ~0.5 s, off the training thread:
:mod:`stream_persia.nn.checkpoint_poller`):

- ``trained``: float | None, the newest ``PersiaBatch.event_time`` of a batch rank 0 ran a
  backward on (``TrainCtx.trained_through``);
- ``progressive``: ``{task: {"window": int, "samples": int, "skipped": int,
  "not_probabilities": int (both optional: older NN ranks send neither), "auc", "ne", "lifetime_ne",
  "calibration", "lifetime_calibration", "log_loss", "lifetime_log_loss": float | None}}``,
  *rank 0's own* progressive figures (:mod:`stream_persia.nn.progressive`) over the samples
  rank 0 trained: a read merged over the ranks is a collective, which the heartbeat, sent
  by rank 0 alone, cannot run. With W ranks each scoring an even share of the stream, rank
  0's window holds ``window / W`` of the samples: the same figures up to sampling noise,
  and ``samples`` counts rank 0's only. ``TrainCtx.progressive()`` (every rank, the same
  step) and ``report.json`` ``progressive`` give the merged ones.

- ``periodic``: ``{"taken", "skipped", "failed", "compacted", "compaction_failed": int
  (background compactions of a chain, ``compact_after``), "last_step": int | None,
  "last_at": float | None (Unix time), "last_duration_s": float | None, "last_bytes": int |
  None}``, rank 0's periodic checkpoints (:mod:`stream_persia.nn.periodic`), only when
  they are on.

All are optional (an older NN sends none) and validated (:func:`parse_relay`): at most
:data:`MAX_TASKS` tasks, names of 1-:data:`MAX_TASK_CHARS` characters, finite floats, no
unknown key; a bad one refuses the heartbeat with BadInput naming the field.

Worker 0 exports them (:class:`NnRelayCollector`): ``persia_nn_progressive_auc_ratio{task}``,
``persia_nn_progressive_ne_ratio{task,window}``, ``persia_nn_progressive_calibration_ratio
{task,window}``, ``persia_nn_progressive_log_loss_nats{task,window}`` (``window`` =
``windowed`` | ``lifetime``), ``persia_nn_progressive_samples_total{task}`` and
``persia_nn_heartbeat_age_seconds``, with ``persia_nn_progressive_skipped_samples_total
{task}`` and ``persia_nn_progressive_not_probability_samples_total{task}`` (from the first of
these, a model whose outputs are logits, the task's figures are None and the quality alerts
cannot fire: ``PersiaProgressiveValidationOff`` says so); ``periodic`` as ``persia_nn_periodic_checkpoints_total
{outcome}`` (``taken`` | ``skipped`` | ``failed`` | ``compacted`` | ``compaction_failed``),
``persia_nn_periodic_checkpoint_last_step``,
``persia_nn_periodic_checkpoint_last_timestamp_seconds``,
``persia_nn_periodic_checkpoint_last_duration_seconds`` and
``persia_nn_periodic_checkpoint_last_bytes``; the ``trained`` watermark goes with the worker's stage
watermarks (:mod:`stream_persia.core.stages`). A figure not known (None) has no sample.
The last heartbeat's figures stay exported after rank 0 stops, cleanly or killed (a
final reading is worth keeping); ``persia_nn_heartbeat_age_seconds`` says how old they
are, and the ``PersiaNNHeartbeatStale`` alert (``deploy/prometheus/alerts.yml``) fires on it.
Before the first heartbeat there is no age; ``persia_nn_heartbeat_seen`` is 0 then (1
after), and ``PersiaNNNeverReported`` fires when it stays 0 (a worker 0 restarted while the
NN ranks are gone, NN workers that never started).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, TypedDict

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from stream_persia.core.data import check_event_time
from stream_persia.errors import BadInput

__all__ = ["MAX_TASKS", "MAX_TASK_CHARS", "FIGURES", "NnRelay", "NnRelayCollector",
           "PeriodicFigures", "parse_relay", "TaskFigures"]

MAX_TASKS = 64
MAX_TASK_CHARS = 128
#: The float figures of one task.
FIGURES = ("auc", "ne", "lifetime_ne", "calibration", "lifetime_calibration", "log_loss",
           "lifetime_log_loss")
_COUNTS = ("window", "samples", "skipped", "not_probabilities")


class TaskFigures(TypedDict, total=False):
    window: int
    samples: int
    skipped: int
    not_probabilities: int
    auc: float | None
    ne: float | None
    lifetime_ne: float | None
    calibration: float | None
    lifetime_calibration: float | None
    log_loss: float | None
    lifetime_log_loss: float | None


class PeriodicFigures(TypedDict):
    taken: int
    skipped: int
    failed: int
    compacted: int
    compaction_failed: int
    last_step: int | None
    last_at: float | None
    last_duration_s: float | None
    last_bytes: int | None


_PERIODIC_COUNTS = ("taken", "skipped", "failed", "compacted", "compaction_failed")
_PERIODIC_LAST = ("last_step", "last_at", "last_duration_s", "last_bytes")


class NnRelay(TypedDict):
    trained: float | None
    progressive: dict[str, TaskFigures]
    periodic: PeriodicFigures | None


def _figure(value: Any, field: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value):
        raise BadInput(f"{field} must be a finite number or null, got {value!r:.80}",
                       field=field)
    return float(value)


def _count(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 63:
        raise BadInput(f"{field} must be an int >= 0, got {value!r:.80}", field=field)
    return value


def _periodic(raw: Any) -> PeriodicFigures | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadInput(f"periodic must map figure -> value, got {type(raw).__name__}",
                       field="periodic")
    unknown = sorted(map(str, set(raw) - set(_PERIODIC_COUNTS) - set(_PERIODIC_LAST)))
    if unknown:
        raise BadInput(f"periodic has unknown figure(s) {unknown[:8]}",
                       field=f"periodic.{unknown[0][:40]}",
                       hint=", ".join((*_PERIODIC_COUNTS, *_PERIODIC_LAST)))
    counts = {k: _count(raw.get(k, 0), f"periodic.{k}") for k in _PERIODIC_COUNTS}
    step, size = (None if raw.get(k) is None else _count(raw[k], f"periodic.{k}")
                  for k in ("last_step", "last_bytes"))
    return {"taken": counts["taken"], "skipped": counts["skipped"],
            "failed": counts["failed"], "compacted": counts["compacted"],
            "compaction_failed": counts["compaction_failed"], "last_step": step,
            "last_bytes": size,
            "last_at": _figure(raw.get("last_at"), "periodic.last_at"),
            "last_duration_s": _figure(raw.get("last_duration_s"),
                                       "periodic.last_duration_s")}


def parse_relay(params: dict[str, Any]) -> NnRelay:
    """The ``trained``, ``progressive`` and ``periodic`` of an ``nn_heartbeat``'s params,
    validated.

    Raises:
        BadInput: naming the field (``trained``, ``progressive``,
            ``progressive.<task>.<figure>``, ``periodic.<figure>``).
    """
    trained = check_event_time(params.get("trained"), "trained")
    periodic = _periodic(params.get("periodic"))
    raw = params.get("progressive")
    progressive: dict[str, TaskFigures] = {}
    if raw is None:
        return {"trained": trained, "progressive": progressive, "periodic": periodic}
    if not isinstance(raw, dict):
        raise BadInput(f"progressive must map task -> figures, got {type(raw).__name__}",
                       field="progressive")
    if len(raw) > MAX_TASKS:
        raise BadInput(f"progressive names {len(raw)} tasks, at most {MAX_TASKS} are "
                       f"relayed", field="progressive")
    for task, figures in raw.items():
        if not isinstance(task, str) or not 0 < len(task) <= MAX_TASK_CHARS:
            raise BadInput(f"a task name must be a string of 1-{MAX_TASK_CHARS} characters, "
                           f"got {str(task)[:80]!r}", field="progressive")
        where = f"progressive.{task}"
        if not isinstance(figures, dict):
            raise BadInput(f"{where} must map figure -> value, got "
                           f"{type(figures).__name__}", field=where)
        unknown = sorted(map(str, set(figures) - set(FIGURES) - set(_COUNTS)))
        if unknown:
            raise BadInput(f"{where} has unknown figure(s) {unknown[:8]}",
                           field=f"{where}.{unknown[0][:40]}",
                           hint=", ".join((*_COUNTS, *FIGURES)))
        out: TaskFigures = {}
        for key in _COUNTS:
            if key in figures:
                out[key] = _count(figures[key], f"{where}.{key}")   # type: ignore[literal-required]
        for key in FIGURES:
            out[key] = _figure(figures.get(key), f"{where}.{key}")   # type: ignore[literal-required]
        progressive[task] = out
    return {"trained": trained, "progressive": progressive, "periodic": periodic}


_WINDOWED = (("ne_ratio", "ne", "lifetime_ne"),
             ("calibration_ratio", "calibration", "lifetime_calibration"),
             ("log_loss_nats", "log_loss", "lifetime_log_loss"))


class NnRelayCollector(Collector):
    """Exports the last relay (``relay()``: the figures and the heartbeat's age in
    seconds, or None before the first heartbeat) as the ``persia_nn_*`` families, and
    ``persia_nn_heartbeat_seen`` (1 once a heartbeat came, 0 before) from the start: a
    worker 0 restarted while the NN ranks are gone has no age to export, and
    ``PersiaNNNeverReported`` fires on the 0 instead of nothing saying so."""

    def __init__(self, relay: Callable[[], tuple[NnRelay, float] | None]):
        self._relay = relay

    def describe(self) -> Iterable[Metric]:
        return [GaugeMetricFamily("persia_nn_heartbeat_seen", "")]

    def collect(self) -> Iterable[Metric]:
        got = self._relay()
        yield GaugeMetricFamily("persia_nn_heartbeat_seen", "1 once NN rank 0's first "
                                "heartbeat reached this worker, 0 before",
                                value=0.0 if got is None else 1.0)
        if got is None:
            return
        relay, age = got
        yield GaugeMetricFamily("persia_nn_heartbeat_age_seconds",
                                "seconds since NN rank 0's last heartbeat", value=age)
        yield from _periodic_families(relay.get("periodic"))
        tasks = relay["progressive"]
        if not tasks:
            return
        auc = GaugeMetricFamily("persia_nn_progressive_auc_ratio", "windowed progressive "
                                "AUC of NN rank 0", labels=["task"])
        samples = CounterMetricFamily("persia_nn_progressive_samples", "samples NN rank 0 "
                                      "scored before learning from them", labels=["task"])
        skipped = CounterMetricFamily("persia_nn_progressive_skipped_samples",
                                      "samples of NN rank 0 left out of the progressive "
                                      "figures (prediction not in [0, 1] or label not 0/1)",
                                      labels=["task"])
        outside = CounterMetricFamily("persia_nn_progressive_not_probability_samples",
                                      "finite predictions of NN rank 0 outside [0, 1] "
                                      "(logits?): the task's figures are off from the first",
                                      labels=["task"])
        windowed = {name: GaugeMetricFamily(
            f"persia_nn_progressive_{name}", f"progressive {name} of NN rank 0",
            labels=["task", "window"]) for name, _, _ in _WINDOWED}
        for task, fig in sorted(tasks.items()):
            if fig.get("auc") is not None:
                auc.add_metric([task], fig["auc"])   # type: ignore[arg-type]
            if fig.get("samples") is not None:
                samples.add_metric([task], float(fig["samples"]))
            if fig.get("skipped") is not None:
                skipped.add_metric([task], float(fig["skipped"]))
            if fig.get("not_probabilities") is not None:
                outside.add_metric([task], float(fig["not_probabilities"]))
            for name, w_key, l_key in _WINDOWED:
                for window, key in (("windowed", w_key), ("lifetime", l_key)):
                    value = fig.get(key)
                    if value is not None:
                        windowed[name].add_metric([task, window], value)   # type: ignore[arg-type]
        for fam in (auc, samples, skipped, outside, *windowed.values()):
            if fam.samples:
                yield fam


def _periodic_families(fig: PeriodicFigures | None) -> Iterable[Metric]:
    if fig is None:
        return
    total = CounterMetricFamily("persia_nn_periodic_checkpoints", "periodic checkpoints of "
                                "the NN ranks (and compactions of their chains) by outcome",
                                labels=["outcome"])
    for outcome in _PERIODIC_COUNTS:
        total.add_metric([outcome], float(fig[outcome]))   # type: ignore[literal-required]
    yield total
    for name, key, doc in (("last_step", "last_step", "training step of the last periodic "
                            "checkpoint"),
                           ("last_timestamp_seconds", "last_at", "Unix time the last "
                            "periodic checkpoint committed"),
                           ("last_duration_seconds", "last_duration_s", "seconds the last "
                            "periodic checkpoint took"),
                           ("last_bytes", "last_bytes", "bytes of the last periodic "
                            "checkpoint")):
        value = fig[key]   # type: ignore[literal-required]
        if value is not None:
            yield GaugeMetricFamily(f"persia_nn_periodic_checkpoint_{name}", doc,
                                    value=float(value))
