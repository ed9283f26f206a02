"""Issue 23 rows 10 and 11 on the real stack: an authenticated NATS server with the stack's own
permissions (``tests.integration.test_security``'s bus: topology with the demo fleet, the ledger and
placement as processes with their own NKeys and Postgres roles), and the reservation filler with its own.

Row 10: the filler is killed in the middle of a reclaim (``HETSCHED_RESERVATION_FAULT_AFTER_RECORD=exit``:
it dies after writing the preemption, before asking the ledger, without answering placement). The owner's
placement is answered within the RPC timeout even by a caller that would wait longer (``queued`` when it
may queue, else a retryable ``no_capacity`` with ``retry_after_s``); placement's health is ``degraded``
while the filler is down and ``ok`` again once the filler answers (no other call to it needed); the
restarted filler finishes the preemption and the queued owner is placed.

Row 11: read-your-writes. A reservation answered ``created`` is in force for the placement asked right
after it: another tenant's preemptible replica never lands on a hard reservation's GPUs, a non-preemptible
one never on a soft reservation's, ten times each.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from hetsched.stack import wait_healthy
from services.registry import SERVICES
from shared.contracts.base import Rejected
from shared.contracts.health import HealthReply, HealthRequest
from shared.contracts.ledger import SnapshotReply, SnapshotRequest
from shared.contracts.permissions import inbox_prefix, service_identity
from shared.contracts.placement import PlaceReply, ReleaseReply, ReleaseRequest
from shared.contracts.reservation import (
    ReservationCancelReply,
    ReservationCancelRequest,
    ReservationCreateReply,
    ReservationCreateRequest,
    ReservationEvent,
    ReservationStatusReply,
    ReservationStatusRequest,
)
from shared.contracts.subjects import Context, Rpc
from shared.infra.rpc import RpcClient
from tests.integration.secure_stack import SecureBus
from tests.integration.test_reservations import one_gpu_request
from tests.integration.test_security import bus
from tests.jetstream import read_all
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

__all__ = ["bus"]  # the authenticated bus fixture, one for this module

A100, WEST = "A100-SXM-80GB", "us-west-1"  # one node of 8 in us-west-1: dgx-a100-01
L40S = "L40S-48GB"  # two nodes of 8 in us-west-1
H200, EAST = "H200-SXM-141GB", "us-east-1"  # two nodes of 8 in us-east-1
FILLER = "reservation_filler"


class Stack:
    """The bus's services plus the filler, asked as the operator (who may call every subject)."""

    def __init__(self, bus: SecureBus, rpc: RpcClient) -> None:
        self.bus = bus
        self.rpc = rpc
        self.rpc_timeout_s = bus.settings.kit.rpc_timeout_ms / 1000

    def start_filler(self, **env: str) -> None:
        identity = service_identity(SERVICES[FILLER].schema)
        assert self.bus.procs is not None
        self.bus.procs.start(
            FILLER,
            name=FILLER,
            HETSCHED_NATS_NKEY_SEED_FILE=str(self.bus.seeds[identity]),
            HETSCHED_NATS_INBOX_PREFIX=inbox_prefix(identity),
            HETSCHED_RESERVATION_TICK_S="0.2",
            **env,
        )

    async def filler_up(self) -> None:
        health = await wait_healthy(
            nats_url=self.bus.url,
            subjects=self.bus.subjects,
            deadline_s=60,
            only={FILLER},
            nkeys_seed=str(self.bus.seeds["operator"]),
        )
        assert health[FILLER]["status"] == "ok", health

    def stop_filler(self) -> None:
        assert self.bus.procs is not None
        self.bus.procs.stop(FILLER)

    async def place(
        self,
        rid: str,
        tenant: str,
        *,
        sku: str = A100,
        region: str = WEST,
        preemptible: bool = False,
        fallbacks: list[str] | None = None,
        timeout_s: float | None = None,
    ) -> PlaceReply | Rejected:
        request = one_gpu_request(
            rid, tenant, sku=sku, region=region, preemptible=preemptible, fallbacks=fallbacks or []
        )
        return await self.rpc.ask(Rpc.PLACEMENT_PLACE, request, PlaceReply, timeout_s=timeout_s)

    async def placed(self, rid: str, tenant: str, **fields: Any) -> PlaceReply:
        reply = await self.place(rid, tenant, **fields)
        assert isinstance(reply, PlaceReply) and reply.status == "placed" and reply.allocation_id, reply
        return reply

    async def release(self, reply: PlaceReply, tenant: str) -> None:
        assert reply.allocation_id is not None
        released = await self.rpc.ask(
            Rpc.PLACEMENT_RELEASE, ReleaseRequest(allocation_id=reply.allocation_id, tenant=tenant), ReleaseReply
        )
        assert isinstance(released, ReleaseReply) and released.status == "released", released

    async def reserve(self, tenant: str, policy: str, **fields: Any) -> ReservationCreateReply:
        reply = await self.rpc.ask(
            Rpc.RESERVATION_CREATE,
            ReservationCreateRequest(tenant=tenant, policy=policy, **fields),  # type: ignore[arg-type]
            ReservationCreateReply,
        )
        assert isinstance(reply, ReservationCreateReply) and reply.status == "created", reply
        assert reply.reservation_id is not None
        return reply

    async def cancel(self, reservation_id: str, tenant: str) -> None:
        reply = await self.rpc.ask(
            Rpc.RESERVATION_CANCEL,
            ReservationCancelRequest(reservation_id=reservation_id, tenant=tenant),
            ReservationCancelReply,
        )
        assert isinstance(reply, ReservationCancelReply) and reply.status == "cancelled", reply

    async def lent(self, tenant: str, reservation_id: str) -> int:
        reply = await self.rpc.ask(
            Rpc.RESERVATION_STATUS,
            ReservationStatusRequest(tenant=tenant, reservation_id=reservation_id),
            ReservationStatusReply,
        )
        assert isinstance(reply, ReservationStatusReply), reply
        return reply.reservations[0].lent

    async def announced_borrowers(self, reservation_id: str) -> int:
        """Borrowers of the reservation as its latest event in the RESERVATION stream says."""
        operator = await self.bus.connect("operator")
        events = await read_all(
            operator.nc.jetstream(),
            stream=self.bus.stream(Context.RESERVATION),
            subject=self.bus.subjects.events_of(Context.RESERVATION),
        )
        states = [ReservationEvent.model_validate(e["payload"]).reservation for e in events]
        mine = [s for s in states if s.reservation_id == reservation_id]
        return len(mine[-1].borrowers) if mine else 0

    async def live(self) -> set[str]:
        reply = await self.rpc.ask(Rpc.LEDGER_SNAPSHOT, SnapshotRequest(limit=10_000), SnapshotReply)
        assert isinstance(reply, SnapshotReply), reply
        for acc in reply.accelerators:
            assert acc.hbm_reserved_bytes <= acc.hbm_usable_bytes, acc
        return {a for acc in reply.accelerators for a in acc.allocations}

    async def placement_health(self) -> HealthReply:
        reply = await self.rpc.ask(Rpc.PLACEMENT_HEALTH, HealthRequest(), HealthReply)
        assert isinstance(reply, HealthReply), reply
        return reply


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(bus: SecureBus) -> AsyncIterator[Stack]:
    rpc = await RpcClient.connect(
        bus.url, bus.subjects, timeout_s=bus.settings.kit.rpc_timeout_ms / 1000, nkeys_seed=str(bus.seeds["operator"])
    )
    s = Stack(bus, rpc)
    s.start_filler()
    await s.filler_up()

    async def knows_the_fleet() -> bool:
        reply = await rpc.ask(
            Rpc.RESERVATION_CREATE,
            ReservationCreateRequest(tenant="probe", policy="hard", count=1000, sku=H200, region=EAST),
            ReservationCreateReply,
        )
        return isinstance(reply, Rejected) and "16 H200" in reply.error.message

    await wait_for(knows_the_fleet, 30, what="the filler learns the demo fleet")
    try:
        yield s
    finally:
        await rpc.close()


def _rejected_retryable(reply: PlaceReply | Rejected) -> dict[str, Any]:
    assert isinstance(reply, Rejected) and reply.error.code == "no_capacity", reply
    details = reply.error.details or {}
    assert details.get("retry_after_s", 0) > 0, reply
    return details


async def test_row_10_a_filler_killed_mid_reclaim_holds_no_answer_and_health_recovers(stack: Stack) -> None:
    # acme reserves the A100 node (soft); globex's preemptible replicas borrow all eight.
    created = await stack.reserve("acme", "soft", count=8, sku=A100, region=WEST)
    assert created.reservation_id is not None
    borrowers: list[str] = []
    for i in range(8):
        reply = await stack.placed(f"globex-a100-{i}", "globex", preemptible=True)
        assert set(reply.placements[0].accelerators) <= set(created.accelerators), reply
        assert reply.allocation_id is not None
        borrowers.append(reply.allocation_id)
    await wait_for(lambda: _equals(stack.lent("acme", created.reservation_id or ""), 8), 30, what="8 lent")
    await wait_for(
        lambda: _equals(stack.announced_borrowers(created.reservation_id or ""), 8), 30, what="8 borrowers announced"
    )

    # The filler dies in the owner's reclaim, after writing the preemption, without answering.
    stack.stop_filler()
    stack.start_filler(HETSCHED_RESERVATION_FAULT_AFTER_RECORD="exit")
    await stack.filler_up()
    # A caller that would wait three RPC timeouts still has its answer within one: queued (it may queue).
    queued = await asyncio.wait_for(
        stack.place("acme-queue", "acme", fallbacks=["queue"], timeout_s=3 * stack.rpc_timeout_s),
        timeout=stack.rpc_timeout_s,
    )
    assert isinstance(queued, PlaceReply) and queued.status == "queued", queued
    assert borrowers[-1] in await stack.live()  # written, not yet asked of the ledger
    # One that may not queue, with the filler down: refused now, retryable, nothing recorded.
    refused = await asyncio.wait_for(
        stack.place("acme-now", "acme", timeout_s=3 * stack.rpc_timeout_s), timeout=stack.rpc_timeout_s
    )
    _rejected_retryable(refused)
    health = await stack.placement_health()
    assert health.status == "degraded" and "reservation" in health.checks["dependencies"], health

    # The filler comes back: it re-issues the preemption it wrote, and the queue places the owner.
    stack.stop_filler()
    stack.start_filler()
    await stack.filler_up()

    async def gone() -> bool:
        return borrowers[-1] not in await stack.live()

    await wait_for(gone, 30, what="the restarted filler finishes the preemption")

    async def queue_placed() -> PlaceReply | None:
        reply = await stack.place("acme-queue", "acme", fallbacks=["queue"])
        return reply if isinstance(reply, PlaceReply) and reply.status == "placed" else None

    owner = await wait_for(queue_placed, 30, what="the queued owner is placed")
    assert set(owner.placements[0].accelerators) <= set(created.accelerators)

    # Placement has not called the filler since it failed; its health says ok once the filler answers.
    async def healthy() -> HealthReply | None:
        reply = await stack.placement_health()
        return reply if reply.status == "ok" else None

    await wait_for(healthy, 20, what="placement's health back to ok")

    # The refused request id may come back: the filler answers now, the next borrower (LIFO) leaves.
    again = await stack.placed("acme-now", "acme")
    assert set(again.placements[0].accelerators) <= set(created.accelerators)
    live = await stack.live()
    assert borrowers[-1] not in live and borrowers[-2] not in live
    assert all(b in live for b in borrowers[:-2])


async def _equals(value: Any, expected: Any) -> bool:
    return bool(await value == expected)


async def test_row_11_a_reservation_answered_created_is_in_force_for_the_next_placement(stack: Stack) -> None:
    runs = 10
    for run in range(runs):
        # Hard: another tenant's preemptible replica asked at once never lands on the reservation.
        owner = f"initech-{run}"
        hard = await stack.reserve(owner, "hard", count=8, sku=L40S, region=WEST)
        intruder = await stack.placed(f"intruder-l40s-{run}", "globex", preemptible=True, sku=L40S)
        assert not set(intruder.placements[0].accelerators) & set(hard.accelerators), (run, intruder, hard)
        await stack.release(intruder, "globex")
        assert hard.reservation_id is not None
        await stack.cancel(hard.reservation_id, owner)

        # Soft: a non-preemptible replica of another tenant never lands on it either; the owner's own
        # replica that follows is placed (it does not queue behind an intruder).
        owner = f"hooli-{run}"
        soft = await stack.reserve(owner, "soft", count=8, sku=H200, region=EAST)
        intruder = await stack.placed(f"intruder-h200-{run}", "globex", sku=H200, region=EAST)
        assert not set(intruder.placements[0].accelerators) & set(soft.accelerators), (run, intruder, soft)
        own = await stack.placed(f"hooli-own-{run}", owner, sku=H200, region=EAST)
        await stack.release(own, owner)
        await stack.release(intruder, "globex")
        assert soft.reservation_id is not None
        await stack.cancel(soft.reservation_id, owner)
