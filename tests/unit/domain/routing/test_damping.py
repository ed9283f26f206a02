"""Damping: a tenant changes region at most once per 30 minutes, unless its region is down, draining
or full. Prices and capacity move between calls (each call gets the regions' tables of its moment)."""

from __future__ import annotations

import pytest

from shared.domain.routing import RegionState, RoutePolicy, TenantRoute, Tier, next_tenant_route
from tests.unit.domain.routing.builders import MINUTE, T0, ask, route, traffic_in, world

CHEAP_EU = world(eu=2.6)  # eu >= 30% below east: the cost tier takes eu when east is full
PLAIN = world(eu=3.6)  # eu only 10% below east: the tenant stays home (east)


def first_route() -> TenantRoute:
    decision = route(ask("eu"), regions=PLAIN, traffic=traffic_in("east"), now_s=T0)
    assert (decision.region, decision.tier, decision.switched) == ("east", Tier.AFFINITY, False)  # first: no switch
    tenant = next_tenant_route(None, decision, T0)
    assert tenant == TenantRoute("east", T0)
    return tenant


def moved_to_eu_while_east_was_full() -> TenantRoute:
    tenant = first_route()
    now = T0 + 1 * MINUTE
    decision = route(ask("eu"), regions=CHEAP_EU, traffic=traffic_in("east"), tenant=tenant, full=("east",), now_s=now)
    assert (decision.region, decision.tier, decision.switched, decision.kept_by) == ("eu", Tier.COST, True, None)
    moved = next_tenant_route(tenant, decision, now)
    assert moved == TenantRoute("eu", now)
    return moved


def test_within_30_minutes_the_tenant_does_not_move_back_when_its_home_has_room_again() -> None:
    tenant = moved_to_eu_while_east_was_full()
    for minutes in (10, 29, 29.99):
        now = tenant.switched_at_s + minutes * MINUTE
        decision = route(ask("eu"), regions=CHEAP_EU, traffic=traffic_in("east"), tenant=tenant, now_s=now)
        assert (decision.region, decision.kept_by, decision.switched) == ("eu", "damping", False)
        assert decision.tier is Tier.COST and decision.relaxed_ttft_ms is None
        assert "east (affinity) would be chosen" in decision.reason
        assert next_tenant_route(tenant, decision, now) == tenant  # switch time kept


def test_after_30_minutes_the_switch_back_happens() -> None:
    tenant = moved_to_eu_while_east_was_full()
    now = tenant.switched_at_s + 30 * MINUTE
    decision = route(ask("eu"), regions=CHEAP_EU, traffic=traffic_in("east"), tenant=tenant, now_s=now)
    assert (decision.region, decision.tier, decision.switched, decision.kept_by) == ("east", Tier.AFFINITY, True, None)
    assert next_tenant_route(tenant, decision, now) == TenantRoute("east", now)


def test_the_tenant_is_then_held_in_the_new_region_for_30_minutes() -> None:
    tenant = TenantRoute("eu", T0)  # switched to eu at T0 by the cost tier; now eu's price is back up
    decision = route(ask("eu"), regions=PLAIN, traffic=traffic_in("east"), tenant=tenant, now_s=T0 + 5 * MINUTE)
    assert (decision.region, decision.kept_by, decision.tier) == ("eu", "damping", Tier.COST)
    back = route(ask("eu"), regions=PLAIN, traffic=traffic_in("east"), tenant=tenant, now_s=T0 + 31 * MINUTE)
    assert (back.region, back.tier, back.switched) == ("east", Tier.AFFINITY, True)


@pytest.mark.parametrize(
    ("states", "full"),
    [({"east": RegionState.DOWN}, ()), ({"east": RegionState.DRAIN}, ()), ({}, ("east",))],
    ids=["down", "drain", "full"],
)
def test_a_region_down_draining_or_full_lets_the_tenant_switch_at_once(
    states: dict[str, RegionState], full: tuple[str, ...]
) -> None:
    tenant = first_route()
    now = T0 + 1 * MINUTE
    decision = route(
        ask("eu"), regions=CHEAP_EU, traffic=traffic_in("east"), tenant=tenant, states=states, full=full, now_s=now
    )
    assert (decision.region, decision.switched, decision.kept_by) == ("eu", True, None)
    assert next_tenant_route(tenant, decision, now) == TenantRoute("eu", now)


def test_staying_put_is_not_damping() -> None:
    tenant = first_route()
    decision = route(ask("eu"), regions=PLAIN, traffic=traffic_in("east"), tenant=tenant, now_s=T0 + MINUTE)
    assert (decision.region, decision.kept_by, decision.switched) == ("east", None, False)


def test_damping_is_a_policy_parameter() -> None:
    tenant = moved_to_eu_while_east_was_full()
    decision = route(
        ask("eu"),
        regions=CHEAP_EU,
        traffic=traffic_in("east"),
        tenant=tenant,
        now_s=tenant.switched_at_s + 5 * MINUTE,
        policy=RoutePolicy(damping_s=300.0),
    )
    assert (decision.region, decision.switched) == ("east", True)


def test_a_rejection_changes_nothing_remembered() -> None:
    tenant = first_route()
    decision = route(ask("eu"), traffic=traffic_in("east"), tenant=tenant, full=("east", "west", "eu"))
    assert decision.region is None
    assert next_tenant_route(tenant, decision, T0 + MINUTE) == tenant
    assert next_tenant_route(None, decision, T0 + MINUTE) is None
