"""Wiring of the topology-discovery service: fleet mode (the fleet's owner) or agent mode (one per node)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from faststream import FastStream

from services.topology_discovery.agent import Agent, AgentIntervals, make_provider, node_name
from services.topology_discovery.handlers import TopologyHandlers
from services.topology_discovery.metrics import TopologyMetrics
from services.topology_discovery.providers import TopologyProvider
from services.topology_discovery.simulated import SimulatedGpus, inventory_gpus
from services.topology_discovery.supervisor import Supervisor
from services.topology_discovery.tables import SCHEMA
from shared.contracts.fleet import FleetDescribeRequest, FleetGetRequest
from shared.contracts.ledger import LedgerEventName
from shared.contracts.subjects import Context, Rpc
from shared.contracts.topology import Heartbeat, TopologyReportRequest
from shared.domain.liveness import LivenessTracker
from shared.infra.catalog import load_skus
from shared.infra.clock import MonotonicMs, monotonic_ms
from shared.infra.service import Consumer, Listen, Loop, Route, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings

# -- fleet mode --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ctx:
    handlers: TopologyHandlers


def wire(runtime: Runtime, *, clock_ms: MonotonicMs = monotonic_ms) -> Ctx:
    settings = runtime.settings
    handlers = TopologyHandlers(
        uow=runtime.uow,
        monotonic_ms=clock_ms,
        skus=load_skus(settings.kit.sku_catalog),
        tracker=LivenessTracker(
            interval_ms=settings.topology.heartbeat_s * 1000, missed_beats=settings.topology.missed_heartbeats
        ),
        log=runtime.log,
        inventory=settings.topology.inventory,
        max_payload=lambda: runtime.nats.max_payload,
        liveness_period_s=max(settings.topology.heartbeat_s / 4, 0.05),
        metrics=TopologyMetrics(runtime.metrics, clock=runtime.clock),
    )
    return Ctx(handlers=handlers)


SERVICE = ServiceDefinition(
    name="topology-discovery",
    health=Rpc.TOPOLOGY_HEALTH,
    schema=SCHEMA,
    wire=wire,
    routes=(
        Route(Rpc.FLEET_GET, FleetGetRequest, lambda ctx: ctx.handlers.fleet_get),
        Route(Rpc.FLEET_DESCRIBE, FleetDescribeRequest, lambda ctx: ctx.handlers.fleet_describe),
        Route(Rpc.TOPOLOGY_REPORT, TopologyReportRequest, lambda ctx: ctx.handlers.report),
    ),
    consumers=(
        Consumer(
            Context.LEDGER,
            "ledger",
            on={
                LedgerEventName.ALLOCATION_COMMITTED: lambda ctx: ctx.handlers.on_allocation_committed,
                LedgerEventName.ALLOCATION_RELEASED: lambda ctx: ctx.handlers.on_allocation_ended,
                LedgerEventName.ALLOCATION_EXPIRED: lambda ctx: ctx.handlers.on_allocation_ended,
            },
            together=True,  # one per placement and release: a batch per transaction (the handlers only write rows)
            skip=lambda payload: not payload.counts_against_hbm,  # requests' KV holds move no HBM
        ),
    ),
    loops=(Loop("liveness", lambda ctx: ctx.handlers.liveness_loop),),
    on_start=(lambda ctx: ctx.handlers.load_inventory(), lambda ctx: ctx.handlers.watch_agents()),
    # Heartbeats are core NATS (fire and forget): a garbled one, or one naming another node than its
    # subject (the one its agent's credential may publish on), is dropped by the kit.
    listens=(Listen(lambda subjects: subjects.heartbeats(), Heartbeat, lambda ctx: ctx.handlers.heartbeat),),
)

# -- agent mode --------------------------------------------------------------------------------


@dataclass(frozen=True)
class AgentCtx:
    agent: Agent
    supervisor: Supervisor


def wire_agent(runtime: Runtime, *, provider: TopologyProvider | None = None) -> AgentCtx:
    settings = runtime.settings
    node = node_name(settings)
    provider = provider or make_provider(settings)
    supervisor = Supervisor(
        node=node,
        rpc=runtime.rpc,
        jetstream=lambda: runtime.jetstream,
        subjects=runtime.subjects,
        clock=runtime.clock,
        settings=settings.agent,
        log_dir=settings.kit.data_dir / "engines" / node,
        log=runtime.log,
    )
    simulated = None
    if provider is None and settings.agent.engine == "sim":  # simulated engines on an inventory node
        gpus = inventory_gpus(settings.topology.inventory, node, runtime.log)
        if gpus:
            simulated = SimulatedGpus(gpus=gpus, supervisor=supervisor).samples
    agent = Agent(
        node=node,
        provider=provider,
        rpc=runtime.rpc,
        nats=lambda: runtime.nats,
        jetstream=lambda: runtime.jetstream,
        subjects=runtime.subjects,
        clock=runtime.clock,
        intervals=AgentIntervals.from_settings(settings),
        log=runtime.log,
        simulated=simulated,
        runs_engines=settings.agent.engine != "none",
    )
    return AgentCtx(agent=agent, supervisor=supervisor)


AGENT = ServiceDefinition(
    name="topology-agent",
    health=Rpc.TOPOLOGY_AGENT_HEALTH,
    schema=SCHEMA,
    wire=wire_agent,
    loops=(
        Loop("topology-scan", lambda ctx: ctx.agent.scan_loop),
        Loop("topology-heartbeat", lambda ctx: ctx.agent.heartbeat_loop),
        Loop("topology-telemetry", lambda ctx: ctx.agent.telemetry_loop),
        Loop("engine-reconcile", lambda ctx: ctx.supervisor.reconcile_loop),
        Loop("engine-status", lambda ctx: ctx.supervisor.status_loop),
    ),
    on_stop=(lambda ctx: ctx.supervisor.stop_all(),),
    calls=(Rpc.PLACEMENT_ASSIGNMENTS,),
)


def bootstrap(settings: Settings, **overrides: Any) -> tuple[FastStream, Runtime]:
    if settings.topology.mode == "agent":
        return build_app(AGENT, settings, database=False, **overrides)
    return build_app(SERVICE, settings, **overrides)
