"""One request id, one outcome, and no HBM without an owner: placement's use cases with fakes (the rig of
``test_handlers``). The pure rules: tests/unit/placement/test_ownership.py."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
from pydantic import BaseModel

from shared.contracts.base import ErrorCode, Rejected
from shared.contracts.envelope import EventEnvelope
from shared.contracts.ledger import AllocationEvent, CommitReply, CommitRequest, LedgerReleaseReply
from shared.contracts.placement import PlaceReply
from shared.contracts.subjects import Rpc
from shared.infra import deadline
from shared.infra.rpc import RpcError
from shared.infra.uow import UnitOfWork
from tests.fakes import NOW, FakeRpc
from tests.unit.services.placement.test_handlers import Interrupted, Rig, committed, place

pytestmark = pytest.mark.asyncio


def duplicate_after_first(allocation_id: str = "al-1") -> Callable[[BaseModel], BaseModel]:
    """A ledger that keeps each request id's first commit: a repeat with the same shares is a duplicate."""
    first: dict[str, CommitRequest] = {}

    def answer(request: BaseModel) -> BaseModel:
        assert isinstance(request, CommitRequest)
        earlier = first.setdefault(request.request_id, request)
        if earlier is not request:
            assert earlier.shares == request.shares, "a retry must ask the ledger for the same shares"
        return CommitReply(
            status="committed",
            request_id=request.request_id,
            allocation_id=allocation_id,
            duplicate=earlier is not request,
        )

    return answer


def allocation_event(name: str, allocation_id: str, request_id: str) -> tuple[EventEnvelope, AllocationEvent]:
    payload = AllocationEvent(
        allocation_id=allocation_id, request_id=request_id, tenant="acme", kind="replica", shares=[]
    )
    envelope = EventEnvelope(
        event_id=uuid.uuid4(),
        type=f"hetsched.ledger.{name}",
        source="capacity-ledger",
        occurred_at=NOW,
        payload=payload.model_dump(mode="json"),
    )
    return envelope, payload


async def deliver(rig: Rig, name: str, allocation_id: str, request_id: str) -> None:
    envelope, payload = allocation_event(name, allocation_id, request_id)
    handler = getattr(rig.handlers.lifecycle, f"on_{name}")

    async def work(uow: UnitOfWork) -> None:
        await handler(uow=uow, event=envelope, payload=payload)

    await rig.uow.run(work)


@pytest.fixture
def no_deadline() -> Iterator[None]:
    deadline.set_deadline(None)
    yield
    deadline.set_deadline(None)


# -- the handlers --------------------------------------------------------------------------------------


async def test_a_placement_killed_after_the_ledger_commit_is_recovered_by_the_retry() -> None:
    rig = Rig(FakeRpc(ledger_commit=[duplicate_after_first("al-1")]))
    rig.interrupt = True
    with pytest.raises(Interrupted):
        await rig.handlers.placing.place(place("r-k"))
    assert rig.store.rows[("acme", "r-k")]["status"] == "committing"  # the intent, before the decision row
    rig.now += timedelta(seconds=6)  # the dead process's claim has run out
    reply = await rig.handlers.placing.place(place("r-k"))
    assert isinstance(reply, PlaceReply) and reply.status == "placed" and reply.allocation_id == "al-1"
    assert "recovered" in reply.explanation[-1]
    first, second = rig.rpc.requests(Rpc.LEDGER_COMMIT)
    assert first == second and first.request_id == "placement/r-k"
    assert await rig.handlers.placing.place(place("r-k")) == reply  # and from then on, the stored answer
    assert len(rig.rpc.requests(Rpc.LEDGER_COMMIT)) == 2
    assert rig.uow.names() == ["placement_decided"]


async def test_a_commit_the_ledger_did_not_answer_is_asked_again_by_the_retry() -> None:
    rig = Rig(FakeRpc(ledger_commit=[RpcError(Rpc.LEDGER_COMMIT, "no reply within 10 s"), committed("al-7")]))
    first = await rig.handlers.placing.place(place("r-t"))
    assert isinstance(first, Rejected) and first.error.code is ErrorCode.INTERNAL
    again = await rig.handlers.placing.place(place("r-t"))  # no wait: the silent attempt gave its claim up
    assert isinstance(again, PlaceReply) and again.allocation_id == "al-7"
    sent = rig.rpc.requests(Rpc.LEDGER_COMMIT)
    assert len(sent) == 2 and sent[0] == sent[1]


async def test_identical_concurrent_requests_get_identical_answers() -> None:
    rig = Rig(FakeRpc(ledger_commit=[duplicate_after_first("al-1")]))
    replies = await asyncio.gather(*(rig.handlers.placing.place(place("r-same")) for _ in range(4)))
    assert all(isinstance(r, PlaceReply) and r.status == "placed" for r in replies)
    assert all(r == replies[0] for r in replies)
    assert len(rig.rpc.requests(Rpc.LEDGER_COMMIT)) == 1
    assert len(rig.handlers.ids) == 0  # no lock left behind


async def test_a_reused_id_with_another_body_is_a_conflict() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1")]))
    assert isinstance(await rig.handlers.placing.place(place("r-b")), PlaceReply)
    other = await rig.handlers.placing.place(place("r-b", concurrency=8))
    assert isinstance(other, Rejected) and other.error.code is ErrorCode.CONFLICT
    assert "another request body" in other.error.message
    assert len(rig.rpc.requests(Rpc.LEDGER_COMMIT)) == 1


async def test_the_same_id_after_its_allocation_expired_is_refused_not_placed() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1")]))
    assert isinstance(await rig.handlers.placing.place(place("r-e")), PlaceReply)
    await deliver(rig, "allocation_expired", "al-1", "placement/r-e")
    again = await rig.handlers.placing.place(place("r-e"))
    assert isinstance(again, Rejected) and again.error.code is ErrorCode.CONFLICT
    assert "expired" in again.error.message
    assert len(rig.rpc.requests(Rpc.LEDGER_COMMIT)) == 1


async def test_a_released_allocation_marks_its_decision_released() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1")]))
    await rig.handlers.placing.place(place("r-r"))
    await deliver(rig, "allocation_released", "al-1", "placement/r-r")
    assert rig.store.rows[("acme", "r-r")]["status"] == "released"


async def test_a_rejected_placement_may_be_retried() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed()]))
    huge = place("r-x", model="llama3-405b", dtype="fp16", context_tokens=131072, concurrency=64, fallbacks=[])
    first = await rig.handlers.placing.place(huge)
    again = await rig.handlers.placing.place(huge)
    assert isinstance(first, PlaceReply) and first.status == "rejected" and again == first
    assert rig.uow.names() == ["placement_rejected", "placement_rejected"]  # decided twice, not replayed
    assert rig.store.rows[("acme", "r-x")]["status"] == "rejected"


async def test_a_caller_whose_deadline_passed_gets_nothing_committed(no_deadline: None) -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed()]))
    deadline.set_deadline(deadline.now_ms() - 1)
    reply = await rig.handlers.placing.place(place("r-d"))
    assert isinstance(reply, Rejected) and reply.error.code is ErrorCode.DEADLINE_EXCEEDED
    assert rig.rpc.requests(Rpc.LEDGER_COMMIT) == [] and rig.store.rows == {}


async def test_the_reconciler_releases_what_no_decision_owns() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed("al-own")], ledger_release=[LedgerReleaseReply(status="released")]))
    await rig.handlers.placing.place(place("r-own"))
    await deliver(rig, "allocation_committed", "al-own", "placement/r-own")  # owned: placed
    await deliver(rig, "allocation_committed", "al-stray", "placement/r-nobody")  # no intent at all
    await deliver(rig, "allocation_committed", "al-other", "gateway/r-1")  # not placement's: never touched
    rig.interrupt = True
    rig.rpc.script[Rpc.LEDGER_COMMIT] = [committed("al-dead")]
    with pytest.raises(Interrupted):
        await rig.handlers.placing.place(place("r-dead"))
    await deliver(rig, "allocation_committed", "al-dead", "placement/r-dead")
    assert await rig.handlers.reconciler.reconcile_once() == []  # inside the grace period: nothing
    rig.now += timedelta(seconds=61)
    released = await rig.handlers.reconciler.reconcile_once()
    assert sorted(released) == ["al-dead", "al-stray"]
    assert rig.store.rows[("acme", "r-dead")]["status"] == "abandoned"
    assert sorted(r.allocation_id for r in rig.rpc.requests(Rpc.LEDGER_RELEASE)) == ["al-dead", "al-stray"]
    # The owner comes back too late: a typed refusal, never the released allocation.
    late = await rig.handlers.placing.place(place("r-dead"))
    assert isinstance(late, Rejected) and late.error.code is ErrorCode.CONFLICT


async def test_an_intent_stuck_without_an_allocation_is_abandoned() -> None:
    rig = Rig(FakeRpc(ledger_commit=[RpcError(Rpc.LEDGER_COMMIT, "no reply")], ledger_release=[]))
    await rig.handlers.placing.place(place("r-lost"))
    rig.now += timedelta(seconds=61)
    assert await rig.handlers.reconciler.reconcile_once() == []
    assert rig.store.rows[("acme", "r-lost")]["status"] == "abandoned"
