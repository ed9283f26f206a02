"""`hetsched sim`: JSON shape, bad rows rejected (naming the row) or skipped (counted)."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

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


def _sim(*args: str) -> object:
    return runner.invoke(app, ["sim", "--fleet", str(demo_fleet_path()), *args])


def test_json_has_every_policy_and_the_api_keys() -> None:
    result = _sim("--trace", str(TRACES / "sim_small.csv"), "--json")
    assert result.exit_code == 0, result.output  # type: ignore[attr-defined]
    body = json.loads(result.stdout)  # type: ignore[attr-defined]
    assert set(body["policies"]) == {"hetsched", "gpu-index", "random", "first-fit", "cheapest-sku"}
    for kpis in body["policies"].values():
        assert API_KEYS <= set(kpis)
        assert kpis["requests"] == 8
        assert kpis["fill_rate"] is None


def test_one_policy_and_a_table() -> None:
    result = _sim("--trace", str(TRACES / "sim_small.csv"), "--policy", "hetsched")
    assert result.exit_code == 0, result.output  # type: ignore[attr-defined]
    assert "hetsched" in result.stdout  # type: ignore[attr-defined]
    assert "gpu-index" not in result.stdout  # type: ignore[attr-defined]


def test_bad_rows_reject_exits_non_zero_naming_the_row() -> None:
    result = _sim("--trace", str(TRACES / "sim_bad_row.csv"), "--json")
    assert result.exit_code != 0
    assert "row 2" in result.output  # type: ignore[attr-defined]


def test_bad_rows_skip_counts_them() -> None:
    result = _sim("--trace", str(TRACES / "sim_bad_row.csv"), "--json", "--bad-rows", "skip", "--policy", "first-fit")
    assert result.exit_code == 0, result.output  # type: ignore[attr-defined]
    assert "skipped 1 bad rows" in result.output  # type: ignore[attr-defined]
    body = json.loads(result.stdout)  # type: ignore[attr-defined]
    assert body["policies"]["first-fit"]["requests"] == 2


def test_plots_are_written(tmp_path: Path) -> None:
    result = _sim("--trace", str(TRACES / "sim_small.csv"), "--policy", "gpu-index", "--plots", str(tmp_path))
    assert result.exit_code == 0, result.output  # type: ignore[attr-defined]
    assert (tmp_path / "gpu-index.png").stat().st_size > 0
