"""deploy/'s Prometheus alert rules and Grafana dashboard, read and parsed for the tests.

Expressions are parsed with ``promql-parser`` (Prometheus's PromQL grammar, ported to
Rust), so a rule that Prometheus would refuse fails here too. Grafana's variables in the
dashboard's queries are replaced by what Grafana would put there before parsing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser as pp
import yaml

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "deploy" / "prometheus" / "alerts.yml"
RULES_TESTS = REPO / "deploy" / "prometheus" / "alerts_test.yml"
DASHBOARD = REPO / "deploy" / "grafana" / "stream-persia.json"

#: Grafana's built-in interval variables -> a duration, its template variables -> a regex
#: matching anything (they stand inside ``=~"..."`` matchers).
GRAFANA_INTERVALS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")

#: Histogram series names -> their family (what the roles register).
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")


def load_rules() -> dict[str, Any]:
    return yaml.safe_load(RULES.read_text())


def rules() -> list[dict[str, Any]]:
    return [r for g in load_rules()["groups"] for r in g["rules"]]


def load_dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def all_panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, the ones inside collapsed rows included."""
    for p in dash["panels"]:
        yield p
        yield from p.get("panels", [])


def grafana_expr(expr: str, variables: set[str]) -> str:
    """``expr`` as Grafana sends it: intervals filled in, template variables -> ``.*``.

    Raises:
        AssertionError: ``expr`` names a variable the dashboard does not define.
    """
    for name, value in GRAFANA_INTERVALS.items():
        expr = expr.replace(name, value)

    def sub(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        assert name in variables, f"{expr!r} uses ${name}, which the dashboard does not define"
        return ".*"
    return _VARIABLE.sub(sub, expr)


def dashboard_exprs(dash: dict[str, Any]) -> list[str]:
    variables = {v["name"] for v in dash["templating"]["list"]}
    return [grafana_expr(t["expr"], variables)
            for p in all_panels(dash) for t in p.get("targets", [])]


def metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` selects (``{__name__="x"}`` included)."""
    names: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, pp.VectorSelector):
            if node.name:
                names.add(node.name)
            for m in node.matchers.matchers:
                if m.name == "__name__":
                    names.add(m.value)
    pp.walk(pp.parse(expr), visit)
    return names


def family(name: str) -> str:
    """``x_bucket``/``x_sum``/``x_count`` -> ``x``; other names as they are."""
    for suffix in _HISTOGRAM_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def used_metric_names() -> dict[str, set[str]]:
    """Every metric name a rule or dashboard panel uses -> where (``alert X``, ``panel Y``)."""
    where: dict[str, set[str]] = {}
    for r in rules():
        for n in metric_names(r["expr"]):
            where.setdefault(n, set()).add(f"alert {r['alert']}")
    dash = load_dashboard()
    variables = {v["name"] for v in dash["templating"]["list"]}
    for p in all_panels(dash):
        for t in p.get("targets", []):
            for n in metric_names(grafana_expr(t["expr"], variables)):
                where.setdefault(n, set()).add(f"panel {p['title']!r}")
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            n = label_values_metric(v["definition"])
            where.setdefault(n, set()).add(f"variable ${v['name']}")
    return where


def label_values_metric(definition: str) -> str:
    """``label_values(metric, label)`` (a Grafana variable's query) -> ``metric``, which
    must parse as a PromQL selector."""
    m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", definition.strip())
    assert m, f"variable query {definition!r} is not label_values(metric, label)"
    names = metric_names(m.group(1))
    assert len(names) == 1, definition
    return names.pop()


# ------------------------------------------------------------ labels of a result
ANY = None   # the selected series' own labels (whatever the target and the role give them)


def result_labels(node: Any) -> set[str] | None:
    """The labels an expression's result carries: a set, :data:`ANY`, or ``set()`` for a
    scalar. Enough of PromQL's rules for alerting expressions: aggregations keep their
    ``by`` labels, comparisons with a scalar keep the vector's, vector matching keeps the
    ``many`` side's (plus ``group_left``/``group_right`` labels)."""
    if isinstance(node, (pp.VectorSelector, pp.MatrixSelector)):
        return ANY
    if isinstance(node, (pp.NumberLiteral, pp.StringLiteral)):
        return set()
    if isinstance(node, (pp.ParenExpr, pp.UnaryExpr, pp.SubqueryExpr)):
        return result_labels(node.expr)
    if isinstance(node, pp.AggregateExpr):
        op = str(node.op).lower()
        if any(k in op for k in ("topk", "bottomk", "limitk", "limit_ratio")):
            return result_labels(node.expr)
        if node.modifier is None:
            return set()
        if node.modifier.type == pp.AggModifierType.By:
            return set(node.modifier.labels)
        inner = result_labels(node.expr)
        return ANY if inner is ANY else inner - set(node.modifier.labels)
    if isinstance(node, pp.Call):
        name = node.func.name
        if name in ("scalar", "time", "vector", "pi"):
            return set()
        if name == "histogram_quantile":
            inner = result_labels(node.args[1])
            return ANY if inner is ANY else inner - {"le"}
        vectors = [a for a in node.args if isinstance(a, pp.Expr)
                   and not isinstance(a, (pp.NumberLiteral, pp.StringLiteral))]
        return result_labels(vectors[0]) if vectors else set()
    if isinstance(node, pp.BinaryExpr):
        lhs, rhs = result_labels(node.lhs), result_labels(node.rhs)
        if lhs == set() or rhs == set():       # one side a scalar: the other's labels
            return rhs if lhs == set() else lhs
        mod = node.modifier
        side = rhs if mod is not None and mod.card == pp.VectorMatchCardinality.OneToMany \
            else lhs
        extra = set(mod.group_labels or []) if mod is not None else set()
        return ANY if side is ANY else side | extra
    raise AssertionError(f"no label rule for {type(node).__name__}: {node}")


def matcher_labels(expr: str) -> set[str]:
    """Labels the expression's selectors match on (they are then on the result)."""
    out: set[str] = set()

    def visit(node: Any) -> None:
        if isinstance(node, pp.VectorSelector):
            out.update(m.name for m in node.matchers.matchers if m.name != "__name__")
    pp.walk(pp.parse(expr), visit)
    return out
