"""LedgerHandlers with fakes: an in-memory store, a unit of work that records its events, a fixed
clock. No servers; what is checked is the handler's part (what it asks the store, what it emits,
what it answers)."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

import pytest

from services.capacity_ledger.batcher import CommitBatcher
from services.capacity_ledger.handlers import LedgerHandlers
from services.capacity_ledger.store import AcceleratorSpec, LedgerEntry, NewAllocation, NodeAvailability, SnapshotPage
from shared.contracts.base import Rejected
from shared.contracts.envelope import new_event
from shared.contracts.ledger import (
    AllocationEvent,
    AllocationsFlaggedEvent,
    CapacityChangedEvent,
    CommitBatchReply,
    CommitBatchRequest,
    CommitReply,
    CommitRequest,
    DriftEvent,
    LedgerReleaseReply,
    LedgerReleaseRequest,
    LedgerRenewReply,
    LedgerRenewRequest,
    ShareIn,
    SnapshotReply,
    SnapshotRequest,
)
from shared.contracts.topology import GpuSample, GpuTelemetryEvent, NodeProfileEvent, NodeStateEvent
from shared.domain.capacity import AcceleratorCapacity
from shared.domain.ledger import (
    AllocationRecord,
    AllocationState,
    CrossDomainUse,
    DriftDetector,
    EndedAllocation,
    ExistingAllocation,
)
from shared.domain.memory import MemoryShare, usable_hbm
from shared.infra.uow import UnitOfWork
from tests.fakes import FakeUnitOfWork

T = TypeVar("T")
GB = 10**9
NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
USABLE = 80 * GB


# -- fakes ---------------------------------------------------------------------------------------


@dataclass
class FakeStore:
    """The ledger's tables in memory; records what the handlers asked."""

    accelerators: dict[str, AcceleratorCapacity] = field(default_factory=dict)
    clusters: dict[str, str | None] = field(default_factory=dict)
    allocations: dict[str, AllocationRecord] = field(default_factory=dict)
    shares: dict[str, tuple[tuple[str, MemoryShare], ...]] = field(default_factory=dict)
    calls: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    page: SnapshotPage = field(default_factory=lambda: SnapshotPage([], None))
    expired: list[str] = field(default_factory=list)
    flagged: list[str] = field(default_factory=list)
    committed: dict[str, datetime] = field(default_factory=dict)  # accelerator -> its newest replica's commit

    def _called(self, name: str, **kwargs: Any) -> None:
        self.calls.append((name, kwargs))

    def called(self, name: str) -> list[dict[str, Any]]:
        return [kwargs for n, kwargs in self.calls if n == name]

    async def existing_allocations(
        self, *, session: Any, keys: Iterable[tuple[str, str]]
    ) -> dict[tuple[str, str], ExistingAllocation]:
        wanted = set(keys)
        return {
            (a.tenant, a.request_id): ExistingAllocation(a.id, a.lease_expires_at, self.shares[a.id])
            for a in self.allocations.values()
            if (a.tenant, a.request_id) in wanted
        }

    async def lock_accelerators(self, *, session: Any, ids: Iterable[str]) -> dict[str, AcceleratorCapacity]:
        return {i: self.accelerators[i] for i in sorted(set(ids)) if i in self.accelerators}

    async def accelerator_clusters(self, *, session: Any, ids: Iterable[str]) -> dict[str, str | None]:
        return {i: self.clusters.get(i) for i in ids}

    async def lock_crossing(self, *, session: Any, clusters: Iterable[str]) -> dict[str, int]:
        self._called("lock_crossing", clusters=sorted(clusters))
        used: dict[str, int] = {}
        for a in self.allocations.values():
            if a.state is AllocationState.ACTIVE and a.cluster and a.cross_domain_bytes_per_s:
                used[a.cluster] = used.get(a.cluster, 0) + a.cross_domain_bytes_per_s
        return {c: used[c] for c in clusters if c in used}

    async def insert_allocations(self, *, session: Any, allocations: Sequence[NewAllocation]) -> None:
        self._called("insert_allocations", allocations=list(allocations))
        for a in allocations:
            self.allocations[a.id] = AllocationRecord(
                id=a.id,
                request_id=a.intent.request_id,
                tenant=a.intent.tenant,
                kind=a.intent.kind,
                state=AllocationState.ACTIVE,
                lease_expires_at=a.lease_expires_at,
                sharing=a.intent.sharing,
                cross_domain_bytes_per_s=a.intent.cross_domain_bytes_per_s,
                cluster=a.cluster,
            )
            self.shares[a.id] = a.intent.shares
            for acc, share in a.intent.shares:
                c = self.accelerators[acc]
                self.accelerators[acc] = replace(
                    c, reserved=c.reserved + share.total, shared=a.intent.sharing == "shared"
                )

    async def lock_allocation(self, *, session: Any, allocation_id: str) -> AllocationRecord | None:
        return self.allocations.get(allocation_id)

    async def lock_allocations(self, *, session: Any, ids: Sequence[str]) -> dict[str, AllocationRecord]:
        return {i: self.allocations[i] for i in sorted(set(ids)) if i in self.allocations}

    async def end_allocations(
        self, *, session: Any, allocations: Sequence[AllocationRecord], state: AllocationState, now: datetime
    ) -> list[EndedAllocation]:
        ended: list[EndedAllocation] = []
        for allocation in allocations:
            ended += await self.end_allocation(session=session, allocation=allocation, state=state, now=now)
        return ended

    async def end_allocation(
        self, *, session: Any, allocation: AllocationRecord, state: AllocationState, now: datetime
    ) -> list[EndedAllocation]:
        self._called("end_allocation", allocation_id=allocation.id, state=state, now=now)
        self.allocations[allocation.id] = replace(allocation, state=state)
        for acc, share in self.shares[allocation.id]:
            c = self.accelerators[acc]
            left = c.reserved - share.total
            self.accelerators[acc] = replace(c, reserved=left, shared=c.shared and left > 0)
        return [EndedAllocation(allocation, self.shares[allocation.id])]

    async def set_lease(self, *, session: Any, allocation_id: str, expires_at: datetime) -> None:
        self._called("set_lease", allocation_id=allocation_id, expires_at=expires_at)

    async def expired_ids(self, *, session: Any, now: datetime, limit: int) -> list[str]:
        self._called("expired_ids", now=now, limit=limit)
        return list(self.expired)

    async def snapshot(self, *, session: Any, node: str | None, after: str | None, limit: int) -> SnapshotPage:
        self._called("snapshot", node=node, after=after, limit=limit)
        return self.page

    async def upsert_capacity(
        self, *, session: Any, node: str, accelerators: Sequence[AcceleratorSpec]
    ) -> dict[str, AcceleratorCapacity]:
        self._called("upsert_capacity", node=node, accelerators=list(accelerators))
        for i, a in enumerate(accelerators):
            self.accelerators[a.id] = AcceleratorCapacity(a.id, node, i, a.sku, a.usable, 0)
            self.clusters[a.id] = a.cluster
        return {a.id: self.accelerators[a.id] for a in accelerators}

    async def held_above_reported(self, *, session: Any, ids: Sequence[str]) -> dict[str, tuple[int, int]]:
        return {}

    async def set_node_available(self, *, session: Any, node: str, available: bool) -> NodeAvailability:
        self._called("set_node_available", node=node, available=available)
        for i, c in list(self.accelerators.items()):
            if c.node == node:
                self.accelerators[i] = replace(c, available=available)
        view = {i: c for i, c in self.accelerators.items() if c.node == node}
        return NodeAvailability(view, [] if available else list(self.flagged))

    async def node_accelerators(self, *, session: Any, node: str) -> list[AcceleratorCapacity]:
        return [c for c in self.accelerators.values() if c.node == node]

    async def newest_replica_commits(self, *, session: Any, node: str) -> dict[str, datetime]:
        return {acc: at for acc, at in self.committed.items() if self.accelerators[acc].node == node}


class NoBatcher:
    async def submit(self, request: CommitRequest) -> CommitReply:
        raise AssertionError("not used here")


def gpu(acc_id: str, *, reserved_gb: float = 0, available: bool = True) -> AcceleratorCapacity:
    node, _, local = acc_id.partition("/")
    index = int(local.removeprefix("gpu")) if local.startswith("gpu") else -1
    return AcceleratorCapacity(acc_id, node, index, "H100-SXM-80GB", USABLE, int(reserved_gb * GB), available)


def make(
    *accelerators: AcceleratorCapacity,
    now: datetime = NOW,
    batcher: Any = None,
    max_payload: int = 1 << 20,
    crossing_budget: int = 0,
    store: FakeStore | None = None,
    drift_grace_s: float = 0.0,
) -> tuple[LedgerHandlers, FakeStore, FakeUnitOfWork]:
    store = store or FakeStore(accelerators={a.id: a for a in accelerators})
    units = FakeUnitOfWork(lambda: now, source="capacity-ledger")
    ids = (f"al-{i}" for i in itertools.count())
    handlers = LedgerHandlers(
        uow=units,
        clock=lambda: now,
        batcher=batcher or NoBatcher(),
        ceiling=0.92,
        default_lease_s=300,
        sweep_period_s=0.1,
        drift=DriftDetector(threshold=0.10, consecutive=2, grace_s=drift_grace_s),
        store=store,
        new_id=lambda: next(ids),
        max_payload=lambda: max_payload,
        crossing_budget=crossing_budget,
    )
    return handlers, store, units


def commit_request(rid: str, *shares: tuple[str, float], tenant: str = "acme", **extra: Any) -> CommitRequest:
    return CommitRequest(
        request_id=rid,
        tenant=tenant,
        shares=[ShareIn(accelerator_id=a, weights_bytes=int(gb * GB)) for a, gb in shares],
        **extra,
    )


def envelope() -> Any:
    return new_event(type="topology.x", source="test", occurred_at=NOW, payload={})


# -- commits ---------------------------------------------------------------------------------------


async def test_commit_batch_results_keep_the_request_order() -> None:
    handlers, _store, units = make(gpu("n/gpu0"), gpu("n/gpu1"))
    request = CommitBatchRequest(
        commits=[
            commit_request("a", ("n/gpu0", 50), sharing="shared"),
            commit_request("b", ("x/gpu0", 1)),  # unknown
            commit_request("c", ("n/gpu0", 50), sharing="shared"),  # 50 + 50 > 80: refused
            commit_request("d", ("n/gpu1", 10)),
            commit_request("e", ("n/gpu0", 20), sharing="shared"),
        ]
    )
    reply = await handlers.commit_batch(request)
    assert isinstance(reply, CommitBatchReply)
    assert [r.request_id for r in reply.results] == ["a", "b", "c", "d", "e"]
    assert [r.status for r in reply.results] == ["committed", "rejected", "rejected", "committed", "committed"]
    assert [r.allocation_id for r in reply.results] == ["al-0", None, None, "al-1", "al-2"]
    assert [r.error.code if r.error else None for r in reply.results] == [None, "not_found", "no_capacity", None, None]
    assert reply.results[2].view[0].reserved_bytes == 50 * GB  # the fresh view, with its unit-named field
    assert reply.results[4].view[0].reserved_bytes == 70 * GB  # the view after the batch
    assert all(r.lease_expires_at == NOW + timedelta(seconds=300) for r in reply.results if r.status == "committed")
    assert units.runs == 1  # one transaction for the batch
    committed = units.named("allocation_committed")
    assert [e["allocation_id"] for e in committed] == ["al-0", "al-1", "al-2"]
    assert committed[0]["shares"][0]["total_bytes"] == 50 * GB


async def test_a_duplicate_commit_writes_nothing_and_emits_nothing() -> None:
    handlers, store, units = make(gpu("n/gpu0"))
    first = await handlers.apply_commits([commit_request("a", ("n/gpu0", 10))])
    again = await handlers.apply_commits([commit_request("a", ("n/gpu0", 10))])
    assert again[0].duplicate and again[0].allocation_id == first[0].allocation_id
    assert len(units.named("allocation_committed")) == 1
    assert store.accelerators["n/gpu0"].reserved == 10 * GB


async def test_commits_through_the_batcher_each_get_their_own_reply() -> None:
    batcher = CommitBatcher(max_batch=4)
    handlers, _store, _units = make(gpu("n/gpu0"), batcher=batcher)
    batcher.start(handlers.apply_commits)
    try:
        replies = await asyncio.gather(
            *(handlers.commit(commit_request(f"r{i}", ("n/gpu0", 10), sharing="shared")) for i in range(10))
        )
    finally:
        await batcher.stop()
    assert [r.request_id for r in replies] == [f"r{i}" for i in range(10)]  # type: ignore[attr-defined]
    assert [r.status for r in replies] == ["committed"] * 8 + ["rejected"] * 2  # type: ignore[attr-defined]
    assert all(isinstance(r, Rejected) for r in replies[8:])  # a single commit refuses in the one shape
    assert [r.error.details["view"][0]["reserved_bytes"] for r in replies[8:]] == [80 * GB] * 2  # type: ignore[attr-defined]
    assert batcher.batches < 10  # commits that queued together shared a transaction


# -- exclusive and shared replicas, cross-domain traffic ------------------------------------------------


async def test_an_exclusive_group_on_a_held_gpu_is_refused_and_writes_nothing() -> None:
    handlers, store, units = make(gpu("n/gpu0"), gpu("n/gpu1"))
    (first,) = await handlers.apply_commits([commit_request("a", ("n/gpu0", 10), ("n/gpu1", 10))])
    (second,) = await handlers.apply_commits([commit_request("b", ("n/gpu1", 10))])
    assert first.status == "committed" and second.status == "rejected"
    assert second.error is not None and second.error.code == "no_capacity"
    assert second.error.message == "n/gpu1: held by another replica (exclusive groups don't share a GPU)"
    assert [len(c["allocations"]) for c in store.called("insert_allocations")] == [1, 0]  # nothing written
    assert len(units.named("allocation_committed")) == 1
    assert store.accelerators["n/gpu1"].reserved == 10 * GB


@pytest.mark.parametrize(
    ("first", "second", "status"),
    [
        ("shared", "shared", "committed"),
        ("shared", "exclusive", "rejected"),
        ("exclusive", "shared", "rejected"),
        ("exclusive", "exclusive", "rejected"),
    ],
)
async def test_only_shared_replicas_sit_together(first: str, second: str, status: str) -> None:
    handlers, store, _units = make(gpu("n/gpu0"))
    replies = await handlers.apply_commits(
        [commit_request("a", ("n/gpu0", 10), sharing=first), commit_request("b", ("n/gpu0", 10), sharing=second)]
    )
    assert [r.status for r in replies] == ["committed", status]
    if status == "rejected":
        assert replies[1].error is not None and "held by another replica" in replies[1].error.message
    assert store.accelerators["n/gpu0"].shared is (first == "shared")  # as the first holder left it


async def test_a_request_commit_is_refused_invalid_and_writes_nothing() -> None:
    """The ledger holds replicas only (admissions are counted by placement in memory)."""
    handlers, store, units = make(gpu("n/gpu0"))
    (replica,) = await handlers.apply_commits([commit_request("a", ("n/gpu0", 10))])
    assert replica.allocation_id is not None
    before = (dict(store.allocations), store.accelerators["n/gpu0"], len(units.named("allocation_committed")))
    request = CommitRequest(
        request_id="q",
        tenant="acme",
        kind="request",
        parent_id=replica.allocation_id,
        shares=[ShareIn(accelerator_id="n/gpu0", kv_bytes=GB)],
    )
    (held,) = await handlers.apply_commits([request])
    assert held.status == "rejected" and held.error is not None
    assert held.error.code == "invalid_request" and "replicas only" in held.error.message
    batch = await handlers.commit_batch(CommitBatchRequest(commits=[request]))
    assert isinstance(batch, CommitBatchReply) and [r.status for r in batch.results] == ["rejected"]
    assert (dict(store.allocations), store.accelerators["n/gpu0"], len(units.named("allocation_committed"))) == before


async def test_a_released_exclusive_gpu_takes_a_new_exclusive_group() -> None:
    handlers, _store, _units = make(gpu("n/gpu0"))
    (first,) = await handlers.apply_commits([commit_request("a", ("n/gpu0", 10))])
    assert first.allocation_id is not None
    await handlers.release(LedgerReleaseRequest(allocation_id=first.allocation_id, tenant="acme"))
    (second,) = await handlers.apply_commits([commit_request("b", ("n/gpu0", 10))])
    assert second.status == "committed"


async def test_the_events_carry_sharing_cross_domain_traffic_and_the_cluster() -> None:
    handlers, store, units = make()
    await handlers.on_node_profiled(uow=units.unit(), event=envelope(), payload=profile_event("n", 2))
    # Learnt from the node's profile, qualified by its region (cluster names repeat across regions).
    assert store.clusters == {"n/gpu0": "r1/c1", "n/gpu1": "r1/c1"}
    (reply,) = await handlers.apply_commits(
        [commit_request("a", ("n/gpu0", 10), ("n/gpu1", 10), cross_domain_bytes_per_s=40 * GB)]
    )
    assert reply.allocation_id is not None
    await handlers.release(LedgerReleaseRequest(allocation_id=reply.allocation_id, tenant="acme"))
    (shared,) = await handlers.apply_commits([commit_request("b", ("n/gpu0", 1), sharing="shared")])
    committed = [AllocationEvent.model_validate(p) for p in units.named("allocation_committed")]
    (released,) = [AllocationEvent.model_validate(p) for p in units.named("allocation_released")]
    assert [(e.sharing, e.cross_domain_bytes_per_s, e.cluster) for e in committed] == [
        ("exclusive", 40 * GB, "r1/c1"),
        ("shared", 0, "r1/c1"),
    ]
    # The end of an allocation carries what its commit added, so a follower can take it back.
    assert (released.sharing, released.cross_domain_bytes_per_s, released.cluster) == ("exclusive", 40 * GB, "r1/c1")
    assert shared.status == "committed"


@pytest.mark.parametrize("extra", [{}, {"parent_id": "al-1", "cross_domain_bytes_per_s": 1}])
async def test_any_request_commit_is_told_why_it_is_refused(extra: dict[str, Any]) -> None:
    """Without a parent or with fields a request never had: the answer is the retirement, not a field error."""
    handlers, _store, _units = make(gpu("n/gpu0"))
    request = CommitRequest(
        request_id="q", tenant="acme", kind="request", shares=[ShareIn(accelerator_id="n/gpu0", kv_bytes=GB)], **extra
    )
    (reply,) = await handlers.apply_commits([request])
    assert reply.error is not None and reply.error.code == "invalid_request"
    assert "placement" in reply.error.message and "replicas only" in reply.error.message


async def test_the_snapshot_says_which_gpus_are_shared_and_the_cross_domain_use_on_every_page() -> None:
    handlers, store, _units = make(max_payload=20_000)
    crossing = [
        CrossDomainUse("al-1", "c1", 40 * GB),
        CrossDomainUse("al-2", "c1", 8 * GB),
        CrossDomainUse("al-3", None, GB),
    ]
    held = replace(gpu("n/gpu1", reserved_gb=5), shared=True)
    store.page = SnapshotPage(
        [LedgerEntry(gpu("n/gpu0"), ()), LedgerEntry(held, ("al-4",))]
        + [LedgerEntry(gpu(f"m{i:04d}/gpu0"), ()) for i in range(400)],
        None,
        crossing,
    )
    reply = await handlers.snapshot(SnapshotRequest(limit=402))
    assert isinstance(reply, SnapshotReply)
    assert [(a.id, a.shared) for a in reply.accelerators[:2]] == [("n/gpu0", False), ("n/gpu1", True)]
    assert reply.next_cursor is not None  # cut to fit one message: the cross-domain figures stay
    assert reply.cross_domain_used == {"c1": 48 * GB}
    assert [(c.allocation_id, c.cluster, c.bytes_per_s) for c in reply.cross_domain] == [
        ("al-1", "c1", 40 * GB),
        ("al-2", "c1", 8 * GB),
        ("al-3", None, GB),
    ]


# -- release, renew, sweep -------------------------------------------------------------------------


async def committed(handlers: LedgerHandlers, rid: str = "a", tenant: str = "acme") -> str:
    """A 10 GB shared replica on n/gpu0 (so that several may be held there)."""
    (reply,) = await handlers.apply_commits([commit_request(rid, ("n/gpu0", 10), tenant=tenant, sharing="shared")])
    assert reply.allocation_id is not None
    return reply.allocation_id


async def test_releasing_another_tenants_allocation_is_answered_as_an_unknown_one_and_changes_nothing() -> None:
    """Issue 23: `not_found` with the same message as an id that does not exist (an id tells no one whether
    it exists), never `forbidden`."""
    handlers, store, units = make(gpu("n/gpu0"))
    allocation = await committed(handlers, tenant="globex")
    reply = await handlers.release(LedgerReleaseRequest(allocation_id=allocation, tenant="acme"))
    unknown = await handlers.release(LedgerReleaseRequest(allocation_id="al-nope", tenant="acme"))
    assert isinstance(reply, Rejected) and isinstance(unknown, Rejected)
    assert reply.error.code == unknown.error.code == "not_found"
    assert reply.error.message.replace(allocation, "ID") == unknown.error.message.replace("al-nope", "ID")
    assert store.called("end_allocation") == [] and units.named("allocation_released") == []


async def test_release_ends_it_once_with_an_event() -> None:
    handlers, store, units = make(gpu("n/gpu0"))
    allocation = await committed(handlers)
    first = await handlers.release(LedgerReleaseRequest(allocation_id=allocation, tenant="acme"))
    again = await handlers.release(LedgerReleaseRequest(allocation_id=allocation, tenant="acme"))
    assert first == LedgerReleaseReply(status="released", already=False)
    assert again == LedgerReleaseReply(status="released", already=True)
    assert store.called("end_allocation") == [
        {"allocation_id": allocation, "state": AllocationState.RELEASED, "now": NOW}
    ]
    released = units.named("allocation_released")
    assert len(released) == 1 and AllocationEvent.model_validate(released[0]).shares[0].total_bytes == 10 * GB
    unknown = await handlers.release(LedgerReleaseRequest(allocation_id="al-nope", tenant="acme"))
    assert isinstance(unknown, Rejected) and unknown.error.code == "not_found"


async def test_renew_computes_the_lease_from_the_clock_and_stores_exactly_that() -> None:
    handlers, store, _units = make(gpu("n/gpu0"))
    allocation = await committed(handlers)
    reply = await handlers.renew(LedgerRenewRequest(allocation_id=allocation, tenant="acme", lease_s=120))
    assert reply == LedgerRenewReply(status="renewed", lease_expires_at=NOW + timedelta(seconds=120))
    end = NOW + timedelta(hours=3)
    await handlers.renew(LedgerRenewRequest(allocation_id=allocation, tenant="acme", lease_expires_at=end))
    assert store.called("set_lease") == [
        {"allocation_id": allocation, "expires_at": NOW + timedelta(seconds=120)},
        {"allocation_id": allocation, "expires_at": end},
    ]


@pytest.mark.parametrize(
    ("tenant", "lease_end", "code"),
    [
        ("acme", NOW - timedelta(seconds=1), "invalid_request"),  # in the past by the injected clock
        ("globex", NOW + timedelta(hours=1), "not_found"),  # another tenant's: as an unknown id (issue 23)
    ],
)
async def test_renew_refusals_store_nothing(tenant: str, lease_end: datetime, code: str) -> None:
    handlers, store, _units = make(gpu("n/gpu0"))
    allocation = await committed(handlers)
    reply = await handlers.renew(
        LedgerRenewRequest(allocation_id=allocation, tenant=tenant, lease_expires_at=lease_end)
    )
    assert isinstance(reply, Rejected) and reply.error.code == code
    assert store.called("set_lease") == []


async def test_renewing_an_ended_allocation_is_a_conflict() -> None:
    handlers, _store, _units = make(gpu("n/gpu0"))
    allocation = await committed(handlers)
    await handlers.release(LedgerReleaseRequest(allocation_id=allocation, tenant="acme"))
    reply = await handlers.renew(LedgerRenewRequest(allocation_id=allocation, tenant="acme", lease_s=60))
    assert isinstance(reply, Rejected) and reply.error.code == "conflict"


async def test_the_sweeper_expires_what_the_store_finds_at_the_clocks_now() -> None:
    handlers, store, units = make(gpu("n/gpu0"))
    a, b = await committed(handlers, "a"), await committed(handlers, "b")
    await handlers.release(LedgerReleaseRequest(allocation_id=b, tenant="acme"))
    store.expired = [a, b]  # b ended meanwhile: skipped
    assert await handlers.sweep_once() == 1
    assert store.called("expired_ids") == [{"now": NOW, "limit": 500}]
    assert [e["allocation_id"] for e in units.named("allocation_expired")] == [a]


# -- snapshot --------------------------------------------------------------------------------------


async def test_snapshot_passes_the_cursor_and_limit_through() -> None:
    handlers, store, _units = make()
    store.page = SnapshotPage([LedgerEntry(gpu("n/gpu3", reserved_gb=5), ("al-1",))], "n/gpu3")
    reply = await handlers.snapshot(SnapshotRequest(node="n", cursor="n/gpu2", limit=1))
    assert store.called("snapshot") == [{"node": "n", "after": "n/gpu2", "limit": 1}]
    assert isinstance(reply, SnapshotReply) and reply.next_cursor == "n/gpu3"
    (view,) = reply.accelerators
    assert (view.id, view.hbm_reserved_bytes, view.hbm_usable_bytes) == ("n/gpu3", 5 * GB, USABLE)
    assert "hbm_reserved" not in view.model_dump() and "hbm_usable" not in view.model_dump()  # each figure once
    assert view.allocations == ["al-1"]
    await handlers.snapshot(SnapshotRequest())
    assert store.called("snapshot")[-1] == {"node": None, "after": None, "limit": 2048}


# -- topology and telemetry events -----------------------------------------------------------------


def profile_event(node: str, gpus: int) -> NodeProfileEvent:
    return NodeProfileEvent.model_validate(
        {
            "node": node,
            "region": "r1",
            "kind": "fully_connected",
            "fingerprint": "f",
            "profile": {
                "name": node,
                "region": "r1",
                "cluster": "c1",
                "rack": "k1",
                "sku": "H100-SXM-80GB",
                "links": [["X" if i == j else "NV18" for j in range(gpus)] for i in range(gpus)],
                "accelerators": [
                    {"index": i, "sku": "H100-SXM-80GB", "hbm_bytes": 85_899_345_920} for i in range(gpus)
                ],
            },
        }
    )


async def test_a_profiled_node_registers_usable_bytes_and_announces_them() -> None:
    handlers, store, units = make()
    uow = units.unit()
    await handlers.on_node_profiled(uow=uow, event=envelope(), payload=profile_event("n", 2))
    (call,) = store.called("upsert_capacity")
    assert [(a.id, a.usable) for a in call["accelerators"]] == [
        ("n/gpu0", usable_hbm(85_899_345_920, 0.92)),
        ("n/gpu1", usable_hbm(85_899_345_920, 0.92)),
    ]
    ((_, env),) = uow.events
    changed = CapacityChangedEvent.model_validate(env.payload)
    assert changed.reason == "profiled" and [a.usable_bytes for a in changed.accelerators] == [79_027_398_246] * 2


@pytest.mark.parametrize(("handler", "reason"), [("on_node_lost", "lost"), ("on_node_removed", "removed")])
async def test_a_lost_or_removed_node_is_unavailable_flags_its_allocations_and_says_so(
    handler: str, reason: str
) -> None:
    handlers, store, units = make(gpu("n/gpu0"), gpu("n/gpu1"), gpu("m/gpu0"))
    store.flagged = ["al-7"]
    uow = units.unit()
    state = NodeStateEvent(node="n", region="r1", accelerators=["n/gpu0", "n/gpu1"])
    await getattr(handlers, handler)(uow=uow, event=envelope(), payload=state)
    assert store.called("set_node_available") == [{"node": "n", "available": False}]
    names = [e.type for _, e in uow.events]
    assert names == ["ledger.allocations_flagged", "ledger.capacity_changed"]
    flagged = AllocationsFlaggedEvent.model_validate(uow.events[0][1].payload)
    assert flagged.reason == f"node_{reason}" and flagged.allocation_ids == ["al-7"]
    changed = CapacityChangedEvent.model_validate(uow.events[1][1].payload)
    assert changed.reason == reason and [a.available for a in changed.accelerators] == [False, False]


async def test_a_recovered_node_takes_commits_again() -> None:
    handlers, store, units = make(gpu("n/gpu0", available=False))
    uow = units.unit()
    await handlers.on_node_recovered(
        uow=uow, event=envelope(), payload=NodeStateEvent(node="n", region="r1", accelerators=[])
    )
    assert store.accelerators["n/gpu0"].available
    assert [e.type for _, e in uow.events] == ["ledger.capacity_changed"]


async def test_drift_is_emitted_once_per_episode() -> None:
    handlers, _store, units = make(gpu("n/gpu0"), gpu("n/gpu1", reserved_gb=30), gpu("n/0.0"))
    drifts: list[DriftEvent] = []
    for used_gb in (30, 30, 30, 2, 30, 30):
        await units.run(sample_of(handlers, used_gb))
    drifts = [DriftEvent.model_validate(payload) for payload in units.named("drift_detected")]
    # gpu0: drift on the 2nd sample, the episode ends at 2 GB, a new one is reported on the 6th;
    # gpu1 uses what it reserved; the TPU chip has no GPU index to match.
    assert [(d.accelerator_id, d.difference_bytes) for d in drifts] == [("n/gpu0", 30 * GB), ("n/gpu0", 30 * GB)]


def sample_of(handlers: Any, used_gb: float) -> Callable[[UnitOfWork], Awaitable[None]]:
    """One telemetry sample of node n (gpu0 using ``used_gb``, gpu1 what it reserved), as the consumer applies it."""
    gpus = [GpuSample(index=0, memory_used_bytes=int(used_gb * GB)), GpuSample(index=1, memory_used_bytes=30 * GB)]

    async def work(uow: UnitOfWork) -> None:
        await handlers.on_gpu_telemetry(uow=uow, event=envelope(), payload=GpuTelemetryEvent(node="n", gpus=gpus))

    return work


async def test_no_drift_within_the_grace_after_a_replica_is_committed_and_as_before_after_it() -> None:
    handlers, store, units = make(gpu("n/gpu0", reserved_gb=30), gpu("n/gpu1", reserved_gb=30), drift_grace_s=600)
    store.committed = {"n/gpu0": NOW - timedelta(seconds=599), "n/gpu1": NOW - timedelta(seconds=600)}
    gpus = [GpuSample(index=0, memory_used_bytes=0), GpuSample(index=1, memory_used_bytes=0)]

    async def idle(uow: UnitOfWork) -> None:  # neither engine holds anything yet
        await handlers.on_gpu_telemetry(uow=uow, event=envelope(), payload=GpuTelemetryEvent(node="n", gpus=gpus))

    for _ in range(3):
        await units.run(idle)
    # gpu0's replica was committed 599 s ago: its engine may still load; gpu1's grace is over.
    assert [p["accelerator_id"] for p in units.named("drift_detected")] == ["n/gpu1"]


async def test_a_sample_whose_transaction_rolls_back_does_not_count_towards_drift() -> None:
    handlers, _store, units = make(gpu("n/gpu0"), gpu("n/gpu1", reserved_gb=30))
    await units.run(sample_of(handlers, 30))  # the first of two samples in a row
    units.fail_next = RuntimeError("the commit failed")
    with pytest.raises(RuntimeError):
        await units.run(sample_of(handlers, 30))  # its drift report rolled back: the streak stays at one
    await units.run(sample_of(handlers, 30))  # so the episode is reported now, not lost
    assert [p["accelerator_id"] for p in units.named("drift_detected")] == ["n/gpu0"]


async def test_a_snapshot_page_too_big_for_one_message_is_cut_and_says_where_to_go_on() -> None:
    handlers, store, _units = make(max_payload=20_000)
    store.page = SnapshotPage([LedgerEntry(gpu(f"n{i:04d}/gpu0"), ()) for i in range(400)], None)
    reply = await handlers.snapshot(SnapshotRequest(limit=400))
    assert isinstance(reply, SnapshotReply)
    # 400 views are ~100 kB of JSON; the page is halved until it fits 90% of the 20 kB payload limit.
    assert 1 <= len(reply.accelerators) < 400 and len(reply.model_dump_json()) <= 18_000
    assert reply.next_cursor == reply.accelerators[-1].id  # the next page starts after the last one sent


async def test_the_ledger_refuses_cross_domain_traffic_past_the_cluster_budget() -> None:
    """The budget is the ledger's hard limit, read under the cluster's lock, so placement replicas
    racing for the last of it cannot overshoot it together."""
    handlers, store, units = make(crossing_budget=100 * GB)
    await handlers.on_node_profiled(uow=units.unit(), event=envelope(), payload=profile_event("n", 2))
    (first,) = await handlers.apply_commits([commit_request("a", ("n/gpu0", 10), cross_domain_bytes_per_s=60 * GB)])
    (second,) = await handlers.apply_commits([commit_request("b", ("n/gpu1", 10), cross_domain_bytes_per_s=60 * GB)])
    assert first.status == "committed" and second.status == "rejected"
    assert second.error is not None and second.error.code == "no_capacity"
    assert "r1/c1's cross-domain budget: 60.0 GB/s in use" in second.error.message
    assert store.called("lock_crossing")[-1] == {"clusters": ["r1/c1"]}
    # Released, its traffic no longer counts.
    assert first.allocation_id is not None
    await handlers.release(LedgerReleaseRequest(allocation_id=first.allocation_id, tenant="acme"))
    (third,) = await handlers.apply_commits([commit_request("c", ("n/gpu1", 10), cross_domain_bytes_per_s=60 * GB)])
    assert third.status == "committed"


async def test_concurrent_releases_end_together_each_answered_on_its_own() -> None:
    handlers, store, units = make(gpu("n/gpu0"))
    allocations = [await committed(handlers, rid=f"r-{i}") for i in range(8)]
    replies = await asyncio.gather(
        *(handlers.release(LedgerReleaseRequest(allocation_id=a, tenant="acme")) for a in allocations),
        handlers.release(LedgerReleaseRequest(allocation_id=allocations[0], tenant="acme")),  # twice: once
        handlers.release(LedgerReleaseRequest(allocation_id=allocations[1], tenant="globex")),  # not theirs
    )
    assert replies[:8] == [LedgerReleaseReply(status="released", already=False)] * 8
    assert replies[8] == LedgerReleaseReply(status="released", already=True)
    assert isinstance(replies[9], Rejected) and replies[9].error.code == "not_found"  # not theirs: as unknown
    assert sorted(c["allocation_id"] for c in store.called("end_allocation")) == sorted(allocations)
    assert len(units.named("allocation_released")) == 8
    assert handlers.lifecycle._releases.groups < 10  # the ones that came while the first ran went together
