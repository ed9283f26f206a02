"""Wiring of the rebalancer service (the shape of docs/SERVICE.md): its routes, consumers and loops,
and ``wire``, which builds its handlers once. The rules live in `shared/domain/rebalance`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from faststream import FastStream

from services.rebalancer.handlers import RebalanceConfig, RebalanceHandlers
from services.rebalancer.metrics import RebalanceMetrics
from services.rebalancer.tables import SCHEMA
from shared.contracts.ledger import LedgerEvent
from shared.contracts.placement_events import PlacementEventName
from shared.contracts.rebalance import RebalanceStatusRequest
from shared.contracts.streams import restate_every_s
from shared.contracts.subjects import Context, Rpc
from shared.contracts.topology import TopologyEvent
from shared.domain.rebalance.detect import Rule
from shared.infra.catalog import load_models, load_skus
from shared.infra.service import Consumer, Loop, Route, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings


@dataclass(frozen=True)
class Ctx:
    handlers: RebalanceHandlers


def config_of(settings: Settings) -> RebalanceConfig:
    """The detectors' rules from the settings (defaults from the brief)."""
    hysteresis = settings.rebalancer.hysteresis
    drift_stale = max(settings.rebalancer.drift_window_s, settings.rebalancer.drift_check_s)
    return RebalanceConfig(
        hot=Rule("hbm_hot", settings.rebalancer.hot_util, settings.rebalancer.hot_window_s, hysteresis=hysteresis),
        cold=Rule(
            "hbm_cold",
            settings.rebalancer.cold_util,
            settings.rebalancer.cold_window_s,
            above=False,
            hysteresis=hysteresis,
        ),
        fragmentation=Rule(
            "tpu_fragmentation",
            settings.rebalancer.frag_threshold,
            settings.rebalancer.frag_window_s,
            hysteresis=hysteresis,
        ),
        pcie=Rule("pcie_hot", settings.rebalancer.pcie_util, settings.rebalancer.pcie_window_s, hysteresis=hysteresis),
        # Drift is sampled every `drift_check_s` on agents that report every 30 s: a target is kept well past
        # a silent gap, so a drift that lasts fires its alarm once.
        drift_alarm=Rule(
            "hbm_drift_alarm", settings.rebalancer.drift_ratio, 0, hysteresis=0.02, stale_s=max(300.0, 3 * drift_stale)
        ),
        drift=Rule(
            "hbm_drift",
            settings.rebalancer.drift_ratio,
            settings.rebalancer.drift_window_s,
            hysteresis=0.02,
            stale_s=max(300.0, 3 * drift_stale),
        ),
        migrations_per_min=settings.rebalancer.migrations_per_min,
        drift_check_s=settings.rebalancer.drift_check_s,
        tick_s=settings.rebalancer.tick_s,
    )


def wire(runtime: Runtime) -> Ctx:
    settings = runtime.settings
    handlers = RebalanceHandlers(
        uow=runtime.uow,
        rpc=runtime.rpc,
        clock=runtime.clock,
        config=config_of(settings),
        skus=load_skus(settings.kit.sku_catalog),
        models=load_models(settings.kit.model_catalog),
        jetstream=lambda: runtime.jetstream,
        subjects=runtime.subjects,
        stream_prefix=settings.kit.stream_prefix,
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
    on_stop=(lambda ctx: ctx.handlers.stop(),),
    consumers=(
        Consumer(
            Context.TOPOLOGY,
            "topology",
            on={
                TopologyEvent.NODE_PROFILED: lambda ctx: ctx.handlers.on_node_profiled,
                TopologyEvent.NODE_CHANGED: lambda ctx: ctx.handlers.on_node_profiled,
                TopologyEvent.NODE_REMOVED: lambda ctx: ctx.handlers.on_node_removed,
                TopologyEvent.TPU_POD_PROFILED: lambda ctx: ctx.handlers.on_tpu_pod_profiled,
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
        ),
        # Bytes per GPU of each allocation (drift) and each replica's KV holds (messages in flight).
        Consumer(
            Context.LEDGER,
            "ledger",
            on={
                LedgerEvent.ALLOCATION_COMMITTED: lambda ctx: ctx.handlers.on_allocation_committed,
                LedgerEvent.ALLOCATION_RELEASED: lambda ctx: ctx.handlers.on_allocation_ended,
                LedgerEvent.ALLOCATION_EXPIRED: lambda ctx: ctx.handlers.on_allocation_ended,
            },
            together=True,
        ),
    ),
    loops=(Loop("rebalance-tick", lambda ctx: ctx.handlers.tick),),
    calls=(Rpc.PLACEMENT_PLACE, Rpc.PLACEMENT_RELEASE, Rpc.FLEET_GET, Rpc.LEDGER_SNAPSHOT),
    # GPU telemetry: an ordered consumer of new samples (the detectors' input; nothing durable to replay).
    reads=(Context.TELEMETRY,),
)


def bootstrap(settings: Settings, **overrides: Any) -> tuple[FastStream, Runtime]:
    return build_app(SERVICE, settings, **overrides)
