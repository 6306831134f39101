"""The end of ``stream-persia run``: predictions served over HTTP, the report and its plot.

``report.json`` (what scripts read)::

    {"topology", "mode", "seconds", "samples", "samples_per_s",
     "auc": {task: float}, "bayes_auc": {task: float}, "bayes_lift": {task: float},
     "served_auc": {task: float}, "served": {"rows", "model_version", "missing_ids",
     "examples": [{head: p, "label": {task: y}}, ...]},
     "checkpoint": path, "gates": [{"metric", "min", "value", "passed"}], "plot": path,
     "progressive": {task: {"auc", "ne", "lifetime_ne", "calibration", "log_loss",
                            "window", "samples", "curve": [[samples, auc, ne], ...]}},
     "watermarks": {stage: {"event_time": float | None,
                            "lag_s": {"p50": float | None, "max": float | None}},
                    "kafka_lag": {"messages_max": int | None, "seconds_max": float | None}}}

``progressive``: progressive validation on the NN workers (every training batch scored
before its update, :mod:`stream_persia.nn.progressive`), as the topology's ``metrics.json``
has it; ``{}`` for a topology that writes none.

``metrics/<process>.prom``: the last ``GET /metrics`` of the API (which relays every
embedding worker's and server's) and of the serving replica, taken after training, before
the roles stop: what Prometheus would have scraped last (``tests/deploy`` checks
``deploy/``'s alert rules and dashboard against it).

``drift`` (only when a shift of the stream was asked, e.g. ``--concept-shift-at K``, and
the topology reports one: synthetic_ctr, taobao_ple)::

    {"shift_at_samples", "window_samples", "task",
     "auc_before", "auc_min_after", "dropped", "bayes_auc_after", "recovered_at_samples",
     "bayes_auc_before", "drop_margin", "recovery_tolerance",
     "bayes_auc_stderr": {task: {"before", "after"}}, "per_task": {task: {...}}}

``auc_before``: the windowed progressive AUC just before the shift; ``auc_min_after``:
its lowest within one window after it; ``dropped``: that fell by more than
``drop_margin`` (0.02); ``bayes_auc_after``: the Bayes-optimal AUC of the stream after the
shift (from the generator's true probabilities); ``recovered_at_samples``: samples after
the shift at which the windowed AUC, past its lowest point, first reached
``bayes_auc_after - recovery_tolerance`` (0.01), null if never. The top level is the first
task's, ``per_task`` every task's (:mod:`stream_persia.launch.drift`). The plot marks the
shift and the Bayes-optimal AUC after it.

``watermarks``: the job's stage watermarks over the run (``produced``, ``ingested``,
``trained``, ``applied``, ``served``; a stage no role reported is left out), sampled from the
job API's ``GET /v1/status`` every ~2 s while training runs
(:mod:`stream_persia.launch.watermark_watch`): ``event_time`` is the last one seen (the
slowest role's), ``lag_s`` the median and the largest of its lag over the samples;
``kafka_lag`` (Kafka runs only) the largest partition lag seen, in messages and seconds.
``{}`` without an API.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from stream_persia.errors import InternalError
from stream_persia.launch.drift import drift_summary
from stream_persia.launch.topology import Topology
from stream_persia.nn.utils import roc_auc

__all__ = ["served_metrics", "build_report", "plot_report", "print_report",
           "predict_over_http", "auc_of", "progress_line", "serving_inputs", "concept_shift_probe",
           "save_scrapes"]


def progress_line(metrics: dict[str, Any], seconds: float) -> str:
    """The run's progress line from its ``metrics.json`` so far, ``seconds`` into it."""
    train = metrics.get("train") or {}
    curve = metrics.get("loss_curve") or []
    loss = f"{curve[-1][1]:.4f}" if curve else "-"
    evals = metrics.get("eval_curve") or []
    auc = ""
    if evals:
        auc = " auc " + " ".join(f"{k}={v:.4f}" for k, v in evals[-1][1].items())
    return (f"[{seconds:6.0f}s] samples {train.get('samples', 0):>9} "
            f"{train.get('samples_per_s', 0):>8.0f}/s loss {loss}{auc}")


def concept_shift_probe(topo: Topology, env: dict[str, str]) -> dict[str, Any] | None:
    """The topology's concept-shift probe (``eval_data.concept_shift_probe``), if any."""
    if int(env.get("STREAM_PERSIA_CONCEPT_SHIFT_AT", "-1")) < 0:
        return None
    return serving_inputs(topo, env, 512, "concept_shift_probe")


def serving_inputs(topo: Topology, env: dict[str, str], n: int, name: str = "eval_batches"):
    """Labelled eval batches from the topology's ``eval_data.py`` (None if it has none)."""
    path = topo.directory / "eval_data.py"
    if n <= 0 or not path.is_file():
        return None
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    sys.path.insert(0, str(topo.directory))
    try:
        spec = importlib.util.spec_from_file_location(f"_eval_data_{topo.name}", path)
        if spec is None or spec.loader is None:   # never for a .py file
            raise InternalError(f"{path} cannot be imported")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if name != "eval_batches":
            fn = getattr(module, name, None)
            return fn(n) if fn is not None else None
        return list(module.eval_batches(n))
    finally:
        sys.path.remove(str(topo.directory))
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def predict_over_http(client: Any, auth: dict[str, str], batches: list, tasks: list[str]
                      ) -> dict[str, Any]:
    """Predict labelled ``batches`` through ``client`` (an ``httpx.Client`` on an API):
    ``{"preds": {task: array}, "labels": {task: array}, "rows", "missing_ids",
    "examples", "model_version", "trained_through"}`` or ``{"error": ...}``."""
    preds: dict[str, list[float]] = {t: [] for t in tasks}
    labels: dict[str, list[float]] = {t: [] for t in tasks}
    missing, rows = 0, 0
    examples: list[dict[str, Any]] = []
    body: dict[str, Any] = {}
    for batch in batches:
        r = client.post("/v1/predict", content=batch.to_bytes(),
                        headers={**auth, "Content-Type": "application/msgpack"})
        if r.status_code != 200:
            return {"error": f"predict failed: HTTP {r.status_code} {r.text[:300]}"}
        body = r.json()
        heads = body["heads"]
        missing += int(body.get("missing_ids", 0))
        rows += int(body["rows"])
        batch_labels = [np.asarray(lb.data, dtype=np.float64).reshape(batch.batch_size, -1)
                        for lb in (batch.labels or [])]
        for i, p in enumerate(body["predictions"]):
            for t, task in enumerate(tasks):
                head = heads[t] if t < len(heads) else None
                value = p.get(head) if head is not None else None
                if isinstance(value, list):
                    value = np.asarray(value, dtype=np.float64).ravel()[0]
                preds[task].append(float("nan") if value is None else float(value))
                labels[task].append(float(batch_labels[t][i, 0]) if t < len(batch_labels)
                                    else float("nan"))
            if len(examples) < 5:
                examples.append({**p, "label": {task: labels[task][-1] for task in tasks}})
    return {"preds": {t: np.asarray(v) for t, v in preds.items()},
            "labels": {t: np.asarray(v) for t, v in labels.items()}, "rows": rows,
            "missing_ids": missing, "examples": examples,
            "model_version": body.get("model_version"),
            "trained_through": body.get("trained_through")}


def auc_of(result: dict[str, Any], tasks: list[str]) -> dict[str, float]:
    """AUC per task of a :func:`predict_over_http` result (tasks with both labels)."""
    out = {}
    for task in tasks:
        y, s = result["labels"][task], result["preds"][task]
        ok = np.isfinite(y) & np.isfinite(s)
        if ok.any() and 0 < y[ok].sum() < ok.sum():
            out[task] = float(roc_auc(y[ok], s[ok]))
    return out


def served_metrics(api_address: str, token: str, checkpoint: str, batches: list | None,
                   tasks: list[str]) -> dict[str, Any]:
    """Serve ``checkpoint`` from the API and predict ``batches`` (labelled) over HTTP."""
    import httpx

    base = f"http://{api_address}"
    auth = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=base, timeout=60) as client:
        r = client.post("/v1/model/reload", json={"checkpoint": checkpoint}, headers=auth)
        if r.status_code != 200:
            return {"error": f"reload failed: HTTP {r.status_code} {r.text[:300]}"}
        model = r.json()
        if not batches:
            return {"model_version": model.get("version"), "rows": 0}
        result = predict_over_http(client, auth, batches, tasks)
    if "error" in result:
        return result
    return {"model_version": model.get("version"), "step": model.get("step"),
            "rows": result["rows"],
            "missing_ids": result["missing_ids"], "served_auc": auc_of(result, tasks),
            "examples": result["examples"], "_preds": result["preds"]}


def save_scrapes(out: Path, addresses: dict[str, str | None]) -> None:
    """``GET /metrics`` of each ``{process: address}`` (API processes) into
    ``out/metrics/<process>.prom``; one that does not answer is left out (the report
    does not depend on it)."""
    import httpx

    for name, address in addresses.items():
        if not address:
            continue
        try:
            r = httpx.get(f"http://{address}/metrics", timeout=10)
        except httpx.HTTPError:
            continue
        if r.status_code == 200:
            (out / "metrics").mkdir(exist_ok=True)
            (out / "metrics" / f"{name}.prom").write_text(r.text)


def build_report(topo: Topology, metrics: dict[str, Any], served: dict[str, Any] | None,
                 out: Path, seconds: float, mode: str) -> dict[str, Any]:
    train = metrics.get("train") or {}
    report: dict[str, Any] = {
        "topology": topo.name, "mode": mode, "seconds": round(seconds, 1),
        "samples": train.get("samples", 0), "samples_per_s": train.get("samples_per_s", 0.0),
        "auc": metrics.get("auc") or {}, "bayes_auc": metrics.get("bayes_auc") or {},
        "bayes_lift": metrics.get("bayes_lift") or {},
        "served_auc": (served or {}).get("served_auc", {}),
        "served": {k: v for k, v in (served or {}).items()
                   if k != "served_auc" and not k.startswith("_")},
        "progressive": metrics.get("progressive") or {},
        "watermarks": metrics.get("watermarks") or {},
        "checkpoint": metrics.get("checkpoint"), "plot": str(out / "report.png"),
        "output_dir": str(out),
    }
    gates = []
    for gate in topo.gates:
        passed, value = gate.check({**metrics, **report})
        gates.append({"metric": gate.metric, "min": gate.min, "value": value,
                      "passed": passed})
    report["gates"] = gates
    drift = drift_summary(metrics)
    if drift is not None:
        report["drift"] = drift
    return report


def plot_report(metrics: dict[str, Any], path: Path, title: str) -> list[str]:
    """Loss (and progressive NE) and eval and progressive AUC over the samples seen, the
    replica's freshness and the stage lags over the run (when measured), as a PNG
    (headless). Returns the labels of the curves drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loss = metrics.get("loss_curve") or []
    evals = metrics.get("eval_curve") or []
    fresh = metrics.get("freshness_curve") or []
    stage_lag = metrics.get("stage_lag_curve") or {}
    panels = 2 + bool(fresh) + bool(stage_lag)
    fig, axes = plt.subplots(1, panels, figsize=(5 * panels, 4))
    ax1, ax2 = axes[0], axes[1]
    if stage_lag:
        ax4 = axes[-1]
        for stage, pts in stage_lag.items():
            ax4.plot(*zip(*pts, strict=True), marker=".", linestyle="-", label=stage)
        ax4.set(title="stage lag (slowest role)", xlabel="seconds into the run",
                ylabel="now - event time (s)")
        ax4.legend()
    if fresh:
        ax3 = axes[2]
        ax3.plot(*zip(*fresh, strict=True), marker=".", linestyle="-")
        ax3.axhline(2.0, linestyle="--", color="grey", label="2 s target")
        ax3.set(title="serving replica freshness", xlabel="seconds into the run",
                ylabel="now - trained_through (s)")
        ax3.legend()
    if loss:
        x, y = zip(*loss, strict=True)
        ax1.plot(x, y, label="training loss")
    ax1.set(title="training loss and progressive NE", xlabel="samples", ylabel="loss")
    ne_axis = None
    for task, prog in (metrics.get("progressive") or {}).items():
        pts = [(s, n) for s, _, n in prog.get("curve") or [] if n is not None]
        if pts:
            ne_axis = ne_axis or ax1.twinx()
            ne_axis.plot(*zip(*pts, strict=True), linestyle=":", color="tab:green",
                         label=f"{task} progressive NE (window {prog.get('window')})")
    if ne_axis is not None:
        ne_axis.set_ylabel("normalized entropy")
        ne_axis.legend(loc="upper right", fontsize="small")
    for task in sorted({t for _, aucs in evals for t in aucs}):
        pts = [(s, a[task]) for s, a in evals if task in a]
        ax2.plot(*zip(*pts, strict=True), marker="o", label=f"{task} AUC")
    for task, prog in (metrics.get("progressive") or {}).items():
        pts = [(s, a) for s, a, _ in prog.get("curve") or [] if a is not None]
        if pts:
            ax2.plot(*zip(*pts, strict=True), marker=".", linestyle=":",
                     label=f"{task} progressive AUC (window {prog.get('window')})")
    drift = metrics.get("drift") or {}
    for task, b in (metrics.get("bayes_auc") or {}).items():
        if drift.get("shift_at_samples") is None:
            ax2.axhline(b, linestyle="--", color="grey", label=f"{task} Bayes-optimal")
    if drift.get("shift_at_samples") is not None:
        shift = drift["shift_at_samples"]
        for ax in (ax1, ax2):
            ax.axvline(shift, color="red", linestyle="-.", label=f"shift at {shift}")
        for task, b in (drift.get("bayes_auc_after") or {}).items():
            if b is not None:
                ax2.hlines(b, shift, max(shift + 1, (metrics.get("train") or {}).get("samples", 0)),
                           linestyle="--", color="grey", label=f"{task} Bayes-optimal after")
        for task, b in (drift.get("bayes_auc_before") or {}).items():
            if b is not None:
                ax2.hlines(b, 0, shift, linestyle="--", color="darkgrey",
                           label=f"{task} Bayes-optimal before")
        ax1.legend(loc="lower left", fontsize="small")
    ax2.set(title="eval and progressive AUC", xlabel="samples", ylabel="AUC")
    if evals or drift:
        ax2.legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    drawn = [label for ax in fig.axes for line in ax.get_lines()
             if not (label := str(line.get_label())).startswith("_")]
    plt.close(fig)
    return drawn


def print_report(report: dict[str, Any], file: Any = None) -> None:
    f = file or sys.stdout

    def fmt(d: dict[str, float]) -> str:
        return ", ".join(f"{k} {v:.4f}" for k, v in d.items()) or "-"

    print(f"\n== {report['topology']} ({report['mode']}) ==", file=f)
    print(f"samples trained   {report['samples']} in {report['seconds']:.0f}s "
          f"({report['samples_per_s']:.0f} samples/s while training)", file=f)
    print(f"test AUC          {fmt(report['auc'])}", file=f)
    if report["bayes_auc"]:
        print(f"Bayes-optimal AUC {fmt(report['bayes_auc'])}   share of lift "
              f"{fmt(report['bayes_lift'])}", file=f)
    served = report.get("served") or {}
    if report["served_auc"] or served:
        print(f"served AUC        {fmt(report['served_auc'])} over {served.get('rows', 0)} "
              f"rows from model {served.get('model_version')}"
              + (f" ({served['error']})" if served.get("error") else ""), file=f)
        for ex in served.get("examples", [])[:3]:
            print(f"  predicted {ex}", file=f)
    rep = report.get("replica")
    if rep:
        print(f"serving replica   freshness p50 {rep.get('freshness_p50_s')} s, p99 "
              f"{rep.get('freshness_p99_s')} s over {rep.get('advances')} advances; served "
              f"AUC after the drain {fmt(rep.get('served_auc_final') or {})}, max |served - "
              f"trained| {rep.get('served_max_abs_diff')}"
              + (f" ({rep['error']})" if rep.get("error") else ""), file=f)
    for task, prog in (report.get("progressive") or {}).items():
        print(f"progressive       {task}: windowed AUC {prog.get('auc')}, NE {prog.get('ne')}, "
              f"calibration {prog.get('calibration')} over the last {prog.get('window_samples')} "
              f"of {prog.get('samples')} samples trained", file=f)
    drift = report.get("drift")
    if drift:
        rec = drift.get("recovered_at_samples")
        print(f"drift             {drift.get('task')}: shift at {drift['shift_at_samples']}; "
              f"windowed AUC {drift.get('auc_before')} before, lowest "
              f"{drift.get('auc_min_after')} within a window ({drift['window_samples']}) "
              f"after: {'dropped' if drift.get('dropped') else 'no drop'} (margin "
              f"{drift.get('drop_margin')}); Bayes-optimal after {drift.get('bayes_auc_after')}, "
              + (f"reached within {drift.get('recovery_tolerance')} of it {rec} samples after "
                 f"the shift" if rec is not None else "never reached within "
                 f"{drift.get('recovery_tolerance')} of it"), file=f)
    marks = report.get("watermarks") or {}
    for stage, mark in marks.items():
        if stage == "kafka_lag":
            print(f"Kafka lag         max {mark.get('messages_max')} messages, "
                  f"{mark.get('seconds_max')} s (largest partition)", file=f)
        else:
            lag = mark.get("lag_s") or {}
            print(f"stage {stage:<11} lag p50 {lag.get('p50')} s, max {lag.get('max')} s; "
                  f"last event time {mark.get('event_time')}", file=f)
    print(f"checkpoint        {report['checkpoint']}", file=f)
    for g in report["gates"]:
        print(f"gate              {g['metric']} >= {g['min']}: {g['value']} "
              f"{'PASS' if g['passed'] else 'FAIL'}", file=f)
    print(f"report            {report['output_dir']}/report.json, {report['plot']}", file=f)
