"""The route cost: each term normalised over the candidates, weighted, affinity subtracted."""

from __future__ import annotations

import pytest

from shared.domain.routing import Weights, costs, power_usd_per_hour
from tests.unit.domain.routing.builders import A100, H100, world

AFFINITY_EAST = {"east": 1.0, "west": 0.1, "eu": 0.1}


def test_the_formula_from_eu_for_a_tenant_at_home_in_east() -> None:
    regions = world(eu=2.6)
    terms = costs(list(regions.values()), origin=regions["eu"], sku=H100, affinity=AFFINITY_EAST, weights=Weights())
    east, west, eu = terms["east"], terms["west"], terms["eu"]
    # raw: RTT from eu 70 / 140 / 0 ms; H100 4.0 / 4.4 / 2.6 USD/h; power 0.070 / 0.168 / 0.154 USD/h
    assert (east.rtt_ms, west.rtt_ms, eu.rtt_ms) == (70.0, 140.0, 0.0)
    assert (east.price_usd_per_hour, west.price_usd_per_hour, eu.price_usd_per_hour) == (4.0, 4.4, 2.6)
    assert east.power_usd_per_hour == pytest.approx(0.070) and west.power_usd_per_hour == pytest.approx(0.168)
    # normalised by the largest among the candidates: RTT /140, price /4.4, power /0.168, affinity /1
    assert (east.rtt, west.rtt, eu.rtt) == (0.5, 1.0, 0.0)
    assert east.price == pytest.approx(4.0 / 4.4) and west.price == 1.0
    assert eu.power == pytest.approx(0.154 / 0.168) and west.power == 1.0
    assert (east.affinity, eu.affinity) == (1.0, 0.1)
    # east: 0.4*0.5 + 0.3*(4.0/4.4) + 0.1*(0.070/0.168) - 0.2*1.0 = 0.2 + 0.27273 + 0.04167 - 0.2 = 0.31439
    assert east.total == pytest.approx(0.31439, abs=1e-5)
    # eu:   0.4*0   + 0.3*(2.6/4.4) + 0.1*(0.154/0.168) - 0.2*0.1 = 0.17727 + 0.09167 - 0.02   = 0.24894
    assert eu.total == pytest.approx(0.24894, abs=1e-5)
    # west: 0.4*1   + 0.3*1         + 0.1*1             - 0.2*0.1 = 0.78
    assert west.total == pytest.approx(0.78)


def test_every_term_is_in_unit_range_and_zero_when_all_are_zero() -> None:
    regions = world()
    only_eu = costs([regions["eu"]], origin=regions["eu"], sku=H100, affinity={}, weights=Weights())["eu"]
    # a lone candidate: RTT 0 to itself and no affinity are all-zero terms; price and power are their own max
    assert (only_eu.rtt, only_eu.affinity, only_eu.price, only_eu.power) == (0.0, 0.0, 1.0, 1.0)
    assert only_eu.total == pytest.approx(0.3 * 1 + 0.1 * 1)
    for terms in costs(
        list(regions.values()), origin=regions["west"], sku=None, affinity={}, weights=Weights()
    ).values():
        assert all(0.0 <= value <= 1.0 for value in (terms.rtt, terms.price, terms.power, terms.affinity))


@pytest.mark.parametrize(
    ("weights", "best"),
    [
        (Weights(rtt=1, price=0, power=0, affinity=0), "eu"),  # the origin itself: 0 ms
        (Weights(rtt=0, price=1, power=0, affinity=0), "eu"),  # 2.6 USD/h
        (Weights(rtt=0, price=0, power=1, affinity=0), "east"),  # cheapest power
        (Weights(rtt=0, price=0, power=0, affinity=1), "east"),  # the tenant's home
    ],
)
def test_weights_pick_what_they_weigh(weights: Weights, best: str) -> None:
    regions = world(eu=2.6)
    terms = costs(list(regions.values()), origin=regions["eu"], sku=H100, affinity=AFFINITY_EAST, weights=weights)
    assert min(terms, key=lambda name: terms[name].total) == best


def test_an_unknown_sku_is_priced_at_the_region_mean() -> None:
    regions = world()
    terms = costs([regions["east"]], origin=regions["east"], sku=None, affinity={}, weights=Weights())
    assert terms["east"].price_usd_per_hour == (4.0 + 2.5) / 2  # mean of its H100 and A100 prices
    a100 = costs([regions["east"]], origin=regions["east"], sku=A100, affinity={}, weights=Weights())
    assert a100["east"].price_usd_per_hour == 2.5


def test_power_per_hour_includes_the_facility_overhead() -> None:
    assert power_usd_per_hour(world()["west"]) == pytest.approx(0.7 * 1.2 * 0.2)  # kW * PUE * USD/kWh
    assert power_usd_per_hour(world()["west"], power_kw=1.0) == pytest.approx(0.24)


def test_no_candidates_no_costs() -> None:
    regions = world()
    assert costs([], origin=regions["eu"], sku=H100, affinity={}, weights=Weights()) == {}


def test_weights_refuse_negative_values() -> None:
    with pytest.raises(ValueError, match="affinity"):
        Weights(affinity=-0.2)
