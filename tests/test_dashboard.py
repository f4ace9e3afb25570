"""The Grafana dashboard in helm/dashboards/gateway.json: its shape, and that every PromQL
expression in it queries only metrics (and labels) the gateway really exports.

The exported names come from the code: a fresh `gateway.metrics.Metrics()` registry, not a list
kept by hand, so renaming a metric without updating the dashboard fails here.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.metrics import MetricWrapperBase

from gateway.metrics import Metrics

DASHBOARD_PATH = Path(__file__).resolve().parents[1] / "helm" / "dashboards" / "gateway.json"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
GRID_WIDTH = 24

# The core metric families of docs/metrics.md, spelt as there.
SPEC_8_METRICS = (
    "gateway_requests_total",
    "gateway_request_duration_seconds",
    "gateway_time_to_first_token_seconds",
    "gateway_tokens_total",
    "gateway_queue_depth",
    "gateway_inflight",
    "gateway_capacity",
    "gateway_rejections_total",
    "gateway_fallbacks_total",
    "gateway_upstream_errors_total",
    "gateway_endpoint_up",
)

# The sample names prometheus-client exports for each family, by family type.
SAMPLE_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
}


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Every identifier PromQL itself may contain: functions, aggregations, keywords, constants.
PROMQL_FUNCTIONS = _words(
    """
    abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes
    clamp clamp_max clamp_min cos cosh count_over_time day_of_month day_of_week day_of_year
    days_in_month deg delta deriv double_exponential_smoothing exp floor histogram_avg
    histogram_count histogram_fraction histogram_quantile histogram_stddev histogram_stdvar
    histogram_sum holt_winters hour idelta increase info irate label_join label_replace
    last_over_time ln log10 log2 mad_over_time max_over_time min_over_time minute month pi
    predict_linear present_over_time quantile_over_time rad rate resets round scalar sgn sin
    sinh sort sort_by_label sort_by_label_desc sort_desc sqrt stddev_over_time stdvar_over_time
    sum_over_time tan tanh time timestamp vector year
    """
)
PROMQL_AGGREGATIONS = _words(
    "avg bottomk count count_values group limit_ratio limitk max min quantile stddev stdvar "
    "sum topk"
)
PROMQL_KEYWORDS = _words(
    "and atan2 bool by end group_left group_right ignoring inf nan offset on or start "
    "unless without"
)
PROMQL_WORDS = PROMQL_FUNCTIONS | PROMQL_AGGREGATIONS | PROMQL_KEYWORDS

# Grafana's own variables, usable in any expression without a templating entry.
GRAFANA_BUILTIN_VARIABLES = frozenset(
    {"__rate_interval", "__interval", "__interval_ms", "__range", "__range_s", "__range_ms"}
)

STRING_RE = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
VARIABLE_RE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)|\[\[(\w+)\]\]")
RANGE_RE = re.compile(r"\[[^\[\]]*\]")
MATCHERS_RE = re.compile(r"\{([^{}]*)\}")
MATCHER_LABEL_RE = re.compile(r"([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)")
GROUPING_RE = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
IDENTIFIER_RE = re.compile(r"(?<![\w:])[a-zA-Z_:][a-zA-Z0-9_:]*")
LEGEND_LABEL_RE = re.compile(r"\{\{\s*(\w+)\s*\}\}")
LABEL_VALUES_RE = re.compile(r"^label_values\(\s*(?:([a-zA-Z_:][\w:]*)\s*,\s*)?(\w+)\s*\)$")


@cache
def dashboard() -> dict[str, Any]:
    with DASHBOARD_PATH.open(encoding="utf-8") as f:
        data: dict[str, Any] = json.load(f)
    return data


def panels() -> list[dict[str, Any]]:
    return list(dashboard()["panels"])


def targets() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(panel, target) for panel in panels() for target in panel.get("targets", [])]


def variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard()["templating"]["list"]}


@cache
def exported_names() -> dict[str, str]:
    """Every sample name the gateway exports, mapped to its family's name."""
    names: dict[str, str] = {}
    for family in Metrics().registry.collect():
        for suffix in SAMPLE_SUFFIXES[family.type]:
            names[family.name + suffix] = family.name
    return names


@cache
def exported_labels() -> dict[str, frozenset[str]]:
    """The label names of each exported sample, read from a registry with one child a metric."""
    metrics = Metrics()
    for collector in vars(metrics).values():
        if isinstance(collector, MetricWrapperBase):
            labelnames = collector._labelnames
            if labelnames:
                collector.labels(*["x"] * len(labelnames))
    labels: dict[str, set[str]] = {}
    for family in metrics.registry.collect():
        for sample in family.samples:
            labels.setdefault(sample.name, set()).update(sample.labels)
    return {name: frozenset(keys) for name, keys in labels.items()}


def parse_expr(expr: str) -> tuple[list[str], set[str], set[str], set[str]]:
    """Split a PromQL expression into (identifiers outside label sets, matcher label names,
    grouping label names, Grafana variables used)."""
    variables_used = {next(g for g in m.groups() if g) for m in VARIABLE_RE.finditer(expr)}
    rest = STRING_RE.sub('""', expr)
    rest = VARIABLE_RE.sub(" ", rest)
    rest = RANGE_RE.sub(" ", rest)
    matcher_labels: set[str] = set()
    for block in MATCHERS_RE.findall(rest):
        matcher_labels.update(MATCHER_LABEL_RE.findall(block))
    rest = MATCHERS_RE.sub(" ", rest)
    grouping_labels: set[str] = set()
    for _, block in GROUPING_RE.findall(rest):
        grouping_labels.update(label.strip() for label in block.split(",") if label.strip())
    rest = GROUPING_RE.sub(r" \1 ", rest)
    return IDENTIFIER_RE.findall(rest), matcher_labels, grouping_labels, variables_used


def spec_family(name: str) -> str | None:
    """The exported family a core metric name denotes: a sample name (`gateway_requests_total`)
    or, for histograms, the family name itself (`gateway_request_duration_seconds`)."""
    names = exported_names()
    if name in names:
        return names[name]
    return name if name in set(names.values()) else None


def metrics_in(expr: str) -> list[str]:
    """The gateway metric names an expression queries."""
    identifiers = parse_expr(expr)[0]
    return [i for i in identifiers if i.startswith("gateway_")]


def target_id(item: tuple[dict[str, Any], dict[str, Any]]) -> str:
    panel, target = item
    return f"panel{panel.get('id')}-{target.get('refId')}"


TARGETS = targets()


# --- the parser and the exported names themselves ---------------------------------------------


def test_parse_expr_separates_metrics_labels_and_variables() -> None:
    expr = (
        'histogram_quantile(0.9, sum by (le, tier) (rate(gateway_x_bucket{model=~"$model", '
        'code!="gateway_not_a_metric"}[$__rate_interval]))) / on (tier) group_left ${other}'
    )
    identifiers, matcher_labels, grouping_labels, used = parse_expr(expr)
    assert identifiers == [
        "histogram_quantile",
        "sum",
        "by",
        "rate",
        "gateway_x_bucket",
        "on",
        "group_left",
    ]
    assert matcher_labels == {"model", "code"}
    assert grouping_labels == {"le", "tier"}
    assert used == {"model", "__rate_interval", "other"}
    assert metrics_in(expr) == ["gateway_x_bucket"]


def test_suffix_rule_matches_what_prometheus_client_exports() -> None:
    """The names derived by type are the sample names a populated registry really renders
    (no `_created` series: the gateway turns them off)."""
    assert set(exported_labels()) == set(exported_names())


def test_spec_8_families_are_all_exported() -> None:
    for name in SPEC_8_METRICS:
        assert spec_family(name), f"core metric {name} is not exported"


# --- dashboard shape --------------------------------------------------------------------------


def test_dashboard_is_valid_json_with_grafana_top_level_shape() -> None:
    d = dashboard()
    assert d["title"] == "LLM gateway"
    assert d["uid"] == "llm-gateway"
    assert isinstance(d["schemaVersion"], int) and not isinstance(d["schemaVersion"], bool)
    assert d["schemaVersion"] == 39
    assert d["tags"] == ["llm", "gateway"]
    assert d["refresh"] == "30s"
    assert d["time"] == {"from": "now-1h", "to": "now"}
    assert "__inputs" not in d
    assert "id" not in d or d["id"] is None
    assert isinstance(d["panels"], list) and d["panels"]


def test_panels_have_required_fields_and_unique_ids() -> None:
    ids = []
    for panel in panels():
        for key in ("id", "title", "type", "gridPos", "targets", "description", "datasource"):
            assert key in panel, f"panel {panel.get('title')!r} lacks {key}"
        assert isinstance(panel["id"], int) and not isinstance(panel["id"], bool)
        assert isinstance(panel["title"], str) and panel["title"].strip()
        assert isinstance(panel["description"], str) and panel["description"].strip()
        assert panel["type"] in {"timeseries", "state-timeline", "table", "stat", "gauge"}
        assert panel["datasource"] == DATASOURCE
        assert isinstance(panel["targets"], list) and panel["targets"]
        ids.append(panel["id"])
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {ids}"


def test_grid_positions_are_inside_the_grid_and_do_not_overlap() -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in panels():
        pos = panel["gridPos"]
        for key in ("x", "y", "w", "h"):
            assert isinstance(pos[key], int) and pos[key] >= 0, (panel["title"], key)
        assert pos["w"] > 0 and pos["h"] > 0
        assert pos["x"] + pos["w"] <= GRID_WIDTH, panel["title"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_targets_have_unique_ref_ids_and_expressions() -> None:
    for panel in panels():
        ref_ids = [target.get("refId") for target in panel["targets"]]
        assert all(isinstance(r, str) and r for r in ref_ids), panel["title"]
        assert len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            assert isinstance(target.get("expr"), str) and target["expr"].strip()
            assert target.get("datasource", DATASOURCE) == DATASOURCE


def test_templating_defines_datasource_model_and_tier() -> None:
    found = variables()
    assert {"datasource", "model", "tier"} <= set(found)
    ds = found["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    for name in ("model", "tier"):
        var = found[name]
        assert var["type"] == "query"
        assert var["datasource"] == DATASOURCE
        assert var["multi"] is True and var["includeAll"] is True
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        assert query == f"label_values(gateway_requests_total, {name})"


def test_variable_queries_use_exported_metrics_and_labels() -> None:
    for var in variables().values():
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        match = LABEL_VALUES_RE.match(query.strip())
        assert match, f"variable {var['name']}: unexpected query {query!r}"
        metric, label = match.groups()
        assert metric in exported_names(), f"variable {var['name']}: {metric} is not exported"
        assert label in exported_labels()[metric], f"{metric} has no label {label}"


# --- every expression against the exported metrics --------------------------------------------


@pytest.mark.parametrize("item", TARGETS, ids=[target_id(t) for t in TARGETS])
def test_expr_uses_only_exported_metrics(item: tuple[dict[str, Any], dict[str, Any]]) -> None:
    panel, target = item
    expr = target["expr"]
    identifiers, matcher_labels, grouping_labels, used = parse_expr(expr)
    names = exported_names()
    used_metrics = [i for i in identifiers if i.startswith("gateway_")]
    assert used_metrics, f"{panel['title']!r}: {expr!r} queries no gateway metric"
    for ident in identifiers:
        if ident.startswith("gateway_"):
            assert ident in names, f"{panel['title']!r}: {ident} is not exported by the gateway"
        else:
            assert ident in PROMQL_WORDS, f"{panel['title']!r}: unknown identifier {ident!r}"

    # Labels in matchers and grouping clauses are labels of the metrics queried.
    labels = exported_labels()
    known = set().union(*(labels[m] for m in used_metrics))
    assert matcher_labels <= known, f"{panel['title']!r}: unknown labels {matcher_labels - known}"
    assert grouping_labels <= known, f"{panel['title']!r}: unknown labels {grouping_labels - known}"

    # Legends only name labels that survive the aggregation.
    legend_labels = set(LEGEND_LABEL_RE.findall(target.get("legendFormat", "")))
    if grouping_labels:
        assert legend_labels <= grouping_labels, f"{panel['title']!r}: legend {legend_labels}"

    # Every $variable is a templating variable or one of Grafana's own.
    defined = set(variables()) | GRAFANA_BUILTIN_VARIABLES
    assert used <= defined, f"{panel['title']!r}: undefined variables {used - defined}"


def test_every_spec_8_family_appears_in_a_panel() -> None:
    """Core metrics all have a panel. The others (the usage spool's) may too,
    but need not."""
    used_families = {
        exported_names()[name]
        for _, target in TARGETS
        for name in metrics_in(target["expr"])
        if name in exported_names()
    }
    missing = [n for n in SPEC_8_METRICS if spec_family(n) not in used_families]
    assert not missing, f"core metrics without a panel: {missing}"


def test_fleet_wide_gauges_are_not_summed_over_replicas() -> None:
    """gateway_queue_depth and gateway_inflight repeat one fleet-wide value on every replica;
    gateway_capacity is each replica's view of the same healthy total. A sum would multiply
    them by the replica count."""
    fleet_wide = {"gateway_queue_depth", "gateway_inflight", "gateway_capacity"}
    seen = set()
    for panel, target in TARGETS:
        expr = target["expr"]
        hits = fleet_wide & set(metrics_in(expr))
        if hits:
            seen |= hits
            assert not re.search(r"\bsum\b", expr), f"{panel['title']!r} sums {hits}"
            assert re.search(r"\bmax\b", expr), f"{panel['title']!r}: use max for {hits}"
            assert "max" in panel["description"] or "sum" in panel["description"]
    assert seen == fleet_wide


def test_the_token_budget_has_a_panel_that_does_not_sum_replicas() -> None:
    """gateway_token_budget is each replica's view of the same workers' budgets (each adapts
    on its own readings): a sum would multiply it by the replica count."""
    found = [
        (panel, target)
        for panel, target in TARGETS
        if "gateway_token_budget" in metrics_in(target["expr"])
    ]
    assert found, "gateway_token_budget has no panel"
    for panel, target in found:
        assert not re.search(r"\bsum\b", target["expr"]), panel["title"]
        assert re.search(r"\b(max|min)\b", target["expr"]), panel["title"]
        _, _, grouping, _ = parse_expr(target["expr"])
        assert {"model", "endpoint"} <= grouping, panel["title"]
