"""``report.json`` carries the NN's progressive validation (issue 19, item 1), and the plot
and the printed summary show it."""

from __future__ import annotations

import io
from pathlib import Path

from stream_persia.launch.report import build_report, plot_report, print_report
from stream_persia.launch.topology import Topology

PROG = {"click": {"window": 1000, "samples": 3000, "window_samples": 1000, "skipped": 0,
                  "auc": 0.71, "ne": 0.93, "lifetime_ne": 0.95, "calibration": 1.02,
                  "log_loss": 0.51, "curve": [[1000, None, 0.99], [2000, 0.69, 0.94],
                                              [3000, 0.71, 0.93]]}}


def test_the_report_has_the_progressive_metrics_of_metrics_json(tmp_path):
    metrics = {"train": {"samples": 3000, "samples_per_s": 10.0}, "auc": {"click": 0.7},
               "eval_curve": [[3000, {"click": 0.7}]], "loss_curve": [[1000, 0.6]],
               "progressive": PROG}
    report = build_report(Topology(Path(tmp_path), "t"), metrics, None, tmp_path, 1.0, "m")
    assert report["progressive"] == PROG
    assert build_report(Topology(Path(tmp_path), "t"), {}, None, tmp_path, 1.0,
                        "m")["progressive"] == {}
    drawn = plot_report(metrics, tmp_path / "report.png", "t")
    assert (tmp_path / "report.png").stat().st_size > 1000
    # progressive AUC beside the eval AUC, progressive NE beside the loss
    assert {"click AUC", "click progressive AUC (window 1000)",
            "click progressive NE (window 1000)", "training loss"} <= set(drawn)
    out = io.StringIO()
    print_report(report, out)
    assert "progressive       click: windowed AUC 0.71, NE 0.93" in out.getvalue()
