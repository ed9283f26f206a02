"""Wiring of the rebalancer service (the shape of docs/SERVICE.md): its routes, consumers and loops,
and ``wire``, which builds its handlers once with their store. The rules live in `shared/domain/rebalance`,
the settings they are built from in `config.py`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from faststream import FastStream

from services.rebalancer.config import config_of
from services.rebalancer.handlers import RebalanceHandlers
from services.rebalancer.metrics import RebalanceMetrics
from services.rebalancer.store import RebalanceStore
from services.rebalancer.tables import SCHEMA
from shared.contracts.ledger import LedgerEventName
from shared.contracts.placement import PlacementEventName
from shared.contracts.rebalance import RebalanceStatusRequest
from shared.contracts.streams import restate_every_s
from shared.contracts.subjects import Context, Rpc
from shared.contracts.topology import TelemetryEventName, TopologyEventName
from shared.infra.catalog import load_models, load_skus
from shared.infra.follow import Follow, Start
from shared.infra.service import Consumer, Loop, Route, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings


@dataclass(frozen=True)
class Ctx:
    handlers: RebalanceHandlers


def wire(runtime: Runtime) -> Ctx:
    settings = runtime.settings
    handlers = RebalanceHandlers(
        uow=runtime.uow,
        store=RebalanceStore(),
        rpc=runtime.rpc,
        clock=runtime.clock,
        config=config_of(settings),
        skus=load_skus(settings.kit.sku_catalog),
        models=load_models(settings.kit.model_catalog),
        log=runtime.log,
        metrics=RebalanceMetrics(runtime.metrics),
        restate_s=restate_every_s(settings.kit.stream_rebalance_max_age_s),  # docs/RETENTION.md
    )
    return Ctx(handlers=handlers)


SERVICE = ServiceDefinition(
    name="rebalancer",
    health=Rpc.REBALANCE_HEALTH,
    schema=SCHEMA,
    wire=wire,
    routes=(Route(Rpc.REBALANCE_STATUS, RebalanceStatusRequest, lambda ctx: ctx.handlers.status),),
    on_start=(lambda ctx: ctx.handlers.start(),),
    consumers=(
        Consumer(
            Context.TOPOLOGY,
            "topology",
            on={
                TopologyEventName.NODE_PROFILED: lambda ctx: ctx.handlers.on_node_profiled,
                TopologyEventName.NODE_CHANGED: lambda ctx: ctx.handlers.on_node_profiled,
                TopologyEventName.NODE_REMOVED: lambda ctx: ctx.handlers.on_node_removed,
                TopologyEventName.TPU_POD_PROFILED: lambda ctx: ctx.handlers.on_tpu_pod_profiled,
            },
        ),
        # Replicas and the request each was placed with (what a move asks again).
        Consumer(
            Context.PLACEMENT,
            "placement",
            on={
                PlacementEventName.PLACEMENT_DECIDED: lambda ctx: ctx.handlers.on_placement_decided,
                PlacementEventName.PLACEMENT_RELEASED: lambda ctx: ctx.handlers.on_placement_released,
            },
            together=True,  # one per placement and release: a batch per transaction (the handlers only write rows)
        ),
        # Bytes per GPU of each allocation (drift).
        Consumer(
            Context.LEDGER,
            "ledger",
            on={
                LedgerEventName.ALLOCATION_COMMITTED: lambda ctx: ctx.handlers.on_allocation_committed,
                LedgerEventName.ALLOCATION_RELEASED: lambda ctx: ctx.handlers.on_allocation_ended,
                LedgerEventName.ALLOCATION_EXPIRED: lambda ctx: ctx.handlers.on_allocation_ended,
            },
            together=True,
        ),
    ),
    loops=(Loop("rebalance-tick", lambda ctx: ctx.handlers.tick),),
    calls=(Rpc.PLACEMENT_PLACE, Rpc.PLACEMENT_RELEASE, Rpc.FLEET_GET, Rpc.LEDGER_SNAPSHOT),
    # Telemetry from now on (nothing durable to replay): GPU samples, the detectors' input; engine reports,
    # what a draining replica still has in flight; ranks' lifecycle states, whether a copy serves yet.
    follows=(
        Follow(
            Context.TELEMETRY,
            start=Start.NEW,
            on={
                TelemetryEventName.GPU: lambda ctx: lambda sample, meta: ctx.handlers.observe(sample, meta.occurred_at),
                TelemetryEventName.ENGINE_STATUS: lambda ctx: (
                    lambda report, meta: ctx.handlers.on_engine_status(report, meta.occurred_at)
                ),
                TelemetryEventName.REPLICA_STATE: lambda ctx: (
                    lambda report, meta: ctx.handlers.on_replica_state(report, meta.occurred_at)
                ),
            },
        ),
    ),
)


def bootstrap(settings: Settings, **overrides: Any) -> tuple[FastStream, Runtime]:
    return build_app(SERVICE, settings, **overrides)
