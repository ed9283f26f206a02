"""The alert rules (infra/prometheus/alerts.yml) and their routing (infra/alertmanager/alertmanager.yml).

promtool checks the rules and runs their unit tests (infra/prometheus/tests/*.yml: each rule fires just
past its threshold, not at or before it, and only after its `for:`); amtool checks the Alertmanager
config and where each priority is routed, and a real Alertmanager shows that its inhibit rules hide the
lower tier of a signal while the higher one fires. All come from Debian packages (prometheus,
prometheus-alertmanager), installed through tests/system_tools.py when missing. The Python tests here
check what promtool cannot: every expression names only catalogued metrics and labels, every rule
carries the brief's severity and priority, and every rule has a firing and a silent promtool case.
"""

from __future__ import annotations

import json
import re
import socket
import subprocess
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared.infra.metrics import CATALOGUE
from tests.system_tools import ensure_tool
from tests.waiting import wait_for_sync

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "infra" / "prometheus" / "alerts.yml"
RULE_TESTS = sorted((ROOT / "infra" / "prometheus" / "tests").glob("*.yml"))
ALERTMANAGER = ROOT / "infra" / "alertmanager" / "alertmanager.yml"

# Metrics every Prometheus target has besides the catalogue: scrape health and process basics.
BASICS = {"up", "process_start_time_seconds", "process_cpu_seconds_total", "process_resident_memory_bytes"}
# Labels Prometheus adds to every scraped series.
TARGET_LABELS = {"job", "instance"}


# --- a small PromQL lexer: enough to find the metric names and matcher labels of an expression -----

_TOKEN = re.compile(
    r"""
    (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<range>\[[^\]]*\])
  | (?P<duration>(?:\d+(?:ms|[smhdwy]))+\b)
  | (?P<number>0[xX][0-9a-fA-F]+|(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)
  | (?P<ident>[a-zA-Z_:][a-zA-Z0-9_:]*)
  | (?P<open>\{)
  | (?P<close>\})
  | (?P<paren>\()
  | (?P<other>\S)
    """,
    re.VERBOSE,
)
_KEYWORDS = {
    "and",
    "or",
    "unless",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "offset",
    "bool",
    "atan2",
    "inf",
    "nan",
}
# Aggregations may put their grouping before the parenthesis: sum by (node) (x).
_AGGREGATIONS = {
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
}
# Keywords followed by a parenthesised list of label names.
_GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}


@dataclass(frozen=True)
class Selector:
    metric: str
    matcher_labels: tuple[str, ...]


def selectors(expr: str) -> list[Selector]:
    """The metric selectors of a PromQL expression: each metric name with the labels its matchers use."""
    tokens = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(expr)]
    found: list[Selector] = []
    i = 0
    while i < len(tokens):
        kind, text = tokens[i]
        following = tokens[i + 1] if i + 1 < len(tokens) else (None, "")
        if kind == "ident" and text.lower() in _GROUPING and following[0] == "paren":
            # by (a, b) / on (...) / group_left (...): label names, not metrics.
            i = _skip_past(tokens, i + 1, ")")
            continue
        if kind == "ident" and (
            following[0] == "paren" or (text.lower() in _AGGREGATIONS and following[1].lower() in _GROUPING)
        ):
            i += 1  # a function call or aggregation: sum(...), sum by (x) (...), vector(0), increase(...)
            continue
        if kind == "ident" and text.lower() not in _KEYWORDS:
            labels, i = _matchers(tokens, i + 1)
            found.append(Selector(text, labels))
            continue
        if kind == "open":  # {__name__="x"} or a selector without a name
            labels, i = _matchers(tokens, i)
            found.append(Selector("", labels))
            continue
        i += 1
    return found


def _skip_past(tokens: list[tuple[str | None, str]], i: int, closing: str) -> int:
    while i < len(tokens) and tokens[i][1] != closing:
        i += 1
    return i + 1


def _matchers(tokens: list[tuple[str | None, str]], i: int) -> tuple[tuple[str, ...], int]:
    """Label names of the ``{...}`` block starting at ``i`` (if any), and the index after it."""
    if i >= len(tokens) or tokens[i][0] != "open":
        return (), i
    labels: list[str] = []
    i += 1
    while i < len(tokens) and tokens[i][0] != "close":
        kind, text = tokens[i]
        if kind in ("ident", "string") and i + 1 < len(tokens) and tokens[i + 1][1] in ("=", "!"):
            labels.append(text.strip("\"'`"))
        i += 1
    return tuple(labels), i + 1


# --- the files -------------------------------------------------------------------------------------


def _rules() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


def _rule_id(rule: dict[str, Any]) -> str:
    return f"{rule['alert']}-{rule['labels']['priority']}-{rule['labels']['severity']}"


ALL_RULES = _rules()


def test_the_lexer_finds_names_and_labels_in_tricky_expressions() -> None:
    expr = (
        'sum by (degree) (rate(foo_total{a="x}y", b!~"1e6"}[5m] offset 1h)) / on (node) group_left (sku) '
        'bar > 100e6 and time() - baz_seconds > 0x1F or vector(0) unless {__name__="qux"}'
    )
    assert selectors(expr) == [
        Selector("foo_total", ("a", "b")),
        Selector("bar", ()),
        Selector("baz_seconds", ()),
        Selector("", ("__name__",)),
    ]


def catalogued_labels(series: str) -> set[str] | None:
    """The labels of a series the catalogue exports (a histogram's ``_bucket`` adds ``le``; its ``_sum`` and
    ``_count`` are series too), or None when no catalogue metric exports it."""
    if series in CATALOGUE:
        return set(CATALOGUE[series].labels)
    for suffix, extra in (("_bucket", {"le"}), ("_sum", set()), ("_count", set())):
        spec = CATALOGUE.get(series.removesuffix(suffix)) if series.endswith(suffix) else None
        if spec is not None and spec.kind == "histogram":
            return set(spec.labels) | extra
    return None


def test_a_histograms_series_are_catalogued_and_only_a_histograms() -> None:
    assert catalogued_labels("hetsched_placement_decision_seconds_bucket") == {"le"}
    assert catalogued_labels("hetsched_gateway_ttft_seconds_count") == {"model", "engine", "sku", "region"}
    assert catalogued_labels("hetsched_hbm_free_bytes_bucket") is None  # a gauge has no buckets
    assert catalogued_labels("hetsched_gateway_ttft_seconds_total") is None


@pytest.mark.parametrize("rule", ALL_RULES, ids=_rule_id)
def test_every_rule_names_only_catalogued_metrics_and_their_labels(rule: dict[str, Any]) -> None:
    found = selectors(rule["expr"])
    assert found, f"no metric found in {rule['expr']!r}"
    for selector in found:
        labels = catalogued_labels(selector.metric)
        assert labels is not None or selector.metric in BASICS, (
            f"{rule['alert']}: {selector.metric!r} is not in shared/infra/metrics.py CATALOGUE"
        )
        known = labels or set()
        unknown = set(selector.matcher_labels) - known - TARGET_LABELS
        assert not unknown, f"{rule['alert']}: {selector.metric} has no label(s) {sorted(unknown)}"


def test_an_uncatalogued_metric_would_be_caught() -> None:
    names = {s.metric for s in selectors("hetsched_hbm_utilisation_ratio > 0.85")}  # British spelling
    assert names == {"hetsched_hbm_utilisation_ratio"}
    assert not names & CATALOGUE.keys()


# The brief's mapping (S2 §9: metrics 1/5/8 -> P0, 2/3/9 -> P1, 4/6/7 -> P2; the P0 for a split
# TP group and the affinity tiers; the gateway's TTFT SLO pages (P0), its rejections open a ticket (P2)):
# alertname -> {(severity, priority, for)}.
EXPECTED = {
    "NvlinkAffinityLow": {("warning", "P2", "5m"), ("warning", "P1", "1m"), ("critical", "P0", "1m")},
    "TpGroupNotNvlinked": {("critical", "P0", None)},
    "NvlinkCrossIslandTraffic": {("warning", "P1", "1m")},
    "TopologyDriftDetected": {("critical", "P0", None)},
    "TopologyMapStale": {("warning", "P1", None)},
    "HbmUtilizationHigh": {("warning", "P1", "5m")},
    "EngineOomRisk": {("critical", "P1", "1m")},
    "EnginePreempting": {("warning", "P1", "5m")},
    "HbmDrift": {("critical", "P0", "1m")},
    "PcieUtilizationHigh": {("warning", "P1", None)},
    "TpuFragmentationHigh": {("warning", "P2", "5m")},
    "ReservationFillRateLow": {("warning", "P2", "15m")},
    "ReservationFillRateLowOverall": {("warning", "P2", "15m")},
    "HetschedGatewayTTFTSLOBreach": {("critical", "P0", "5m")},
    "HetschedGatewayRejecting": {("warning", "P2", "10m")},
    "NodeLost": {("critical", "P1", None)},
    "ServiceDown": {("critical", "P0", "1m")},
    "ReplicaFailed": {("critical", "P1", None)},
    "ReplicaLoadingOverdue": {("warning", "P2", None)},
    "EventsDeadLettered": {("warning", "P1", None)},
    "OutboxEventsQuarantined": {("warning", "P1", None)},
}


def test_every_rule_has_the_briefs_severity_priority_and_for() -> None:
    got: dict[str, set[tuple[str, str, str | None]]] = {}
    for rule in ALL_RULES:
        got.setdefault(rule["alert"], set()).add(
            (rule["labels"]["severity"], rule["labels"]["priority"], rule.get("for"))
        )
    assert got == EXPECTED


@pytest.mark.parametrize("rule", ALL_RULES, ids=_rule_id)
def test_every_rule_has_a_summary_and_a_description(rule: dict[str, Any]) -> None:
    assert rule["labels"]["severity"] in {"warning", "critical"}
    assert rule["labels"]["priority"] in {"P0", "P1", "P2"}
    assert rule["annotations"]["summary"].strip()
    assert rule["annotations"]["description"].strip()


def _cases() -> list[tuple[str, list[dict[str, Any]]]]:
    """Every (alertname, exp_alerts) of every promtool unit test."""
    cases = []
    for path in RULE_TESTS:
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                cases.append((case["alertname"], case.get("exp_alerts") or []))
    return cases


@pytest.mark.parametrize("rule", ALL_RULES, ids=_rule_id)
def test_every_rule_has_a_firing_and_a_silent_promtool_case(rule: dict[str, Any]) -> None:
    def this_tier(alert: dict[str, Any]) -> bool:
        labels = alert.get("exp_labels") or {}
        return all(labels.get(k) == v for k, v in rule["labels"].items())

    mine = [alerts for name, alerts in _cases() if name == rule["alert"]]
    assert any(any(this_tier(a) for a in alerts) for alerts in mine), f"no promtool case where {_rule_id(rule)} fires"
    assert any(not any(this_tier(a) for a in alerts) for alerts in mine), f"no case where {_rule_id(rule)} is silent"


def _run(*command: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in command], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


def test_promtool_checks_the_rules() -> None:
    promtool = ensure_tool("promtool", "prometheus")
    result = _run(promtool, "check", "rules", RULES)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(ALL_RULES)} rules found" in result.stdout


def test_promtool_unit_tests_of_every_rule_pass() -> None:
    promtool = ensure_tool("promtool", "prometheus")
    assert RULE_TESTS, "no promtool unit tests in infra/prometheus/tests"
    result = _run(promtool, "test", "rules", *RULE_TESTS)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert output.count("SUCCESS") == len(RULE_TESTS), output


def test_amtool_checks_the_alertmanager_config() -> None:
    amtool = ensure_tool("amtool", "prometheus-alertmanager")
    result = _run(amtool, "check-config", ALERTMANAGER)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@pytest.mark.parametrize(
    ("priority", "receiver"),
    [("P0", "oncall-pager"), ("P1", "oncall-chat"), ("P2", "oncall-ticket"), ("P7", "oncall-ticket")],
)
def test_alertmanager_routes_each_priority_to_its_receiver(priority: str, receiver: str) -> None:
    amtool = ensure_tool("amtool", "prometheus-alertmanager")
    result = _run(
        amtool, "config", "routes", "test", f"--config.file={ALERTMANAGER}", f"priority={priority}", "alertname=Any"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.split() == [receiver]


def test_each_priority_repeats_at_its_answer_time() -> None:
    # S2 §9: P0 answered in 5 min, P1 in 15 min, P2 in 1 h; P0 is sent at once (group_wait 0s).
    routes = yaml.safe_load(ALERTMANAGER.read_text())["route"]["routes"]
    timing = {r["matchers"][0]: (r["group_wait"], r["repeat_interval"]) for r in routes}
    assert timing['priority="P0"'] == ("0s", "5m")
    assert timing['priority="P1"'][1] == "15m"
    assert timing['priority="P2"'][1] == "1h"
    priorities = {rule["labels"]["priority"] for rule in ALL_RULES}
    assert {f'priority="{p}"' for p in priorities} <= timing.keys()


def _post_json(url: str, body: object) -> None:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200, response.status


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def test_a_real_alertmanager_hides_the_lower_tier_while_the_higher_fires(tmp_path: Path) -> None:
    binary = ensure_tool("prometheus-alertmanager", "prometheus-alertmanager")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    base = f"http://127.0.0.1:{port}/api/v2"
    process = subprocess.Popen(
        [
            str(binary),
            f"--config.file={ALERTMANAGER}",
            f"--storage.path={tmp_path}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def inhibited(
        count: int, settled: dict[tuple[str, str, str, str], bool] | None = None
    ) -> dict[tuple[str, str, str, str], bool]:
        """The alerts Alertmanager holds once there are ``count``, and (Alertmanager marks an alert
        inhibited a moment after the alert that inhibits it arrives) once those of ``settled`` are so."""

        def states() -> dict[tuple[str, str, str, str], bool] | None:
            got = {
                (
                    a["labels"]["alertname"],
                    a["labels"].get("accelerator", ""),
                    a["labels"]["severity"],
                    a["labels"]["priority"],
                ): bool(a["status"]["inhibitedBy"])
                for a in _get_json(f"{base}/alerts")
            }
            if len(got) != count or any(got.get(k) != v for k, v in (settled or {}).items()):
                return None
            return got

        found = wait_for_sync(states, 30, interval_s=0.2, what=f"Alertmanager holds {count} alerts")
        assert found is not None
        return found

    try:
        wait_for_sync(lambda: _ready(base), 30, interval_s=0.2, what="Alertmanager answers")
        # Affinity at 69%: the P1 tier hides the P2 tier. HBM: both tiers on g2, only the warning on g0.
        hbm = {"alertname": "HbmUtilizationHigh", "node": "n2", "sku": "H200-SXM-141GB"}
        _post_json(
            f"{base}/alerts",
            [
                {"labels": {"alertname": "NvlinkAffinityLow", "severity": "warning", "priority": "P2"}},
                {"labels": {"alertname": "NvlinkAffinityLow", "severity": "warning", "priority": "P1"}},
                {"labels": {**hbm, "accelerator": "g2", "severity": "warning", "priority": "P1"}},
                {"labels": {**hbm, "accelerator": "g2", "severity": "critical", "priority": "P1"}},
                {"labels": {**hbm, "accelerator": "g0", "severity": "warning", "priority": "P1"}},
            ],
        )
        expected = {
            ("NvlinkAffinityLow", "", "warning", "P2"): True,
            ("NvlinkAffinityLow", "", "warning", "P1"): False,
            ("HbmUtilizationHigh", "g2", "warning", "P1"): True,
            ("HbmUtilizationHigh", "g2", "critical", "P1"): False,
            ("HbmUtilizationHigh", "g0", "warning", "P1"): False,  # another accelerator: not hidden
        }
        first = inhibited(5, {k: v for k, v in expected.items() if v})  # wait for the hidden ones only
        assert first == expected
        # Affinity falls below 65%: the P0 tier hides both lower ones.
        _post_json(
            f"{base}/alerts", [{"labels": {"alertname": "NvlinkAffinityLow", "severity": "critical", "priority": "P0"}}]
        )
        hidden_by_p0 = {
            ("NvlinkAffinityLow", "", "warning", "P2"): True,
            ("NvlinkAffinityLow", "", "warning", "P1"): True,
            ("NvlinkAffinityLow", "", "critical", "P0"): False,
        }
        second = inhibited(6, hidden_by_p0)
        assert {k: v for k, v in second.items() if k[0] == "NvlinkAffinityLow"} == hidden_by_p0
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _ready(base: str) -> bool:
    try:
        _get_json(f"{base}/status")
    except OSError:
        return False
    return True
