"""Wiring of the capacity-ledger service: commit/release/renew/snapshot, the lease sweeper, and the
consumers of topology (capacity, lost and removed nodes) and telemetry (drift). No logic here."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from faststream import FastStream

from services.capacity_ledger import store, tables
from services.capacity_ledger.batcher import CommitBatcher
from services.capacity_ledger.handlers import LedgerHandlers
from services.capacity_ledger.metrics import LedgerMetrics, refresh_loop
from shared.contracts.ledger import (
    CommitBatchRequest,
    CommitRequest,
    LedgerPreemptRequest,
    LedgerReleaseRequest,
    LedgerRenewRequest,
    SnapshotRequest,
)
from shared.contracts.subjects import Context, Rpc
from shared.contracts.topology import TelemetryEventName, TopologyEventName
from shared.domain.ledger import DriftDetector
from shared.infra.service import Consumer, Loop, Route, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings


@dataclass(frozen=True)
class Ctx:
    handlers: LedgerHandlers
    batcher: CommitBatcher
    refresh_metrics: Callable[[], Awaitable[None]]


def wire(runtime: Runtime) -> Ctx:
    settings = runtime.settings
    batcher = CommitBatcher(max_batch=settings.ledger.max_batch)
    metrics = LedgerMetrics(
        runtime.metrics, crossing_budget_bytes_per_s=settings.ledger.cross_domain_budget_bytes_per_s
    )
    handlers = LedgerHandlers(
        uow=runtime.uow,
        clock=runtime.clock,
        batcher=batcher,
        ceiling=settings.ledger.ceiling,
        default_lease_s=settings.ledger.default_lease_s,
        sweep_period_s=settings.ledger.sweep_ms / 1000,
        drift=DriftDetector(
            threshold=settings.ledger.drift_threshold,
            consecutive=settings.ledger.drift_consecutive,
            grace_s=settings.ledger.drift_grace_s,
        ),
        max_payload=lambda: runtime.nats.max_payload,
        log=runtime.log,
        crossing_budget=settings.ledger.cross_domain_budget_bytes_per_s,
        metrics=metrics,
    )

    async def figures() -> store.MetricsFigures:
        return await runtime.uow.read(lambda session: store.metrics_figures(session=session))

    async def refresh() -> None:
        await refresh_loop(metrics, figures, log=runtime.log)

    return Ctx(handlers=handlers, batcher=batcher, refresh_metrics=refresh)


async def start_batcher(ctx: Ctx) -> None:
    ctx.batcher.start(ctx.handlers.apply_commits)


async def stop_batcher(ctx: Ctx) -> None:
    await ctx.batcher.stop()


SERVICE = ServiceDefinition(
    name="capacity-ledger",
    health=Rpc.LEDGER_HEALTH,
    schema=tables.SCHEMA,
    wire=wire,
    routes=(
        Route(Rpc.LEDGER_COMMIT, CommitRequest, lambda ctx: ctx.handlers.commit),
        Route(Rpc.LEDGER_COMMIT_BATCH, CommitBatchRequest, lambda ctx: ctx.handlers.commit_batch),
        Route(Rpc.LEDGER_RELEASE, LedgerReleaseRequest, lambda ctx: ctx.handlers.release),
        Route(Rpc.LEDGER_RENEW, LedgerRenewRequest, lambda ctx: ctx.handlers.renew),
        Route(Rpc.LEDGER_PREEMPT, LedgerPreemptRequest, lambda ctx: ctx.handlers.preempt),
        Route(Rpc.LEDGER_SNAPSHOT, SnapshotRequest, lambda ctx: ctx.handlers.snapshot),
    ),
    consumers=(
        Consumer(
            Context.TOPOLOGY,
            "topology",
            on={
                TopologyEventName.NODE_PROFILED: lambda ctx: ctx.handlers.on_node_profiled,
                TopologyEventName.NODE_CHANGED: lambda ctx: ctx.handlers.on_node_changed,
                TopologyEventName.NODE_REMOVED: lambda ctx: ctx.handlers.on_node_removed,
                TopologyEventName.NODE_LOST: lambda ctx: ctx.handlers.on_node_lost,
                TopologyEventName.NODE_RECOVERED: lambda ctx: ctx.handlers.on_node_recovered,
                TopologyEventName.TPU_POD_PROFILED: lambda ctx: ctx.handlers.on_tpu_pod_profiled,
            },
        ),
        Consumer(
            Context.TELEMETRY, "telemetry", on={TelemetryEventName.GPU: lambda ctx: ctx.handlers.on_gpu_telemetry}
        ),
    ),
    loops=(
        Loop("lease-sweeper", lambda ctx: ctx.handlers.sweep_leases),
        Loop("ledger-metrics", lambda ctx: ctx.refresh_metrics),
    ),
    on_start=(start_batcher,),
    on_stop=(stop_batcher,),
)


def bootstrap(settings: Settings, **overrides: Any) -> tuple[FastStream, Runtime]:
    return build_app(SERVICE, settings, **overrides)
