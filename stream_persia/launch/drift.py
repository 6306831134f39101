"""How progressive validation reacted to a shift of the stream: ``report.json``'s ``drift``.

A topology that was asked for a shift (synthetic_ctr's concept shift, taobao_ple's
distribution shift) writes ``drift`` into its ``metrics.json``: the shift's sample
(``shift_at_samples``), the window of the progressive metrics (``window_samples``) and
the Bayes-optimal AUC per task on each side of the shift (``bayes_auc_before`` /
``bayes_auc_after``, from the generator's true probabilities; null where unknown). With
the progressive curve (``progressive.<task>.curve``: ``[samples_scored, windowed_auc,
windowed_ne]`` points), :func:`drift_summary` says per task:

- ``auc_before``: the windowed AUC of the last curve point at or before the shift;
- ``auc_min_after``: the lowest windowed AUC of the points in the window after the shift
  (``shift < samples <= shift + window``: while the window fills with shifted samples);
- ``dropped``: ``auc_min_after < auc_before - DROP_MARGIN``;
- ``recovered_at_samples``: samples after the shift of the first point after that lowest
  one whose windowed AUC is ``>= bayes_auc_after - RECOVERY_TOLERANCE``; null if none
  (or if the Bayes AUC after the shift is unknown).

Samples are counted as the NN ranks scored them, which is the stream's order for one
data loader; with several, batches interleave and the shift is smeared over a few of them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["drift_summary", "DROP_MARGIN", "RECOVERY_TOLERANCE"]

#: A drop is a windowed AUC this far below the one just before the shift: above the
#: noise of the windowed AUC of a window of ~10,000 samples (a standard deviation of about
#: 0.004 around an AUC of 0.88).
DROP_MARGIN = 0.02
#: Recovered: within this of the Bayes-optimal AUC after the shift (issue 19).
RECOVERY_TOLERANCE = 0.01


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _task_summary(curve: list[list[Any]], shift: int, window: int,
                  bayes_after: float | None) -> dict[str, Any]:
    points = [(int(s), float(a)) for s, a, *_ in curve if a is not None]
    before = [a for s, a in points if s <= shift]
    after = [(s, a) for s, a in points if shift < s <= shift + window]
    auc_before = before[-1] if before else None
    low = min(after, key=lambda p: p[1]) if after else None
    recovered = None
    if low is not None and bayes_after is not None:
        recovered = next((s - shift for s, a in points
                          if s >= low[0] and a >= bayes_after - RECOVERY_TOLERANCE), None)
    return {"auc_before": _round(auc_before), "auc_min_after": _round(low[1] if low else None),
            "dropped": bool(low is not None and auc_before is not None
                            and low[1] < auc_before - DROP_MARGIN),
            "bayes_auc_after": _round(bayes_after), "recovered_at_samples": recovered}


def drift_summary(metrics: dict[str, Any]) -> dict[str, Any] | None:
    """``report.json``'s ``drift`` from a topology's ``metrics.json`` (None without a
    shift): the first task's figures (module docstring) at the top level, with ``task``
    naming it, ``per_task`` holding every task's, and ``shift_at_samples``,
    ``window_samples``, ``drop_margin``, ``recovery_tolerance``, ``bayes_auc_before``
    and ``bayes_auc_stderr`` (per task) as the topology gave them."""
    drift = metrics.get("drift")
    if not isinstance(drift, dict) or drift.get("shift_at_samples") is None:
        return None
    shift = int(drift["shift_at_samples"])
    window = int(drift.get("window_samples") or 0)
    progressive = metrics.get("progressive") or {}
    bayes_after = drift.get("bayes_auc_after") or {}
    bayes_before = drift.get("bayes_auc_before") or {}
    tasks = list(bayes_after) + [t for t in progressive if t not in bayes_after]
    per_task = {}
    for task in tasks:
        prog = progressive.get(task) or {}
        per_task[task] = {**_task_summary(prog.get("curve") or [], shift,
                                          window or int(prog.get("window_samples") or 0),
                                          bayes_after.get(task)),
                          "bayes_auc_before": _round(bayes_before.get(task))}
    first = tasks[0] if tasks else None
    return {"shift_at_samples": shift, "window_samples": window, "task": first,
            **(per_task[first] if first else {}), "per_task": per_task,
            "drop_margin": DROP_MARGIN, "recovery_tolerance": RECOVERY_TOLERANCE,
            "bayes_auc_stderr": drift.get("bayes_auc_stderr") or {}}
