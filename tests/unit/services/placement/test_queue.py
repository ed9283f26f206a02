"""Placement's queue with fakes (test_handlers' rig: the real pure view, a scripted ledger, an in-memory
store): a request refused for capacity waits `queued` (reserving nothing), is placed in arrival order
once capacity frees, times out as a `no_capacity` rejection, and the same request id answers its
current state throughout."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from services.placement.handlers import Queueing
from shared.contracts.base import ErrorCode
from shared.contracts.ledger import CommitRequest
from shared.contracts.placement import PlaceReply, PlaceRequest
from shared.contracts.placement_events import PlacementEvent
from shared.contracts.subjects import Rpc
from tests.unit.services.placement.test_handlers import FakeRpc, Rig, committed, place
from tests.unit.services.placement.test_ownership import deliver
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio


def tp8(rid: str, **extra: Any) -> PlaceRequest:
    """A TP=8 group: it takes the whole 8-GPU node of the rig, so a second one finds no idle GPUs."""
    return place(rid, model="llama3-70b", dtype="fp8", tp=8, **extra)


def release(rig: Rig, reply: PlaceReply, allocation_id: str, rid: str) -> None:
    """The ledger's `allocation_released` of ``reply``'s allocation, as the view's feed applies it."""
    assert reply.hbm_per_accelerator is not None
    total = reply.hbm_per_accelerator.total
    accs = [a for p in reply.placements for a in p.accelerators]
    rig.view.allocation_moved(allocation_id, key=("acme", f"placement/{rid}"), delta=dict.fromkeys(accs, -total))


def commits(rig: Rig) -> list[CommitRequest]:
    return list(rig.rpc.requests(Rpc.LEDGER_COMMIT))


async def test_a_request_that_does_not_fit_waits_reserving_nothing_then_is_placed_when_capacity_frees() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1"), committed("al-2")]))
    first = await rig.handlers.place(tp8("first"))
    assert isinstance(first, PlaceReply) and first.status == "placed"
    held = rig.reserved()

    waiting = await rig.handlers.place(tp8("second"))
    assert isinstance(waiting, PlaceReply) and waiting.status == "queued", waiting
    assert waiting.queue_position == 1 and waiting.error is None and waiting.allocation_id is None
    assert any("queued" in line for line in waiting.explanation)
    assert len(commits(rig)) == 1 and rig.reserved() == held  # queued: nothing committed, nothing assumed
    assert rig.uow.names() == ["placement_decided"]  # no event until it is decided

    again = await rig.handlers.place(tp8("second"))  # the same id: its state, not a new decision
    assert isinstance(again, PlaceReply) and again.status == "queued" and again.queue_position == 1
    assert await rig.handlers.serve_queue_once() == {"second": "queued"}  # nothing freed yet
    assert len(commits(rig)) == 1

    release(rig, first, "al-1", "first")
    assert await rig.handlers.serve_queue_once() == {"second": "placed"}
    (_first, second_commit) = commits(rig)
    assert second_commit.request_id == "placement/second" and second_commit.sharing == "exclusive"
    placed = await rig.handlers.place(tp8("second"))
    assert isinstance(placed, PlaceReply) and placed.status == "placed" and placed.allocation_id == "al-2"
    assert placed.queue_position is None and placed.binding and placed.launch is not None
    assert rig.store.queue == {}
    assert rig.uow.names() == ["placement_decided", "placement_decided"]
    event = PlacementEvent.model_validate(rig.uow.events[-1].payload)
    assert event.request_id == "second" and event.reply.allocation_id == "al-2"


async def test_the_queue_is_served_in_arrival_order() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1"), committed("al-2"), committed("al-3")]))
    first = await rig.handlers.place(tp8("first"))
    assert isinstance(first, PlaceReply) and first.status == "placed"
    for rid in ("q-a", "q-b"):
        assert (await rig.handlers.place(tp8(rid))).model_dump()["status"] == "queued"
    positions = [(await rig.handlers.place(tp8(rid))).model_dump()["queue_position"] for rid in ("q-a", "q-b")]
    assert positions == [1, 2]
    release(rig, first, "al-1", "first")
    assert await rig.handlers.serve_queue_once() == {"q-a": "placed", "q-b": "queued"}
    later = await rig.handlers.place(tp8("q-b"))
    assert isinstance(later, PlaceReply) and later.status == "queued" and later.queue_position == 1


async def test_a_queued_request_times_out_as_a_no_capacity_rejection() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1")]))
    assert (await rig.handlers.place(tp8("first"))).model_dump()["status"] == "placed"
    waiting = await rig.handlers.place(tp8("late", queue_timeout_s=30))
    assert isinstance(waiting, PlaceReply) and waiting.status == "queued"
    rig.now += timedelta(seconds=29)
    assert await rig.handlers.serve_queue_once() == {"late": "queued"}
    rig.now += timedelta(seconds=2)
    assert await rig.handlers.serve_queue_once() == {"late": "timed_out"}
    assert rig.store.queue == {} and len(commits(rig)) == 1

    answer = await rig.handlers.place(tp8("late", queue_timeout_s=30))  # the same id: the timeout, for good
    assert isinstance(answer, PlaceReply) and answer.status == "rejected" and answer.error is not None
    assert answer.error.code is ErrorCode.NO_CAPACITY and "queue timeout" in answer.error.message
    assert rig.uow.names() == ["placement_decided", "placement_rejected"]
    assert PlacementEvent.model_validate(rig.uow.events[-1].payload).reply == answer
    assert await rig.handlers.serve_queue_once() == {}


async def test_the_default_queue_timeout_comes_from_the_setting() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1")]))
    await rig.handlers.place(tp8("first"))
    await rig.handlers.place(tp8("waits"))
    (entry,) = rig.store.queue.values()
    assert entry.deadline_at - entry.enqueued_at == timedelta(seconds=600)  # Queueing() default


@pytest.mark.parametrize("fallbacks", [[], ["kv_quantize", "pipeline"]])
async def test_a_request_that_does_not_allow_the_queue_is_rejected(fallbacks: list[str]) -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1")]))
    await rig.handlers.place(tp8("first"))
    reply = await rig.handlers.place(tp8("no-wait", fallbacks=fallbacks))
    assert isinstance(reply, PlaceReply) and reply.status == "rejected" and reply.queue_position is None
    assert reply.error is not None and reply.error.code is ErrorCode.NO_CAPACITY
    assert rig.store.queue == {} and rig.store.rows[("acme", "no-wait")]["status"] == "rejected"


async def test_a_queued_id_with_another_body_is_a_conflict_and_keeps_its_place() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1")]))
    await rig.handlers.place(tp8("first"))
    await rig.handlers.place(tp8("q"))
    other = await rig.handlers.place(tp8("q", concurrency=8))
    assert other.model_dump()["error"]["code"] == "conflict"
    assert [q.request_id for q in rig.store.queue.values()] == ["q"]


async def test_explain_says_it_would_queue_and_queues_nothing() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1")]))
    await rig.handlers.place(tp8("first"))
    dry = await rig.handlers.explain(tp8("dry"))
    assert isinstance(dry, PlaceReply) and dry.status == "rejected"
    assert any("would queue" in line for line in dry.explanation)
    assert rig.store.queue == {}


async def test_a_release_event_wakes_the_queue_which_places_the_waiting_request() -> None:
    # A retry period no test waits out: only the wake-up can serve the queue in time.
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1"), committed("al-2")]), queueing=Queueing(retry_s=3600))
    first = await rig.handlers.place(tp8("first"))
    assert isinstance(first, PlaceReply) and first.status == "placed"
    assert (await rig.handlers.place(tp8("second"))).model_dump()["status"] == "queued"
    serving = asyncio.create_task(rig.handlers.serve_queue())
    try:
        release(rig, first, "al-1", "first")  # the view's feed applies the release...
        await deliver(rig, "allocation_released", "al-1", "placement/first")  # ...and the consumer hears it

        async def placed() -> bool:
            return (await rig.handlers.place(tp8("second"))).model_dump()["status"] == "placed"

        await wait_for(placed, 10, what="the queued request placed after the release")
    finally:
        serving.cancel()
