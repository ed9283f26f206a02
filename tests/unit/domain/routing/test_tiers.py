"""The tiers in order: the affinity region while it is up with capacity; when it is full, draining or
down, a cheaper acceptable region (cost); else any region with capacity (fallback, SLO relaxed); else
none (rejected)."""

from __future__ import annotations

import pytest

from shared.domain.routing import Region, RegionState, RouteAsk, RoutePolicy, Tier, Weights
from tests.unit.domain.routing.builders import A100, H100, ask, mesh, route, traffic_in, world

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


def test_the_affinity_region_while_it_has_capacity_even_when_a_near_region_is_far_cheaper() -> None:
    # From eu, eu itself is 0 ms away (within east's 70 + 20) and 2.6 <= (1 - 0.30) * 4.0 = 2.8 USD/h,
    # with a lower total cost (eu 0.24894 < east 0.31439, test_cost): east still has room, so east.
    decision = route(ask("eu"), regions=world(eu=2.6), traffic=traffic_in("east"))
    assert (decision.region, decision.tier, decision.rtt_ms) == ("east", Tier.AFFINITY, 70.0)


def test_the_cost_tier_when_the_affinity_region_is_full_and_a_near_region_is_at_least_30_percent_cheaper() -> None:
    # Over the open regions (west, eu) from eu: RTT /140, price /4.4, power /0.168, affinity 0.1 each:
    # eu: 0.4*0 + 0.3*(2.6/4.4) + 0.1*(0.154/0.168) - 0.2*1 = 0.06894
    decision = route(ask("eu"), regions=world(eu=2.6), traffic=traffic_in("east"), full=("east",))
    assert (decision.region, decision.tier, decision.rtt_ms) == ("eu", Tier.COST, 0.0)
    assert decision.cost is not None and decision.cost.total == pytest.approx(0.06894, abs=1e-5)
    assert decision.cost.price_usd_per_hour == 2.6
    assert "east is full; 35% cheaper than it (2.60 vs 4.00 USD/h)" in decision.reason
    assert decision.relaxed_ttft_ms is None


@pytest.mark.parametrize("state", [RegionState.DOWN, RegionState.DRAIN])
def test_the_cost_tier_when_the_affinity_region_is_not_up(state: RegionState) -> None:
    decision = route(ask("eu"), regions=world(eu=2.6), traffic=traffic_in("east"), states={"east": state})
    assert (decision.region, decision.tier, decision.relaxed_ttft_ms) == ("eu", Tier.COST, None)


@pytest.mark.parametrize(("eu_price", "tier"), [(2.75, Tier.COST), (2.85, Tier.FALLBACK), (3.6, Tier.FALLBACK)])
def test_the_cost_tier_needs_the_saving(eu_price: float, tier: Tier) -> None:
    decision = route(ask("eu"), regions=world(eu=eu_price), traffic=traffic_in("east"), full=("east",))
    assert (decision.region, decision.tier) == ("eu", tier)


def edge(cheap_rtt_ms: float, *, cheap: float = 2.0) -> dict[str, Region]:
    """Origin "edge" 40 ms from the tenant's home, ``cheap_rtt_ms`` from a cheaper region."""
    return mesh({"edge": 4.0, "home": 4.0, "cheap": cheap}, {("edge", "home"): 40, ("edge", "cheap"): cheap_rtt_ms})


@pytest.mark.parametrize(("cheap_rtt_ms", "tier"), [(55, Tier.COST), (60, Tier.COST), (65, Tier.FALLBACK)])
def test_the_cost_tier_needs_the_region_within_20_ms_of_the_affinity_regions_rtt(
    cheap_rtt_ms: float, tier: Tier
) -> None:
    # Home and edge are full: "cheap" is the one region left; it is the cost tier only when near enough.
    decision = route(
        ask("edge"), regions=edge(cheap_rtt_ms), full=("edge", "home"), traffic=traffic_in("home"), policy=PRICE_HEAVY
    )
    assert (decision.region, decision.tier) == ("cheap", tier)
    assert decision.relaxed_ttft_ms == (None if tier is Tier.COST else 500.0)


def test_among_several_cheaper_regions_the_lowest_total_cost() -> None:
    regions = mesh(
        {"edge": 4.0, "home": 4.0, "c1": 2.0, "c2": 1.5},
        {("edge", "home"): 40, ("edge", "c1"): 45, ("edge", "c2"): 50},
    )
    # over c1, c2 (home and edge full; RTT /50, price /2.0, affinity 0.1 each):
    # c1: 0.1*0.9 + 0.8*1    - 0.1*1 = 0.79;  c2: 0.1*1 + 0.8*0.75 - 0.1*1 = 0.6
    decision = route(
        ask("edge"), regions=regions, full=("edge", "home"), traffic=traffic_in("home"), policy=PRICE_HEAVY
    )
    assert (decision.region, decision.tier) == ("c2", Tier.COST)
    assert decision.cost is not None and decision.cost.total == pytest.approx(0.6)


def test_each_region_is_priced_by_the_cheapest_sku_that_serves_the_request_there() -> None:
    # The ask's SKU is H100 (east 4.0, eu 3.6: 10%, no cost tier), but eu serves the model on A100 (2.5)
    # and H100 both: eu is priced at 2.5, 37.5% below east's H100.
    by_region = RouteAsk(
        tenant="acme", origin="eu", sku=H100, in_flight=False, skus={"east": (H100,), "eu": (H100, A100)}
    )
    decision = route(by_region, traffic=traffic_in("east"), full=("east",))
    assert (decision.region, decision.tier) == ("eu", Tier.COST)
    assert decision.cost is not None and decision.cost.price_usd_per_hour == 2.5
    plain = route(ask("eu"), traffic=traffic_in("east"), full=("east",))
    assert plain.tier is Tier.FALLBACK and plain.cost is not None and plain.cost.price_usd_per_hour == 3.6


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
