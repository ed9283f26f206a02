"""Placement's per-tenant quotas with fakes (test_handlers' rig): GPUs placed (counted from the tenant's
allocations and its commits in flight, freed when they end, loaded at start) and queued requests (the
cap at enqueue). Past one: `quota_exceeded` naming the quota, its limit and the use now; nothing is
reserved, recorded, queued or announced."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import BaseModel

from services.placement.attempts import Ownership
from services.placement.handlers import PlacementHandlers
from services.placement.records import QueuedRequest
from shared.contracts.base import ErrorCode, Rejected
from shared.contracts.ledger import AllocationEvent, CommitRequest, ShareOut
from shared.contracts.placement import PlaceReply, PlaceRequest
from shared.contracts.subjects import Rpc
from shared.domain.quotas import Quota, Quotas
from tests.fakes import FakeRpc
from tests.unit.services.placement.test_handlers import Rig, committed, fleet_view, place
from tests.unit.services.placement.test_queue import ended, tp8

pytestmark = pytest.mark.asyncio


def commits(rig: Rig) -> list[CommitRequest]:
    return list(rig.rpc.requests(Rpc.LEDGER_COMMIT))


def each_its_own(request: BaseModel) -> BaseModel:
    assert isinstance(request, CommitRequest)
    return committed(f"al-{request.request_id.removeprefix('placement/')}")(request)


def refusal(reply: BaseModel, quota: Quota) -> dict[str, Any]:
    assert isinstance(reply, Rejected), reply
    assert reply.error.code is ErrorCode.QUOTA_EXCEEDED and quota.value in reply.error.message
    assert reply.error.details is not None
    return reply.error.details


def released(rig: Rig, reply: BaseModel, tenant: str, rid: str) -> None:
    """The ledger's `allocation_released`, as the view's LEDGER feed applies it (bytes and the tally)."""
    assert isinstance(reply, PlaceReply) and reply.allocation_id is not None
    ended(rig, reply, tenant, rid)
    shares = [
        ShareOut(accelerator_id=a, weights_bytes=0, kv_bytes=0, activation_bytes=0, workspace_bytes=0, total_bytes=0)
        for a in held(reply)
    ]
    event = AllocationEvent(
        allocation_id=reply.allocation_id, request_id=f"placement/{rid}", tenant=tenant, kind="replica", shares=shares
    )
    rig.handlers.tally.on_view_allocation("allocation_released", event)


def held(reply: PlaceReply) -> list[str]:
    return [a for p in reply.placements for a in p.accelerators]


async def test_a_placement_past_the_tenants_gpus_placed_quota_is_refused_and_reserves_nothing() -> None:
    rig = Rig(
        FakeRpc(ledger_commit=[each_its_own]),
        view=fleet_view(nodes=("n1", "n2")),
        quotas=Quotas(limits={Quota.GPUS_PLACED: 8}),
    )
    first = await rig.handlers.placing.place(tp8("first"))
    assert isinstance(first, PlaceReply) and first.status == "placed"
    reserved = rig.reserved()

    over = await rig.handlers.placing.place(tp8("second"))
    assert refusal(over, Quota.GPUS_PLACED) == {"quota": "gpus_placed", "limit": 8, "used": 8, "asked": 8}
    assert "limit 8" in over.model_dump()["error"]["message"]
    assert len(commits(rig)) == 1 and rig.reserved() == reserved  # nothing committed, nothing assumed
    assert ("acme", "second") not in rig.store.rows and rig.store.queue == {}  # nothing recorded
    assert rig.uow.names() == ["placement_decided"]  # nothing announced
    small = await rig.handlers.placing.place(place("small", tp=1))  # one GPU more is past it too
    assert refusal(small, Quota.GPUS_PLACED)["asked"] == 1

    again = await rig.handlers.placing.place(tp8("first"))  # the placed id still answers its placement
    assert isinstance(again, PlaceReply) and again.allocation_id == first.allocation_id
    dry = await rig.handlers.placing.explain(tp8("dry"))
    assert any("would refuse" in line and "gpus_placed" in line for line in dry.model_dump()["explanation"])
    other = await rig.handlers.placing.place(tp8("theirs", tenant="globex"))  # another tenant's quota is its own
    assert isinstance(other, PlaceReply) and other.status == "placed"

    released(rig, first, "acme", "first")
    after = await rig.handlers.placing.place(tp8("second"))  # the same id, once acme's first ended
    assert isinstance(after, PlaceReply) and after.status == "placed", after


async def test_concurrent_placements_cannot_all_pass_the_quota_while_their_commits_are_in_flight() -> None:
    """Sixteen one-GPU replicas at once against a quota of 8: the commits in flight count, so 8 are
    placed and 8 refused, not 16 placed."""

    class SlowLedger(FakeRpc):
        async def call(self, rpc: Rpc, request: BaseModel, **kwargs: Any) -> BaseModel:
            if rpc is Rpc.LEDGER_COMMIT:
                await asyncio.sleep(0.01)  # every decision is made while the first commits are in flight
            return await super().call(rpc, request, **kwargs)

    rig = Rig(
        SlowLedger(ledger_commit=[each_its_own]),
        view=fleet_view(nodes=("n1", "n2")),
        quotas=Quotas(limits={Quota.GPUS_PLACED: 8}),
    )
    replies = await asyncio.gather(*(rig.handlers.placing.place(place(f"r-{i}", tp=1)) for i in range(16)))
    placed = [r for r in replies if isinstance(r, PlaceReply) and r.status == "placed"]
    refused = [r for r in replies if isinstance(r, Rejected) and r.error.code is ErrorCode.QUOTA_EXCEEDED]
    assert (len(placed), len(refused)) == (8, 8)
    assert len(commits(rig)) == 8
    assert rig.handlers.tally.holdings.held("acme") == 8


async def test_a_tenant_override_and_zero_unlimited() -> None:
    quotas = Quotas(limits={Quota.GPUS_PLACED: 8}, overrides={"acme": {Quota.GPUS_PLACED: 0}})
    rig = Rig(FakeRpc(ledger_commit=[each_its_own]), view=fleet_view(nodes=("n1", "n2")), quotas=quotas)
    for rid in ("one", "two"):
        assert (await rig.handlers.placing.place(tp8(rid))).model_dump()["status"] == "placed"


async def test_a_restarted_placement_counts_the_placed_decisions_it_finds() -> None:
    quotas = Quotas(limits={Quota.GPUS_PLACED: 8})
    rig = Rig(FakeRpc(ledger_commit=[each_its_own]), view=fleet_view(nodes=("n1", "n2")), quotas=quotas)
    assert (await rig.handlers.placing.place(tp8("first"))).model_dump()["status"] == "placed"
    restarted = PlacementHandlers.build(
        view=rig.view,
        store=rig.store,
        uow=rig.uow,  # type: ignore[arg-type]
        rpc=rig.rpc,
        timer=lambda: 0.0,
        default_lease_s=3600,
        ownership=Ownership(claim_s=5, grace_s=60),
        clock=lambda: rig.now,
        quotas=quotas,
        direct=False,
    )
    await restarted.tally.start()
    assert restarted.tally.holdings.held("acme") == 8
    assert refusal(await restarted.placing.place(tp8("second")), Quota.GPUS_PLACED)["used"] == 8


async def test_allocations_another_placement_committed_count_from_the_views_feed() -> None:
    quotas = Quotas(limits={Quota.GPUS_PLACED: 8})
    rig = Rig(FakeRpc(ledger_commit=[each_its_own]), view=fleet_view(nodes=("n1", "n2")), quotas=quotas)
    shares = [
        ShareOut(
            accelerator_id=f"n2/gpu{i}",
            weights_bytes=0,
            kv_bytes=0,
            activation_bytes=0,
            workspace_bytes=0,
            total_bytes=0,
        )
        for i in range(8)
    ]
    elsewhere = AllocationEvent(
        allocation_id="al-x", request_id="placement/x", tenant="acme", kind="replica", shares=shares
    )
    rig.handlers.tally.on_view_allocation("allocation_committed", elsewhere)
    rig.handlers.tally.on_view_allocation(  # a KV hold and another service's allocation are not placed GPUs
        "allocation_committed", elsewhere.model_copy(update={"allocation_id": "al-kv", "kind": "request"})
    )
    rig.handlers.tally.on_view_allocation(
        "allocation_committed", elsewhere.model_copy(update={"allocation_id": "al-y", "request_id": "ops/y"})
    )
    assert rig.handlers.tally.holdings.held("acme") == 8
    assert refusal(await rig.handlers.placing.place(place("one", tp=1)), Quota.GPUS_PLACED)["used"] == 8
    rig.handlers.tally.on_view_allocation("allocation_expired", elsewhere)
    assert (await rig.handlers.placing.place(place("one", tp=1))).model_dump()["status"] == "placed"


async def test_a_queued_request_that_fits_waits_while_its_tenant_is_at_its_quota() -> None:
    quotas = Quotas(limits={Quota.GPUS_PLACED: 8})
    rig = Rig(FakeRpc(ledger_commit=[each_its_own]), view=fleet_view(nodes=("n1", "n2")), quotas=quotas)
    mine = await rig.handlers.placing.place(tp8("mine"))
    theirs = await rig.handlers.placing.place(tp8("theirs", tenant="globex"))
    assert (await rig.handlers.placing.place(tp8("waits"))).model_dump()["status"] == "queued"  # no room at all
    released(rig, theirs, "globex", "theirs")
    assert await rig.handlers.queue.serve_once() == {"waits": "queued"}  # room, but acme holds its 8
    assert len(commits(rig)) == 2
    released(rig, mine, "acme", "mine")
    assert await rig.handlers.queue.serve_once() == {"waits": "placed"}


async def test_a_request_past_the_tenants_queued_requests_quota_is_refused_and_queues_nothing() -> None:
    quotas = Quotas(limits={Quota.QUEUED_REQUESTS: 2}, overrides={"globex": {Quota.QUEUED_REQUESTS: 1}})
    rig = Rig(FakeRpc(ledger_commit=[each_its_own]), quotas=quotas)
    assert (await rig.handlers.placing.place(tp8("first"))).model_dump()["status"] == "placed"
    for rid in ("q-1", "q-2"):
        assert (await rig.handlers.placing.place(tp8(rid))).model_dump()["status"] == "queued"
    over = await rig.handlers.placing.place(tp8("q-3"))
    assert refusal(over, Quota.QUEUED_REQUESTS) == {"quota": "queued_requests", "limit": 2, "used": 2, "asked": 1}
    assert sorted(rid for _tenant, rid in rig.store.queue) == ["q-1", "q-2"]
    assert rig.store.rows[("acme", "q-3")]["status"] == "rejected" and rig.store.rows[("acme", "q-3")]["reply"] is None
    assert rig.uow.names() == ["placement_decided"]  # no event for a refusal that recorded nothing
    queued = await rig.handlers.placing.place(tp8("q-1"))  # a queued one asked again keeps its place
    assert isinstance(queued, PlaceReply) and queued.status == "queued" and queued.queue_position == 1
    assert refusal(await rig.handlers.placing.place(tp8("q-3")), Quota.QUEUED_REQUESTS)["used"] == 2  # still past it

    assert (await rig.handlers.placing.place(tp8("g-1", tenant="globex"))).model_dump()["status"] == "queued"
    assert refusal(await rig.handlers.placing.place(tp8("g-2", tenant="globex")), Quota.QUEUED_REQUESTS)["limit"] == 1

    await rig.handlers.placing.place(tp8("q-1", fallbacks=[]))  # another body: a conflict, q-1 keeps its place
    rig.store.queue.pop(("acme", "q-1"))  # q-1 leaves the queue (placed or timed out)
    assert (await rig.handlers.placing.place(tp8("q-3"))).model_dump()["status"] == "queued"  # room again


async def test_request_body_shape_ignores_the_id_and_the_wait() -> None:
    def entry(request: PlaceRequest) -> QueuedRequest:
        now = datetime(2026, 1, 1, tzinfo=UTC)
        return QueuedRequest(
            seq=1,
            tenant=request.tenant,
            request_id=request.request_id,
            body=request.model_dump(mode="json"),
            enqueued_at=now,
            deadline_at=now,
        )

    assert entry(tp8("a", queue_timeout_s=5)).shape == entry(tp8("b", queue_timeout_s=50)).shape
    assert entry(tp8("a")).shape != entry(tp8("a", tenant="globex")).shape  # what a tenant may use differs
    assert entry(tp8("a")).shape != entry(tp8("a", concurrency=8)).shape
    assert entry(tp8("a")).request == tp8("a")
