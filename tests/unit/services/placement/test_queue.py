"""Placement's queue with fakes (test_handlers' rig: the real pure view, a scripted ledger, an in-memory
store): a request refused for capacity waits `queued` (reserving nothing), is placed in arrival order
once capacity frees, times out as a `no_capacity` rejection, and the same request id answers its
current state throughout."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from services.placement.attempts import Queueing
from shared.contracts.base import ErrorCode
from shared.contracts.ledger import CommitRequest
from shared.contracts.placement import PlacementEvent, PlaceReply, PlaceRequest
from shared.contracts.subjects import Rpc
from shared.domain.capacity import AcceleratorCapacity
from shared.domain.fleet import AcceleratorId
from shared.domain.memory import usable_hbm
from shared.domain.placement.view import FleetView, LedgerMirror
from tests.fakes import FakeRpc
from tests.unit.placement.builders import models, node, skus
from tests.unit.services.placement.test_handlers import Rig, committed, fleet_view, place
from tests.unit.services.placement.test_ownership import deliver
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio


def tp8(rid: str, **extra: Any) -> PlaceRequest:
    """A TP=8 group: it takes the whole 8-GPU node of the rig, so a second one finds no idle GPUs."""
    return place(rid, model="llama3-70b", dtype="fp8", tp=8, **extra)


def release(rig: Rig, reply: PlaceReply, allocation_id: str, rid: str) -> None:
    """The ledger's `allocation_released` of ``reply``'s allocation, as the view's feed applies it."""
    assert reply.hbm_per_accelerator is not None
    total = reply.hbm_per_accelerator.total_bytes
    accs = [a for p in reply.placements for a in p.accelerators]
    rig.view.allocation_moved(allocation_id, key=("acme", f"placement/{rid}"), delta=dict.fromkeys(accs, -total))


def commits(rig: Rig) -> list[CommitRequest]:
    return list(rig.rpc.requests(Rpc.LEDGER_COMMIT))


async def test_a_request_that_does_not_fit_waits_reserving_nothing_then_is_placed_when_capacity_frees() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1"), committed("al-2")]))
    first = await rig.handlers.placing.place(tp8("first"))
    assert isinstance(first, PlaceReply) and first.status == "placed"
    held = rig.reserved()

    waiting = await rig.handlers.placing.place(tp8("second"))
    assert isinstance(waiting, PlaceReply) and waiting.status == "queued", waiting
    assert waiting.queue_position == 1 and waiting.error is None and waiting.allocation_id is None
    assert any("queued" in line for line in waiting.explanation)
    assert len(commits(rig)) == 1 and rig.reserved() == held  # queued: nothing committed, nothing assumed
    assert rig.uow.names() == ["placement_decided"]  # no event until it is decided

    again = await rig.handlers.placing.place(tp8("second"))  # the same id: its state, not a new decision
    assert isinstance(again, PlaceReply) and again.status == "queued" and again.queue_position == 1
    assert await rig.handlers.queue.serve_once() == {"second": "queued"}  # nothing freed yet
    assert len(commits(rig)) == 1

    release(rig, first, "al-1", "first")
    assert await rig.handlers.queue.serve_once() == {"second": "placed"}
    (_first, second_commit) = commits(rig)
    assert second_commit.request_id == "placement/second" and second_commit.sharing == "exclusive"
    placed = await rig.handlers.placing.place(tp8("second"))
    assert isinstance(placed, PlaceReply) and placed.status == "placed" and placed.allocation_id == "al-2"
    assert placed.queue_position is None and placed.binding and placed.launch is not None
    assert rig.store.queue == {}
    assert rig.uow.names() == ["placement_decided", "placement_decided"]
    event = PlacementEvent.model_validate(rig.uow.events[-1].payload)
    assert event.request_id == "second" and event.reply.allocation_id == "al-2"


async def test_the_queue_is_served_in_arrival_order() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1"), committed("al-2"), committed("al-3")]))
    first = await rig.handlers.placing.place(tp8("first"))
    assert isinstance(first, PlaceReply) and first.status == "placed"
    for rid in ("q-a", "q-b"):
        assert (await rig.handlers.placing.place(tp8(rid))).model_dump()["status"] == "queued"
    positions = [(await rig.handlers.placing.place(tp8(rid))).model_dump()["queue_position"] for rid in ("q-a", "q-b")]
    assert positions == [1, 2]
    release(rig, first, "al-1", "first")
    assert await rig.handlers.queue.serve_once() == {"q-a": "placed", "q-b": "queued"}
    later = await rig.handlers.placing.place(tp8("q-b"))
    assert isinstance(later, PlaceReply) and later.status == "queued" and later.queue_position == 1


async def test_a_queued_request_times_out_as_a_no_capacity_rejection() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1")]))
    assert (await rig.handlers.placing.place(tp8("first"))).model_dump()["status"] == "placed"
    waiting = await rig.handlers.placing.place(tp8("late", queue_timeout_s=30))
    assert isinstance(waiting, PlaceReply) and waiting.status == "queued"
    rig.now += timedelta(seconds=29)
    assert await rig.handlers.queue.serve_once() == {"late": "queued"}
    rig.now += timedelta(seconds=2)
    assert await rig.handlers.queue.serve_once() == {"late": "timed_out"}
    assert rig.store.queue == {} and len(commits(rig)) == 1

    answer = await rig.handlers.placing.place(tp8("late", queue_timeout_s=30))  # the same id: the timeout, for good
    assert isinstance(answer, PlaceReply) and answer.status == "rejected" and answer.error is not None
    assert answer.error.code is ErrorCode.NO_CAPACITY and "queue timeout" in answer.error.message
    assert rig.uow.names() == ["placement_decided", "placement_rejected"]
    assert PlacementEvent.model_validate(rig.uow.events[-1].payload).reply == answer
    assert await rig.handlers.queue.serve_once() == {}


async def test_the_default_queue_timeout_comes_from_the_setting() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1")]))
    await rig.handlers.placing.place(tp8("first"))
    await rig.handlers.placing.place(tp8("waits"))
    (entry,) = rig.store.queue.values()
    assert entry.deadline_at - entry.enqueued_at == timedelta(seconds=600)  # Queueing() default


@pytest.mark.parametrize("fallbacks", [[], ["kv_quantize", "pipeline"]])
async def test_a_request_that_does_not_allow_the_queue_is_rejected(fallbacks: list[str]) -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1")]))
    await rig.handlers.placing.place(tp8("first"))
    reply = await rig.handlers.placing.place(tp8("no-wait", fallbacks=fallbacks))
    assert isinstance(reply, PlaceReply) and reply.status == "rejected" and reply.queue_position is None
    assert reply.error is not None and reply.error.code is ErrorCode.NO_CAPACITY
    assert rig.store.queue == {} and rig.store.rows[("acme", "no-wait")]["status"] == "rejected"


async def test_a_queued_id_with_another_body_is_a_conflict_and_keeps_its_place() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1")]))
    await rig.handlers.placing.place(tp8("first"))
    await rig.handlers.placing.place(tp8("q"))
    other = await rig.handlers.placing.place(tp8("q", concurrency=8))
    assert other.model_dump()["error"]["code"] == "conflict"
    assert [q.request_id for q in rig.store.queue.values()] == ["q"]


async def test_explain_says_it_would_queue_and_queues_nothing() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1")]))
    await rig.handlers.placing.place(tp8("first"))
    dry = await rig.handlers.placing.explain(tp8("dry"))
    assert isinstance(dry, PlaceReply) and dry.status == "rejected"
    assert any("would queue" in line for line in dry.explanation)
    assert rig.store.queue == {}


async def test_a_release_event_wakes_the_queue_which_places_the_waiting_request() -> None:
    # A retry period no test waits out: only the wake-up can serve the queue in time.
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1"), committed("al-2")]), queueing=Queueing(retry_s=3600))
    first = await rig.handlers.placing.place(tp8("first"))
    assert isinstance(first, PlaceReply) and first.status == "placed"
    assert (await rig.handlers.placing.place(tp8("second"))).model_dump()["status"] == "queued"
    serving = asyncio.create_task(rig.handlers.queue.serve())
    try:
        release(rig, first, "al-1", "first")  # the view's feed applies the release...
        await deliver(rig, "allocation_released", "al-1", "placement/first")  # ...and the consumer hears it

        async def placed() -> bool:
            return (await rig.handlers.placing.place(tp8("second"))).model_dump()["status"] == "placed"

        await wait_for(placed, 10, what="the queued request placed after the release")
    finally:
        serving.cancel()


# -- issue 23 row 4: every queued request, every due row, no tenant's backlog in another's way ----------


def two_sku_view() -> FleetView:
    """An 8-GPU H100 node and a one-GPU L40S node: the probe's A100 backlog and globex's idle L40S."""
    profiles = [node("h1").nvswitch(8).profile(), node("l1").sku("L40S-48GB").pcie(1).profile()]
    rows = [
        AcceleratorCapacity.of_ledger(
            id=AcceleratorId.gpu(p.name, a.index), node=p.name, usable=usable_hbm(a.hbm_bytes), reserved=0
        )
        for p in profiles
        for a in p.accelerators
    ]
    return FleetView(skus=skus(), models=models(), nodes=[(p, True) for p in profiles], ledger=LedgerMirror(rows))


def h100_group(rid: str, **extra: Any) -> PlaceRequest:
    return tp8(rid, skus=["H100-SXM-80GB"], **extra)


def l40s_replica(rid: str, **extra: Any) -> PlaceRequest:
    return place(rid, tenant="globex", tp=1, skus=["L40S-48GB"], **extra)


def ended(rig: Rig, reply: PlaceReply, tenant: str, rid: str) -> None:
    """The ledger's `allocation_released` of ``reply``'s allocation, as the view's feed applies it."""
    assert reply.hbm_per_accelerator is not None and reply.allocation_id is not None
    accs = [a for p in reply.placements for a in p.accelerators]
    total = reply.hbm_per_accelerator.total_bytes
    key = (tenant, f"placement/{rid}")
    rig.view.allocation_moved(reply.allocation_id, key=key, delta=dict.fromkeys(accs, -total))


def counting_decisions(rig: Rig) -> list[str]:
    """The request ids the handlers decide from now on (each costs a run of the pipeline)."""
    decided: list[str] = []
    decide = rig.handlers.decider.decide

    def spy(snapshot: Any, request: PlaceRequest) -> Any:
        decided.append(request.request_id)
        return decide(snapshot, request)

    rig.handlers.decider.decide = spy  # type: ignore[method-assign]
    return decided


async def test_another_tenants_request_behind_a_backlog_of_205_is_placed_when_its_capacity_frees() -> None:
    """The probe at its own scale: acme's 205 H100 groups wait (its only H100 node is taken); globex's
    L40S replica waits behind them for the one L40S; once that frees, one pass places globex's, and
    acme's 205 identical requests cost one decision, not 205."""
    commits = [committed("al-h"), committed("al-l1"), committed("al-l2")]
    rig = Rig(FakeRpc(ledger_commit=commits), view=two_sku_view())
    assert (await rig.handlers.placing.place(h100_group("h-first"))).model_dump()["status"] == "placed"
    first_l40s = await rig.handlers.placing.place(l40s_replica("g-first"))
    assert isinstance(first_l40s, PlaceReply) and first_l40s.status == "placed"
    for i in range(205):
        assert (await rig.handlers.placing.place(h100_group(f"a-{i}"))).model_dump()["status"] == "queued"
    waiting = await rig.handlers.placing.place(l40s_replica("g-second"))
    assert isinstance(waiting, PlaceReply) and waiting.status == "queued" and waiting.queue_position == 206

    ended(rig, first_l40s, "globex", "g-first")
    decided = counting_decisions(rig)
    outcomes = await rig.handlers.queue.serve_once()
    assert outcomes["g-second"] == "placed"
    assert sum(1 for rid, outcome in outcomes.items() if rid.startswith("a-") and outcome == "queued") == 205
    assert decided.count("g-second") == 2  # the dry decision, then the attempt's
    assert len([rid for rid in decided if rid.startswith("a-")]) == 1  # one shape, one decision
    placed = await rig.handlers.placing.place(l40s_replica("g-second"))
    assert isinstance(placed, PlaceReply) and placed.status == "placed" and placed.allocation_id == "al-l2"


async def test_every_queued_request_past_its_deadline_is_timed_out_in_one_pass() -> None:
    """230 due requests, more than a page of the old pass (200): all of them leave in one pass."""
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1")]))
    await rig.handlers.placing.place(tp8("first"))
    for i in range(230):
        assert (await rig.handlers.placing.place(tp8(f"q-{i}", queue_timeout_s=30))).model_dump()["status"] == "queued"
    rig.now += timedelta(seconds=31)
    outcomes = await rig.handlers.queue.serve_once()
    assert len(outcomes) == 230 and set(outcomes.values()) == {"timed_out"}
    assert rig.store.queue == {}
    assert rig.uow.names().count("placement_rejected") == 230


async def test_a_pass_reads_the_queue_in_pages_of_the_setting() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1")]), queueing=Queueing(page=20))
    await rig.handlers.placing.place(tp8("first"))
    for i in range(45):
        await rig.handlers.placing.place(tp8(f"q-{i}", queue_timeout_s=30 if i >= 40 else 600))
    rig.store.pages = 0
    rig.now += timedelta(seconds=31)
    outcomes = await rig.handlers.queue.serve_once()
    assert rig.store.pages == 3  # 20 + 20 + 5 (keyset: each page after the last row of the one before)
    assert [rid for rid, outcome in outcomes.items() if outcome == "timed_out"] == [f"q-{i}" for i in range(40, 45)]
    assert len(rig.store.queue) == 40


async def test_the_queue_is_served_round_robin_by_tenant() -> None:
    """Room for two groups once both nodes free: acme's first and globex's first are placed, not acme's
    first two (acme queued three before globex queued one)."""
    commits = [committed(f"al-{i}") for i in range(1, 5)]
    rig = Rig(FakeRpc(ledger_commit=commits), view=fleet_view(nodes=("n1", "n2")))
    held = [await rig.handlers.placing.place(tp8(rid)) for rid in ("hold-1", "hold-2")]
    for rid in ("a-1", "a-2", "a-3"):
        assert (await rig.handlers.placing.place(tp8(rid))).model_dump()["status"] == "queued"
    assert (await rig.handlers.placing.place(tp8("g-1", tenant="globex"))).model_dump()["status"] == "queued"
    for reply, rid in zip(held, ("hold-1", "hold-2"), strict=True):
        assert isinstance(reply, PlaceReply)
        ended(rig, reply, "acme", rid)
    outcomes = await rig.handlers.queue.serve_once()
    assert outcomes == {"a-1": "placed", "g-1": "placed", "a-2": "queued", "a-3": "queued"}


async def test_a_queue_pass_decides_only_once_its_reservation_view_is_current_and_still_times_out() -> None:
    """Read-your-writes on the queue's path (issue 23 row 11): a queued request is decided later, by a
    pass; the pass asks the reservation view first, and one not known to be current decides nothing
    (a reservation answered meanwhile might be missing from it), though rows past their deadline still go."""
    behind: list[str | None] = [None, None]  # place() of "first" and of "waiting" find the view current

    async def current(timeout_s: float) -> str | None:
        return behind.pop(0) if behind else "applied RESERVATION events up to 3 of 5"

    rig = Rig(FakeRpc(ledger_commit=[committed("al-1"), committed("al-2")]), reservations_current=current)
    first = await rig.handlers.placing.place(tp8("first"))
    assert isinstance(first, PlaceReply) and first.status == "placed"
    assert (await rig.handlers.placing.place(tp8("waiting", queue_timeout_s=30))).model_dump()["status"] == "queued"
    release(rig, first, "al-1", "first")  # it would fit now ...
    assert await rig.handlers.queue.serve_once() == {"waiting": "queued"}  # ... but the view is behind
    assert len(commits(rig)) == 1
    rig.now += timedelta(seconds=31)
    assert await rig.handlers.queue.serve_once() == {"waiting": "timed_out"}
    behind.append(None)
    assert await rig.handlers.queue.serve_once() == {}  # an empty queue asks nothing
    assert behind == [None]


async def test_a_wake_up_reads_no_queue_it_knows_is_empty_until_something_is_queued() -> None:
    """Every release wakes the queue: once a pass found it empty, a wake-up reads nothing until this
    process queues a request (the periodic pass still reads, for other processes' requests)."""
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1"), committed("al-2")]), queueing=Queueing(retry_s=3600))
    queue = rig.handlers.queue
    serving = asyncio.create_task(queue.serve())
    try:
        queue.wake()
        await wait_for(lambda: rig.store.pages == 1, 2, what="the first pass read the queue")
        for _ in range(5):
            queue.wake()
            await asyncio.sleep(0.01)
        assert rig.store.pages == 1  # known empty: no reads
        await rig.handlers.placing.place(tp8("big-1"))
        queued = await rig.handlers.placing.place(tp8("big-2"))
        assert isinstance(queued, PlaceReply) and queued.status == "queued"
        queue.wake()
        await wait_for(lambda: rig.store.pages == 2, 2, what="a pass after something was queued")
    finally:
        serving.cancel()
