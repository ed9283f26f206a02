"""route.select, route.region and the traffic flush on fakes (``fakes.router``): the tiers, damping,
session pinning, admission's "full" trying the next region, typed errors, and memory that follows only
what committed. No servers."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from services.cross_region_router.handlers import SESSION_KEPT_S
from shared.contracts.base import ErrorCode, Rejected
from shared.contracts.placement import AdmitRequest
from shared.contracts.routing import RouteRegionReply, RouteRegionRequest
from shared.contracts.subjects import Rpc
from shared.domain.routing import day_of
from shared.infra.rpc import RpcError
from tests.fakes import NOW
from tests.unit.domain.routing.builders import A100, H100, world
from tests.unit.services.cross_region_router.fakes import FakeStore, Router, full_in, router

pytestmark = pytest.mark.asyncio

EVERYWHERE = (("al-e", "east"), ("al-w", "west"), ("al-u", "eu"))
TODAY = day_of(NOW.timestamp())
CHEAP_EU = world(eu=1.0)  # eu's mean price (H100 and A100) far below east's: the cost tier wants it
# east serves on H100 (4.0 USD/h), eu on A100 (2.5), west on H100 (4.4): by SKU eu is 37.5% below east; by the
# regions' means (east 3.25, eu 3.05) only 6%.
BY_SKU = (("al-e", "east", H100), ("al-w", "west", H100), ("al-u", "eu", A100))


def with_history(region: str, *, requests: int = 100) -> FakeStore:
    """A store where tenant acme routed ``requests`` to ``region`` today (its affinity region)."""
    store = FakeStore()
    store.traffic[("acme", region, TODAY)] = requests
    return store


def admitted_regions(r: Router) -> list[str | None]:
    return [request.region for request in r.rpc.requests(Rpc.PLACEMENT_ADMIT)]


async def drain(r: Router, region: str, state: str = "drain") -> RouteRegionReply:
    reply = await r.handlers.region(RouteRegionRequest(region=region, state=state))  # type: ignore[arg-type]
    assert isinstance(reply, RouteRegionReply)
    return reply


# -- typed errors ------------------------------------------------------------------------------------


async def test_an_unknown_origin_or_model_is_a_typed_error_that_changes_nothing() -> None:
    r = router(replicas=EVERYWHERE)
    origin = await r.select(origin_region="mars")
    model = await r.select(model="no-such-model")
    assert isinstance(origin, Rejected) and origin.error.code is ErrorCode.INVALID_REQUEST
    assert "mars" in origin.error.message
    assert isinstance(model, Rejected) and model.error.code is ErrorCode.UNKNOWN_MODEL
    assert r.rpc.sent == [] and r.store.tenants == {} and r.uow.events == []


async def test_a_model_no_region_serves_is_rejected_no_capacity_without_asking_admission() -> None:
    r = router(replicas=EVERYWHERE)
    reply = await r.select(model="llama3-70b")  # replicas serve llama3-8b only
    assert isinstance(reply, Rejected) and reply.error.code is ErrorCode.NO_CAPACITY
    assert reply.error.details is not None and "no region can take the request" in reply.error.details["explanation"]
    assert r.rpc.sent == [] and r.store.tenants == {}


# -- tiers ---------------------------------------------------------------------------------------------


async def test_a_new_tenant_goes_to_the_nearest_region_serving_its_model_and_is_admitted_there() -> None:
    r = router(replicas=(("al-w", "west"), ("al-u", "eu")))  # nothing in east, the origin
    reply = await r.routed(origin_region="east")
    assert (reply.status, reply.region, reply.tier, reply.rtt_ms, reply.switched) == (
        "routed",
        "west",
        "affinity",
        60.0,
        False,
    )
    assert reply.admission is not None and reply.admission.status == "admitted"
    assert admitted_regions(r) == ["west"]
    assert r.store.tenants["acme"].region == "west" and r.store.tenants["acme"].switched_at == NOW
    assert r.uow.names() == []  # a first route is no switch


async def test_the_affinity_region_wins_while_it_is_up_with_capacity() -> None:
    r = router(replicas=EVERYWHERE, store=with_history("east"))
    reply = await r.routed(origin_region="eu")
    assert (reply.region, reply.tier, reply.rtt_ms) == ("east", "affinity", 70.0)
    assert reply.cost is not None and reply.cost.affinity == 1.0


async def test_a_much_cheaper_region_near_the_origin_waits_while_the_affinity_region_has_room() -> None:
    r = router(regions=CHEAP_EU, replicas=EVERYWHERE, store=with_history("east"))
    reply = await r.routed(origin_region="eu")
    assert (reply.region, reply.tier) == ("east", "affinity")
    assert admitted_regions(r) == ["east"]


async def test_the_cost_tier_takes_a_much_cheaper_near_region_when_the_affinity_region_is_full() -> None:
    r = router(regions=CHEAP_EU, replicas=EVERYWHERE, store=with_history("east"), admit=[full_in("east")])
    reply = await r.routed(origin_region="eu")
    assert (reply.region, reply.tier) == ("eu", "cost")
    assert "affinity region east is full" in (reply.explanation or "")
    assert admitted_regions(r) == ["east", "eu"]


async def test_each_region_is_priced_by_the_sku_its_replicas_serve_on() -> None:
    r = router(replicas=BY_SKU, store=with_history("east"), admit=[full_in("east")])
    reply = await r.routed(origin_region="eu")
    assert (reply.region, reply.tier) == ("eu", "cost")
    assert reply.cost is not None and reply.cost.price_usd_per_hour == 2.5
    assert "(2.50 vs 4.00 USD/h)" in (reply.explanation or "")


async def test_without_known_skus_a_region_is_priced_at_its_mean() -> None:
    r = router(replicas=EVERYWHERE, store=with_history("east"), admit=[full_in("east")])
    reply = await r.routed(origin_region="eu")
    assert (reply.region, reply.tier) == ("eu", "fallback")
    assert reply.cost is not None and reply.cost.price_usd_per_hour == 3.05  # (3.6 + 2.5) / 2


async def test_the_cheapest_sku_serving_in_a_region_prices_it_and_a_released_one_no_longer_does() -> None:
    r = router(replicas=(("al-e", "east", H100),), store=with_history("east"), admit=[full_in("east")])
    await r.decided("al-u1", "eu", sku=H100)
    await r.decided("al-u2", "eu", sku=A100)
    cheap = await r.routed(origin_region="eu", request_id="r1")
    assert (cheap.region, cheap.tier) == ("eu", "cost")
    assert cheap.cost is not None and cheap.cost.price_usd_per_hour == 2.5
    await r.released("al-u2")
    r.clock.advance(3600)  # past damping
    plain = await r.routed(origin_region="eu", request_id="r2")
    assert (plain.region, plain.tier) == ("eu", "fallback")  # H100: 3.6 is only 10% below 4.0
    assert plain.cost is not None and plain.cost.price_usd_per_hour == 3.6


async def test_the_fallback_tier_relaxes_the_ttft_slo_it_asks_admission_with() -> None:
    r = router(replicas=(("al-w", "west"),), store=with_history("east"))  # home east serves nothing
    reply = await r.routed(origin_region="east", slo={"ttft_ms": 200})
    assert (reply.region, reply.tier, reply.relaxed_ttft_ms) == ("west", "fallback", 500.0)
    (asked,) = r.rpc.requests(Rpc.PLACEMENT_ADMIT)
    assert isinstance(asked, AdmitRequest) and asked.slo is not None and asked.slo.ttft_ms == 500.0


async def test_a_model_group_goes_where_any_of_its_members_is_served() -> None:
    r = router()
    await r.decided("al-70", "west", model="llama3-70b")
    reply = await r.routed(model="chat")
    assert (reply.status, reply.region) == ("routed", "west")


# -- admission --------------------------------------------------------------------------------------------


async def test_a_region_whose_admission_is_full_is_passed_over_for_the_next_tier() -> None:
    r = router(replicas=EVERYWHERE, store=with_history("east"), admit=[full_in("east")])
    reply = await r.routed(origin_region="east")
    assert (reply.region, reply.tier, reply.relaxed_ttft_ms) == ("west", "fallback", 500.0)
    assert admitted_regions(r) == ["east", "west"]
    assert reply.admission is not None and reply.admission.status == "admitted"


async def test_full_everywhere_is_rejected_after_asking_each_region_once() -> None:
    r = router(replicas=EVERYWHERE, admit=[full_in("east", "west", "eu")])
    reply = await r.select()
    assert isinstance(reply, Rejected) and reply.error.code is ErrorCode.NO_CAPACITY
    assert sorted(admitted_regions(r)) == ["east", "eu", "west"]


async def test_without_admit_the_region_is_chosen_and_admission_is_not_asked() -> None:
    r = router(replicas=EVERYWHERE)
    reply = await r.routed(admit=False)
    assert (reply.region, reply.admission) == ("east", None) and r.rpc.sent == []


async def test_admission_unreachable_is_an_internal_admission_error_in_a_routed_reply() -> None:
    r = router(replicas=EVERYWHERE, admit=[RpcError(Rpc.PLACEMENT_ADMIT, "timed out")])
    reply = await r.routed()
    assert reply.status == "routed" and reply.region == "east"
    assert reply.admission is not None and reply.admission.error is not None
    assert reply.admission.error.code is ErrorCode.INTERNAL and "admission" in reply.admission.error.message


# -- damping and switching ---------------------------------------------------------------------------------


async def test_damping_holds_the_tenant_then_the_switch_is_written_with_its_event() -> None:
    r = router(regions=CHEAP_EU, replicas=EVERYWHERE, store=with_history("east"))
    assert (await r.routed(origin_region="eu")).region == "east"
    r.clock.advance(60)
    r.rpc.script[Rpc.PLACEMENT_ADMIT] = [full_in("east")]  # east fills up: the tenant moves at once
    moved = await r.routed(origin_region="eu")
    assert (moved.region, moved.tier, moved.switched) == ("eu", "cost", True)
    (event,) = r.uow.named("route_switched")
    assert (event["from_region"], event["to_region"], event["tier"]) == ("east", "eu", "cost")
    assert r.store.tenants["acme"].region == "eu"
    assert r.store.tenants["acme"].switched_at == NOW + timedelta(minutes=1)

    r.rpc.script[Rpc.PLACEMENT_ADMIT] = [full_in()]  # east has room again
    r.clock.advance(10 * 60)
    held = await r.routed(origin_region="eu")
    assert (held.region, held.switched) == ("eu", False)
    assert "kept by damping" in (held.explanation or "") and "east (affinity) would be chosen" in (
        held.explanation or ""
    )
    assert len(r.uow.named("route_switched")) == 1

    r.clock.advance(21 * 60)  # 31 minutes after the switch
    back = await r.routed(origin_region="eu")
    assert (back.region, back.tier, back.switched) == ("east", "affinity", True)
    assert [e["to_region"] for e in r.uow.named("route_switched")] == ["eu", "east"]
    assert r.store.tenants["acme"].switched_at == NOW + timedelta(minutes=32)


async def test_a_request_whose_region_did_not_change_writes_nothing() -> None:
    r = router(replicas=EVERYWHERE)
    await r.routed(session_id="s-1")
    runs = r.uow.runs
    await r.routed(session_id="s-1")
    assert r.uow.runs == runs


async def test_routes_that_come_together_are_written_in_one_transaction_and_a_failed_one_alone() -> None:
    r = router(replicas=EVERYWHERE)
    await r.handlers.start()
    runs = r.uow.runs
    replies = await asyncio.gather(*(r.routed(tenant=f"t{n}", session_id=f"s{n}") for n in range(8)))
    assert [reply.region for reply in replies] == ["east"] * 8
    assert r.uow.runs == runs + 1, "eight new tenants and sessions, one transaction"
    assert sorted(r.store.tenants) == [f"t{n}" for n in range(8)]
    assert sorted(r.store.sessions) == [(f"t{n}", f"s{n}") for n in range(8)]

    # A group whose transaction fails is written again request by request: one failure fails its own only.
    r.uow.fail_next = RuntimeError("commit refused")
    runs = r.uow.runs
    again = await asyncio.gather(*(r.routed(tenant=f"u{n}", session_id=f"s{n}") for n in range(3)))
    assert [reply.region for reply in again] == ["east"] * 3
    assert r.uow.runs == runs + 1 + 3, "the failed group, then each request alone"
    runs = r.uow.runs
    await asyncio.gather(*(r.routed(tenant=f"u{n}", session_id=f"s{n}") for n in range(3)))
    assert r.uow.runs == runs, "each one's region is remembered once written: nothing to write again"


async def test_a_route_whose_write_rolled_back_leaves_memory_as_it_was() -> None:
    r = router(replicas=EVERYWHERE)
    await r.handlers.start()
    r.uow.fail_next = RuntimeError("commit refused")
    with pytest.raises(RuntimeError):
        await r.select(session_id="s-1")
    runs = r.uow.runs
    await r.routed(session_id="s-1")  # the tenant and session are new again: written again
    assert r.uow.runs == runs + 1


# -- sessions -------------------------------------------------------------------------------------------


async def test_an_in_flight_session_stays_in_its_draining_region_and_moves_when_it_goes_down() -> None:
    r = router(replicas=EVERYWHERE)
    assert (await r.routed(session_id="s-1")).region == "east"
    await drain(r, "east")
    held = await r.routed(session_id="s-1", in_flight=True)
    assert held.region == "east" and "in-flight session stays" in (held.explanation or "")
    assert (await r.routed(session_id="s-2")).region == "west"  # a new session avoids the draining region
    await drain(r, "east", "down")
    moved = await r.routed(session_id="s-1", in_flight=True)
    assert moved.region == "west" and r.store.sessions[("acme", "s-1")][0] == "west"


async def test_a_held_session_is_not_sent_elsewhere_when_its_region_is_full() -> None:
    r = router(replicas=EVERYWHERE, admit=[full_in("east")])
    await r.routed(session_id="s-1", admit=False)
    reply = await r.routed(session_id="s-1", in_flight=True)
    assert reply.region == "east" and admitted_regions(r) == ["east"]
    assert reply.admission is not None and reply.admission.status == "rejected"


# -- route.region ---------------------------------------------------------------------------------------


async def test_region_state_is_written_with_its_event_once_per_change() -> None:
    r = router()
    first = await drain(r, "east")
    again = await drain(r, "east")
    assert (first.state, first.previous, again.previous) == ("drain", "up", "drain")
    assert r.uow.named("region_state_changed") == [{"region": "east", "state": "drain", "previous": "up"}]
    assert r.store.regions == {"east": "drain"}
    unknown = await r.handlers.region(RouteRegionRequest(region="mars", state="down"))
    assert isinstance(unknown, Rejected) and unknown.error.code is ErrorCode.NOT_FOUND


async def test_a_region_state_that_did_not_commit_is_not_in_memory() -> None:
    r = router()
    await drain(r, "east")
    r.uow.fail_next = RuntimeError("commit refused")
    with pytest.raises(RuntimeError):
        await drain(r, "east", "down")
    assert (await drain(r, "east", "up")).previous == "drain"


# -- start, the flush and the regions file ----------------------------------------------------------------


async def test_start_loads_the_tables_and_a_failed_load_is_retried_by_the_first_request() -> None:
    store = with_history("west")
    store.regions["west"] = "down"
    store.load_fails.append(ConnectionError("postgres is not up"))
    r = router(replicas=EVERYWHERE, store=store)
    await r.handlers.start()  # logged, not raised
    reply = await r.routed(origin_region="west")
    assert store.loads == 2 and reply.region == "east"  # west is down (loaded), east nearest
    assert reply.tier == "fallback"  # its affinity region (loaded traffic) is down


async def test_flush_writes_the_traffic_once_and_keeps_it_when_the_write_fails() -> None:
    r = router(replicas=EVERYWHERE)
    await r.routed()
    await r.routed()
    r.store.write_fails.append(RuntimeError("connection lost"))
    with pytest.raises(RuntimeError):
        await r.handlers.flush_once()
    assert await r.handlers.flush_once() == 2
    assert r.store.traffic == {("acme", "east", TODAY): 2}
    runs = r.uow.runs
    assert await r.handlers.flush_once() == 0 and r.uow.runs == runs  # nothing pending: no transaction


async def test_the_sweep_forgets_old_sessions_in_the_table_and_in_memory() -> None:
    r = router(replicas=EVERYWHERE)
    await r.routed(session_id="s-1")
    r.clock.advance(SESSION_KEPT_S + 1)
    await r.handlers.flush_once(sweep=True)
    assert r.store.sessions == {}
    assert [what for what, _ in r.store.swept] == ["sessions", "traffic"]
    runs = r.uow.runs
    await r.routed(session_id="s-1")  # routed like a new session: its region is written again
    assert r.uow.runs == runs + 1


async def test_the_flush_loop_takes_the_new_regions_file_and_a_bad_one_keeps_the_old() -> None:
    r = router(replicas=EVERYWHERE, store=with_history("east"))
    r.regions_file.extend([ValueError("not valid YAML"), CHEAP_EU])
    assert not r.handlers.reload_regions()  # the bad file: kept the old
    assert (await r.routed(origin_region="eu")).region == "east"
    loop = asyncio.ensure_future(r.handlers.flush())
    try:
        for _ in range(200):
            await asyncio.sleep(0.005)
            if not r.regions_file and r.store.traffic:
                break
    finally:
        loop.cancel()
    assert r.regions_file == [] and r.store.traffic[("acme", "east", TODAY)] == 101
    r.rpc.script[Rpc.PLACEMENT_ADMIT] = [full_in("east")]
    moved = await r.routed(origin_region="eu")  # with the old prices: the fallback tier
    assert (moved.region, moved.tier) == ("eu", "cost")
