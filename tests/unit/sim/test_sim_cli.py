"""`hetsched sim`: JSON shape, bad rows rejected (naming the row) or skipped (counted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from hetsched.cli import app
from shared.infra.catalog import demo_fleet_path

TRACES = Path(__file__).resolve().parents[2] / "fixtures" / "traces"
API_KEYS = {
    "requests",
    "placed",
    "success_rate",
    "slo_attainment",
    "nvlink_affinity",
    "fill_rate",
    "tpu_fragmentation",
    "cost_per_million_tokens",
    "energy_kwh",
    "decision_p50_ms",
    "decision_p99_ms",
}
runner = CliRunner()


def _sim(*args: str) -> Result:
    return runner.invoke(app, ["sim", "--fleet", str(demo_fleet_path()), *args])


def test_json_has_every_policy_and_the_api_keys() -> None:
    result = _sim("--trace", str(TRACES / "sim_small.csv"), "--json")
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert set(body["policies"]) == {"hetsched", "gpu-index", "random", "first-fit", "cheapest-sku"}
    for kpis in body["policies"].values():
        assert API_KEYS <= set(kpis)
        assert kpis["requests"] == 8
        assert kpis["fill_rate"] is None


def test_one_policy_and_a_table() -> None:
    result = _sim("--trace", str(TRACES / "sim_small.csv"), "--policy", "hetsched")
    assert result.exit_code == 0, result.output
    assert "hetsched" in result.stdout
    assert "gpu-index" not in result.stdout


def test_bad_rows_reject_exits_non_zero_naming_the_row() -> None:
    result = _sim("--trace", str(TRACES / "sim_bad_row.csv"), "--json")
    assert result.exit_code != 0
    assert "row 2" in result.output


def test_bad_rows_skip_counts_them() -> None:
    result = _sim("--trace", str(TRACES / "sim_bad_row.csv"), "--json", "--bad-rows", "skip", "--policy", "first-fit")
    assert result.exit_code == 0, result.output
    assert "skipped 1 bad rows" in result.output
    body = json.loads(result.stdout)
    assert body["policies"]["first-fit"]["requests"] == 2


def test_plots_are_written(tmp_path: Path) -> None:
    result = _sim("--trace", str(TRACES / "sim_small.csv"), "--policy", "gpu-index", "--plots", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "gpu-index.png").stat().st_size > 0


def test_load_scales_the_arrivals_and_keeps_the_shape() -> None:
    native = json.loads(_sim("--trace", str(TRACES / "sim_small.csv"), "--json", "--policy", "hetsched").stdout)
    loaded = _sim("--trace", str(TRACES / "sim_small.csv"), "--json", "--policy", "hetsched", "--load", "0.9")
    assert loaded.exit_code == 0, loaded.output
    body = json.loads(loaded.stdout)
    assert set(body["policies"]) == {"hetsched"}
    assert body["load"]["target"] == 0.9 and body["load"]["factor"] > 0
    assert "load 0.9: arrivals" in loaded.output
    assert body["policies"]["hetsched"]["requests"] == native["policies"]["hetsched"]["requests"] == 8
    assert _sim("--trace", str(TRACES / "sim_small.csv"), "--load", "0").exit_code == 2


def test_sweep_json_has_every_load_policy_and_the_margin() -> None:
    result = _sim("--trace", str(TRACES / "sim_small.csv"), "--sweep", "--loads", "0.5,0.9", "--json")
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert body["trace"] == "sim_small"
    assert "arrival rate" in body["load_definition"]
    assert body["native_load"] > 0
    assert {m["model"] for m in body["models"]} <= {"llama3-8b", "llama3-70b", "mixtral-8x7b"}
    assert [p["load"] for p in body["sweep"]] == [0.5, 0.9]
    first, second = body["sweep"]
    assert second["factor"] == pytest.approx(first["factor"] * 0.9 / 0.5)
    assert first["factor"] == pytest.approx(0.5 / body["native_load"])
    for point in body["sweep"]:
        assert set(point["policies"]) == {"hetsched", "gpu-index", "random", "first-fit", "cheapest-sku"}
        for kpis in point["policies"].values():
            assert API_KEYS <= set(kpis) and kpis["requests"] == 8
        best = max(k["slo_attainment"] for name, k in point["policies"].items() if name != "hetsched")
        ours = point["policies"]["hetsched"]["slo_attainment"]
        assert point["margin"]["slo_attainment"] == pytest.approx(ours - best)


def test_sweep_prints_one_row_per_policy_and_load_and_writes_cost_vs_slo_plots(tmp_path: Path) -> None:
    result = _sim("--trace", str(TRACES / "sim_small.csv"), "--sweep", "--loads", "0.6,0.95", "--plots", str(tmp_path))
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "hetsched sim --sweep: sim_small" in out
    assert out.count("cheapest-sku") == 2 and out.count("first-fit") == 2
    assert "load 0.6: hetsched SLO attainment" in out and "load 0.95: hetsched SLO attainment" in out
    for name in ("hetsched", "gpu-index", "random", "first-fit", "cheapest-sku", "all"):
        assert (tmp_path / f"sim_sim_small_{name}.png").stat().st_size > 0


def test_sweep_refuses_bad_loads_and_the_live_stack() -> None:
    trace = str(TRACES / "sim_small.csv")
    bad = _sim("--trace", trace, "--sweep", "--loads", "0.6,abc")
    assert bad.exit_code == 2 and "abc" in bad.output
    assert _sim("--trace", trace, "--sweep", "--loads", "-1").exit_code == 2
    assert _sim("--trace", trace, "--sweep", "--live").exit_code == 2
    assert _sim("--trace", trace, "--sweep", "--sharing", "compare").exit_code == 2
