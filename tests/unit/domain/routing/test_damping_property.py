"""Property: over random sequences of time steps, price moves, region states and capacity, a tenant
never switches twice within ``damping_s`` unless its region was down, draining or full at the second
switch; and every decision is one the tiers allow."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.domain.routing import (
    RegionState,
    RouteDecision,
    RoutePolicy,
    SessionRoute,
    TenantRoute,
    Tier,
    Traffic,
    choose,
    next_tenant_route,
)
from tests.unit.domain.routing.builders import T0, ask, world

NAMES = ("east", "west", "eu")
POLICY = RoutePolicy()


@dataclass(frozen=True)
class Step:
    dt_s: float
    prices: tuple[float, float, float]  # H100 USD/h for east, west, eu
    states: tuple[RegionState, RegionState, RegionState]
    capacity: tuple[bool, bool, bool]
    origin: str
    session_in_flight: bool


steps = st.builds(
    Step,
    dt_s=st.sampled_from([0.0, 60.0, 600.0, 1200.0, 1799.0, 1800.0, 3600.0, 86_400.0]),
    prices=st.tuples(*[st.sampled_from([1.0, 2.0, 2.6, 3.6, 4.0, 4.4, 6.0])] * 3),
    # mostly up, so that switches and damping both happen often
    states=st.tuples(*[st.sampled_from([RegionState.UP] * 4 + [RegionState.DRAIN, RegionState.DOWN])] * 3),
    capacity=st.tuples(*[st.sampled_from([True, True, True, False])] * 3),
    origin=st.sampled_from(NAMES),
    session_in_flight=st.booleans(),
)


def _open(step: Step, name: str) -> bool:
    i = NAMES.index(name)
    return step.states[i] is RegionState.UP and step.capacity[i]


def _check_tiers(step: Step, decision: RouteDecision, session: SessionRoute | None) -> None:
    if decision.kept_by == "session":
        assert session is not None and decision.region == session.region
        assert step.states[NAMES.index(session.region)] is not RegionState.DOWN
        return
    if decision.region is None:
        assert not any(_open(step, name) for name in NAMES) and decision.tier is None
        return
    assert _open(step, decision.region)  # a new route goes only where the request can be served
    assert (decision.relaxed_ttft_ms is not None) == (decision.tier is Tier.FALLBACK)
    assert decision.cost is not None
    assert all(0.0 <= v <= 1.0 for v in (decision.cost.rtt, decision.cost.price, decision.cost.power))


@settings(max_examples=200, deadline=None)
@given(st.lists(steps, min_size=1, max_size=30), st.sampled_from(NAMES))
def test_a_tenant_never_switches_twice_within_the_damping_window_unless_forced(sequence: list[Step], home: str) -> None:
    now = T0
    traffic = Traffic()
    traffic.add(home, now, 50)  # some history, so that affinity and the cost tier both play
    tenant: TenantRoute | None = None
    session: SessionRoute | None = None
    for step in sequence:
        now += step.dt_s
        regions = world(east=step.prices[0], west=step.prices[1], eu=step.prices[2])
        decision = choose(
            ask(step.origin),
            regions=regions,
            states=dict(zip(NAMES, step.states, strict=True)),
            capacity=dict(zip(NAMES, step.capacity, strict=True)),
            tenant=tenant,
            session=session,
            traffic=traffic,
            now_s=now,
            policy=POLICY,
        )
        _check_tiers(step, decision, session)
        if decision.switched:
            assert tenant is not None and decision.region != tenant.region
            forced = not _open(step, tenant.region)
            assert forced or now - tenant.switched_at_s >= POLICY.damping_s, (tenant, now, decision.reason)
        else:
            assert tenant is None or decision.region in (tenant.region, None) or decision.kept_by == "session"
        tenant = next_tenant_route(tenant, decision, now)
        if decision.region is not None:
            traffic.add(decision.region, now)
            session = SessionRoute(decision.region, in_flight=step.session_in_flight)
