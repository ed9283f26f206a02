"""Wiring of the cross-region-router service: its routes and lifecycle (the logic lives in `shared/`)."""

from __future__ import annotations

from faststream import FastStream

from shared.contracts.routing import RouteSelectRequest
from shared.contracts.subjects import Rpc
from shared.infra.service import Route, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings

SERVICE = ServiceDefinition(
    name="cross-region-router",
    health=Rpc.ROUTE_HEALTH,
    schema="routing",
    routes=(Route(Rpc.ROUTE_SELECT, RouteSelectRequest),),
)


def bootstrap(settings: Settings) -> tuple[FastStream, Runtime]:
    return build_app(SERVICE, settings)
