"""Wiring of the topology-discovery service: fleet mode (the fleet's owner) or agent mode (one per node)."""

from __future__ import annotations

from typing import Any

from faststream import FastStream
from faststream.nats import NatsBroker

from services.topology_discovery.agent import start_agent
from services.topology_discovery.fleet import (
    FleetState,
    fleet_describe_handler,
    fleet_get_handler,
    liveness_loop,
    load_configured_inventory,
    report_handler,
    subscribe_heartbeats,
    watch_agents,
)
from shared.contracts.fleet import FleetDescribeRequest, FleetGetRequest
from shared.contracts.subjects import Rpc
from shared.contracts.topology import TopologyReportRequest
from shared.infra.service import Route, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings


def _fleet_definition() -> ServiceDefinition:
    state: dict[str, FleetState] = {}

    def st(runtime: Runtime) -> FleetState:
        return state.setdefault("s", FleetState(runtime))

    def factory(make: Any) -> Any:
        return lambda runtime: make(runtime, st(runtime))

    async def on_start(runtime: Runtime) -> None:
        await load_configured_inventory(runtime, st(runtime))
        await watch_agents(runtime, st(runtime))
        runtime.spawn(liveness_loop(runtime, st(runtime)), name="liveness")

    def extra(broker: NatsBroker, runtime: Runtime) -> None:
        subscribe_heartbeats(broker, runtime, st(runtime))

    return ServiceDefinition(
        name="topology-discovery",
        health=Rpc.TOPOLOGY_HEALTH,
        schema="topology",
        routes=(
            Route(Rpc.FLEET_GET, FleetGetRequest, factory(fleet_get_handler)),
            Route(Rpc.FLEET_DESCRIBE, FleetDescribeRequest, factory(fleet_describe_handler)),
            Route(Rpc.TOPOLOGY_REPORT, TopologyReportRequest, factory(report_handler)),
        ),
        on_start=(on_start,),
        extra=extra,
    )


SERVICE = _fleet_definition()  # what the registry and tests read; each app builds its own

AGENT = ServiceDefinition(
    name="topology-agent", health=Rpc.TOPOLOGY_AGENT_HEALTH, schema="topology", on_start=(start_agent,)
)


def bootstrap(settings: Settings) -> tuple[FastStream, Runtime]:
    if settings.topology_mode == "agent":
        return build_app(AGENT, settings, database=False)
    return build_app(_fleet_definition(), settings)
