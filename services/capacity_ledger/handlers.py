"""The capacity ledger's handlers: one method per request and per event. Each reads like a sentence:
load (store) -> decide (``shared.domain.ledger``) -> write (store) + events (unit of work) -> reply."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable, Sequence
from datetime import datetime
from typing import Protocol, TypeVar

from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession

from services.capacity_ledger import mapping, store
from services.capacity_ledger.metrics import LedgerMetrics
from shared.contracts.base import ErrorCode, rejected
from shared.contracts.envelope import EventEnvelope
from shared.contracts.ledger import (
    AllocationsFlaggedEvent,
    CapacityChangedEvent,
    CommitBatchReply,
    CommitBatchRequest,
    CommitReply,
    CommitRequest,
    DriftEvent,
    LedgerEvent,
    LedgerPreemptReply,
    LedgerPreemptRequest,
    LedgerReleaseReply,
    LedgerReleaseRequest,
    LedgerRenewReply,
    LedgerRenewRequest,
    SnapshotReply,
    SnapshotRequest,
    no_allocation,
)
from shared.contracts.subjects import Context
from shared.contracts.topology import GpuTelemetryEvent, NodeProfileEvent, NodeStateEvent, TpuPodEvent
from shared.domain.capacity import AcceleratorCapacity
from shared.domain.fleet import AcceleratorId, TpuPod, cluster_key, tpu_chip_ids
from shared.domain.ledger import (
    MAX_LEASE_S,
    Access,
    AllocationRecord,
    AllocationState,
    CommitPlan,
    DriftDetector,
    Duplicate,
    EndedAllocation,
    ExistingAllocation,
    Refused,
    ReplicaPool,
    allocation_cluster,
    cross_domain_used,
    lease_too_long,
    may_change,
    plan_commits,
    renewal_end,
    view_of,
)
from shared.domain.memory import usable_hbm
from shared.domain.topology.tpu import TpuType
from shared.infra import deadline
from shared.infra.clock import Clock
from shared.infra.grouping import Grouped
from shared.infra.uow import UnitOfWork

T = TypeVar("T")


class Batcher(Protocol):
    async def submit(self, request: CommitRequest) -> CommitReply: ...


class Units(Protocol):
    """Opens units of work (``shared.infra.uow.UnitOfWorkFactory``, or a fake in tests)."""

    async def run(self, work: Callable[[UnitOfWork], Awaitable[T]]) -> T: ...
    async def read(self, work: Callable[[AsyncSession], Awaitable[T]]) -> T: ...


class Store(Protocol):
    """The ledger's repository (the ``store`` module, or a fake in tests)."""

    async def existing_allocations(
        self, *, session: AsyncSession, keys: Iterable[tuple[str, str]]
    ) -> dict[tuple[str, str], ExistingAllocation]: ...
    async def lock_accelerators(
        self, *, session: AsyncSession, ids: Iterable[str]
    ) -> dict[str, AcceleratorCapacity]: ...
    async def accelerator_clusters(self, *, session: AsyncSession, ids: Iterable[str]) -> dict[str, str | None]: ...

    async def lock_crossing(self, *, session: AsyncSession, clusters: Iterable[str]) -> dict[str, int]: ...
    async def lock_replica_pools(self, *, session: AsyncSession, ids: Iterable[str]) -> dict[str, ReplicaPool]: ...
    async def insert_allocations(
        self, *, session: AsyncSession, allocations: Sequence[store.NewAllocation]
    ) -> None: ...
    async def lock_allocation(self, *, session: AsyncSession, allocation_id: str) -> AllocationRecord | None: ...
    async def lock_allocations(self, *, session: AsyncSession, ids: Sequence[str]) -> dict[str, AllocationRecord]: ...
    async def end_allocations(
        self,
        *,
        session: AsyncSession,
        allocations: Sequence[AllocationRecord],
        state: AllocationState,
        now: datetime,
    ) -> list[EndedAllocation]: ...
    async def set_lease(self, *, session: AsyncSession, allocation_id: str, expires_at: datetime) -> None: ...
    async def expired_ids(self, *, session: AsyncSession, now: datetime, limit: int) -> list[str]: ...
    async def snapshot(
        self, *, session: AsyncSession, node: str | None, after: str | None, limit: int
    ) -> store.SnapshotPage: ...
    async def upsert_capacity(
        self, *, session: AsyncSession, node: str, accelerators: Sequence[store.AcceleratorSpec]
    ) -> dict[str, AcceleratorCapacity]: ...
    async def held_above_reported(self, *, session: AsyncSession, ids: Sequence[str]) -> dict[str, tuple[int, int]]: ...
    async def set_node_available(
        self, *, session: AsyncSession, node: str, available: bool
    ) -> store.NodeAvailability: ...
    async def node_accelerators(self, *, session: AsyncSession, node: str) -> list[AcceleratorCapacity]: ...


def new_allocation_id() -> str:
    return f"al-{uuid.uuid4().hex}"


def _live_commits(
    requests: Sequence[CommitRequest], deadlines: Sequence[float | None] | None
) -> Callable[[], list[bool]]:
    """Asked now, which commits' callers are still waiting (no deadline: always)."""
    until = list(deadlines) if deadlines is not None else [None] * len(requests)
    return lambda: [d is None or deadline.now_ms() < d for d in until]


class LedgerHandlers:
    """Commit / release / renew / snapshot, the lease sweeper, and the topology and telemetry events."""

    def __init__(
        self,
        *,
        uow: Units,
        clock: Clock,
        batcher: Batcher,
        ceiling: float,
        default_lease_s: int,
        sweep_period_s: float,
        drift: DriftDetector,
        snapshot_limit: int = 2048,
        max_payload: Callable[[], int] = lambda: 1 << 20,
        sweep_batch: int = 500,
        store: Store = store,
        new_id: Callable[[], str] = new_allocation_id,
        log: logging.Logger | None = None,
        crossing_budget: int = 0,
        metrics: LedgerMetrics | None = None,
    ) -> None:
        self._uow = uow
        self._metrics = metrics
        self._drifting: set[str] = set()  # accelerators in a drift episode (their gauge shows the difference)
        self._crossing_budget = crossing_budget  # bytes/s of cross-domain TP traffic per cluster; 0: none
        self._store = store
        self._clock = clock
        self._batcher = batcher
        self._ceiling = ceiling
        self._default_lease_s = default_lease_s
        self._sweep_period_s = sweep_period_s
        self._drift = drift
        self._snapshot_limit = snapshot_limit
        self._max_payload = max_payload
        self._sweep_batch = sweep_batch
        self._new_id = new_id
        self._log = log or logging.getLogger("hetsched.capacity-ledger")
        # Releases that arrive while one transaction of them runs are ended together in the next.
        self._releases: Grouped[tuple[str, str | None], Access] = Grouped(
            lambda items: self._end_many(items, AllocationState.RELEASED)
        )

    # -- requests ------------------------------------------------------------------------------

    async def commit(self, request: CommitRequest) -> BaseModel:
        """One commit, applied together with the commits that arrive meanwhile (group commit)."""
        if deadline.expired():  # the caller has gone: reserve nothing it would never learn of
            return mapping.abandoned_reply(request.request_id)
        return await self._batcher.submit(request)

    async def commit_batch(self, request: CommitBatchRequest) -> BaseModel:
        until = [deadline.current()] * len(request.commits)
        return CommitBatchReply(results=await self.apply_commits(request.commits, deadlines=until))

    async def apply_commits(
        self, requests: Sequence[CommitRequest], *, deadlines: Sequence[float | None] | None = None
    ) -> list[CommitReply]:
        """Commits in one transaction, each all-or-nothing on its own; one reply per commit, in order.
        A commit whose caller's deadline (``deadlines``, epoch ms, per commit) has passed once the
        accelerators are locked is left out: nothing is reserved for a caller who gave up."""
        live = _live_commits(requests, deadlines)
        if not any(live()):
            return [mapping.abandoned_reply(r.request_id) for r in requests]
        intents = [mapping.intent(r) for r in requests]
        gone: set[int] = set()

        async def work(uow: UnitOfWork) -> tuple[CommitPlan, list[store.NewAllocation]]:
            existing = await self._store.existing_allocations(session=uow.session, keys=[i.key for i in intents])
            view = await self._store.lock_accelerators(
                session=uow.session, ids=[a for i in intents for a in i.accelerator_ids]
            )
            clusters = await self._store.accelerator_clusters(session=uow.session, ids=view.keys())
            charged = {
                c
                for i in intents
                if i.cross_domain_bytes_per_s > 0 and (c := allocation_cluster(i.accelerator_ids, clusters))
            }
            crossing = (
                await self._store.lock_crossing(session=uow.session, clusters=charged)
                if charged and self._crossing_budget > 0
                else {}
            )
            parents = await self._store.lock_replica_pools(
                session=uow.session, ids=[i.parent_id for i in intents if i.parent_id]
            )
            gone.clear()
            gone.update(i for i, alive in enumerate(live()) if not alive)  # re-checked after the locks
            planned = [i for n, i in enumerate(intents) if n not in gone]
            plan = plan_commits(
                planned,
                view=view,
                existing=existing,
                parents=parents,
                now=uow.now,
                default_lease_s=self._default_lease_s,
                clusters=clusters,
                crossing=crossing,
                crossing_budget=self._crossing_budget,
            )
            new = [
                store.NewAllocation(
                    id=self._new_id(),
                    intent=planned[i],
                    lease_expires_at=o.lease_expires_at,
                    created_at=uow.now,
                    cluster=o.cluster,
                )
                for i, o in plan.accepted
            ]
            await self._store.insert_allocations(session=uow.session, allocations=new)
            for a in new:
                uow.emit(
                    Context.LEDGER,
                    LedgerEvent.ALLOCATION_COMMITTED,
                    mapping.committed_event(
                        allocation_id=a.id, intent=a.intent, lease_expires_at=a.lease_expires_at, cluster=a.cluster
                    ),
                    tenant=a.intent.tenant,
                    correlation_id=a.intent.request_id,
                )
            return plan, new

        plan, new = await self._uow.run(work)
        if self._metrics is not None:
            self._metrics.committed(len(new))
        written = iter(new)
        outcomes = iter(plan.outcomes)
        replies: list[CommitReply] = []
        for n, intent in enumerate(intents):
            if n in gone:
                replies.append(mapping.abandoned_reply(intent.request_id))
                continue
            outcome = next(outcomes)
            if isinstance(outcome, Refused):
                replies.append(mapping.refused_reply(intent.request_id, outcome))
            elif isinstance(outcome, Duplicate):
                replies.append(mapping.duplicate_reply(intent.request_id, outcome))
            else:
                allocation = next(written)
                after = view_of(plan.view, intent.accelerator_ids)
                replies.append(mapping.committed_reply(allocation.id, allocation.lease_expires_at, intent, after))
        return replies

    async def release(self, request: LedgerReleaseRequest) -> BaseModel:
        access = await self._end(request.allocation_id, tenant=request.tenant, state=AllocationState.RELEASED)
        if access in (Access.NOT_FOUND, Access.FORBIDDEN):  # alike: an id must not tell whether it exists
            return no_allocation(request.allocation_id)
        return LedgerReleaseReply(status="released", already=access is Access.ENDED)

    async def renew(self, request: LedgerRenewRequest) -> BaseModel:
        now = self._clock()
        end = renewal_end(now=now, lease_s=request.lease_s, lease_expires_at=request.lease_expires_at)
        if end is None:
            return rejected(ErrorCode.INVALID_REQUEST, "the new lease ends in the past")
        if lease_too_long(end, now=now):
            return rejected(ErrorCode.INVALID_REQUEST, f"the new lease is longer than {MAX_LEASE_S // 86400} days")

        async def work(uow: UnitOfWork) -> Access:
            allocation = await self._store.lock_allocation(session=uow.session, allocation_id=request.allocation_id)
            access = may_change(allocation, tenant=request.tenant)
            if access is Access.OK:
                await self._store.set_lease(session=uow.session, allocation_id=request.allocation_id, expires_at=end)
            return access

        access = await self._uow.run(work)
        if access in (Access.NOT_FOUND, Access.FORBIDDEN):  # alike: an id must not tell whether it exists
            return no_allocation(request.allocation_id)
        if access is Access.ENDED:
            return rejected(ErrorCode.CONFLICT, "the allocation was released or has expired")
        return LedgerRenewReply(status="renewed", lease_expires_at=end)

    async def preempt(self, request: LedgerPreemptRequest) -> BaseModel:
        """End a preemptible allocation for the reservation filler, in one transaction: at once when its
        deadline has passed (``allocation_released``), else by moving its lease end to the deadline (the
        sweeper ends it then with ``allocation_expired``). Never lengthens a lease; a repeat answers the same."""
        now = self._clock()

        async def work(uow: UnitOfWork) -> BaseModel:
            locked = await self._store.lock_allocations(session=uow.session, ids=[request.allocation_id])
            allocation = locked.get(request.allocation_id)
            access = may_change(allocation, tenant=None)
            if access is Access.NOT_FOUND:
                return rejected(ErrorCode.NOT_FOUND, f"no allocation {request.allocation_id!r}")
            if access is Access.ENDED:
                return LedgerPreemptReply(status="ended", already=True)
            assert allocation is not None
            if not allocation.preemptible:
                return rejected(ErrorCode.CONFLICT, "only a preemptible allocation may be preempted")
            if request.deadline_at > now:
                end = min(request.deadline_at, allocation.lease_expires_at)
                if end < allocation.lease_expires_at:
                    await self._store.set_lease(session=uow.session, allocation_id=allocation.id, expires_at=end)
                return LedgerPreemptReply(status="scheduled", lease_expires_at=end)
            for ended in await self._store.end_allocations(
                session=uow.session, allocations=[allocation], state=AllocationState.RELEASED, now=uow.now
            ):
                uow.emit(
                    Context.LEDGER,
                    LedgerEvent.ALLOCATION_RELEASED,
                    mapping.ended_event(ended),
                    tenant=ended.allocation.tenant,
                    correlation_id=ended.allocation.request_id,
                )
            return LedgerPreemptReply(status="ended")

        return await self._uow.run(work)

    async def snapshot(self, request: SnapshotRequest) -> BaseModel:
        page = await self._uow.read(
            lambda session: self._store.snapshot(
                session=session, node=request.node, after=request.cursor, limit=request.limit or self._snapshot_limit
            )
        )
        views = [mapping.ledger_view(e.capacity, e.allocations) for e in page.entries]
        # Cross-domain traffic is the whole fleet's on every page: a reader seeds its per-cluster budget use
        # from any page (and counts each allocation once while it follows the events).
        crossing = {
            "cross_domain_used": cross_domain_used(page.cross_domain),
            "cross_domain": [mapping.cross_domain(u) for u in page.cross_domain],
        }
        reply = SnapshotReply(accelerators=views, next_cursor=page.next_cursor, **crossing)
        # A page must fit one NATS message, whatever limit was asked: keep halving and say where to go on.
        budget = int(self._max_payload() * 0.9)
        while len(views) > 1 and len(reply.model_dump_json()) > budget:
            views = views[: len(views) // 2]
            reply = SnapshotReply(accelerators=views, next_cursor=views[-1].id, **crossing)
        return reply

    # -- the lease sweeper ---------------------------------------------------------------------

    async def sweep_leases(self) -> None:
        """Forever: release allocations whose lease ended, each with an `allocation_expired` event."""
        while True:
            await asyncio.sleep(self._sweep_period_s)
            try:
                await self.sweep_once()
            except Exception:
                self._log.exception("lease sweep failed; retrying")

    async def sweep_once(self) -> int:
        """One pass of the sweeper; how many allocations it expired (in one transaction)."""
        now = self._clock()
        ids = await self._uow.read(
            lambda session: self._store.expired_ids(session=session, now=now, limit=self._sweep_batch)
        )
        if not ids:
            return 0
        accesses = await self._end_many([(allocation_id, None) for allocation_id in ids], AllocationState.EXPIRED)
        return sum(1 for access in accesses if access is Access.OK)

    async def _end(self, allocation_id: str, *, tenant: str | None, state: AllocationState) -> Access:
        """End an allocation (and the requests inside a replica) with an event each, if ``tenant`` may;
        releases arriving together share one transaction (``Grouped``)."""
        if state is AllocationState.RELEASED:
            return await self._releases.submit((allocation_id, tenant))
        (access,) = await self._end_many([(allocation_id, tenant)], state)
        return access

    async def _end_many(self, items: Sequence[tuple[str, str | None]], state: AllocationState) -> list[Access]:
        """End each ``(allocation id, tenant)`` the tenant may end, in one transaction, locked in id order;
        an id named twice ends once (the second is told it had ended)."""
        event = LedgerEvent.ALLOCATION_RELEASED if state is AllocationState.RELEASED else LedgerEvent.ALLOCATION_EXPIRED

        async def work(uow: UnitOfWork) -> list[Access]:
            locked = await self._store.lock_allocations(session=uow.session, ids=[i for i, _ in items])
            accesses: list[Access] = []
            chosen: dict[str, AllocationRecord] = {}
            for allocation_id, tenant in items:
                access = may_change(locked.get(allocation_id), tenant=tenant)
                if access is Access.OK and allocation_id in chosen:
                    access = Access.ENDED
                elif access is Access.OK:
                    chosen[allocation_id] = locked[allocation_id]
                accesses.append(access)
            for ended in await self._store.end_allocations(
                session=uow.session, allocations=list(chosen.values()), state=state, now=uow.now
            ):
                uow.emit(
                    Context.LEDGER,
                    event,
                    mapping.ended_event(ended),
                    tenant=ended.allocation.tenant,
                    correlation_id=ended.allocation.request_id,
                )
            return accesses

        return await self._uow.run(work)

    # -- TOPOLOGY events -----------------------------------------------------------------------

    async def on_node_profiled(self, *, uow: UnitOfWork, event: EventEnvelope, payload: NodeProfileEvent) -> None:
        """A node's GPUs become ledger accelerators (usable = HBM x ceiling), in the node's cluster (its
        ``<region>/<cluster>`` key: names repeat across regions)."""
        profile = payload.profile
        cluster = cluster_key(profile.region, profile.cluster) if profile.cluster else None
        accelerators = [
            self._spec(AcceleratorId.gpu(payload.node, a.index), a.sku, a.hbm_bytes, cluster=cluster)
            for a in payload.profile.accelerators
        ]
        view = await self._store.upsert_capacity(session=uow.session, node=payload.node, accelerators=accelerators)
        await self._held_above_reported(uow, node=payload.node, ids=[a.id for a in accelerators])
        self._capacity_changed(uow, event, node=payload.node, reason="profiled", view=view.values())

    async def _held_above_reported(self, uow: UnitOfWork, *, node: str, ids: list[str]) -> None:
        """A device reported smaller than what is reserved on it keeps its reservations: the database holds
        its usable HBM at what is reserved (nothing new fits) and lets it shrink with each release, down to
        the new figure (migration 0015, docs/LEDGER.md). Said once per report, with the figures."""
        held = await self._store.held_above_reported(session=uow.session, ids=ids)
        for accelerator_id, (usable, reported) in held.items():
            self._log.warning(
                "an accelerator reports less HBM than is reserved on it; it takes nothing new until releases "
                "bring it down to the new figure",
                extra={
                    "node": node,
                    "accelerator_id": accelerator_id,
                    "usable_bytes": usable,
                    "reported_bytes": reported,
                },
            )

    async def on_node_changed(self, *, uow: UnitOfWork, event: EventEnvelope, payload: NodeProfileEvent) -> None:
        """A re-profiled node resizes its accelerators; what is reserved on them stays."""
        await self.on_node_profiled(uow=uow, event=event, payload=payload)

    async def on_tpu_pod_profiled(self, *, uow: UnitOfWork, event: EventEnvelope, payload: TpuPodEvent) -> None:
        """A TPU chip is an accelerator of its own; a slice reserves its chips whole."""
        pod = TpuPod(name=payload.pod, region=payload.region, type=TpuType(payload.type), shape=tuple(payload.shape))
        accelerators = [self._spec(chip, payload.sku, payload.hbm_per_chip) for chip in tpu_chip_ids(pod)]
        view = await self._store.upsert_capacity(session=uow.session, node=pod.name, accelerators=accelerators)
        await self._held_above_reported(uow, node=pod.name, ids=[a.id for a in accelerators])
        self._capacity_changed(uow, event, node=pod.name, reason="profiled", view=view.values())

    async def on_node_lost(self, *, uow: UnitOfWork, event: EventEnvelope, payload: NodeStateEvent) -> None:
        await self._availability(uow, event, node=payload.node, available=False, reason="lost")

    async def on_node_removed(self, *, uow: UnitOfWork, event: EventEnvelope, payload: NodeStateEvent) -> None:
        await self._availability(uow, event, node=payload.node, available=False, reason="removed")

    async def on_node_recovered(self, *, uow: UnitOfWork, event: EventEnvelope, payload: NodeStateEvent) -> None:
        await self._availability(uow, event, node=payload.node, available=True, reason="recovered")

    def _spec(
        self, accelerator_id: str, sku: str, hbm_bytes: int, *, cluster: str | None = None
    ) -> store.AcceleratorSpec:
        return store.AcceleratorSpec(
            id=accelerator_id,
            sku=sku,
            hbm_total=hbm_bytes,
            ceiling=self._ceiling,
            usable=usable_hbm(hbm_bytes, self._ceiling),
            cluster=cluster,
        )

    async def _availability(
        self, uow: UnitOfWork, event: EventEnvelope, *, node: str, available: bool, reason: str
    ) -> None:
        """Lost / removed: the node's accelerators take nothing more and the allocations on them are
        flagged; recovered: they take commits again."""
        changed = await self._store.set_node_available(session=uow.session, node=node, available=available)
        if changed.flagged:
            uow.emit(
                Context.LEDGER,
                LedgerEvent.ALLOCATIONS_FLAGGED,
                AllocationsFlaggedEvent(node=node, reason=f"node_{reason}", allocation_ids=changed.flagged),
                causation_id=event.event_id,
            )
        self._capacity_changed(uow, event, node=node, reason=reason, view=changed.view.values())

    def _capacity_changed(
        self,
        uow: UnitOfWork,
        event: EventEnvelope,
        *,
        node: str,
        reason: str,
        view: Iterable[AcceleratorCapacity],
    ) -> None:
        accelerators = sorted(view, key=lambda c: c.id)
        if not accelerators:
            return  # a node the ledger never knew
        uow.emit(
            Context.LEDGER,
            LedgerEvent.CAPACITY_CHANGED,
            CapacityChangedEvent(node=node, reason=reason, accelerators=mapping.balances(accelerators)),
            causation_id=event.event_id,
        )

    # -- TELEMETRY events ----------------------------------------------------------------------

    async def on_gpu_telemetry(self, *, uow: UnitOfWork, event: EventEnvelope, payload: GpuTelemetryEvent) -> None:
        """Observed HBM use against what the ledger reserved; drift is reported once per episode."""
        used = {g.index: g.memory_used_bytes for g in payload.gpus if g.memory_used_bytes is not None}
        if not used:
            return
        for acc in await self._store.node_accelerators(session=uow.session, node=payload.node):
            observed = used.get(acc.index) if acc.index >= 0 else None  # a TPU chip has no GPU index
            if observed is None:
                continue
            drift = self._drift.observe(
                accelerator_id=acc.id, observed_bytes=observed, reserved_bytes=acc.reserved, usable_bytes=acc.usable
            )
            self._show_drift(acc, observed, reported=drift is not None)
            if drift is not None:
                uow.emit(
                    Context.LEDGER,
                    LedgerEvent.DRIFT_DETECTED,
                    DriftEvent(
                        accelerator_id=drift.accelerator_id,
                        observed_bytes=drift.observed_bytes,
                        reserved_bytes=drift.reserved_bytes,
                        usable_bytes=drift.usable_bytes,
                        difference_bytes=drift.difference,
                    ),
                    causation_id=event.event_id,
                )

    def _show_drift(self, acc: AcceleratorCapacity, observed: int, *, reported: bool) -> None:
        """The drift gauge: observed - reserved from the sample that reports an episode while the samples
        stay outside the detector's band, back to 0 with the first one inside it (the episode ends)."""
        if self._metrics is None or not (reported or acc.id in self._drifting):
            return
        if reported or _outside_band(self._drift, acc, observed):
            self._drifting.add(acc.id)
            self._metrics.drift(acc.id, observed - acc.reserved)
        else:
            self._drifting.discard(acc.id)
            self._metrics.drift(acc.id, 0)


def _outside_band(detector: DriftDetector, acc: AcceleratorCapacity, observed: int) -> bool:
    """Whether ``detector``'s rule calls this one sample a difference (a fresh detector that needs one
    sample answers it, so the rule stays the domain's)."""
    probe = DriftDetector(threshold=detector.threshold, consecutive=1)
    drift = probe.observe(
        accelerator_id=acc.id, observed_bytes=observed, reserved_bytes=acc.reserved, usable_bytes=acc.usable
    )
    return drift is not None
