"""Borrowers on a reservation and taking them back, on fakes: ``lent`` / ``reclaimed`` as the ledger's
allocations come and go, reclaim (written before the ledger is asked; soft now, spot after its notice),
most recently lent first, and preemptions the ledger did not acknowledge issued again by the tick."""

from __future__ import annotations

from datetime import timedelta

import pytest

from shared.contracts.base import Rejected
from shared.contracts.ledger import LedgerPreemptReply
from shared.contracts.reservation import (
    ReservationCreateReply,
    ReservationCreateRequest,
    ReservationReclaimReply,
    ReservationReclaimRequest,
)
from shared.contracts.subjects import Rpc
from shared.domain.errors import ErrorCode
from shared.domain.reservations import lifo
from shared.infra.rpc import RpcError
from tests.fakes import NOW, FakeRpc
from tests.unit.services.reservation_filler.fakes import Filler, allocation, later, ledger_event

pytestmark = pytest.mark.asyncio

ENDED = LedgerPreemptReply(status="ended")


async def reserve(filler: Filler, policy: str, gpus: list[str]) -> str:
    reply = await filler.handlers.requests.create(
        ReservationCreateRequest(tenant="acme", policy=policy, accelerators=gpus)
    )
    assert isinstance(reply, ReservationCreateReply), reply
    return reply.reservation_id or ""


async def commit(filler: Filler, allocation_id: str, tenant: str, gpus: list[str], *, seconds: float = 0) -> None:
    payload = allocation(allocation_id, tenant, gpus)
    event = ledger_event("allocation_committed", at=later(seconds))
    await filler.uow.run(
        lambda uow: filler.handlers.uses.on_allocation_committed(uow=uow, event=event, payload=payload)
    )


async def end(filler: Filler, allocation_id: str, how: str = "released") -> None:
    payload = allocation(allocation_id, "x", [])
    event = ledger_event(f"allocation_{how}")
    await filler.uow.run(lambda uow: filler.handlers.uses.on_allocation_ended(uow=uow, event=event, payload=payload))


def reclaim(*allocation_ids: str, tenant: str = "acme") -> ReservationReclaimRequest:
    return ReservationReclaimRequest(request_id="place-1", tenant=tenant, allocation_ids=list(allocation_ids))


async def lent_twice(filler: Filler, policy: str = "soft") -> tuple[str, list[str]]:
    """A lending reservation of four GPUs with two borrowers: al-old (lent first) and al-new."""
    gpus = filler.store.node("n1", gpus=4)
    rid = await reserve(filler, policy, gpus)
    await commit(filler, "al-old", "globex", gpus[:1], seconds=1)
    await commit(filler, "al-new", "initech", gpus[1:2], seconds=2)
    return rid, gpus


async def test_borrowers_are_lent_in_order_and_the_owners_use_is_not_a_borrow() -> None:
    filler = Filler()
    rid, gpus = await lent_twice(filler)
    await commit(filler, "al-own", "acme", gpus[2:3], seconds=3)
    assert filler.uow.names() == ["created", "lent", "lent", "offered"]
    assert [e["allocation_id"] for e in filler.uow.named("lent")] == ["al-old", "al-new"]
    reservation = filler.store.reservations[rid]
    assert [b.allocation_id for b in reservation.borrowers] == ["al-old", "al-new"]  # oldest first
    assert [b.allocation_id for b in lifo(reservation)] == ["al-new", "al-old"]  # reclaim takes the newest first
    await commit(filler, "al-own", "acme", gpus[2:3])  # the same allocation again: nothing new
    assert len(filler.uow.events) == 4


async def test_a_soft_reclaim_is_written_before_the_ledger_is_asked_and_due_now() -> None:
    seen: list[bool] = []
    # Called between the transaction and the ledger's question (where a crash is tested for real).
    filler = Filler(rpc=FakeRpc(ledger_preempt=[ENDED]), after_record=lambda: seen.append(bool(filler.store.owed())))
    rid, _ = await lent_twice(filler)
    reply = await filler.handlers.reclaimer.reclaim(reclaim("al-new"))
    assert seen == [True]  # the preemption was recorded before the ledger heard of it
    assert isinstance(reply, ReservationReclaimReply) and reply.status == "preempted"
    assert [(p.allocation_id, p.done, p.deadline_at) for p in reply.preemptions] == [("al-new", True, NOW)]
    asked = filler.rpc.requests(Rpc.LEDGER_PREEMPT)
    assert [(a.allocation_id, a.deadline_at, a.reservation_id) for a in asked] == [("al-new", NOW, rid)]
    await filler.handlers.reclaimer.settled()
    preempted = filler.uow.named("preempted")
    assert [(e["allocation_id"], e["reason"]) for e in preempted] == [
        ("al-new", "owner_demand"),
        ("al-new", "acknowledged"),
    ]
    assert preempted[0]["tenant"] == "initech" and preempted[0]["accelerators"] == ["n1/gpu1"]
    reservation = filler.store.reservations[rid]
    assert reservation.preemptions[0].done and "n1/gpu1" in reservation.backoff
    assert "n1/gpu1" not in reservation.offered  # not lent again at once
    await end(filler, "al-new")
    assert filler.uow.named("reclaimed")[-1]["reason"] == "preempted"
    assert not filler.store.reservations[rid].preemptions  # done, and its allocation is gone


async def test_a_spot_borrower_gets_its_notice() -> None:
    filler = Filler(rpc=FakeRpc(ledger_preempt=[ENDED]))
    await lent_twice(filler, policy="spot")
    reply = await filler.handlers.reclaimer.reclaim(reclaim("al-old"))
    assert isinstance(reply, ReservationReclaimReply)
    assert reply.preemptions[0].deadline_at == NOW + timedelta(seconds=30)
    assert filler.rpc.requests(Rpc.LEDGER_PREEMPT)[0].deadline_at == NOW + timedelta(seconds=30)


async def test_a_repeat_answers_the_preemption_already_issued_without_a_new_event() -> None:
    filler = Filler(rpc=FakeRpc(ledger_preempt=[ENDED]))
    await lent_twice(filler)
    await filler.handlers.reclaimer.reclaim(reclaim("al-new"))
    await filler.handlers.reclaimer.settled()
    events = len(filler.uow.events)
    again = await filler.handlers.reclaimer.reclaim(reclaim("al-new"))
    assert isinstance(again, ReservationReclaimReply) and again.preemptions[0].done
    assert len(filler.uow.events) == events and len(filler.rpc.requests(Rpc.LEDGER_PREEMPT)) == 1


@pytest.mark.parametrize(
    ("policy", "tenant", "allocation_id"),
    [("hard", "acme", "al-x"), ("soft", "globex", "al-new"), ("soft", "acme", "al-none")],
)
async def test_nothing_to_reclaim_is_not_found_and_records_nothing(
    policy: str, tenant: str, allocation_id: str
) -> None:
    filler = Filler()
    gpus = filler.store.node("n1", gpus=2)
    await reserve(filler, policy, gpus)
    await commit(filler, "al-x", "globex", gpus[:1])
    if policy == "soft":
        await commit(filler, "al-new", "initech", gpus[1:])
    before, events = filler.store.recorded(), list(filler.uow.events)
    reply = await filler.handlers.reclaimer.reclaim(reclaim(allocation_id, tenant=tenant))
    assert isinstance(reply, Rejected) and reply.error.code is ErrorCode.NOT_FOUND
    assert filler.store.recorded() == before and filler.uow.events == events
    assert filler.rpc.sent == []


async def test_a_silent_ledger_leaves_the_preemption_owed_and_the_tick_asks_again() -> None:
    filler = Filler(rpc=FakeRpc(ledger_preempt=[RpcError(Rpc.LEDGER_PREEMPT, "timed out"), ENDED]))
    rid, _ = await lent_twice(filler)
    reply = await filler.handlers.reclaimer.reclaim(reclaim("al-new"))
    assert isinstance(reply, ReservationReclaimReply) and not reply.preemptions[0].done
    await filler.handlers.reclaimer.settled()
    assert not filler.store.reservations[rid].preemptions[0].done
    assert await filler.handlers.upkeep.tick_once() == 1
    await filler.handlers.reclaimer.settled()
    assert filler.store.reservations[rid].preemptions[0].done
    assert await filler.handlers.upkeep.tick_once() == 0  # nothing owed any more
    assert len(filler.rpc.requests(Rpc.LEDGER_PREEMPT)) == 2


async def test_a_borrower_that_leaves_on_its_own_is_reclaimed_released_or_expired() -> None:
    filler = Filler()
    await lent_twice(filler)
    await end(filler, "al-old", "released")
    await end(filler, "al-new", "expired")
    await end(filler, "al-new", "expired")  # ended before: nothing
    assert [(e["allocation_id"], e["reason"]) for e in filler.uow.named("reclaimed")] == [
        ("al-old", "released"),
        ("al-new", "expired"),
    ]
