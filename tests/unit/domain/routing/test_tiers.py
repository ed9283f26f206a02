"""The tiers in order: a cheaper acceptable region (cost), the affinity region, any region with
capacity (fallback, SLO relaxed), none (rejected)."""

from __future__ import annotations

import pytest

from shared.domain.routing import Region, RegionState, RoutePolicy, Tier, Weights
from tests.unit.domain.routing.builders import ask, mesh, route, traffic_in, world

# Price-heavy weights, so that the cost tier's RTT slack decides rather than the RTT term.
PRICE_HEAVY = RoutePolicy(weights=Weights(rtt=0.1, price=0.8, power=0.0, affinity=0.1))


def test_the_affinity_region_while_it_is_up_with_capacity() -> None:
    decision = route(ask("east"), traffic=traffic_in("east"))
    assert (decision.region, decision.tier, decision.kept_by) == ("east", Tier.AFFINITY, None)
    assert decision.rtt_ms == 0.0 and decision.relaxed_ttft_ms is None and not decision.switched
    assert decision.reason.startswith("east: affinity region")
    assert decision.cost is not None and decision.cost.affinity == 1.0


def test_the_affinity_region_even_when_the_request_comes_from_far_away() -> None:
    # From west the tenant's home (east) is 60 ms away; eu is 140 ms (beyond 60 + 20) although cheaper.
    decision = route(ask("west"), regions=world(eu=2.0), traffic=traffic_in("east"))
    assert (decision.region, decision.tier, decision.rtt_ms) == ("east", Tier.AFFINITY, 60.0)


def test_without_history_the_nearest_region_to_the_origin() -> None:
    decision = route(ask("west"))
    assert (decision.region, decision.tier) == ("west", Tier.AFFINITY)
    assert "no traffic in the last 7 days" in decision.reason
    assert decision.cost is not None and decision.cost.affinity == 0.0


def test_without_history_the_nearest_region_that_can_take_it_when_the_origin_cannot() -> None:
    # A new tenant entering in eu, where nothing serves its model: eu is not a full home to fall back from
    # (that would relax its SLO); its affinity region is the nearest one with capacity, east (70 ms).
    decision = route(ask("eu"), full=("eu",))
    assert (decision.region, decision.tier, decision.relaxed_ttft_ms) == ("east", Tier.AFFINITY, None)
    assert "nearest region to eu" in decision.reason


def test_the_cost_tier_wins_over_affinity_when_a_near_region_is_at_least_30_percent_cheaper() -> None:
    # From eu, the tenant's home east is 70 ms away; eu itself is 0 ms (within 70 + 20) and
    # 2.6 <= (1 - 0.30) * 4.0 = 2.8 USD/h; totals (test_cost): eu 0.24894 < east 0.31439.
    decision = route(ask("eu"), regions=world(eu=2.6), traffic=traffic_in("east"))
    assert (decision.region, decision.tier, decision.rtt_ms) == ("eu", Tier.COST, 0.0)
    assert decision.cost is not None and decision.cost.total == pytest.approx(0.24894, abs=1e-5)
    assert "35% cheaper than affinity region east" in decision.reason and decision.relaxed_ttft_ms is None


@pytest.mark.parametrize(("eu_price", "tier"), [(2.75, Tier.COST), (2.85, Tier.AFFINITY), (3.6, Tier.AFFINITY)])
def test_the_cost_tier_needs_the_saving(eu_price: float, tier: Tier) -> None:
    decision = route(ask("eu"), regions=world(eu=eu_price), traffic=traffic_in("east"))
    assert decision.tier is tier


def edge(cheap_rtt_ms: float, *, cheap: float = 2.0) -> dict[str, Region]:
    """Origin "edge" (no capacity) 40 ms from the tenant's home, ``cheap_rtt_ms`` from a cheaper region."""
    return mesh({"edge": 4.0, "home": 4.0, "cheap": cheap}, {("edge", "home"): 40, ("edge", "cheap"): cheap_rtt_ms})


@pytest.mark.parametrize(("cheap_rtt_ms", "tier"), [(55, Tier.COST), (60, Tier.COST), (65, Tier.AFFINITY)])
def test_the_cost_tier_needs_the_region_within_20_ms_of_the_affinity_regions_rtt(
    cheap_rtt_ms: float, tier: Tier
) -> None:
    decision = route(
        ask("edge"), regions=edge(cheap_rtt_ms), full=("edge",), traffic=traffic_in("home"), policy=PRICE_HEAVY
    )
    assert decision.tier is tier
    assert decision.region == ("cheap" if tier is Tier.COST else "home")


def test_the_cost_tier_needs_a_lower_total_cost() -> None:
    # Near and cheap enough, but with the default weights it costs more overall (affinity and RTT):
    # home:  0.4*(40/55) + 0.3*1   + 0.1*1 - 0.2*1   = 0.49091
    # cheap: 0.4*1       + 0.3*0.5 + 0.1*1 - 0.2*0.1 = 0.63
    decision = route(ask("edge"), regions=edge(55), full=("edge",), traffic=traffic_in("home"))
    assert (decision.region, decision.tier) == ("home", Tier.AFFINITY)


def test_among_several_cheaper_regions_the_lowest_total_cost() -> None:
    regions = mesh(
        {"edge": 4.0, "home": 4.0, "c1": 2.0, "c2": 1.5},
        {("edge", "home"): 40, ("edge", "c1"): 45, ("edge", "c2"): 50},
    )
    # over home, c1, c2 (RTT /50, price /4.0):
    # home: 0.1*0.8 + 0.8*1     - 0.1*1   = 0.78;  c1: 0.1*0.9 + 0.8*0.5 - 0.1*0.1 = 0.48
    # c2:   0.1*1   + 0.8*0.375 - 0.1*0.1 = 0.39
    decision = route(ask("edge"), regions=regions, full=("edge",), traffic=traffic_in("home"), policy=PRICE_HEAVY)
    assert (decision.region, decision.tier) == ("c2", Tier.COST)
    assert decision.cost is not None and decision.cost.total == pytest.approx(0.39)


def test_a_cheaper_region_serves_when_the_affinity_region_is_full() -> None:
    decision = route(ask("eu"), regions=world(eu=2.6), traffic=traffic_in("east"), full=("east",))
    assert (decision.region, decision.tier) == ("eu", Tier.COST)
    assert "east is full" in decision.reason


def test_fallback_when_neither_the_affinity_nor_the_cost_region_has_capacity() -> None:
    decision = route(ask("eu"), regions=world(eu=2.6), traffic=traffic_in("east"), full=("east", "eu"))
    assert (decision.region, decision.tier, decision.relaxed_ttft_ms) == ("west", Tier.FALLBACK, 500.0)
    assert "fallback" in decision.reason and "500 ms" in decision.reason


@pytest.mark.parametrize("state", [RegionState.DOWN, RegionState.DRAIN])
def test_fallback_picks_the_lowest_total_cost_when_the_affinity_region_is_not_up(state: RegionState) -> None:
    # over west and eu from eu: west 0.4*1 + 0.3*1 + 0.1*1 - 0.2*1 = 0.6;
    # eu 0.4*0 + 0.3*(3.6/4.4) + 0.1*(0.154/0.168) - 0.2*1 = 0.13712
    decision = route(ask("eu"), traffic=traffic_in("east"), states={"east": state})
    assert (decision.region, decision.tier, decision.relaxed_ttft_ms) == ("eu", Tier.FALLBACK, 500.0)
    assert decision.cost is not None and decision.cost.total == pytest.approx(0.13712, abs=1e-5)


def test_the_fallback_slo_is_a_policy_parameter() -> None:
    decision = route(ask("eu"), traffic=traffic_in("east"), full=("east",), policy=RoutePolicy(fallback_ttft_ms=800.0))
    assert decision.relaxed_ttft_ms == 800.0


def test_no_region_with_capacity_is_a_rejection_with_the_reason() -> None:
    decision = route(
        ask("eu"),
        traffic=traffic_in("east"),
        states={"east": RegionState.DOWN, "west": RegionState.DRAIN},
        full=("eu",),
    )
    assert (decision.region, decision.tier, decision.cost, decision.rtt_ms) == (None, None, None, None)
    assert not decision.switched and decision.kept_by is None
    assert decision.reason == "no region can take the request: east down, eu full, west draining"


def test_capacity_may_be_a_mapping_where_a_missing_region_has_none() -> None:
    decision = route(ask("east"), traffic=traffic_in("east"), capacity={"east": False, "west": True})
    assert (decision.region, decision.tier) == ("west", Tier.FALLBACK)


def test_an_unknown_origin_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown origin"):
        route(ask("mars"))
