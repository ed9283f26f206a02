"""Reservations on real NATS and Postgres: topology, the ledger, placement and the reservation filler as
processes. An owner reserves the only A100-SXM node of us-west-1 (soft); a borrower's preemptible replicas
fill what the owner leaves idle, non-preemptible ones are refused; the owner's demand takes the capacity
back most-recently-lent first; tenants see only their own reservations; a hard reservation is never lent;
replaying the RESERVATION stream rebuilds what the filler holds; a filler killed between writing a
reclaim and asking the ledger re-issues it when it starts; bad input changes nothing."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from sqlalchemy import text

from hetsched.stack import wait_healthy
from shared.contracts.base import Rejected
from shared.contracts.ledger import SnapshotReply, SnapshotRequest
from shared.contracts.placement import PlaceReply, PlaceRequest, ReleaseReply, ReleaseRequest
from shared.contracts.reservation import (
    ReservationCancelReply,
    ReservationCancelRequest,
    ReservationCreateReply,
    ReservationCreateRequest,
    ReservationEvent,
    ReservationReportReply,
    ReservationReportRequest,
    ReservationState,
    ReservationStatusReply,
    ReservationStatusRequest,
)
from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context, Rpc, Subjects
from shared.domain.reservations import ReservationBook
from shared.infra.catalog import demo_fleet_path
from shared.infra.db import make_engine
from shared.infra.reservations import reservation_of, state_of
from shared.infra.rpc import RpcClient
from shared.infra.settings import Settings
from tests.conftest import ServiceProcesses
from tests.jetstream import read_all
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

SKU = "A100-SXM-80GB"  # us-west-1 has one node of them: dgx-a100-01
L40S = "L40S-48GB"  # us-west-1 has two nodes of them
REGION = "us-west-1"
SERVICES = ("topology_discovery", "capacity_ledger", "placement", "reservation_filler")
NAMES = {s: f"rs_{s}" for s in SERVICES}


def one_gpu_request(
    rid: str, tenant: str, *, sku: str = SKU, region: str = REGION, preemptible: bool = False, **extra: Any
) -> PlaceRequest:
    """A TP=1 llama3.1-8b replica on one GPU of ``sku`` in ``region``: the unit these tests reserve and lend."""
    return PlaceRequest(
        request_id=rid,
        tenant=tenant,
        model="llama3.1-8b",
        context_tokens=8192,
        tp=1,
        region=region,
        skus=[sku],
        backend="gpu",
        preemptible=preemptible,
        fallbacks=extra.pop("fallbacks", []),
        **extra,
    )


class Stack:
    def __init__(self, rpc: RpcClient, nc: Client, settings: Settings, processes: ServiceProcesses) -> None:
        self.rpc = rpc
        self.nc = nc
        self.settings = settings
        self.processes = processes
        self.placed: dict[str, tuple[str, str]] = {}  # allocation id -> (tenant, request id)
        self.reservations: dict[str, str] = {}  # reservation id -> tenant

    async def place(
        self, rid: str, tenant: str, *, preemptible: bool = False, sku: str = SKU, region: str = REGION, **extra: Any
    ) -> PlaceReply | Rejected:
        request = one_gpu_request(rid, tenant, sku=sku, region=region, preemptible=preemptible, **extra)
        reply = await self.rpc.ask(Rpc.PLACEMENT_PLACE, request, PlaceReply)
        if isinstance(reply, PlaceReply) and reply.allocation_id:
            self.placed[reply.allocation_id] = (tenant, rid)
        return reply

    async def reserve(self, tenant: str, policy: str, **fields: Any) -> ReservationCreateReply:
        reply = await self.rpc.ask(
            Rpc.RESERVATION_CREATE,
            ReservationCreateRequest(tenant=tenant, policy=policy, **fields),  # type: ignore[arg-type]
            ReservationCreateReply,
        )
        assert isinstance(reply, ReservationCreateReply) and reply.status == "created", reply
        assert reply.reservation_id is not None
        self.reservations[reply.reservation_id] = tenant
        return reply

    async def status(self, tenant: str, **fields: Any) -> ReservationStatusReply | Rejected:
        return await self.rpc.ask(
            Rpc.RESERVATION_STATUS, ReservationStatusRequest(tenant=tenant, **fields), ReservationStatusReply
        )

    async def report(self) -> ReservationReportReply:
        reply = await self.rpc.ask(Rpc.RESERVATION_REPORT, ReservationReportRequest(), ReservationReportReply)
        assert isinstance(reply, ReservationReportReply), reply
        return reply

    async def events(self) -> list[dict[str, Any]]:
        return await read_all(
            self.nc.jetstream(),
            stream=stream_name(Context.RESERVATION, stream_prefix=self.settings.kit.stream_prefix),
            subject=Subjects(self.settings.kit.subject_prefix).events_of(Context.RESERVATION),
        )

    async def ledger(self) -> SnapshotReply:
        reply = await self.rpc.ask(Rpc.LEDGER_SNAPSHOT, SnapshotRequest(), SnapshotReply)
        assert isinstance(reply, SnapshotReply), reply
        return reply

    async def live(self) -> set[str]:
        return {a for acc in (await self.ledger()).accelerators for a in acc.allocations}

    async def release(self, allocation_id: str) -> None:
        tenant, _rid = self.placed.pop(allocation_id)
        reply = await self.rpc.ask(
            Rpc.PLACEMENT_RELEASE, ReleaseRequest(allocation_id=allocation_id, tenant=tenant), ReleaseReply
        )
        assert isinstance(reply, ReleaseReply) and reply.status == "released", reply

    def start_filler(self, **env: str) -> None:
        self.processes.start(
            "reservation_filler", name=NAMES["reservation_filler"], HETSCHED_RESERVATION_TICK_S="0.2", **env
        )


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(service_processes: ServiceProcesses, settings: Settings) -> AsyncIterator[Stack]:
    service_processes.start(
        "topology_discovery", name=NAMES["topology_discovery"], HETSCHED_TOPOLOGY_INVENTORY=str(demo_fleet_path())
    )
    service_processes.start("capacity_ledger", name=NAMES["capacity_ledger"], HETSCHED_LEDGER_SWEEP_MS="200")
    service_processes.start("placement", name=NAMES["placement"])
    rpc = await RpcClient.connect(settings.kit.nats_url or "", Subjects(settings.kit.subject_prefix), timeout_s=10)
    nc = await nats.connect(settings.kit.nats_url or "")
    s = Stack(rpc, nc, settings, service_processes)
    s.start_filler()
    health = await wait_healthy(
        nats_url=settings.kit.nats_url or "",
        subjects=Subjects(settings.kit.subject_prefix),
        deadline_s=60,
        only=set(SERVICES),
    )
    assert all(h["status"] == "ok" for h in health.values()), health

    async def knows_the_fleet() -> bool:
        reply = await s.rpc.ask(
            Rpc.RESERVATION_CREATE,
            ReservationCreateRequest(tenant="probe", policy="hard", count=100_000, sku=SKU, region=REGION),
            ReservationCreateReply,
        )
        # Refused for want of GPUs, naming how many it knows of: the inventory is in.
        return isinstance(reply, Rejected) and "8 A100-SXM-80GB" in reply.error.message

    await wait_for(knows_the_fleet, 30, what="the filler learns the demo fleet")
    yield s
    # The session's database and streams are shared with later modules: give back what this one took.
    for allocation_id in list(s.placed):
        if allocation_id in await s.live():
            await s.release(allocation_id)
    for reservation_id, tenant in s.reservations.items():
        reply = await rpc.ask(
            Rpc.RESERVATION_CANCEL,
            ReservationCancelRequest(reservation_id=reservation_id, tenant=tenant),
            ReservationCancelReply,
        )
        assert isinstance(reply, ReservationCancelReply) and reply.status == "cancelled", reply
    await rpc.close()
    await nc.close()
    for name in reversed(NAMES.values()):
        service_processes.stop(name)


async def _stored(stack: Stack, reservation_id: str) -> ReservationState:
    engine = make_engine(stack.settings.kit.database_url or "")
    try:
        async with engine.connect() as conn:
            body = (
                await conn.execute(
                    text("SELECT body FROM reservation.reservations WHERE reservation_id = :id"), {"id": reservation_id}
                )
            ).scalar_one()
    finally:
        await engine.dispose()
    return ReservationState.model_validate(body)


def _no_double_booking(ledger: SnapshotReply, stack: Stack, reserved: list[str]) -> None:
    """No accelerator is over-committed, and no reserved one holds both the owner's and a borrower's replica."""
    tenants = {a: t for a, (t, _r) in stack.placed.items()}
    for acc in ledger.accelerators:
        assert acc.hbm_reserved_bytes <= acc.hbm_usable_bytes, acc
        if acc.id in reserved:
            assert len({tenants.get(a) for a in acc.allocations}) <= 1, acc


def _preempted(event: dict[str, Any]) -> bool:
    return str(event["type"]).endswith(".preempted")


def _placed(reply: PlaceReply | Rejected) -> PlaceReply:
    assert isinstance(reply, PlaceReply) and reply.status == "placed", reply
    return reply


async def _until_lent(stack: Stack, tenant: str, reservation_id: str, *, lent: int, owner: int) -> None:
    async def there() -> bool:
        reply = await stack.status(tenant, reservation_id=reservation_id)
        return isinstance(reply, ReservationStatusReply) and (
            reply.reservations[0].lent,
            reply.reservations[0].owner_used,
        ) == (lent, owner)

    await wait_for(there, 15, what=f"the filler sees {owner} owner and {lent} lent")


async def test_idle_reserved_gpus_are_lent_and_the_owner_takes_them_back_lifo(stack: Stack) -> None:
    created = await stack.reserve("acme", "soft", count=8, sku=SKU, region=REGION, request_id="acme-a100")
    reservation_id = created.reservation_id
    assert reservation_id is not None
    assert sorted(created.accelerators) == [f"dgx-a100-01/gpu{i}" for i in range(8)]
    again = await stack.reserve("acme", "soft", count=8, sku=SKU, region=REGION, request_id="acme-a100")
    assert again.duplicate and again.reservation_id == reservation_id

    # The owner uses 4 of its 8.
    for i in range(4):
        reply = _placed(await stack.place(f"acme-{i}", "acme"))
        assert set(reply.placements[0].accelerators) <= set(created.accelerators)
    await _until_lent(stack, "acme", reservation_id, lent=0, owner=4)
    status = await stack.status("acme")
    assert isinstance(status, ReservationStatusReply)
    view = status.reservations[0]
    assert (view.owner_used, view.idle, view.offered, view.fill_rate) == (4, 4, 4, 0.5)
    assert view.idle_cost_usd_per_hour > 0

    # Another tenant's non-preemptible replica may not use them; its preemptible ones borrow the idle four.
    refused = await stack.place("globex-firm", "globex")
    assert isinstance(refused, Rejected) or refused.status == "rejected", refused
    borrowers: list[str] = []
    for i in range(4):

        async def borrowed(i: int = i) -> PlaceReply | None:
            reply = await stack.place(f"globex-{i}", "globex", preemptible=True)
            return reply if isinstance(reply, PlaceReply) and reply.status == "placed" else None

        reply = await wait_for(borrowed, 15, what="placement learns the offer")
        assert set(reply.placements[0].accelerators) <= set(created.accelerators)
        assert reply.allocation_id is not None
        borrowers.append(reply.allocation_id)
    await _until_lent(stack, "acme", reservation_id, lent=4, owner=4)
    status = await stack.status("acme")
    assert isinstance(status, ReservationStatusReply) and status.fill_rate == 1.0

    # The owner comes back for two more: the two most recently lent are preempted (soft: at once).
    took_ms: list[float] = []
    for i in range(4, 6):
        started = time.perf_counter()
        _placed(await stack.place(f"acme-{i}", "acme"))
        took_ms.append((time.perf_counter() - started) * 1000)
    print(f"owner placements that reclaimed a soft borrower took {[round(t, 1) for t in took_ms]} ms")
    live = await stack.live()
    assert borrowers[3] not in live and borrowers[2] not in live  # LIFO: the newest went
    assert borrowers[0] in live and borrowers[1] in live
    preempted = [
        e for e in await stack.events() if e["type"].endswith(".preempted") and e["payload"]["reason"] == "owner_demand"
    ]
    assert [e["payload"]["allocation_id"] for e in preempted][-2:] == [borrowers[3], borrowers[2]]
    for e in preempted[-2:]:
        assert e["payload"]["tenant"] == "globex" and e["payload"]["reservation_id"] == reservation_id
        assert e["payload"]["deadline_at"] is not None
    for allocation_id in (borrowers[3], borrowers[2]):
        stack.placed.pop(allocation_id, None)
    await _until_lent(stack, "acme", reservation_id, lent=2, owner=6)

    _no_double_booking(await stack.ledger(), stack, created.accelerators)


async def test_tenants_see_and_touch_only_their_own_reservations(stack: Stack) -> None:
    mine = await stack.status("acme")
    assert isinstance(mine, ReservationStatusReply) and mine.reservations
    theirs = await stack.status("globex")
    assert isinstance(theirs, ReservationStatusReply) and theirs.reservations == []
    reservation_id = mine.reservations[0].reservation_id
    # Another tenant's reservation id is answered as one that does not exist (issue 23): the same code and
    # message, so an id tells globex nothing.
    for rid in (reservation_id, "res-does-not-exist"):
        read = await stack.status("globex", reservation_id=rid)
        assert isinstance(read, Rejected) and read.error.code == "not_found", read
        assert read.error.message == f"no reservation {rid!r} for this tenant"
        cancel = await stack.rpc.ask(
            Rpc.RESERVATION_CANCEL,
            ReservationCancelRequest(reservation_id=rid, tenant="globex"),
            ReservationCancelReply,
        )
        assert isinstance(cancel, Rejected) and cancel.error.code == "not_found", cancel
        assert cancel.error.message == f"no reservation {rid!r} for this tenant"
    # Asking for GPUs acme holds says how many are taken, never which.
    theirs = list(mine.reservations[0].accelerators[:3])
    clash = await stack.rpc.ask(
        Rpc.RESERVATION_CREATE,
        ReservationCreateRequest(tenant="globex", policy="soft", accelerators=theirs),
        ReservationCreateReply,
    )
    assert isinstance(clash, Rejected) and clash.error.code == "conflict", clash
    assert clash.error.details == {"in_use": 3}  # was the list of acme's GPUs
    assert not any(acc in clash.error.message for acc in theirs), clash.error.message
    assert clash.error.message.startswith("3 of the 3 GPU(s) asked for")
    after = await stack.status("acme")
    assert isinstance(after, ReservationStatusReply)
    assert [r.reservation_id for r in after.reservations] == [r.reservation_id for r in mine.reservations]


async def test_a_hard_reservation_is_never_lent(stack: Stack) -> None:
    created = await stack.reserve("initech", "hard", count=16, sku=L40S, region=REGION)
    assert created.reservation_id is not None
    status = await stack.status("initech")
    assert isinstance(status, ReservationStatusReply)
    view = next(r for r in status.reservations if r.reservation_id == created.reservation_id)
    assert (view.offered, view.idle, view.fill_rate) == (0, 16, 0.0)
    for preemptible in (True, False):
        reply = await stack.place(f"globex-l40s-{preemptible}", "globex", preemptible=preemptible, sku=L40S)
        assert isinstance(reply, Rejected) or reply.status == "rejected", reply
    _placed(await stack.place("initech-1", "initech", sku=L40S))  # the owner's own


async def test_replaying_the_reservation_stream_rebuilds_what_the_filler_holds(stack: Stack) -> None:
    book = ReservationBook()
    for event in await stack.events():
        if event.get("source") != "reservation-filler":
            continue
        book.apply(reservation_of(ReservationEvent.model_validate(event["payload"]).reservation))
    engine = make_engine(stack.settings.kit.database_url or "")
    try:
        async with engine.connect() as conn:
            rows = (await conn.execute(text("SELECT reservation_id, body FROM reservation.reservations"))).all()
    finally:
        await engine.dispose()
    assert rows
    for reservation_id, body in rows:
        folded = book.get(reservation_id)
        assert folded is not None, reservation_id
        assert state_of(folded) == ReservationState.model_validate(body)


async def test_bad_input_gets_typed_errors_and_changes_nothing(stack: Stack) -> None:
    before = await stack.report()
    events = len(await stack.events())
    a100 = {"sku": SKU, "region": REGION}
    cases: list[tuple[Rpc, dict[str, Any], str]] = [
        (Rpc.RESERVATION_CREATE, {"tenant": "acme", "policy": "soft", "count": 2}, "invalid_request"),
        (
            Rpc.RESERVATION_CREATE,
            {"tenant": "acme", "policy": "lend", "count": 2, **a100},
            "invalid_request",
        ),
        (
            Rpc.RESERVATION_CREATE,
            {"tenant": "acme", "policy": "spot", "count": 1, "spot_eviction_s": 90, **a100},
            "invalid_request",
        ),
        (
            Rpc.RESERVATION_CREATE,
            {"tenant": "acme", "policy": "soft", "count": 1, "sku": "H900", "region": REGION},
            "unknown_sku",
        ),
        (Rpc.RESERVATION_CREATE, {"tenant": "acme", "policy": "soft", "accelerators": ["nope/gpu0"]}, "not_found"),
        (Rpc.RESERVATION_CREATE, {"tenant": "acme", "policy": "soft", "accelerators": ["pod/0.0"]}, "invalid_request"),
        (
            Rpc.RESERVATION_CREATE,
            {"tenant": "globex", "policy": "soft", "accelerators": ["dgx-a100-01/gpu0"]},
            "conflict",
        ),
        (
            Rpc.RESERVATION_CREATE,
            {"tenant": "acme", "policy": "soft", "count": 9, **a100},
            "no_capacity",
        ),
        (Rpc.RESERVATION_CANCEL, {"tenant": "acme", "reservation_id": "res-missing"}, "not_found"),
        (Rpc.RESERVATION_STATUS, {"tenant": ""}, "invalid_request"),
        (Rpc.RESERVATION_RECLAIM, {"request_id": "x", "tenant": "acme", "allocation_ids": ["al-nope"]}, "not_found"),
        (Rpc.RESERVATION_RECLAIM, {"request_id": "x", "tenant": "acme", "allocation_ids": []}, "invalid_request"),
    ]
    subjects = Subjects(stack.settings.kit.subject_prefix)
    raw_bodies = [json.dumps(body).encode() for _rpc, body, _code in cases]
    for (rpc, body, code), raw in zip(cases, raw_bodies, strict=True):
        msg = await stack.nc.request(subjects.rpc(rpc), raw, timeout=10)
        reply = json.loads(msg.data)
        assert reply["status"] == "rejected" and reply["error"]["code"] == code, (rpc, body, reply)
    for rpc in (Rpc.RESERVATION_CREATE, Rpc.RESERVATION_CANCEL, Rpc.RESERVATION_STATUS, Rpc.RESERVATION_RECLAIM):
        for garbage in (b"not json", b"[]", b"{}"):
            msg = await stack.nc.request(subjects.rpc(rpc), garbage, timeout=10)
            reply = json.loads(msg.data)
            assert reply["status"] == "rejected" and reply["error"]["code"] == "invalid_request", (rpc, reply)
    assert await stack.report() == before
    assert len(await stack.events()) == events


async def test_a_filler_killed_during_a_reclaim_reissues_it_when_it_starts(stack: Stack) -> None:
    # acme's A100 reservation: 6 owner, 2 lent. The filler dies right after writing the next reclaim.
    status = await stack.status("acme")
    assert isinstance(status, ReservationStatusReply)
    view = next(r for r in status.reservations if r.policy == "soft")
    assert (view.owner_used, view.lent) == (6, 2)
    newest = view.borrowers[-1].allocation_id
    stack.processes.stop(NAMES["reservation_filler"])
    stack.start_filler(HETSCHED_RESERVATION_FAULT_AFTER_RECORD="exit")
    await wait_healthy(
        nats_url=stack.settings.kit.nats_url or "",
        subjects=Subjects(stack.settings.kit.subject_prefix),
        deadline_s=60,
        only={"reservation_filler"},
    )
    reply = await stack.place("acme-6", "acme")  # the filler dies mid-reclaim: no capacity yet
    assert isinstance(reply, Rejected) or reply.status == "rejected", reply
    assert newest in await stack.live()  # written, not yet asked of the ledger
    stored = await _stored(stack, view.reservation_id)
    assert [(p.allocation_id, p.done) for p in stored.preemptions] == [(newest, False)]

    stack.processes.stop(NAMES["reservation_filler"])
    stack.start_filler()

    async def gone() -> bool:
        return newest not in await stack.live()

    await wait_for(gone, 30, what="the restarted filler re-issues the preemption")
    # Its `preempted` event, written with the preemption, was published by the restarted filler's relay.
    assert [e for e in await stack.events() if _preempted(e) and e["payload"]["allocation_id"] == newest]
    stack.placed.pop(newest, None)
    _placed(await stack.place("acme-7", "acme"))
    _no_double_booking(await stack.ledger(), stack, view.accelerators)
    await _until_lent(stack, "acme", view.reservation_id, lent=1, owner=7)
    final = await stack.status("acme", reservation_id=view.reservation_id)
    assert isinstance(final, ReservationStatusReply)
    assert all(p.done for p in final.reservations[0].preemptions)


async def test_a_spot_borrower_gets_its_notice_and_the_owner_is_placed_when_it_ends(stack: Stack) -> None:
    h200, east = "H200-SXM-141GB", "us-east-1"
    # Every H200 of us-east-1 that is free (earlier modules of the run may hold one): nothing else to go to.
    probe = await stack.rpc.ask(
        Rpc.RESERVATION_CREATE,
        ReservationCreateRequest(tenant="hooli", policy="spot", count=100_000, sku=h200, region=east),
        ReservationCreateReply,
    )
    assert isinstance(probe, Rejected) and probe.error.details is not None
    free = int(probe.error.details["free"])
    assert free >= 2, probe
    created = await stack.reserve("hooli", "spot", count=free, sku=h200, region=east, spot_eviction_s=5)
    assert created.reservation_id is not None and len(created.accelerators) == free
    borrowers: list[str] = []
    for i in range(free):

        async def borrowed(i: int = i) -> PlaceReply | None:
            reply = await stack.place(f"spot-b-{i}", "globex", preemptible=True, sku=h200, region=east)
            return reply if isinstance(reply, PlaceReply) and reply.status == "placed" else None

        reply = await wait_for(borrowed, 15, what="placement learns the spot offer")
        assert reply.allocation_id is not None
        borrowers.append(reply.allocation_id)
    await _until_lent(stack, "hooli", created.reservation_id, lent=free, owner=0)

    # The owner's replica that may not queue is refused, with the deadline, and nothing is recorded.
    asked = time.monotonic()
    first = await stack.place("hooli-1", "hooli", sku=h200, region=east)
    assert isinstance(first, Rejected) and first.error.code == "no_capacity", first
    assert first.error.details is not None and 4 <= first.error.details["retry_after_s"] <= 5
    events = [e for e in await stack.events() if _preempted(e) and e["payload"]["reason"] == "owner_demand"]
    assert events[-1]["payload"]["allocation_id"] == borrowers[-1]  # LIFO
    assert events[-1]["payload"]["deadline_at"] is not None
    assert borrowers[-1] in await stack.live()  # it has its notice: still running

    # One that may queue is queued; both are placed once the notice ends (the same request ids).
    queued = await stack.place("hooli-2", "hooli", sku=h200, region=east, fallbacks=["queue"])
    assert isinstance(queued, PlaceReply) and queued.status == "queued", queued

    async def placed_again() -> PlaceReply | None:
        reply = await stack.place("hooli-1", "hooli", sku=h200, region=east)
        return reply if isinstance(reply, PlaceReply) and reply.status == "placed" else None

    reply = await wait_for(placed_again, 20, what="the spot borrower's notice ends")
    waited_s = time.monotonic() - asked
    print(f"the spot owner was placed {waited_s:.2f} s after asking (notice 5 s)")
    assert waited_s >= 4.5  # never before the borrower's notice ended
    stack.placed.pop(borrowers[-1], None)

    async def queued_one_placed() -> PlaceReply | None:
        again = await stack.place("hooli-2", "hooli", sku=h200, region=east, fallbacks=["queue"])
        return again if isinstance(again, PlaceReply) and again.status == "placed" else None

    await wait_for(queued_one_placed, 30, what="the queued owner placement is served")
    live = await stack.live()
    assert borrowers[-1] not in live and borrowers[-2] not in live and borrowers[0] in live
