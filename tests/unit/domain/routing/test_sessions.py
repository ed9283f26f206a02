"""Sessions: an in-flight session stays in its region while the region is up (draining or full
included) whatever prices or the tenant do; it moves only when its region is down."""

from __future__ import annotations

import pytest

from shared.domain.routing import Region, RegionState, SessionRoute, TenantRoute, Tier, next_tenant_route
from tests.unit.domain.routing.builders import MINUTE, T0, ask, route, traffic_in, world

IN_FLIGHT_EAST = SessionRoute("east", in_flight=True)
TENANT_EAST = TenantRoute("east", T0 - 3600)  # switched there an hour ago: damping holds nothing


@pytest.mark.parametrize(
    ("states", "full", "regions"),
    [
        ({}, (), world()),
        ({"east": RegionState.DRAIN}, (), world()),
        ({}, ("east",), world()),
        ({}, (), world(eu=1.0, east=9.0)),  # prices moved: eu is now far cheaper
        ({"east": RegionState.DRAIN}, ("east",), world(eu=1.0)),
    ],
    ids=["up", "drain", "full", "prices-moved", "drain-full-cheaper"],
)
def test_an_in_flight_session_never_moves_while_its_region_is_up(
    states: dict[str, RegionState], full: tuple[str, ...], regions: dict[str, Region]
) -> None:
    decision = route(
        ask("eu"),
        regions=regions,
        states=states,
        full=full,
        traffic=traffic_in("east"),
        tenant=TENANT_EAST,
        session=IN_FLIGHT_EAST,
    )
    assert (decision.region, decision.kept_by, decision.switched) == ("east", "session", False)
    assert decision.tier is Tier.AFFINITY and decision.cost is not None and decision.rtt_ms == 70.0
    assert next_tenant_route(TENANT_EAST, decision, T0) == TENANT_EAST


def test_the_session_stays_even_after_its_tenant_moved() -> None:
    tenant = TenantRoute("eu", T0 - MINUTE)  # the tenant's new requests go to eu now
    decision = route(
        ask("eu"), regions=world(eu=2.6), traffic=traffic_in("east"), tenant=tenant, session=IN_FLIGHT_EAST
    )
    assert (decision.region, decision.kept_by, decision.switched) == ("east", "session", False)
    assert next_tenant_route(tenant, decision, T0) == tenant  # the session does not move the tenant back


def test_a_continuing_ask_holds_its_session_too() -> None:
    session = SessionRoute("east", in_flight=False)
    decision = route(ask("eu", in_flight=True), regions=world(eu=2.6), traffic=traffic_in("east"), session=session)
    assert (decision.region, decision.kept_by) == ("east", "session")


def test_an_in_flight_session_moves_when_its_region_goes_down() -> None:
    decision = route(
        ask("eu"),
        regions=world(eu=2.6),
        states={"east": RegionState.DOWN},
        traffic=traffic_in("east"),
        tenant=TENANT_EAST,
        session=IN_FLIGHT_EAST,
    )
    assert (decision.region, decision.tier, decision.kept_by, decision.switched) == ("eu", Tier.COST, None, True)


def test_an_in_flight_session_in_a_region_gone_from_the_catalog_moves() -> None:
    decision = route(ask("eu"), traffic=traffic_in("east"), session=SessionRoute("mars", in_flight=True))
    assert decision.region == "east" and decision.kept_by is None


def test_a_session_not_in_flight_follows_the_tenant() -> None:
    session = SessionRoute("east", in_flight=False)
    decision = route(
        ask("eu"),
        regions=world(eu=2.6),
        full=("east",),
        traffic=traffic_in("east"),
        tenant=TENANT_EAST,
        session=session,
    )
    assert (decision.region, decision.tier, decision.switched, decision.kept_by) == ("eu", Tier.COST, True, None)
