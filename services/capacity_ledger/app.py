"""Wiring of the capacity-ledger service: commit/release/renew/snapshot, the lease sweeper, and the
consumers of topology (capacity, lost nodes) and telemetry (drift)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import TypeVar

from faststream import FastStream
from pydantic import BaseModel
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncSession

from services.capacity_ledger import store
from services.capacity_ledger.batcher import CommitBatcher
from shared.contracts.base import ErrorCode, rejected
from shared.contracts.envelope import EventEnvelope
from shared.contracts.ledger import (
    ALLOCATION_EXPIRED,
    ALLOCATION_RELEASED,
    ALLOCATIONS_FLAGGED,
    CAPACITY_CHANGED,
    DRIFT_DETECTED,
    AcceleratorLedgerView,
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
    SnapshotReply,
    SnapshotRequest,
)
from shared.contracts.subjects import Context, Rpc
from shared.contracts.topology import (
    NODE_CHANGED,
    NODE_LOST,
    NODE_PROFILED,
    NODE_RECOVERED,
    NODE_REMOVED,
    TPU_POD_PROFILED,
)
from shared.domain.fleet import TpuPod, tpu_chip_ids
from shared.domain.ledger import DriftDetector
from shared.domain.memory import usable_hbm
from shared.domain.topology.tpu import TpuType
from shared.infra.bus import EventHandler
from shared.infra.service import EventRoute, Route, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings

T = TypeVar("T")
RETRYABLE = {"40P01", "40001", "23505"}  # deadlock, serialization, a concurrent duplicate insert


async def transaction(runtime: Runtime, work: Callable[[AsyncSession], Awaitable[T]], *, attempts: int = 5) -> T:
    """Run ``work`` in one transaction, again from scratch when Postgres asks for a retry."""
    for attempt in range(attempts):
        try:
            async with runtime.sessions() as session, session.begin():
                result = await work(session)
            if runtime.relay:
                runtime.relay.wake()
            return result
        except DBAPIError as exc:
            code = getattr(getattr(exc.orig, "__cause__", None), "sqlstate", None) or getattr(
                exc.orig, "sqlstate", None
            )
            if code not in RETRYABLE or attempt == attempts - 1:
                raise
            await asyncio.sleep(0.002 * (attempt + 1))
    raise AssertionError("unreachable")


_BATCHERS: dict[int, CommitBatcher] = {}


def _batcher(runtime: Runtime) -> CommitBatcher:
    """One group-commit batcher per runtime (started with the service)."""
    batcher = _BATCHERS.get(id(runtime))
    if batcher is None:
        lease = runtime.settings.ledger_default_lease_s

        async def apply(commits: Sequence[CommitRequest]) -> list[CommitReply]:
            return await transaction(
                runtime, lambda s: store.commit_batch(s, commits, subjects=runtime.subjects, default_lease_s=lease)
            )

        batcher = _BATCHERS[id(runtime)] = CommitBatcher(apply, max_batch=runtime.settings.ledger_max_batch)
    return batcher


def commit_handler(runtime: Runtime) -> Callable[[CommitRequest], Awaitable[BaseModel]]:
    batcher = _batcher(runtime)

    async def handle(request: CommitRequest) -> BaseModel:
        return await batcher.submit(request)

    return handle


def commit_batch_handler(runtime: Runtime) -> Callable[[CommitBatchRequest], Awaitable[BaseModel]]:
    lease = runtime.settings.ledger_default_lease_s

    async def handle(request: CommitBatchRequest) -> BaseModel:
        results: list[CommitReply] = await transaction(
            runtime, lambda s: store.commit_batch(s, request.commits, subjects=runtime.subjects, default_lease_s=lease)
        )
        return CommitBatchReply(results=results)

    return handle


def release_handler(runtime: Runtime) -> Callable[[LedgerReleaseRequest], Awaitable[BaseModel]]:
    async def handle(request: LedgerReleaseRequest) -> BaseModel:
        outcome, _row = await transaction(
            runtime,
            lambda s: store.end_allocation(
                s,
                request.allocation_id,
                subjects=runtime.subjects,
                state="released",
                event=ALLOCATION_RELEASED,
                tenant=request.tenant,
            ),
        )
        if outcome == "not_found":
            return rejected(ErrorCode.NOT_FOUND, f"no allocation {request.allocation_id!r}")
        if outcome == "forbidden":
            return rejected(ErrorCode.FORBIDDEN, "the allocation belongs to another tenant")
        return LedgerReleaseReply(status="released", already=outcome == "already")

    return handle


def renew_handler(runtime: Runtime) -> Callable[[LedgerRenewRequest], Awaitable[BaseModel]]:
    async def handle(request: LedgerRenewRequest) -> BaseModel:
        now = datetime.now(UTC)
        expires = request.lease_expires_at or now + timedelta(seconds=request.lease_s or 0)
        if expires <= now:
            return rejected(ErrorCode.INVALID_REQUEST, "the new lease ends in the past")
        outcome, _row = await transaction(
            runtime, lambda s: store.renew(s, request.allocation_id, tenant=request.tenant, expires_at=expires)
        )
        if outcome == "not_found":
            return rejected(ErrorCode.NOT_FOUND, f"no allocation {request.allocation_id!r}")
        if outcome == "forbidden":
            return rejected(ErrorCode.FORBIDDEN, "the allocation belongs to another tenant")
        if outcome == "ended":
            return rejected(ErrorCode.CONFLICT, "the allocation was released or has expired")
        return LedgerRenewReply(status="renewed", lease_expires_at=expires)

    return handle


def snapshot_handler(runtime: Runtime) -> Callable[[SnapshotRequest], Awaitable[BaseModel]]:
    async def handle(request: SnapshotRequest) -> BaseModel:
        async with runtime.sessions() as session:
            rows, cursor = await store.snapshot(
                session, node=request.node, after=request.cursor, limit=request.limit or 2048
            )
        return SnapshotReply(
            accelerators=[
                AcceleratorLedgerView(
                    id=r["id"],
                    node=r["node"],
                    hbm_usable=r["hbm_usable"],
                    hbm_reserved=r["reserved"],
                    available=r["available"],
                    allocations=list(r["allocations"]),
                )
                for r in rows
            ],
            next_cursor=cursor,
        )

    return handle


async def sweep_leases(runtime: Runtime) -> None:
    """Release allocations whose lease ended, each with an `allocation_expired` event."""
    period = runtime.settings.ledger_sweep_ms / 1000
    while True:
        await asyncio.sleep(period)
        try:
            async with runtime.sessions() as session:
                ids = await store.expired_ids(session, limit=500)
            for allocation_id in ids:
                await transaction(
                    runtime,
                    lambda s, a=allocation_id: store.end_allocation(  # type: ignore[misc]
                        s, a, subjects=runtime.subjects, state="expired", event=ALLOCATION_EXPIRED
                    ),
                )
        except Exception:
            runtime.log.exception("lease sweep failed; retrying")


def topology_consumer(runtime: Runtime) -> EventHandler:
    """Capacity from node profiles; lost/removed nodes make accelerators unavailable and flag allocations."""
    ceiling = runtime.settings.ledger_ceiling

    async def apply(session: AsyncSession, event: EventEnvelope) -> None:
        kind = event.type.rsplit(".", 1)[-1]
        payload = event.payload
        node = str(payload.get("node"))
        if kind in (NODE_PROFILED, NODE_CHANGED):
            profile = payload["profile"]
            accs = [(f"{node}/gpu{a['index']}", str(a["sku"]), int(a["hbm_bytes"])) for a in profile["accelerators"]]
            view = await store.upsert_capacity(
                session, node=node, accelerators=accs, ceiling=ceiling, usable=usable_hbm
            )
            reason = "profiled"
        elif kind == TPU_POD_PROFILED:
            # A TPU chip is an accelerator of its own; a slice reserves its chips whole.
            pod = TpuPod(
                name=str(payload["pod"]),
                region=str(payload["region"]),
                type=TpuType(payload["type"]),
                shape=tuple(payload["shape"]),
            )
            node = pod.name
            accs = [(chip, str(payload["sku"]), int(payload["hbm_per_chip"])) for chip in tpu_chip_ids(pod)]
            view = await store.upsert_capacity(
                session, node=node, accelerators=accs, ceiling=ceiling, usable=usable_hbm
            )
            reason = "profiled"
        elif kind in (NODE_LOST, NODE_REMOVED, NODE_RECOVERED):
            view, flagged = await store.set_node_available(session, node=node, available=kind == NODE_RECOVERED)
            reason = {NODE_LOST: "lost", NODE_REMOVED: "removed", NODE_RECOVERED: "recovered"}[kind]
            if flagged:
                await store.emit(
                    session,
                    runtime.subjects,
                    ALLOCATIONS_FLAGGED,
                    AllocationsFlaggedEvent(node=node, reason=f"node_{reason}", allocation_ids=flagged).model_dump(
                        mode="json"
                    ),
                    causation_id=str(event.event_id),
                )
        else:
            return
        if view:
            await store.emit(
                session,
                runtime.subjects,
                CAPACITY_CHANGED,
                CapacityChangedEvent(node=node, reason=reason, accelerators=store.balances(view, view)).model_dump(
                    mode="json"
                ),
                causation_id=str(event.event_id),
            )

    return apply


def telemetry_consumer(runtime: Runtime) -> EventHandler:
    detector = DriftDetector(threshold=runtime.settings.drift_threshold, consecutive=runtime.settings.drift_consecutive)

    async def apply(session: AsyncSession, event: EventEnvelope) -> None:
        node = str(event.payload.get("node"))
        samples = {int(g["index"]): g.get("memory_used_bytes") for g in event.payload.get("gpus", [])}
        rows = await session.execute(
            text("SELECT id, hbm_usable, reserved FROM ledger.accelerators WHERE node = :node"), {"node": node}
        )
        for row in rows:
            index = int(row.id.rsplit("gpu", 1)[-1]) if "gpu" in row.id else -1
            used = samples.get(index)
            if used is None:
                continue
            drift = detector.observe(
                accelerator_id=row.id,
                observed_bytes=int(used),
                reserved_bytes=row.reserved,
                usable_bytes=row.hbm_usable,
            )
            if drift is not None:
                await store.emit(
                    session,
                    runtime.subjects,
                    DRIFT_DETECTED,
                    DriftEvent(
                        accelerator_id=drift.accelerator_id,
                        observed_bytes=drift.observed_bytes,
                        reserved_bytes=drift.reserved_bytes,
                        usable_bytes=drift.usable_bytes,
                        difference_bytes=drift.difference,
                    ).model_dump(mode="json"),
                    causation_id=str(event.event_id),
                )

    return apply


async def start_sweeper(runtime: Runtime) -> None:
    _batcher(runtime).start()
    runtime.spawn(sweep_leases(runtime), name="lease-sweeper")


async def stop_batcher(runtime: Runtime) -> None:
    batcher = _BATCHERS.pop(id(runtime), None)
    if batcher is not None:
        await batcher.stop()


SERVICE = ServiceDefinition(
    name="capacity-ledger",
    health=Rpc.LEDGER_HEALTH,
    schema="ledger",
    routes=(
        Route(Rpc.LEDGER_COMMIT, CommitRequest, commit_handler),
        Route(Rpc.LEDGER_COMMIT_BATCH, CommitBatchRequest, commit_batch_handler),
        Route(Rpc.LEDGER_RELEASE, LedgerReleaseRequest, release_handler),
        Route(Rpc.LEDGER_RENEW, LedgerRenewRequest, renew_handler),
        Route(Rpc.LEDGER_SNAPSHOT, SnapshotRequest, snapshot_handler),
    ),
    events=(
        EventRoute(Context.TOPOLOGY, "*", "topology", topology_consumer),
        EventRoute(Context.TELEMETRY, "gpu", "telemetry", telemetry_consumer),
    ),
    on_start=(start_sweeper,),
    on_stop=(stop_batcher,),
)


def bootstrap(settings: Settings) -> tuple[FastStream, Runtime]:
    return build_app(SERVICE, settings)
