"""reservation.create / status / cancel / report on fakes: what is recorded, which events, what is answered.
No servers; what a refusal records is nothing."""

from __future__ import annotations

from typing import Any

import pytest

from shared.contracts.base import Rejected
from shared.contracts.reservation import (
    ReservationCancelReply,
    ReservationCancelRequest,
    ReservationCreateReply,
    ReservationCreateRequest,
    ReservationReportReply,
    ReservationReportRequest,
    ReservationStatusReply,
    ReservationStatusRequest,
)
from shared.domain.errors import ErrorCode
from shared.domain.quotas import Quota, Quotas
from tests.unit.services.reservation_filler.fakes import (
    REGION,
    SKU,
    FakeReservationStore,
    Filler,
    allocation,
    ledger_event,
)

pytestmark = pytest.mark.asyncio


def by_count(count: int, *, tenant: str = "acme", policy: str = "hard", **extra: Any) -> ReservationCreateRequest:
    return ReservationCreateRequest(tenant=tenant, policy=policy, count=count, sku=SKU, region=REGION, **extra)


def named(accelerators: list[str], *, tenant: str = "acme", policy: str = "hard") -> ReservationCreateRequest:
    return ReservationCreateRequest(tenant=tenant, policy=policy, accelerators=accelerators)


def code_of(reply: object) -> ErrorCode:
    assert isinstance(reply, Rejected), reply
    return reply.error.code


async def created(filler: Filler, request: ReservationCreateRequest) -> ReservationCreateReply:
    reply = await filler.handlers.requests.create(request)
    assert isinstance(reply, ReservationCreateReply), reply
    return reply


# -- create ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["hard", "soft", "spot"])
async def test_create_by_count_takes_a_whole_node_records_it_and_tells_of_it(policy: str) -> None:
    filler = Filler()
    filler.store.node("n1", gpus=4)
    whole = filler.store.node("n2", gpus=8)
    reply = await created(filler, by_count(8, policy=policy, spot_eviction_s=10))
    assert reply.status == "created" and not reply.duplicate
    assert reply.accelerators == sorted(whole)  # the node it can take whole, not two halves
    stored = filler.store.reservations[reply.reservation_id or ""]
    assert (stored.policy, stored.sku, stored.region, stored.version) == (policy, SKU, REGION, 1)
    assert set(filler.store.holds) == set(whole)
    assert filler.uow.names() == ["created"]
    state = filler.uow.named("created")[0]["reservation"]
    assert state["policy"] == policy and state["accelerators"] == sorted(whole)
    assert state["spot_eviction_s"] == 10
    # Idle from the start: a lending reservation offers every GPU at once, a hard one none.
    assert sorted(state["offered"]) == (sorted(whole) if policy != "hard" else [])


async def test_named_gpus_give_their_sku_and_region_only_when_all_share_one() -> None:
    filler = Filler()
    h100 = filler.store.node("n1", gpus=2)
    other = filler.store.node("n2", gpus=1, sku="H200-SXM-141GB", region="eu-west-1")
    alike = await created(filler, named(h100[:1]))
    mixed = await created(filler, named([h100[1], *other]))
    assert mixed.accelerators == [h100[1], *other]
    one, two = (filler.store.reservations[r.reservation_id or ""] for r in (alike, mixed))
    assert (one.sku, one.region) == (SKU, REGION)
    assert (two.sku, two.region) == (None, None)


@pytest.mark.parametrize("taken_by", ["reservation", "another_tenant"])
async def test_a_clash_is_a_conflict_that_names_how_many_and_records_nothing(taken_by: str) -> None:
    filler = Filler()
    gpus = filler.store.node("n1", gpus=4)
    if taken_by == "reservation":
        await created(filler, named(gpus[:2], tenant="globex"))
    else:
        await filler.uow.run(
            lambda uow: filler.handlers.uses.on_allocation_committed(
                uow=uow, event=ledger_event("allocation_committed"), payload=allocation("al-1", "globex", gpus[:2])
            )
        )
    before, events = filler.store.recorded(), list(filler.uow.events)
    reply = await filler.handlers.requests.create(named(gpus[1:3]))
    assert code_of(reply) is ErrorCode.CONFLICT
    assert isinstance(reply, Rejected) and reply.error.details == {"in_use": 1}
    assert "gpu" not in reply.error.message  # how many, never which
    assert filler.store.recorded() == before and filler.uow.events == events


async def test_not_enough_free_gpus_is_no_capacity_with_the_free_count() -> None:
    filler = Filler()
    gpus = filler.store.node("n1", gpus=4)
    await created(filler, named(gpus[:1], tenant="globex"))
    before = filler.store.recorded()
    reply = await filler.handlers.requests.create(by_count(4))
    assert code_of(reply) is ErrorCode.NO_CAPACITY
    assert isinstance(reply, Rejected) and reply.error.details == {"free": 3}
    assert filler.store.recorded() == before and filler.uow.names() == ["created"]


@pytest.mark.parametrize(
    ("request_", "code"),
    [
        (ReservationCreateRequest(tenant="acme", policy="hard", count=1, sku="NO-SUCH", region=REGION), "unknown_sku"),
        (ReservationCreateRequest(tenant="acme", policy="hard", accelerators=["n1/gpu7"]), "not_found"),
        (ReservationCreateRequest(tenant="acme", policy="hard", accelerators=["pod-1/0.0"]), "invalid_request"),
        (ReservationCreateRequest(tenant="acme", policy="hard", accelerators=["nonsense"]), "invalid_request"),
    ],
)
async def test_a_request_it_cannot_serve_is_a_typed_error_and_records_nothing(
    request_: ReservationCreateRequest, code: str
) -> None:
    filler = Filler()
    filler.store.node("n1", gpus=2)
    before = filler.store.recorded()
    assert code_of(await filler.handlers.requests.create(request_)) == code
    assert filler.store.recorded() == before and filler.uow.events == []


async def test_the_same_request_id_answers_the_same_reservation_once() -> None:
    filler = Filler()
    filler.store.node("n1", gpus=8)
    first = await created(filler, by_count(2, request_id="r-1"))
    again = await created(filler, by_count(2, request_id="r-1"))
    assert again.duplicate and (again.reservation_id, again.accelerators) == (first.reservation_id, first.accelerators)
    assert len(filler.store.reservations) == 1 and filler.uow.names() == ["created"]


async def test_past_the_tenants_quota_is_refused_and_records_nothing() -> None:
    filler = Filler(quotas=Quotas(overrides={"acme": {Quota.GPUS_RESERVED: 4}}))
    filler.store.node("n1", gpus=8)
    await created(filler, by_count(3))
    before = filler.store.recorded()
    assert code_of(await filler.handlers.requests.create(by_count(2))) is ErrorCode.QUOTA_EXCEEDED
    assert filler.store.recorded() == before and filler.uow.names() == ["created"]
    await created(filler, by_count(4, tenant="globex"))  # another tenant's count is its own


async def test_a_concurrent_create_that_took_the_gpus_first_is_a_conflict() -> None:
    class Racing(FakeReservationStore):
        async def held(self, *, session: Any) -> set[str]:
            return set()  # read before the other create's holds were written

    store = Racing()
    filler = Filler(store=store)
    gpus = store.node("n1", gpus=2)
    store.holds[gpus[0]] = "res-other"  # its add raises HeldElsewhere, as the SQL's would
    reply = await filler.handlers.requests.create(named(gpus))
    assert code_of(reply) is ErrorCode.CONFLICT
    assert isinstance(reply, Rejected) and reply.error.details == {"in_use": 1}
    assert filler.uow.events == [] and not store.reservations


# -- status and cancel -----------------------------------------------------------------------------


async def test_status_shows_the_tenants_own_reservations_with_use_and_idle_cost() -> None:
    filler = Filler()
    gpus = filler.store.node("n1", gpus=4)
    mine = await created(filler, named(gpus[:2], policy="soft"))
    await created(filler, named(gpus[2:], tenant="globex"))
    await filler.uow.run(
        lambda uow: filler.handlers.uses.on_allocation_committed(
            uow=uow, event=ledger_event("allocation_committed"), payload=allocation("al-1", "acme", gpus[:1])
        )
    )
    reply = await filler.handlers.requests.status(ReservationStatusRequest(tenant="acme"))
    assert isinstance(reply, ReservationStatusReply)
    assert [v.reservation_id for v in reply.reservations] == [mine.reservation_id]
    view = reply.reservations[0]
    assert (view.owner_used, view.lent, view.idle, view.fill_rate) == (1, 0, 1, 0.5)
    assert view.idle_cost_usd_per_hour == 4.4  # one idle H100 at us-west-1's price
    assert reply.fill_rate == 0.5


@pytest.mark.parametrize("ask", ["status", "cancel"])
async def test_another_tenants_id_answers_exactly_like_an_unknown_id(ask: str) -> None:
    filler = Filler()
    gpus = filler.store.node("n1", gpus=2)
    theirs = (await created(filler, named(gpus, tenant="globex"))).reservation_id or ""

    async def answer() -> object:
        if ask == "status":
            return await filler.handlers.requests.status(ReservationStatusRequest(tenant="acme", reservation_id=theirs))
        return await filler.handlers.requests.cancel(ReservationCancelRequest(tenant="acme", reservation_id=theirs))

    existing = await answer()
    assert code_of(existing) is ErrorCode.NOT_FOUND
    assert filler.store.reservations[theirs].active and filler.uow.names() == ["created"]
    del filler.store.reservations[theirs]
    assert await answer() == existing


async def test_cancel_ends_the_reservation_frees_its_gpus_and_answers_a_repeat_as_already() -> None:
    filler = Filler()
    gpus = filler.store.node("n1", gpus=2)
    rid = (await created(filler, named(gpus, policy="soft"))).reservation_id or ""
    cancel = ReservationCancelRequest(tenant="acme", reservation_id=rid)
    reply = await filler.handlers.requests.cancel(cancel)
    assert isinstance(reply, ReservationCancelReply) and not reply.already
    assert not filler.store.reservations[rid].active and not filler.store.holds
    event = filler.uow.named("cancelled")[0]
    assert event["reservation"]["state"] == "cancelled" and event["reservation"]["offered"] == []
    again = await filler.handlers.requests.cancel(cancel)
    assert isinstance(again, ReservationCancelReply) and again.already
    assert filler.uow.names() == ["created", "cancelled"]
    await created(filler, named(gpus))  # its GPUs may be reserved again


async def test_report_adds_up_every_tenant_and_cluster() -> None:
    filler = Filler()
    gpus = filler.store.node("n1", gpus=4)
    await created(filler, named(gpus[:2]))
    await created(filler, named(gpus[2:], tenant="globex"))
    await filler.uow.run(
        lambda uow: filler.handlers.uses.on_allocation_committed(
            uow=uow, event=ledger_event("allocation_committed"), payload=allocation("al-1", "acme", gpus[:2])
        )
    )
    reply = await filler.handlers.requests.report(ReservationReportRequest())
    assert isinstance(reply, ReservationReportReply)
    assert (reply.reserved, reply.owner_used, reply.lent, reply.fill_rate) == (4, 2, 0, 0.5)
    assert reply.by_tenant == {"acme": 1.0, "globex": 0.0}
    assert reply.by_cluster == {f"{REGION}/c1": 0.5}
    assert reply.idle_cost_usd_per_hour == 8.8
