"""deploy/prometheus/alerts.yml and deploy/grafana/stream-persia.json are well formed.

Every rule's expression parses with a real PromQL parser (``promql-parser``), every rule
has what Alertmanager routes and shows (``severity``, ``summary``, ``description``), its
durations are Prometheus durations, and its annotation templates name only labels its
expression's result carries. The dashboard is Grafana's structure: unique panel ids,
panels on the 24-column grid, every query on the ``${datasource}`` variable and parsing
as PromQL. Where ``promtool`` (Prometheus's own checker; Debian's ``prometheus`` package
ships it) is on PATH, ``promtool check rules`` and the rules' unit tests
(``deploy/prometheus/alerts_test.yml``) run too.

That every metric named here is exported by the roles is
``test_deploy_metrics.py``'s part (it needs a running job).
"""

from __future__ import annotations

import re
import shutil
import subprocess

import promql_parser as pp
import pytest
from monitoring import (
    DASHBOARD,
    RULES,
    RULES_TESTS,
    all_panels,
    dashboard_exprs,
    load_dashboard,
    load_rules,
    matcher_labels,
    metric_names,
    result_labels,
    rules,
    used_metric_names,
)

SEVERITIES = {"info", "warning", "critical"}
#: Labels Prometheus or a usual scrape configuration puts on every target's series.
TARGET_LABELS = {"instance", "job", "namespace", "pod"}
#: What a template may do in an annotation: a label, the value, the value formatted.
_TEMPLATE = re.compile(r"\{\{\s*(.*?)\s*\}\}")
_TEMPLATE_FORMS = (re.compile(r"\$labels\.(\w+)"),
                   re.compile(r"\$value(?:\s*\|\s*(?:humanize|humanizeDuration|"
                              r"humanizePercentage|printf \"%\.\df\"))?"))
_RULE_KEYS = {"alert", "expr", "for", "keep_firing_for", "labels", "annotations"}


def duration(raw: str) -> float:
    """A Prometheus duration in seconds (promql-parser's parser, Prometheus's syntax)."""
    assert isinstance(raw, str) and raw, f"duration {raw!r}"
    return pp.parse_duration(raw).total_seconds()


# ------------------------------------------------------------------ alert rules
def test_rule_groups_are_well_formed():
    doc = load_rules()
    assert set(doc) == {"groups"}, set(doc)
    names = [g["name"] for g in doc["groups"]]
    assert len(names) == len(set(names)), names
    alerts = [r["alert"] for r in rules()]
    assert len(alerts) == len(set(alerts)), alerts
    for g in doc["groups"]:
        assert set(g) <= {"name", "interval", "rules", "limit"}, g["name"]
        assert 10 <= duration(g["interval"]) <= 300, g["name"]
        assert g["rules"], g["name"]


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r["alert"])
def test_every_rule_parses_and_is_complete(rule):
    assert set(rule) <= _RULE_KEYS and {"alert", "expr", "for", "labels",
                                        "annotations"} <= set(rule), rule
    assert re.fullmatch(r"Persia[A-Z]\w+", rule["alert"]), rule["alert"]
    node = pp.parse(rule["expr"])
    # An alert fires per series: its expression must give an instant vector.
    assert not isinstance(node, (pp.NumberLiteral, pp.StringLiteral, pp.MatrixSelector)), \
        rule["expr"]
    assert 0 < duration(rule["for"]) <= 3600, rule["for"]
    assert rule["labels"]["severity"] in SEVERITIES, rule["labels"]
    assert set(rule["annotations"]) >= {"summary", "description"}, rule["annotations"]


@pytest.mark.parametrize("rule", rules(), ids=lambda r: r["alert"])
def test_annotations_name_only_labels_the_result_carries(rule):
    carried = result_labels(pp.parse(rule["expr"]))
    if carried is None:   # the selected series as they are: target labels and matched ones
        carried = TARGET_LABELS | matcher_labels(rule["expr"])
    for key, text in rule["annotations"].items():
        for template in _TEMPLATE.findall(text):
            form = next((f.fullmatch(template) for f in _TEMPLATE_FORMS
                         if f.fullmatch(template)), None)
            assert form is not None, f"{rule['alert']} {key}: unknown template {{{{{template}}}}}"
            if form.re is _TEMPLATE_FORMS[0]:
                assert form.group(1) in carried, (
                    f"{rule['alert']} {key} names $labels.{form.group(1)}, but its "
                    f"expression's result has only {sorted(carried)}")


def test_the_label_check_catches_a_label_the_result_drops():
    """The check above is not vacuous: an aggregation drops what ``by`` does not keep."""
    assert result_labels(pp.parse("max by (task) (x) > 1")) == {"task"}
    assert result_labels(pp.parse("histogram_quantile(0.9, sum by (le, i) (rate(x[5m])))")) \
        == {"i"}
    assert result_labels(pp.parse("max by (a, s) (x) - on (a) group_left min by (a) (x)")) \
        == {"a", "s"}
    assert result_labels(pp.parse("x > 1")) is None


def test_rules_cover_the_issue_19_alerts():
    """Lag in seconds, stage lag, AUC drop, NE rise, freshness, heartbeat, role down."""
    by_metric = {}
    for r in rules():
        for m in metric_names(r["expr"]):
            by_metric.setdefault(m, []).append(r["alert"])
    for metric in ("persia_embedding_worker_kafka_lag_seconds", "persia_stage_lag_seconds",
                   "persia_nn_progressive_auc_ratio", "persia_nn_progressive_ne_ratio",
                   "persia_api_freshness_seconds_bucket",
                   "persia_api_replica_staleness_seconds",
                   "persia_nn_heartbeat_age_seconds", "persia_api_role_up"):
        assert metric in by_metric, f"no alert on {metric}"


@pytest.mark.skipif(shutil.which("promtool") is None,
                    reason="promtool not on PATH (apt-get install prometheus)")
def test_promtool_checks_the_rules_and_runs_their_unit_tests():
    check = subprocess.run(["promtool", "check", "rules", str(RULES)], capture_output=True,
                           text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    unit = subprocess.run(["promtool", "test", "rules", RULES_TESTS.name],
                          cwd=RULES_TESTS.parent, capture_output=True, text=True, timeout=60)
    assert unit.returncode == 0, unit.stdout + unit.stderr


def test_every_alert_has_a_promtool_unit_test():
    import yaml

    tested = {t["alertname"] for case in yaml.safe_load(RULES_TESTS.read_text())["tests"]
              for t in case.get("alert_rule_test", [])}
    assert tested == {r["alert"] for r in rules()}


# ------------------------------------------------------------------ dashboard
def test_dashboard_is_grafana_structure():
    dash = load_dashboard()
    assert dash["schemaVersion"] >= 36 and dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus", ds
    panels = list(all_panels(dash))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {DASHBOARD.name}"
    cells = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        cell = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not cell & cells, f"panel {p['title']!r} overlaps another"
        cells |= cell
        if p["type"] == "row":
            continue
        assert p["type"] in {"timeseries", "stat", "gauge", "table", "bargauge"}, p["type"]
        assert p["targets"], p["title"]
        for t in [p, *p["targets"]]:
            assert t["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, \
                f"panel {p['title']!r} does not query the $datasource variable"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]
    for v in variables.values():
        if v["type"] == "query":
            assert v["datasource"]["uid"] == "${datasource}", v["name"]


def test_every_dashboard_query_parses():
    exprs = dashboard_exprs(load_dashboard())
    assert len(exprs) >= 12
    for e in exprs:
        pp.parse(e)


def test_dashboard_covers_the_issue_19_panels():
    text = " ".join(dashboard_exprs(load_dashboard()))
    for metric in ("persia_nn_progressive_auc_ratio", "persia_nn_progressive_ne_ratio",
                   "persia_nn_progressive_calibration_ratio", "persia_stage_lag_seconds",
                   "persia_embedding_worker_kafka_lag_messages",
                   "persia_embedding_worker_kafka_lag_seconds",
                   "persia_api_freshness_seconds_bucket",
                   "persia_embedding_worker_batches_ingested_total",
                   "persia_embedding_worker_batches_applied_total", "persia_api_role_up"):
        assert metric in text, f"no panel shows {metric}"


def test_names_used_are_persia_metrics():
    """Nothing outside the job's own families (the scrape test checks they exist)."""
    for name in used_metric_names():
        assert name.startswith("persia_"), name
