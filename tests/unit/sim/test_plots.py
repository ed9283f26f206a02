"""`hetsched sim --plots`: policies keep one distinct style, equal series share a line, the figures are written."""

from __future__ import annotations

from pathlib import Path

import pytest

from hetsched.cli.sim.plots import group_identical, missed_slo_pct, style, write_comparison, write_plots
from hetsched.cli.sim.run import run_sim
from shared.domain.sim import POLICIES
from shared.infra.catalog import demo_fleet_path

TRACES = Path(__file__).resolve().parents[2] / "fixtures" / "traces"


def test_every_policy_has_its_own_colour_marker_and_line_style() -> None:
    styles = [style(name, i) for i, name in enumerate(POLICIES)]
    for part in range(3):
        assert len({repr(s[part]) for s in styles}) == len(POLICIES)
    assert style("hetsched", 0) == style("hetsched", 3)  # by name, wherever it is drawn
    assert style("live", 0) != style("live", 1)  # other names: the spares, in turn


@pytest.mark.parametrize(
    ("series", "groups"),
    [
        ({"a": (1.0, 2.0), "b": (1.0, 2.5), "c": (1.0, 2.0)}, [(("a", "c"), (1.0, 2.0)), (("b",), (1.0, 2.5))]),
        ({"a": (None, 1.0), "b": (None, 1.0)}, [(("a", "b"), (None, 1.0))]),
        ({"a": (1.0,), "b": (1.0 + 1e-12,)}, [(("a",), (1.0,)), (("b",), (1.0 + 1e-12,))]),  # equal means equal
        ({}, []),
    ],
)
def test_equal_series_share_one_line_named_by_every_policy(
    series: dict[str, tuple[float | None, ...]], groups: list[tuple[tuple[str, ...], tuple[float | None, ...]]]
) -> None:
    assert group_identical(series) == groups


def test_the_comparison_figure_and_the_per_policy_series_are_written(tmp_path: Path) -> None:
    results, _ = run_sim(demo_fleet_path(), TRACES / "sim_small.csv")
    for result in results.values():
        assert missed_slo_pct(result.kpis) == pytest.approx(100 * (1 - result.kpis.slo_attainment))
    path = write_comparison(results, tmp_path / "sub" / "policies.png", title="sim_small")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    written = write_plots(results, tmp_path / "all", title="sim_small")
    assert [p.name for p in written] == ["policies.png", *(f"{name}.png" for name in POLICIES)]
