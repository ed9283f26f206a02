"""The Grafana dashboards (infra/grafana/) are checked against the metrics the services export.

Every query names only series that a service's ``ServiceMetrics`` exposes: the catalogue metrics of
shared/infra/metrics.py with the series their type adds (``_bucket``/``_sum``/``_count``/``_created``
for a histogram, ``_created`` beside a counter's ``_total``), the process basics that registry carries
(``process_*``, ``python_info``), and Prometheus's ``up``. The allowed names are read from a real
registry, so they are the exposition's names, not a guess at them. Metric names are read out of PromQL
by a small tokenizer (tested below): an identifier is a metric unless it is a function or aggregation
called, a keyword, or a label name (in a matcher or a ``by``/``without``/``on``/``ignoring``/
``group_left``/``group_right`` list).
"""

from __future__ import annotations

import json
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.metrics import MetricWrapperBase

from shared.infra.metrics import CATALOGUE, ServiceMetrics
from tests.system_tools import ensure_tool

REPO = Path(__file__).resolve().parents[2]
GRAFANA = REPO / "infra" / "grafana"
DASHBOARDS = GRAFANA / "dashboards"
PROVISIONING = GRAFANA / "provisioning"
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}
# Where a Grafana container sees the repository's folders (the comment in provisioning/dashboards/*.yml).
MOUNTS = {"/etc/grafana/provisioning": PROVISIONING, "/var/lib/grafana/dashboards": DASHBOARDS}
# Labels Prometheus adds to every scraped series.
TARGET_LABELS = frozenset({"job", "instance"})

# ---------------------------------------------------------------------------------------------- PromQL

FUNCTIONS = frozenset(
    """abs absent absent_over_time acos acosh asin asinh atan atanh avg_over_time ceil changes clamp clamp_max
    clamp_min cos cosh count_over_time day_of_month day_of_week day_of_year days_in_month deg delta deriv
    double_exponential_smoothing end exp floor histogram_avg histogram_count histogram_fraction
    histogram_quantile histogram_stddev histogram_stdvar histogram_sum holt_winters hour idelta increase info
    irate label_join label_replace last_over_time ln log10 log2 mad_over_time max_over_time min_over_time minute
    month pi predict_linear present_over_time quantile_over_time rad rate resets round scalar sgn sin sinh sort
    sort_by_label sort_by_label_desc sort_desc sqrt start stddev_over_time stdvar_over_time sum_over_time tan tanh
    time timestamp vector year""".split()
)
AGGREGATORS = frozenset(
    "avg bottomk count count_values group limit_ratio limitk max min quantile stddev stdvar sum topk".split()
)
LABEL_LISTS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
KEYWORDS = frozenset({"and", "or", "unless", "bool", "offset", "atan2", "inf", "nan"}) | LABEL_LISTS
MATCH_OPS = frozenset({"=", "!=", "=~", "!~"})
RATE_FUNCTIONS = frozenset({"rate", "irate", "increase"})

_TOKEN = re.compile(
    r"""
    (?P<space>\s+)
    |(?P<comment>\#[^\n]*)
    |(?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
    |(?P<variable>\$\{[^}]*\}|\$\w+)
    |(?P<duration>(?:\d+(?:ms|s|m|h|d|w|y))+(?![\w.]))
    |(?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
    |(?P<ident>[A-Za-z_][A-Za-z0-9_:]*)
    |(?P<op>=~|!~|!=|==|<=|>=|[-+*/%^<>=,(){}\[\]@:])
    """,
    re.VERBOSE,
)
_CLOSE = {"(": ")", "{": "}", "[": "]"}


@dataclass(frozen=True, slots=True)
class Token:
    kind: str
    text: str


def tokenize(expr: str) -> list[Token]:
    """PromQL (with Grafana's ``$variables``) as tokens, spaces and comments dropped."""
    tokens, pos = [], 0
    while pos < len(expr):
        match = _TOKEN.match(expr, pos)
        if match is None:
            raise ValueError(f"cannot read {expr[pos:]!r} in {expr!r}")
        kind = match.lastgroup
        assert kind is not None
        if kind not in ("space", "comment"):
            tokens.append(Token(kind, match.group()))
        pos = match.end()
    return tokens


@dataclass(frozen=True, slots=True)
class MetricUse:
    name: str
    calls: tuple[str, ...]  # the functions and aggregations it is an argument of, outermost first


@dataclass(slots=True)
class Query:
    metrics: list[MetricUse] = field(default_factory=list)
    labels: set[str] = field(default_factory=set)

    @property
    def names(self) -> set[str]:
        return {use.name for use in self.metrics}


def parse(expr: str) -> Query:
    """The metric names (with the calls around each) and the label names a PromQL expression uses."""
    tokens = tokenize(expr)
    query = Query()
    stack: list[tuple[str, str]] = []  # (bracket, role): role is a call's name, "labels", "group", "braces", "range"
    pending_call: str | None = None  # an aggregation whose `by (...)` comes before its argument
    selector_named = False  # the `{...}` being read follows a metric name or holds __name__="..."
    last_metric = -2  # the index of the last token read as a metric name

    def peek(i: int) -> Token | None:
        return tokens[i] if i < len(tokens) else None

    i = 0
    while i < len(tokens):
        token, nxt = tokens[i], peek(i + 1)
        role = stack[-1][1] if stack else None
        if token.kind == "op" and token.text in _CLOSE:
            if token.text == "(":
                if pending_call is not None:
                    stack.append(("(", pending_call))
                    pending_call = None
                else:
                    stack.append(("(", "group"))
            elif token.text == "{":
                selector_named = last_metric == i - 1
                stack.append(("{", "braces"))
            else:
                stack.append(("[", "range"))
        elif token.kind == "op" and token.text in (")", "}", "]"):
            if not stack or _CLOSE[stack[-1][0]] != token.text:
                raise ValueError(f"unbalanced {token.text!r} in {expr!r}")
            if stack.pop()[1] == "braces" and not selector_named:
                raise ValueError(f"a selector without a metric name in {expr!r}")
        elif token.kind == "ident":
            word = token.text.lower()
            if role == "braces":
                if nxt is None or nxt.text not in MATCH_OPS:
                    raise ValueError(f"{token.text!r} is not a label matcher in {expr!r}")
                if token.text == "__name__":
                    value = peek(i + 2)
                    if nxt.text != "=" or value is None or value.kind != "string":
                        raise ValueError(f'only __name__="..." names a metric we can check, in {expr!r}')
                    query.metrics.append(MetricUse(value.text[1:-1], _calls(stack)))
                    selector_named = True
                else:
                    query.labels.add(token.text)
            elif role == "labels":
                query.labels.add(token.text)
            elif role == "range":
                raise ValueError(f"{token.text!r} inside a range in {expr!r}")
            elif word in LABEL_LISTS:
                if nxt is not None and nxt.text == "(":
                    stack.append(("(", "labels"))
                    i += 1
                elif word not in ("group_left", "group_right"):
                    raise ValueError(f"{token.text} without a label list in {expr!r}")
            elif word in AGGREGATORS and nxt is not None and nxt.text.lower() in ("by", "without"):
                pending_call = word
            elif nxt is not None and nxt.text == "(":
                if word not in FUNCTIONS and word not in AGGREGATORS:
                    raise ValueError(f"unknown function {token.text!r} in {expr!r}")
                stack.append(("(", word))
                i += 1
            elif word not in KEYWORDS:
                query.metrics.append(MetricUse(token.text, _calls(stack)))
                last_metric = i
        i += 1
    if stack:
        raise ValueError(f"unclosed {stack[-1][0]!r} in {expr!r}")
    return query


def _calls(stack: list[tuple[str, str]]) -> tuple[str, ...]:
    return tuple(role for _, role in stack if role not in ("group", "labels", "braces", "range"))


def template_query(query: str) -> tuple[Query, str | None]:
    """A query variable's definition: Grafana's ``label_values(expr, label)`` or plain PromQL."""
    match = re.fullmatch(r"\s*label_values\((.*),\s*([A-Za-z_]\w*)\s*\)\s*", query, re.DOTALL)
    if match is None:
        return parse(query), None
    return parse(match.group(1)), match.group(2)


# PromQL tokenizer and parser, table-driven: (expression, metric names, label names).
PARSE_CASES = [
    ("hetsched_hbm_utilization_ratio", {"hetsched_hbm_utilization_ratio"}, set()),
    ("max by (sku) (hetsched_hbm_utilization_ratio)", {"hetsched_hbm_utilization_ratio"}, {"sku"}),
    ("sum(rate(a_total[5m])) by (job)", {"a_total"}, {"job"}),
    ("sum without (instance) (up)", {"up"}, {"instance"}),
    (
        "histogram_quantile(0.99, sum by (le) (rate(h_bucket[$__rate_interval])))",
        {"h_bucket"},
        {"le"},
    ),
    ('a{b="c", d=~"e|f"} / on (b) group_left (d) g', {"a", "g"}, {"b", "d"}),
    ("a * on(x) group_left g", {"a", "g"}, {"x"}),
    ("a > bool 0.5 AND b unless c or d", {"a", "b", "c", "d"}, set()),
    ("rate(a_total[1h30m] offset 1d)", {"a_total"}, set()),
    ("max_over_time(a[1h:5m]) @ start()", {"a"}, set()),
    ("time() - max(t_seconds)", {"t_seconds"}, set()),
    ("topk(5, a) # b is only a comment", {"a"}, set()),
    ('(sum(g{n="true"}) or vector(0)) / (sum(g) > 0)', {"g"}, {"n"}),
    ('sum(c{tenant=~"$tenant", cluster=~"${cluster}"}) * 1e3 + -Inf', {"c"}, {"tenant", "cluster"}),
    ('label_replace(a, "dst", "$1", "src", "(.*)")', {"a"}, set()),
    ('{__name__="a", job="x"}', {"a"}, {"job"}),
    ("job:requests:rate5m", {"job:requests:rate5m"}, set()),
    ('count_values("v", a) + 0x1F', {"a"}, set()),
]


@pytest.mark.parametrize(("expr", "metrics", "labels"), PARSE_CASES)
def test_parse_reads_metric_and_label_names(expr: str, metrics: set[str], labels: set[str]) -> None:
    query = parse(expr)
    assert query.names == metrics
    assert query.labels == labels


def test_parse_records_the_calls_around_a_metric() -> None:
    query = parse("histogram_quantile(0.9, sum by (le) (rate(h_bucket[5m]))) + sum(rate(c_total[1m])) by (x) - g")
    calls = {use.name: use.calls for use in query.metrics}
    assert calls == {"h_bucket": ("histogram_quantile", "sum", "rate"), "c_total": ("sum", "rate"), "g": ()}


@pytest.mark.parametrize(
    "expr",
    [
        "summ(a)",  # not a function
        "rate(a[5m]",  # unclosed
        "a)",  # unbalanced
        "a[5m}",  # mismatched
        '{job="x"}',  # no metric name to check
        '{__name__=~"hetsched_.*"}',  # a regex over names cannot be checked
        "a[b]",  # an identifier in a range
        "sum by sku (a)",  # a label list needs parentheses
        "a{b}",  # not a matcher
        "a ? b",  # not PromQL
    ],
)
def test_parse_refuses_what_it_cannot_check(expr: str) -> None:
    with pytest.raises(ValueError):
        parse(expr)


def test_template_query_reads_label_values() -> None:
    query, label = template_query('label_values(hetsched_reservation_fill_rate{tenant=~"$tenant"}, cluster)')
    assert (query.names, query.labels, label) == ({"hetsched_reservation_fill_rate"}, {"tenant"}, "cluster")
    query, label = template_query("sum(up)")
    assert (query.names, label) == ({"up"}, None)


# ------------------------------------------------------------------------------------- exported series


@dataclass(frozen=True, slots=True)
class Series:
    name: str
    labels: frozenset[str]
    counter: bool  # a monotonic count (a counter's _total, a histogram's _bucket/_sum/_count): read with rate()


def exported_series() -> dict[str, Series]:
    """Every series name a service's registry exposes (each catalogue metric made once, with a child per label set)."""
    metrics = ServiceMetrics("dashboards-test")
    for spec in CATALOGUE.values():
        made: MetricWrapperBase = getattr(metrics, spec.kind)(spec.name)
        if spec.labels:
            made.labels(*("x" for _ in spec.labels))
    series = {"up": Series("up", TARGET_LABELS, counter=False)}
    for family in metrics.registry.collect():
        for sample in family.samples:
            counter = family.type in ("counter", "histogram") and not sample.name.endswith("_created")
            series[sample.name] = Series(sample.name, frozenset(sample.labels) | TARGET_LABELS, counter)
    return series


def test_exported_series_follow_the_catalogue_types() -> None:
    series = exported_series()
    assert series["hetsched_ledger_commits_total"].counter
    assert "hetsched_ledger_commits_created" in series
    assert {"hetsched_placement_decision_seconds_bucket", "hetsched_placement_decision_seconds_count"} <= set(series)
    assert "le" in series["hetsched_route_rtt_seconds_bucket"].labels
    assert not series["hetsched_hbm_utilization_ratio"].counter
    assert series["hetsched_reservation_fill_rate"].labels == {"tenant", "cluster"} | TARGET_LABELS
    assert "process_cpu_seconds_total" in series


# ------------------------------------------------------------------------------------------ dashboards


def _dashboards() -> dict[str, dict[str, Any]]:
    return {path.name: json.loads(path.read_text()) for path in sorted(DASHBOARDS.glob("*.json"))}


def _panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))  # a collapsed row holds its panels
    return out


def _exprs(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, expr) for every panel target."""
    return [
        (f"{dashboard['uid']} / {panel['title']} / {target['refId']}", target["expr"])
        for panel in _panels(dashboard)
        for target in panel.get("targets", [])
    ]


def _variables(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    variables: list[dict[str, Any]] = dashboard.get("templating", {}).get("list", [])
    return variables


def _variable_query(variable: dict[str, Any]) -> str:
    query = variable["query"]
    return str(query["query"] if isinstance(query, dict) else query)


def test_the_four_dashboards_load_with_unique_uids_and_titles() -> None:
    dashboards = _dashboards()
    assert set(dashboards) == {
        "hetsched-fleet.json",
        "hetsched-gateway.json",
        "hetsched-reservations.json",
        "hetsched-routing.json",
    }
    for name, dashboard in dashboards.items():
        assert dashboard["uid"] == name.removesuffix(".json"), name  # the uid is the file's name: /d/<uid> is stable
        assert dashboard["title"] and dashboard["schemaVersion"] >= 36, name
    assert len({d["uid"] for d in dashboards.values()}) == len(dashboards)
    assert len({d["title"] for d in dashboards.values()}) == len(dashboards)


def test_every_panel_has_a_title_the_prometheus_datasource_and_queries() -> None:
    for name, dashboard in _dashboards().items():
        ids = [panel["id"] for panel in _panels(dashboard)]
        assert len(ids) == len(set(ids)), f"{name}: panel ids repeat"
        for panel in _panels(dashboard):
            where = f"{name} / {panel.get('title')!r}"
            assert panel.get("title"), where
            assert panel.get("datasource") == DATASOURCE, where
            if panel["type"] == "row":
                continue
            targets = panel.get("targets", [])
            assert targets, f"{where}: no query"
            assert len({t["refId"] for t in targets}) == len(targets), where
            for target in targets:
                assert target.get("datasource") == DATASOURCE, where
                assert target.get("expr", "").strip(), where


def test_panels_fit_the_grid_without_overlapping() -> None:
    for name, dashboard in _dashboards().items():
        taken: set[tuple[int, int]] = set()
        for panel in dashboard["panels"]:
            pos = panel["gridPos"]
            assert pos["x"] >= 0 and pos["w"] > 0 and pos["x"] + pos["w"] <= 24, f"{name} / {panel['title']}"
            cells = {(pos["x"] + dx, pos["y"] + dy) for dx in range(pos["w"]) for dy in range(pos["h"])}
            assert not cells & taken, f"{name} / {panel['title']} overlaps another panel"
            taken |= cells


def test_every_query_names_only_exported_series() -> None:
    series = exported_series()
    for dashboard in _dashboards().values():
        for where, expr in _exprs(dashboard):
            query = parse(expr)
            assert query.metrics, f"{where}: {expr!r} reads no metric"
            unknown = query.names - set(series)
            assert not unknown, f"{where}: {sorted(unknown)} are not exported (shared/infra/metrics.py CATALOGUE)"
            known_labels = set().union(*(series[name].labels for name in query.names))
            assert query.labels <= known_labels, f"{where}: no such label {sorted(query.labels - known_labels)}"
            for use in query.metrics:
                rated = bool(use.calls) and use.calls[-1] in RATE_FUNCTIONS
                kind = "a counter" if series[use.name].counter else "a gauge"
                assert rated == series[use.name].counter, f"{where}: {use.name} is {kind}, rate() is {rated}"
                if "histogram_quantile" in use.calls:
                    assert use.name.endswith("_bucket"), f"{where}: histogram_quantile over {use.name}"


def test_variables_query_exported_labels_and_queries_use_only_defined_variables() -> None:
    series = exported_series()
    for dashboard in _dashboards().values():
        variables = _variables(dashboard)
        defined = {variable["name"] for variable in variables}
        for variable in variables:
            assert variable["type"] == "query" and variable["datasource"] == DATASOURCE, variable["name"]
            query, label = template_query(_variable_query(variable))
            assert query.names <= set(series), variable["name"]
            labels = set().union(*(series[name].labels for name in query.names))
            assert label in labels and query.labels <= labels, variable["name"]
        texts = [expr for _, expr in _exprs(dashboard)] + [_variable_query(v) for v in variables]
        texts += [link["url"] for panel in _panels(dashboard) for link in _field_links(panel)]
        for text in texts:
            for used in re.findall(r"\$\{?(\w+)", text):
                assert used.startswith("__") or used in defined, f"{dashboard['uid']}: ${used} is not a variable"


def _field_links(panel: dict[str, Any]) -> list[dict[str, Any]]:
    links: list[dict[str, Any]] = panel.get("fieldConfig", {}).get("defaults", {}).get("links", [])
    return links


def test_prometheus_parses_every_query(tmp_path: Path) -> None:
    """promtool's PromQL parser agrees the queries are PromQL (Grafana's variables given sample values)."""
    exprs = [expr for dashboard in _dashboards().values() for _, expr in _exprs(dashboard)]
    for dashboard in _dashboards().values():
        for variable in _variables(dashboard):
            match = re.fullmatch(r"label_values\((.*),\s*\w+\)", _variable_query(variable), re.DOTALL)
            exprs.append(match.group(1) if match else _variable_query(variable))
    rules = [
        {"record": f"dashboard:query_{n}", "expr": re.sub(r"\$\{?\w+\}?", ".*", re.sub(r"\[\$\w+\]", "[5m]", expr))}
        for n, expr in enumerate(exprs)
    ]
    path = tmp_path / "dashboard_queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    promtool = ensure_tool("promtool", "prometheus")
    result = subprocess.run([promtool, "check", "rules", path], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(rules)} rules found" in result.stdout


def test_every_catalogue_metric_is_on_a_dashboard() -> None:
    used = {name for dashboard in _dashboards().values() for _, expr in _exprs(dashboard) for name in parse(expr).names}
    for name, spec in CATALOGUE.items():
        expected = {f"{name}_bucket", f"{name}_count", f"{name}_sum"} if spec.kind == "histogram" else {name}
        assert expected & used, f"{name} is exported but on no dashboard"


def test_each_dashboard_links_to_the_others() -> None:
    dashboards = _dashboards()
    for dashboard in dashboards.values():
        reached = set()
        for link in dashboard.get("links", []):
            if link["type"] == "dashboards":
                reached |= {d["uid"] for d in dashboards.values() if set(link["tags"]) <= set(d.get("tags", []))}
            else:
                reached |= {d["uid"] for d in dashboards.values() if f"/d/{d['uid']}" in link["url"]}
        others = {d["uid"] for d in dashboards.values()} - {dashboard["uid"]}
        assert others <= reached, f"{dashboard['uid']} does not link to {sorted(others - reached)}"


def test_reservations_drill_down_by_tenant_and_cluster_with_target_and_alert_lines() -> None:
    dashboard = _dashboards()["hetsched-reservations.json"]
    variables = {v["name"]: v for v in _variables(dashboard)}
    assert {"tenant", "cluster"} <= set(variables)
    for name in ("tenant", "cluster"):
        query, label = template_query(_variable_query(variables[name]))
        assert query.names == {"hetsched_reservation_fill_rate"} and label == name
        assert variables[name]["multi"] and variables[name]["includeAll"]
    fill_rate = {"hetsched_reservation_fill_rate", "hetsched_reservation_fill_rate_overall"}
    grouped: set[frozenset[str]] = set()
    for panel in _panels(dashboard):
        if panel["type"] != "timeseries" or not any(parse(t["expr"]).names & fill_rate for t in panel["targets"]):
            continue
        defaults = panel["fieldConfig"]["defaults"]
        steps = {step["value"] for step in defaults["thresholds"]["steps"]}
        assert {0.7, 0.85} <= steps, f"{panel['title']}: no 0.85 target / 0.7 alert threshold"
        assert defaults["custom"]["thresholdsStyle"]["mode"] != "off", f"{panel['title']}: thresholds not drawn"
        for target in panel["targets"]:
            query = parse(target["expr"])
            if "hetsched_reservation_fill_rate" in query.names:
                assert {"tenant", "cluster"} <= query.labels, f"{panel['title']}: not filtered by the variables"
            grouped.add(frozenset(query.labels - {"tenant", "cluster"} | _by_labels(target["expr"])))
    # Overall, per tenant, per cluster, per tenant and cluster.
    assert {frozenset(), frozenset({"tenant"}), frozenset({"cluster"}), frozenset({"tenant", "cluster"})} <= grouped


def _by_labels(expr: str) -> set[str]:
    return {label.strip() for group in re.findall(r"\bby\s*\(([^)]*)\)", expr) for label in group.split(",") if label}


def test_idle_cost_is_shown_per_tenant() -> None:
    dashboard = _dashboards()["hetsched-reservations.json"]
    exprs = [
        expr for _, expr in _exprs(dashboard) if "hetsched_reservation_idle_cost_usd_per_hour" in parse(expr).names
    ]
    assert any(_by_labels(expr) == {"tenant"} for expr in exprs)


GATEWAY_OWN = {"hetsched_gateway_added_seconds_bucket", "hetsched_gateway_in_flight_requests"}


def test_gateway_slo_shows_ttft_quantiles_against_the_target_tpot_e2e_and_outcomes_per_model() -> None:
    dashboard = _dashboards()["hetsched-gateway.json"]
    variables = {v["name"]: v for v in _variables(dashboard)}
    query, label = template_query(_variable_query(variables["model"]))
    assert query.names == {"hetsched_gateway_requests_total"} and label == "model"
    shown: dict[tuple[str, str], set[str]] = {}  # (series, quantile or "") -> grouping labels
    for _, expr in _exprs(dashboard):
        query = parse(expr)
        if query.names <= GATEWAY_OWN:  # the gateway's own figures carry no model
            continue
        assert "model" in query.labels, f"{expr!r} is not filtered by $model"
        found = re.match(r"histogram_quantile\((0\.\d+),", expr)
        for name in query.names:
            shown.setdefault((name, found.group(1) if found else ""), set()).update(_by_labels(expr))
    for quantile in ("0.5", "0.99"):
        assert "model" in shown[("hetsched_gateway_ttft_seconds_bucket", quantile)]
    assert "model" in shown[("hetsched_gateway_slo_ttft_seconds", "")]
    assert "model" in shown[("hetsched_gateway_tpot_seconds_bucket", "0.99")]
    assert "model" in shown[("hetsched_gateway_e2e_seconds_bucket", "0.99")]
    assert {"outcome", "reason"} <= shown[("hetsched_gateway_requests_total", "")]
    # The rejection share panel draws the alert's 5% line.
    share = next(p for p in _panels(dashboard) if p["title"].startswith("Rejected for capacity or failed"))
    assert 0.05 in {step["value"] for step in share["fieldConfig"]["defaults"]["thresholds"]["steps"]}
    assert share["fieldConfig"]["defaults"]["custom"]["thresholdsStyle"]["mode"] != "off"


# ---------------------------------------------------------------------------------------- provisioning


def _yaml(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    return data


def test_datasource_provisioning_defines_the_uid_the_dashboards_use() -> None:
    files = sorted((PROVISIONING / "datasources").glob("*.yml"))
    assert files
    sources = [source for path in files for source in _yaml(path)["datasources"]]
    assert all(_yaml(path)["apiVersion"] == 1 for path in files)
    prometheus = [s for s in sources if s["uid"] == DATASOURCE["uid"]]
    assert len(prometheus) == 1 and prometheus[0]["type"] == DATASOURCE["type"]
    assert prometheus[0]["url"].startswith("http") and prometheus[0]["access"] == "proxy"
    assert sum(bool(s.get("isDefault")) for s in sources) == 1


def test_dashboard_provisioning_points_at_the_dashboards_folder() -> None:
    files = sorted((PROVISIONING / "dashboards").glob("*.yml"))
    assert files
    providers = [provider for path in files for provider in _yaml(path)["providers"]]
    assert all(_yaml(path)["apiVersion"] == 1 for path in files)
    assert len(providers) == 1
    provider = providers[0]
    assert provider["type"] == "file" and not provider.get("allowUiUpdates")
    mounted = MOUNTS.get(provider["options"]["path"].rstrip("/"))
    assert mounted == DASHBOARDS, f"{provider['options']['path']} is not where infra/grafana/dashboards is mounted"
    assert sorted(p.name for p in mounted.iterdir()) == sorted(_dashboards()), "only the dashboards in that folder"


def test_the_documented_mounts_are_the_ones_the_provisioning_expects() -> None:
    """The provisioning file's `docker run` example mounts what MOUNTS says; so does a Grafana in compose, if any."""
    text = next((PROVISIONING / "dashboards").glob("*.yml")).read_text()
    documented = {target: REPO / source for source, target in re.findall(r'-v "\$PWD/([^:"]+):([^:"]+):ro"', text)}
    assert documented == MOUNTS
    for spec in _yaml(REPO / "docker-compose.yml")["services"].values():
        if str(spec.get("image", "")).startswith("grafana/"):
            volumes = {
                str(v).split(":")[1].rstrip("/"): (REPO / str(v).split(":")[0]).resolve() for v in spec["volumes"]
            }
            for target, folder in MOUNTS.items():
                assert volumes.get(target) == folder, f"compose's Grafana does not mount {folder} at {target}"
