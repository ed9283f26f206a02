"""Wiring of the topology-discovery service: its routes and lifecycle (the logic lives in `shared/`)."""

from __future__ import annotations

from faststream import FastStream

from shared.contracts.fleet import FleetGetRequest
from shared.contracts.subjects import Rpc
from shared.infra.service import Route, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings

SERVICE = ServiceDefinition(
    name="topology-discovery",
    health=Rpc.TOPOLOGY_HEALTH,
    schema="topology",
    routes=(
        Route(Rpc.FLEET_GET, FleetGetRequest),
        Route(Rpc.FLEET_DESCRIBE, FleetGetRequest),
    ),
)


def bootstrap(settings: Settings) -> tuple[FastStream, Runtime]:
    return build_app(SERVICE, settings)
