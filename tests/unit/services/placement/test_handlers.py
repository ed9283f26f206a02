"""Placement's use cases with fakes: the real pure view (``FleetView``), a ledger that answers as each test
scripts it and a unit of work that records its events (``tests.fakes``), an in-memory decision store. No
servers."""

from __future__ import annotations

import itertools
import logging
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import BaseModel

from hetsched.emit import node_lines
from services.placement.attempts import Ownership, Queueing
from services.placement.handlers import PlacementHandlers
from services.placement.records import PlacedAllocation, QueuedRequest, SeenAllocation, StoredIntent, Turn
from services.placement.store import DecisionStore
from shared.contracts.base import ErrorBody, ErrorCode, Rejected, rejected
from shared.contracts.envelope import EventEnvelope
from shared.contracts.ledger import (
    AcceleratorBalance,
    AllocationEvent,
    CommitReply,
    CommitRequest,
    LedgerReleaseReply,
    LedgerReleaseRequest,
    LedgerRenewReply,
    LedgerRenewRequest,
)
from shared.contracts.placement import PlacementEvent, PlaceReply, PlaceRequest, ReleaseRequest, RenewRequest
from shared.contracts.subjects import Rpc
from shared.domain.capacity import AcceleratorCapacity
from shared.domain.fleet import AcceleratorId, tpu_chip_ids
from shared.domain.memory import usable_hbm
from shared.domain.placement.ownership import Intent, IntentState
from shared.domain.placement.view import FleetView, LedgerMirror
from shared.domain.quotas import Quotas
from shared.infra import deadline
from shared.infra.rpc import RpcError
from shared.infra.uow import UnitOfWork
from tests.fakes import NOW, Answer, FakeRpc, FakeUnitOfWork
from tests.unit.placement.builders import models, node, skus, tpu_pod

pytestmark = pytest.mark.asyncio

USABLE = usable_hbm(skus()["H100-SXM-80GB"].hbm_bytes)
log = logging.getLogger("test.placement")


# -- fakes -------------------------------------------------------------------------------------


class FakeStore(DecisionStore):
    """The decision store in memory, with the SQL's compare-and-set semantics (attempt, status)."""

    def __init__(self) -> None:
        self.rows: dict[tuple[str, str], dict[str, Any]] = {}
        self.allocations: dict[str, dict[str, Any]] = {}
        self.released: list[str] = []
        self.queue: dict[tuple[str, str], QueuedRequest] = {}
        self.pages = 0  # pages of the queue read
        self._seq = itertools.count(1)

    @property
    def replies(self) -> dict[tuple[str, str], PlaceReply]:
        return {k: r["reply"] for k, r in self.rows.items() if r["status"] == "placed"}

    def _intent(self, row: dict[str, Any]) -> Intent:
        return Intent(
            tenant=row["tenant"],
            request_id=row["request_id"],
            body_hash=row["body_hash"],
            status=IntentState(row["status"]),
            attempt=row["attempt"],
            claimed_until=row["claimed_until"],
            updated_at=row["updated_at"],
            allocation_id=row["allocation_id"],
        )

    async def lock(self, *, session: Any, tenant: str, request_id: str) -> StoredIntent | None:
        row = self.rows.get((tenant, request_id))
        if row is None:
            return None
        return StoredIntent(intent=self._intent(row), commit=row["commit"], reply=row["reply"])

    async def insert(
        self, *, session: Any, tenant: str, request_id: str, body_hash: str, claimed_until: datetime, now: datetime
    ) -> bool:
        if (tenant, request_id) in self.rows:
            return False
        self.rows[(tenant, request_id)] = {
            "tenant": tenant,
            "request_id": request_id,
            "body_hash": body_hash,
            "status": "committing",
            "attempt": 1,
            "claimed_until": claimed_until,
            "updated_at": now,
            "allocation_id": None,
            "commit": None,
            "reply": None,
        }
        return True

    async def insert_decided(
        self,
        *,
        session: Any,
        tenant: str,
        request_id: str,
        body_hash: str,
        status: IntentState,
        claimed_until: datetime | None,
        commit: CommitRequest | None,
        pending: PlaceReply | None,
        now: datetime,
    ) -> bool:
        if not await self.insert(
            session=session,
            tenant=tenant,
            request_id=request_id,
            body_hash=body_hash,
            claimed_until=claimed_until,  # type: ignore[arg-type]  # None for a rejected intent
            now=now,
        ):
            return False
        self.rows[(tenant, request_id)].update(status=status.value, commit=commit, reply=pending)
        return True

    async def take(
        self, *, session: Any, tenant: str, request_id: str, claimed_until: datetime, now: datetime, keep_commit: bool
    ) -> int:
        row = self.rows[(tenant, request_id)]
        row.update(status="committing", attempt=row["attempt"] + 1, claimed_until=claimed_until, updated_at=now)
        if not keep_commit:
            row.update(commit=None, reply=None, allocation_id=None)
        return int(row["attempt"])

    def _mine(self, turn: Turn) -> dict[str, Any] | None:
        row = self.rows.get((turn.tenant, turn.request_id))
        return row if row is not None and row["attempt"] == turn.attempt and row["status"] == "committing" else None

    async def save_commit(
        self,
        *,
        session: Any,
        turn: Turn,
        commit: CommitRequest,
        pending: PlaceReply,
        claimed_until: datetime,
        now: datetime,
    ) -> bool:
        row = self._mine(turn)
        if row is None:
            return False
        row.update(commit=commit, reply=pending, claimed_until=claimed_until, updated_at=now)
        return True

    async def finish(
        self,
        *,
        session: Any,
        turn: Turn,
        status: IntentState,
        reply: PlaceReply | None,
        allocation_id: str | None,
        now: datetime,
        lease_expires_at: datetime | None = None,
    ) -> bool:
        row = self._mine(turn)
        if row is None:
            return False
        row.update(
            status=status.value,
            reply=reply,
            allocation_id=allocation_id,
            lease_expires_at=lease_expires_at,
            claimed_until=None,
            updated_at=now,
        )
        return True

    async def lease_renewed(self, *, session: Any, allocation_id: str, lease_expires_at: datetime) -> bool:
        found = False
        for row in self.rows.values():
            if row["allocation_id"] == allocation_id and row["status"] == "placed":
                row["lease_expires_at"] = lease_expires_at
                row["lease_s"] = None
                found = True
        return found

    async def record_placed(
        self,
        *,
        session: Any,
        tenant: str,
        request_id: str,
        body_hash: str | None,
        reply: PlaceReply,
        lease_expires_at: datetime | None,
        lease_s: int | None,
        now: datetime,
    ) -> bool:
        row = self.rows.get((tenant, request_id))
        if row is not None and row["status"] not in ("committing", "queued", "rejected", "abandoned"):
            return False
        if row is None:
            await self.insert(
                session=session,
                tenant=tenant,
                request_id=request_id,
                body_hash=body_hash or "",
                claimed_until=now,
                now=now,
            )
            row = self.rows[(tenant, request_id)]
        row.update(
            status="placed",
            reply=reply,
            allocation_id=reply.allocation_id,
            lease_expires_at=lease_expires_at,
            lease_s=lease_s,
            claimed_until=None,
            updated_at=now,
        )
        self.queue.pop((tenant, request_id), None)
        return True

    async def first_leases(self, *, session: Any) -> list[tuple[str, str, int, list[str]]]:
        return [
            (r["allocation_id"], r["tenant"], r["lease_s"], [p.node for p in r["reply"].placements])
            for r in self.rows.values()
            if r["status"] == "placed" and r.get("lease_s") is not None
        ]

    async def settle(
        self,
        *,
        session: Any,
        turn: Turn,
        was: IntentState,
        status: IntentState,
        reply: PlaceReply | None,
        now: datetime,
    ) -> bool:
        row = self.rows.get((turn.tenant, turn.request_id))
        if row is None or row["attempt"] != turn.attempt or row["status"] != was.value:
            return False
        row.update(status=status.value, reply=reply, claimed_until=None, updated_at=now)
        return True

    async def enqueue(
        self, *, session: Any, request: PlaceRequest, enqueued_at: datetime, deadline_at: datetime
    ) -> None:
        key = (request.tenant, request.request_id)
        if key not in self.queue:
            self.queue[key] = QueuedRequest(
                seq=next(self._seq),
                tenant=request.tenant,
                request_id=request.request_id,
                body=request.model_dump(mode="json"),
                enqueued_at=enqueued_at,
                deadline_at=deadline_at,
            )

    async def queue_position(self, *, session: Any, tenant: str, request_id: str) -> int | None:
        mine = self.queue.get((tenant, request_id))
        if mine is None:
            return None
        return sum(1 for q in self.queue.values() if q.seq <= mine.seq)

    async def dequeue(self, *, session: Any, tenant: str, request_id: str) -> None:
        self.queue.pop((tenant, request_id), None)

    async def queued(self, *, session: Any, limit: int, after: int | None = None) -> list[QueuedRequest]:
        self.pages += 1
        return sorted((q for q in self.queue.values() if after is None or q.seq > after), key=lambda q: q.seq)[:limit]

    async def queued_of(self, *, session: Any, tenant: str, request_id: str) -> int:
        return sum(1 for q in self.queue.values() if q.tenant == tenant and q.request_id != request_id)

    async def placed_allocations(self, *, session: Any) -> list[PlacedAllocation]:
        return [
            PlacedAllocation(
                allocation_id=r["allocation_id"],
                tenant=r["tenant"],
                accelerators=tuple(s.accelerator_id for s in r["commit"].shares),
            )
            for r in self.rows.values()
            if r["status"] == "placed" and r["allocation_id"] and r["commit"] is not None
        ]

    async def unclaim(self, *, session: Any, turn: Turn, now: datetime) -> None:
        row = self.rows.get((turn.tenant, turn.request_id))
        if row is not None and row["attempt"] == turn.attempt:
            row.update(claimed_until=now, updated_at=now)

    async def mark_released(self, *, session: Any, allocation_id: str) -> None:
        self.released.append(allocation_id)
        for row in self.rows.values():
            if row["allocation_id"] == allocation_id:
                row["status"] = "released"

    async def mark_ended(self, *, session: Any, allocation_id: str, status: IntentState, now: datetime) -> str | None:
        tenant = None
        for (row_tenant, _rid), row in self.rows.items():
            if row["allocation_id"] == allocation_id and row["status"] == "placed":
                row.update(status=status.value, updated_at=now)
                tenant = row_tenant
        seen = self.allocations.get(allocation_id)
        if seen is not None and seen["state"] == "active":
            seen.update(state=status.value)
        return tenant

    async def allocation_seen(
        self, *, session: Any, allocation_id: str, tenant: str, request_id: str, now: datetime
    ) -> None:
        self.allocations.setdefault(
            allocation_id, {"tenant": tenant, "request_id": request_id, "state": "active", "seen_at": now}
        )

    async def committing(self, *, session: Any, touched_before: datetime, limit: int) -> list[Intent]:
        return [
            self._intent(r)
            for r in self.rows.values()
            if r["status"] == "committing" and r["updated_at"] < touched_before
        ][:limit]

    async def abandon(self, *, session: Any, turn: Turn, now: datetime) -> bool:
        row = self._mine(turn)
        if row is None:
            return False
        row.update(status="abandoned", claimed_until=None, updated_at=now)
        return True

    async def active_allocations(self, *, session: Any, seen_before: datetime, limit: int) -> list[SeenAllocation]:
        out = []
        for allocation_id, a in self.allocations.items():
            if a["state"] != "active" or a["seen_at"] >= seen_before:
                continue
            row = self.rows.get((a["tenant"], a["request_id"]))
            out.append(
                SeenAllocation(
                    allocation_id=allocation_id,
                    tenant=a["tenant"],
                    request_id=a["request_id"],
                    seen_at=a["seen_at"],
                    intent=self._intent(row) if row is not None else None,
                )
            )
        return out[:limit]


class Interrupted(BaseException):
    """Stands for placement killed mid-request (not an Exception: nothing catches it)."""


class FakeTimer:
    def __init__(self, step_ms: float = 0.25) -> None:
        self.ms = itertools.count(0.0, step_ms)

    def __call__(self) -> float:
        return next(self.ms)


# -- builders ------------------------------------------------------------------------------------


def fleet_view(*, nodes: tuple[str, ...] = ("n1",), pods: tuple[str, ...] = ()) -> FleetView:
    rows = [
        AcceleratorCapacity.of_ledger(id=AcceleratorId.gpu(n, i), node=n, usable=USABLE, reserved=0)
        for n in nodes
        for i in range(8)
    ]
    tpu_hbm = usable_hbm(skus()["TPU-V5E"].hbm_bytes)
    pod_list = [tpu_pod(p, shape=(4, 4)) for p in pods]
    rows += [
        AcceleratorCapacity.of_ledger(id=c, node=p.name, usable=tpu_hbm, reserved=0)
        for p in pod_list
        for c in tpu_chip_ids(p)
    ]
    return FleetView(
        skus=skus(),
        models=models(),
        nodes=[(node(n).nvswitch(8).profile(), True) for n in nodes],
        pods=[(p, None) for p in pod_list],
        ledger=LedgerMirror(rows),
    )


class Rig:
    def __init__(
        self,
        rpc: FakeRpc,
        view: FleetView | None = None,
        queueing: Queueing | None = None,
        timer: FakeTimer | None = None,
        quotas: Quotas | None = None,
        reservations_current: Callable[[float], Awaitable[str | None]] | None = None,
        direct: bool = False,
        first_lease_s: int | None = None,
    ) -> None:
        self.rpc = rpc
        self.view = view or fleet_view()
        self.now = NOW
        self.uow = FakeUnitOfWork(lambda: self.now, source="placement")
        self.store = FakeStore()
        self.interrupt = False
        self.handlers = PlacementHandlers.build(
            view=self.view,
            store=self.store,
            uow=self.uow,  # type: ignore[arg-type]
            rpc=rpc,
            timer=timer or FakeTimer(),
            default_lease_s=3600,
            ownership=Ownership(claim_s=5, grace_s=60),
            clock=lambda: self.now,
            after_commit=self.after_commit,
            queueing=queueing,
            quotas=quotas,
            reservations_current=reservations_current,
            # By default the intent path (its intent written before the commit, its outcome after): what
            # queued requests take, and what these tests pin down. test_direct.py covers the direct path.
            direct=direct,
            first_lease_s=first_lease_s,
        )

    def reserved(self) -> dict[str, int]:
        return {a: c.reserved for a, c in self.view.snapshot.capacity.items() if c.reserved}

    def after_commit(self) -> None:
        if self.interrupt:  # the process dies between the ledger's commit and the decision row
            self.interrupt = False
            raise Interrupted


def place(rid: str = "r-1", **extra: Any) -> PlaceRequest:
    body: dict[str, Any] = {
        "request_id": rid,
        "tenant": "acme",
        "model": "llama3-8b",
        "dtype": "bf16",
        "context_tokens": 4096,
        "concurrency": 4,
        "backend": "gpu",
        **extra,
    }
    return PlaceRequest.model_validate(body)


def committed(allocation_id: str = "al-1", lease: datetime | None = None) -> Callable[[BaseModel], BaseModel]:
    def answer(request: BaseModel) -> CommitReply:
        assert isinstance(request, CommitRequest)
        return CommitReply(
            status="committed", request_id=request.request_id, allocation_id=allocation_id, lease_expires_at=lease
        )

    return answer


def refused(code: ErrorCode, *, full: bool = True, legacy: bool = False) -> Callable[[BaseModel], BaseModel]:
    """The ledger refuses the commit (``Rejected``, as it answers on the wire); its view, in the error's
    details, shows the asked GPUs full (a fresher view than ours). ``legacy``: in the deprecated
    ``CommitReply(status="rejected", view=...)`` shape instead."""

    def answer(request: BaseModel) -> BaseModel:
        assert isinstance(request, CommitRequest)
        view = [
            AcceleratorBalance(
                id=s.accelerator_id, usable_bytes=USABLE, reserved_bytes=USABLE if full else 0, available=True
            )
            for s in request.shares
        ]
        if legacy:
            error = ErrorBody(code=code, message="HBM short")
            return CommitReply(status="rejected", request_id=request.request_id, error=error, view=view)
        error = ErrorBody(code=code, message="HBM short", details={"view": [b.model_dump() for b in view]})
        return Rejected(error=error, request_id=request.request_id)

    return answer


def accelerators(commit: CommitRequest) -> list[str]:
    return [s.accelerator_id for s in commit.shares]


# -- place -----------------------------------------------------------------------------------------


async def test_a_placement_commits_once_and_keeps_its_bytes_in_the_view() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1")]))
    reply = await rig.handlers.placing.place(place())
    assert isinstance(reply, PlaceReply) and reply.status == "placed" and reply.allocation_id == "al-1"
    (commit,) = rig.rpc.requests(Rpc.LEDGER_COMMIT)
    assert commit.request_id == "placement/r-1" and commit.lease_s == 3600
    assert commit.expected == dict.fromkeys(accelerators(commit), 0)
    assert reply.hbm_per_accelerator is not None
    assert rig.reserved() == dict.fromkeys(accelerators(commit), reply.hbm_per_accelerator.total_bytes)
    # Its event, later, changes nothing: the allocation is counted once.
    total = reply.hbm_per_accelerator.total_bytes
    rig.view.allocation_moved("al-1", key=("acme", "placement/r-1"), delta=dict.fromkeys(accelerators(commit), total))
    assert rig.reserved() == dict.fromkeys(accelerators(commit), reply.hbm_per_accelerator.total_bytes)
    assert rig.uow.names() == ["placement_decided"]
    event = PlacementEvent.model_validate(rig.uow.events[0].payload)
    assert event.reply == reply and event.attempts == 1


async def test_the_same_request_id_returns_the_stored_decision() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1"), committed("al-2")]))
    first = await rig.handlers.placing.place(place("same"))
    again = await rig.handlers.placing.place(place("same"))
    assert again == first
    assert len(rig.rpc.requests(Rpc.LEDGER_COMMIT)) == 1


@pytest.mark.parametrize("legacy", [False, True], ids=["rejected", "deprecated-commit-reply"])
async def test_a_conflict_decides_again_on_the_ledgers_fresher_figures(legacy: bool) -> None:
    rig = Rig(FakeRpc(ledger_commit=[refused(ErrorCode.CONFLICT, legacy=legacy), committed("al-2")]))
    reply = await rig.handlers.placing.place(place())
    assert isinstance(reply, PlaceReply) and reply.status == "placed" and reply.allocation_id == "al-2"
    first, second = rig.rpc.requests(Rpc.LEDGER_COMMIT)
    assert not set(accelerators(first)) & set(accelerators(second))  # the refused GPUs are full per the ledger
    assert "after 2 attempt(s)" in reply.explanation[-1]
    assert PlacementEvent.model_validate(rig.uow.events[0].payload).attempts == 2


async def test_conflicts_retry_four_times_then_answer_conflict() -> None:
    rig = Rig(FakeRpc(ledger_commit=[refused(ErrorCode.CONFLICT, full=False)]))
    reply = await rig.handlers.placing.place(place())
    assert isinstance(reply, Rejected) and reply.error.code is ErrorCode.CONFLICT
    assert len(rig.rpc.requests(Rpc.LEDGER_COMMIT)) == 4
    assert rig.reserved() == {} and rig.view.assumed == 0
    assert rig.uow.events == []


@pytest.mark.parametrize(
    "answer",
    [
        refused(ErrorCode.CONFLICT),
        refused(ErrorCode.NO_CAPACITY),
        rejected(ErrorCode.FORBIDDEN, "not yours"),
        refused(ErrorCode.NOT_FOUND),
        RpcError(Rpc.LEDGER_COMMIT, "no reply within 10 s"),
        RuntimeError("the connection broke"),
    ],
    ids=["conflict", "no_capacity", "rejected", "not_found", "timeout", "exception"],
)
async def test_a_failed_commit_forgets_the_assumed_share(answer: Answer) -> None:
    rig = Rig(FakeRpc(ledger_commit=[answer]))
    seen: list[dict[str, int]] = []
    # The share is assumed meanwhile.
    rig.rpc.before_answer[Rpc.LEDGER_COMMIT] = lambda _commit: seen.append(rig.reserved())
    try:
        reply = await rig.handlers.placing.place(place())
    except RuntimeError:
        reply = None
    assert seen and all(seen), "the decision was not assumed in the view while its commit was in flight"
    assert rig.reserved() == {} and rig.view.assumed == 0
    assert reply is None or reply.model_dump()["status"] == "rejected"


async def test_a_timeout_answers_a_typed_refusal() -> None:
    rig = Rig(FakeRpc(ledger_commit=[RpcError(Rpc.LEDGER_COMMIT, "no reply within 10 s")]))
    reply = await rig.handlers.placing.place(place())
    assert isinstance(reply, Rejected) and reply.error.code is ErrorCode.INTERNAL
    assert "did not answer" in reply.error.message


async def test_a_commit_is_not_sent_when_the_callers_deadline_leaves_less_than_commits_take() -> None:
    # Each timer reading is a second later: a commit "takes" a few seconds from sending to its answer.
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1"), committed("al-2")]), timer=FakeTimer(step_ms=1000))
    first = await rig.handlers.placing.place(place("r-1"))  # no deadline: placed, and its commit's time is learnt
    assert isinstance(first, PlaceReply) and first.status == "placed"
    before = rig.reserved()
    deadline.set_deadline(deadline.now_ms() + 500)  # half a second left: less than a commit takes now
    try:
        late = await rig.handlers.placing.place(place("r-2"))
    finally:
        deadline.set_deadline(None)
    assert isinstance(late, Rejected) and late.error.code is ErrorCode.DEADLINE_EXCEEDED
    assert len(rig.rpc.requests(Rpc.LEDGER_COMMIT)) == 1 and rig.reserved() == before, "nothing sent or assumed"
    deadline.set_deadline(deadline.now_ms() + 60_000)  # time enough: the same request id is placed
    try:
        again = await rig.handlers.placing.place(place("r-2"))
    finally:
        deadline.set_deadline(None)
    assert isinstance(again, PlaceReply) and again.status == "placed" and again.allocation_id == "al-2"


async def test_a_refusal_other_than_conflict_is_passed_on_without_retry() -> None:
    rig = Rig(FakeRpc(ledger_commit=[rejected(ErrorCode.INVALID_REQUEST, "lease too long")]))
    reply = await rig.handlers.placing.place(place())
    assert isinstance(reply, Rejected) and reply.error.code is ErrorCode.INVALID_REQUEST
    assert len(rig.rpc.requests(Rpc.LEDGER_COMMIT)) == 1


async def test_nothing_fits_is_a_rejected_event_and_no_commit() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed()]))
    huge = place(model="llama3-405b", dtype="fp16", context_tokens=131072, concurrency=64, fallbacks=[])
    reply = await rig.handlers.placing.place(huge)
    assert isinstance(reply, PlaceReply) and reply.status == "rejected" and reply.error is not None
    assert rig.rpc.requests(Rpc.LEDGER_COMMIT) == [] and rig.uow.names() == ["placement_rejected"]


async def test_a_tpu_commit_reserves_exactly_the_slice_it_reports() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed("al-t")]), fleet_view(nodes=(), pods=("p1",)))
    reply = await rig.handlers.placing.place(place(backend="tpu"))
    assert isinstance(reply, PlaceReply) and reply.status == "placed" and reply.tpu_slice is not None
    slice_ = reply.tpu_slice
    reported = {
        AcceleratorId.tpu(slice_.pod, (x, y))
        for x in range(slice_.origin[0], slice_.origin[0] + slice_.shape[0])
        for y in range(slice_.origin[1], slice_.origin[1] + slice_.shape[1])
    }
    (commit,) = rig.rpc.requests(Rpc.LEDGER_COMMIT)
    assert set(accelerators(commit)) == reported
    whole = rig.view.snapshot.tpu_pods["p1"].usable_per_chip
    assert {s.weights_bytes for s in commit.shares} == {whole}


async def test_explain_reserves_nothing() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed()]))
    reply = await rig.handlers.placing.explain(place())
    assert isinstance(reply, PlaceReply) and reply.status == "placed" and reply.allocation_id is None
    assert reply.explanation[0].startswith("dry run")
    assert rig.rpc.sent == [] and rig.uow.events == [] and rig.reserved() == {}


async def test_a_dry_run_carries_the_binding_and_launch_lines_without_reserving() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed()]))
    reply = await rig.handlers.placing.explain(place(tp=2))
    assert isinstance(reply, PlaceReply) and reply.status == "placed" and reply.allocation_id is None
    assert reply.binding is not None and reply.launch is not None
    (line,) = node_lines(reply, "vllm")
    assert line.comment == "# node n1 (rank 0 of 1), dry run: no allocation reserved"
    assert line.env["CUDA_VISIBLE_DEVICES"] == reply.binding[0].cuda_visible_devices
    assert "HETSCHED_ALLOCATION_ID" not in line.env
    assert line.argv[line.argv.index("--tensor-parallel-size") + 1] == "2"
    assert rig.rpc.sent == [] and rig.reserved() == {}


async def test_a_dry_run_on_a_tpu_slice_carries_vllm_tpu_arguments() -> None:
    rig = Rig(FakeRpc(), fleet_view(nodes=(), pods=("p1",)))
    reply = await rig.handlers.placing.explain(place(backend="tpu"))
    assert isinstance(reply, PlaceReply) and reply.status == "placed" and reply.tpu_slice is not None
    assert reply.launch is not None and reply.launch.sglang == [] and reply.launch.env == {"PJRT_DEVICE": "TPU"}
    chips = reply.tpu_slice.shape[0] * reply.tpu_slice.shape[1]
    vllm = reply.launch.vllm
    assert vllm[0] == "meta-llama/Meta-Llama-3-8B"
    assert vllm[vllm.index("--tensor-parallel-size") + 1] == str(chips)
    assert rig.rpc.sent == []


# -- release / renew ---------------------------------------------------------------------------------


async def test_release_goes_through_the_ledger_and_the_ledgers_event_announces_it() -> None:
    rig = Rig(FakeRpc(ledger_commit=[committed("al-1")], ledger_release=[LedgerReleaseReply(status="released")]))
    await rig.handlers.placing.place(place())
    reply = await rig.handlers.lifecycle.release(ReleaseRequest(allocation_id="al-1", tenant="acme"))
    assert reply.model_dump()["status"] == "released"
    assert rig.rpc.requests(Rpc.LEDGER_RELEASE) == [LedgerReleaseRequest(allocation_id="al-1", tenant="acme")]
    # The ledger's release is the only durable step: nothing is written or announced until its event.
    assert rig.uow.names() == ["placement_decided"] and rig.store.rows[("acme", "r-1")]["status"] == "placed"
    payload = AllocationEvent(
        allocation_id="al-1", request_id="placement/r-1", tenant="acme", kind="replica", shares=[]
    )
    envelope = EventEnvelope(
        event_id=uuid.uuid4(),
        type="hetsched.ledger.allocation_released",
        source="capacity-ledger",
        occurred_at=NOW,
        payload=payload.model_dump(mode="json"),
    )

    async def work(uow: UnitOfWork) -> None:
        await rig.handlers.lifecycle.on_allocation_released(uow=uow, event=envelope, payload=payload)

    await rig.uow.run(work)
    assert rig.uow.names() == ["placement_decided", "placement_released"]
    assert rig.store.rows[("acme", "r-1")]["status"] == "released"


async def test_a_refused_release_changes_nothing() -> None:
    refusal = LedgerReleaseReply(status="rejected", error=ErrorBody(code=ErrorCode.FORBIDDEN, message="not yours"))
    rig = Rig(FakeRpc(ledger_release=[refusal]))
    reply = await rig.handlers.lifecycle.release(ReleaseRequest(allocation_id="al-1", tenant="globex"))
    assert isinstance(reply, Rejected) and reply.error.code is ErrorCode.FORBIDDEN
    assert rig.uow.events == [] and rig.store.released == []


async def test_renew_passes_exactly_the_requested_lease() -> None:
    until = datetime(2026, 12, 1, 12, 20, 34, tzinfo=UTC)
    rig = Rig(FakeRpc(ledger_renew=[LedgerRenewReply(status="renewed", lease_expires_at=until)]))
    reply = await rig.handlers.lifecycle.renew(RenewRequest(allocation_id="al-1", tenant="acme", lease_s=1234))
    assert rig.rpc.requests(Rpc.LEDGER_RENEW) == [LedgerRenewRequest(allocation_id="al-1", tenant="acme", lease_s=1234)]
    assert reply.model_dump() == {"status": "renewed", "lease_expires_at": until, "error": None}


async def test_a_replica_keeps_the_lease_end_the_ledger_answered_and_each_renewal_moves_it() -> None:
    """What `placement.replicas` lists as `lease_expires_at`: the commit's answer, then each renewal's."""
    placed_until = datetime(2026, 12, 1, 13, 0, tzinfo=UTC)
    renewed_until = datetime(2026, 12, 1, 15, 0, tzinfo=UTC)
    rig = Rig(
        FakeRpc(
            ledger_commit=[committed("al-1", lease=placed_until)],
            ledger_renew=[LedgerRenewReply(status="renewed", lease_expires_at=renewed_until)],
        )
    )
    await rig.handlers.placing.place(place())
    assert rig.store.rows[("acme", "r-1")]["lease_expires_at"] == placed_until
    await rig.handlers.lifecycle.renew(RenewRequest(allocation_id="al-1", tenant="acme", lease_s=7200))
    assert rig.store.rows[("acme", "r-1")]["lease_expires_at"] == renewed_until


async def test_renew_without_an_answer_is_a_typed_refusal() -> None:
    rig = Rig(FakeRpc(ledger_renew=[RpcError(Rpc.LEDGER_RENEW, "no service answers this subject")]))
    reply = await rig.handlers.lifecycle.renew(RenewRequest(allocation_id="al-1", tenant="acme", lease_s=60))
    assert isinstance(reply, Rejected) and reply.error.code is ErrorCode.INTERNAL
