"""The direct path (docs/PLACEMENT.md, "One durable step"): the ledger's commit, carrying the placement's
record, is the only durable step before the answer; placement's decision row and `placement_decided` follow
from the ledger's `allocation_committed`; a retry with the same request id is answered from the ledger; a
new replica holds a short first lease until its caller renews or an engine on its node reports. Placement's
use cases with fakes (the rig of ``test_handlers``, with a ledger that keeps what it committed)."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

import pytest
from pydantic import BaseModel

from shared.contracts.base import ErrorBody, ErrorCode, Rejected
from shared.contracts.envelope import EventEnvelope
from shared.contracts.ledger import (
    AllocationEvent,
    CommitReply,
    CommitRequest,
    LedgerReleaseReply,
    LedgerRenewReply,
)
from shared.contracts.placement import PlaceReply, RenewRequest
from shared.contracts.subjects import Rpc
from shared.contracts.topology import EngineStatusEvent
from shared.infra.uow import UnitOfWork
from tests.fakes import NOW, FakeRpc
from tests.unit.services.placement.test_handlers import Interrupted, Rig, place

pytestmark = pytest.mark.asyncio

FIRST_LEASE_S = 30


class FakeLedger:
    """Keeps each (tenant, request id)'s first commit, as the ledger's table does: a repeat with the same
    body hash is answered with that allocation and its record, one with another hash is a conflict."""

    def __init__(self) -> None:
        self.commits: dict[tuple[str, str], tuple[str, CommitRequest]] = {}

    def __call__(self, request: BaseModel) -> BaseModel:
        assert isinstance(request, CommitRequest)
        key = (request.tenant, request.request_id)
        if key in self.commits:
            allocation_id, first = self.commits[key]
            if first.body_hash != request.body_hash:
                message = "request_id was already used for a different request"
                error = ErrorBody(code=ErrorCode.CONFLICT, message=message)
                return Rejected(error=error, request_id=request.request_id)
            return CommitReply(
                status="committed",
                request_id=request.request_id,
                allocation_id=allocation_id,
                duplicate=True,
                lease_expires_at=NOW + timedelta(seconds=first.lease_s or 0),
                record=first.record,
            )
        allocation_id = f"al-{len(self.commits) + 1}"
        self.commits[key] = (allocation_id, request)
        return CommitReply(
            status="committed",
            request_id=request.request_id,
            allocation_id=allocation_id,
            lease_expires_at=NOW + timedelta(seconds=request.lease_s or 0),
        )

    def event(self, allocation_id: str) -> tuple[EventEnvelope, AllocationEvent]:
        """The `allocation_committed` the ledger publishes for one of its allocations."""
        request = next(r for a, r in self.commits.values() if a == allocation_id)
        payload = AllocationEvent(
            allocation_id=allocation_id,
            request_id=request.request_id,
            tenant=request.tenant,
            kind="replica",
            shares=[],
            lease_expires_at=NOW + timedelta(seconds=request.lease_s or 0),
            record=request.record,
        )
        envelope = EventEnvelope(
            event_id=uuid.uuid4(),
            type="hetsched.ledger.allocation_committed",
            source="capacity-ledger",
            occurred_at=NOW,
            payload=payload.model_dump(mode="json"),
        )
        return envelope, payload


def direct_rig(ledger: FakeLedger, **script: Any) -> Rig:
    return Rig(FakeRpc(ledger_commit=[ledger], **script), direct=True, first_lease_s=FIRST_LEASE_S)


async def deliver(rig: Rig, ledger: FakeLedger, allocation_id: str) -> None:
    envelope, payload = ledger.event(allocation_id)

    async def work(uow: UnitOfWork) -> None:
        await rig.handlers.lifecycle.on_allocation_committed(uow=uow, event=envelope, payload=payload)

    await rig.uow.run(work)


def report(replica_id: str, node: str) -> EngineStatusEvent:
    return EngineStatusEvent(
        replica_id=replica_id,
        node=node,
        queue_depth=0,
        kv_used_bytes=0,
        kv_total_bytes=10**9,
        latency_p50_ms=10.0,
        latency_p99_ms=20.0,
    )


async def test_a_placement_is_one_ledger_commit_carrying_its_record_and_nothing_else_is_written() -> None:
    ledger = FakeLedger()
    rig = direct_rig(ledger)
    reply = await rig.handlers.placing.place(place("r-1", lease_s=600))
    assert isinstance(reply, PlaceReply) and reply.status == "placed" and reply.allocation_id == "al-1"
    (commit,) = rig.rpc.requests(Rpc.LEDGER_COMMIT)
    assert commit.lease_s == FIRST_LEASE_S  # the first lease, not the 600 s asked for
    assert commit.body_hash and commit.record is not None
    assert commit.record["lease_s"] == 600 and commit.record["request"]["request_id"] == "r-1"
    assert commit.record["reply"]["placements"] == [p.model_dump(mode="json") for p in reply.placements]
    # No durable step of placement's own on the critical path: no row, no event.
    assert rig.uow.runs == 0 and rig.store.rows == {} and rig.uow.events == []
    assert rig.handlers.first_leases.asked("al-1") == 600


async def test_the_ledgers_event_records_and_announces_the_decision_once() -> None:
    ledger = FakeLedger()
    rig = direct_rig(ledger)
    reply = await rig.handlers.placing.place(place("r-1", lease_s=600))
    assert isinstance(reply, PlaceReply)
    await deliver(rig, ledger, "al-1")
    row = rig.store.rows[("acme", "r-1")]
    assert row["status"] == "placed" and row["allocation_id"] == "al-1" and row["lease_s"] == 600
    assert row["reply"].placements == reply.placements
    assert rig.uow.names() == ["placement_decided"]
    (event,) = rig.uow.named("placement_decided")
    assert event["reply"]["allocation_id"] == "al-1" and event["request"]["request_id"] == "r-1"
    await deliver(rig, ledger, "al-1")  # redelivered: nothing new
    assert rig.uow.names() == ["placement_decided"]


async def test_a_retry_after_a_lost_answer_gets_the_same_allocation_and_accelerators() -> None:
    ledger = FakeLedger()
    rig = direct_rig(ledger)
    rig.interrupt = True  # the process dies right after the ledger's commit: its caller learns nothing
    with pytest.raises(Interrupted):
        await rig.handlers.placing.place(place("r-1"))
    first_commit = rig.rpc.requests(Rpc.LEDGER_COMMIT)[0]
    # Meanwhile the fleet looks different to the retry (its own decision would pick other GPUs).
    rig.view.allocation_moved("other", key=("x", "y"), delta={s.accelerator_id: 10**9 for s in first_commit.shares})
    again = await rig.handlers.placing.place(place("r-1"))
    assert isinstance(again, PlaceReply) and again.status == "placed" and again.allocation_id == "al-1"
    held = [a for p in again.placements for a in p.accelerators]
    assert held == [s.accelerator_id for s in first_commit.shares]
    assert again.explanation[-1] == "reserved in the ledger after 1 attempt(s)"  # the first answer's words
    assert len(ledger.commits) == 1  # one allocation


async def test_a_reused_id_with_another_body_is_a_conflict_and_reserves_nothing() -> None:
    ledger = FakeLedger()
    rig = direct_rig(ledger)
    await rig.handlers.placing.place(place("r-1"))
    other = await rig.handlers.placing.place(place("r-1", concurrency=8))
    assert isinstance(other, Rejected) and other.error.code is ErrorCode.CONFLICT
    assert len(ledger.commits) == 1 and len(rig.rpc.requests(Rpc.LEDGER_COMMIT)) == 2


async def test_no_answer_from_the_ledger_says_retry_with_the_same_id() -> None:
    from shared.infra.rpc import RpcError

    rig = Rig(
        FakeRpc(ledger_commit=[RpcError(Rpc.LEDGER_COMMIT, "no reply within 10 s")]), direct=True, first_lease_s=30
    )
    reply = await rig.handlers.placing.place(place("r-1"))
    assert isinstance(reply, Rejected) and "same request_id" in reply.error.message
    assert rig.reserved() == {} and rig.view.assumed == 0 and rig.store.rows == {}


async def test_an_engine_report_from_the_replicas_node_extends_its_first_lease() -> None:
    ledger = FakeLedger()
    rig = direct_rig(ledger, ledger_renew=[LedgerRenewReply(status="renewed", lease_expires_at=NOW)])
    reply = await rig.handlers.placing.place(place("r-1", lease_s=600))
    assert isinstance(reply, PlaceReply) and reply.allocation_id is not None
    await deliver(rig, ledger, reply.allocation_id)
    first_leases = rig.handlers.first_leases
    first_leases.engine_reported(reply.allocation_id, "not-its-node")
    await asyncio.sleep(0)
    assert rig.rpc.requests(Rpc.LEDGER_RENEW) == []
    first_leases.engine_reported(reply.allocation_id, reply.placements[0].node)
    for _ in range(5):
        await asyncio.sleep(0)
    (renew,) = rig.rpc.requests(Rpc.LEDGER_RENEW)
    assert renew.allocation_id == reply.allocation_id and renew.lease_s == 600 and renew.tenant == "acme"
    assert first_leases.asked(reply.allocation_id) is None
    assert rig.store.rows[("acme", "r-1")]["lease_s"] is None
    first_leases.engine_reported(reply.allocation_id, reply.placements[0].node)  # later reports: nothing more
    await asyncio.sleep(0)
    assert len(rig.rpc.requests(Rpc.LEDGER_RENEW)) == 1


async def test_the_callers_renew_ends_the_first_lease_and_a_restart_finds_the_others() -> None:
    ledger = FakeLedger()
    rig = direct_rig(ledger, ledger_renew=[LedgerRenewReply(status="renewed", lease_expires_at=NOW)])
    one = await rig.handlers.placing.place(place("r-1", lease_s=600))
    two = await rig.handlers.placing.place(place("r-2", lease_s=900))
    assert isinstance(one, PlaceReply) and isinstance(two, PlaceReply)
    assert one.allocation_id is not None and two.allocation_id is not None
    await deliver(rig, ledger, one.allocation_id)
    await deliver(rig, ledger, two.allocation_id)
    renewed = await rig.handlers.lifecycle.renew(
        RenewRequest(allocation_id=one.allocation_id, tenant="acme", lease_s=600)
    )
    assert renewed.model_dump()["status"] == "renewed"
    assert rig.handlers.first_leases.asked(one.allocation_id) is None
    # A restarted placement loads the replicas still on their first lease from its decisions.
    restarted = Rig(rig.rpc, view=rig.view, direct=True, first_lease_s=FIRST_LEASE_S)
    restarted.store = rig.store
    restarted.handlers.first_leases._store = rig.store  # the same table
    await restarted.handlers.first_leases.load()
    assert restarted.handlers.first_leases.asked(one.allocation_id) is None
    assert restarted.handlers.first_leases.asked(two.allocation_id) == 900


async def test_a_lease_no_longer_than_the_first_is_committed_whole() -> None:
    ledger = FakeLedger()
    rig = direct_rig(ledger)
    await rig.handlers.placing.place(place("r-1", lease_s=20))
    (commit,) = rig.rpc.requests(Rpc.LEDGER_COMMIT)
    assert commit.lease_s == 20 and rig.handlers.first_leases.asked("al-1") is None


async def test_a_release_ends_the_first_lease() -> None:
    ledger = FakeLedger()
    rig = direct_rig(ledger, ledger_release=[LedgerReleaseReply(status="released")])
    from shared.contracts.placement import ReleaseRequest

    reply = await rig.handlers.placing.place(place("r-1", lease_s=600))
    assert isinstance(reply, PlaceReply) and reply.allocation_id is not None
    await rig.handlers.lifecycle.release(ReleaseRequest(allocation_id=reply.allocation_id, tenant="acme"))
    assert rig.handlers.first_leases.asked(reply.allocation_id) is None


async def test_conflicts_on_every_attempt_answer_conflict_and_leave_nothing_assumed() -> None:
    """Each refusal decides again on the ledger's figures; after the last attempt nothing more is assumed
    (an assumption never sent would hold its bytes in the view for good)."""
    from tests.unit.services.placement.test_handlers import refused

    rig = Rig(FakeRpc(ledger_commit=[refused(ErrorCode.CONFLICT, full=False)]), direct=True, first_lease_s=30)
    reply = await rig.handlers.placing.place(place("r-1"))
    assert isinstance(reply, Rejected) and reply.error.code is ErrorCode.CONFLICT
    assert len(rig.rpc.requests(Rpc.LEDGER_COMMIT)) == 4
    assert rig.reserved() == {} and rig.view.assumed == 0


async def test_a_renew_before_the_decision_row_exists_waits_for_it_and_records_its_lease() -> None:
    """The caller renews at once (as `hetsched place` does); the decision row follows the ledger's event a
    moment later. The renewal waits for the row, so `placement.replicas` lists the renewed lease end, not the
    first lease the row is written with."""
    renewed_until = NOW + timedelta(seconds=600)
    ledger = FakeLedger()
    rig = direct_rig(ledger, ledger_renew=[LedgerRenewReply(status="renewed", lease_expires_at=renewed_until)])
    one = await rig.handlers.placing.place(place("r-1", lease_s=600))
    assert isinstance(one, PlaceReply) and one.allocation_id is not None
    renewing = asyncio.create_task(
        rig.handlers.lifecycle.renew(RenewRequest(allocation_id=one.allocation_id, tenant="acme", lease_s=600))
    )
    await asyncio.sleep(0.2)
    assert not renewing.done()  # its row is not there yet
    await deliver(rig, ledger, one.allocation_id)  # the ledger's event: the row, with the first lease
    renewed = await asyncio.wait_for(renewing, 2)
    assert renewed.model_dump()["status"] == "renewed"
    assert rig.store.rows[("acme", "r-1")]["lease_expires_at"] == renewed_until
