"""`hetsched sim --reserve TENANT:POLICY:COUNT:SKU --owner-models ...`: parsing, errors, and the KPIs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner, Result

from hetsched.cli import app
from hetsched.cli.sim.run import parse_owner_models, parse_reservations, parse_reserve
from shared.domain.sim import SimReservation
from shared.infra.catalog import demo_fleet_path

TRACE = Path(__file__).resolve().parents[3] / "fixtures" / "traces" / "sim_small.csv"
runner = CliRunner()


def _sim(*args: str) -> Result:
    return runner.invoke(app, ["sim", "--fleet", str(demo_fleet_path()), "--trace", str(TRACE), *args])


def test_parse_reserve() -> None:
    assert parse_reserve("acme:soft:8:H100-SXM-80GB") == SimReservation(
        tenant="acme", policy="soft", count=8, sku="H100-SXM-80GB"
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("acme:soft:8", "TENANT:POLICY:COUNT:SKU"),
        ("acme:soft:8:H100:x", "TENANT:POLICY:COUNT:SKU"),
        ("acme::8:H100", "TENANT:POLICY:COUNT:SKU"),
        ("acme:lend:8:H100", "policy 'lend'"),
        ("acme:hard:eight:H100", "not a whole number"),
        ("acme:hard:0:H100", "positive"),
    ],
)
def test_parse_reserve_rejects(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_reserve(text)


def test_owner_models_bare_and_by_tenant() -> None:
    assert parse_owner_models(["a,b"], ["acme"]) == (("a", "acme"), ("b", "acme"))
    assert parse_owner_models(["acme=a", "globex=b, c"], ["acme", "globex"]) == (
        ("a", "acme"),
        ("b", "globex"),
        ("c", "globex"),
    )
    with pytest.raises(ValueError, match="several tenants"):
        parse_owner_models(["a"], ["acme", "globex"])
    with pytest.raises(ValueError, match="no --reserve"):
        parse_owner_models(["initech=a"], ["acme"])
    with pytest.raises(ValueError, match="twice"):
        parse_owner_models(["a,a"], ["acme"])


def test_parse_reservations() -> None:
    assert parse_reservations([], []) is None
    setup = parse_reservations(["acme:spot:4:L40S-48GB"], ["llama3-8b"], known_models={"llama3-8b"})
    assert setup is not None
    assert setup.reservations == (SimReservation(tenant="acme", policy="spot", count=4, sku="L40S-48GB"),)
    assert setup.owner_models == (("llama3-8b", "acme"),)
    with pytest.raises(ValueError, match="give --reserve"):
        parse_reservations([], ["llama3-8b"])
    with pytest.raises(ValueError, match="unknown model"):
        parse_reservations(["acme:hard:1:L40S-48GB"], ["llama-9"], known_models={"llama3-8b"})


def test_sim_reports_fill_rate_and_preemptions() -> None:
    result = _sim(
        "--policy", "hetsched", "--json", "--reserve", "acme:soft:8:H100-SXM-80GB", "--owner-models", "llama3-70b"
    )
    assert result.exit_code == 0, result.output
    kpis = json.loads(result.stdout)["policies"]["hetsched"]
    # llama3-70b runs one TP=4 replica on acme's 8 reserved H100s for the whole run (4 / 8).
    assert kpis["fill_rate"] == pytest.approx(0.5)
    assert kpis["preemptions"] == 0 and kpis["preempted_requests"] == 0
    table = _sim("--policy", "hetsched", "--reserve", "acme:hard:8:H100-SXM-80GB", "--owner-models", "llama3-70b")
    assert table.exit_code == 0, table.output
    assert "fill rate" in table.stdout and "preemptions" in table.stdout


def test_sim_without_reserve_has_no_fill_row() -> None:
    result = _sim("--policy", "hetsched")
    assert result.exit_code == 0, result.output
    assert "fill rate" not in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--reserve", "acme:soft:8"), "TENANT:POLICY:COUNT:SKU"),
        (("--owner-models", "llama3-8b"), "give --reserve"),
        (("--reserve", "acme:soft:8:H100-SXM-80GB", "--owner-models", "llama-9"), "unknown model"),
        (("--reserve", "acme:soft:8:H100-SXM-80GB", "--sharing", "compare"), "not with --live"),
        (("--reserve", "acme:soft:9999:H100-SXM-80GB"), "fewer than 9999"),
    ],
)
def test_sim_rejects_bad_reservations(args: tuple[str, ...], message: str) -> None:
    result = _sim("--policy", "hetsched", *args)
    assert result.exit_code == 2, result.output
    assert message in result.output
