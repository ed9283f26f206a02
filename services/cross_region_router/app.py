"""Wiring of the cross-region-router service (the shape of docs/SERVICE.md): its routes, consumers and loops,
and ``wire``, which builds its handlers once. The logic will live in `shared/domain/`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from faststream import FastStream

from services.cross_region_router.handlers import RoutingHandlers
from services.cross_region_router.tables import SCHEMA
from shared.contracts.routing import RouteSelectRequest
from shared.contracts.subjects import Rpc
from shared.infra.service import Route, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings


@dataclass(frozen=True)
class Ctx:
    handlers: RoutingHandlers


def wire(runtime: Runtime) -> Ctx:
    return Ctx(handlers=RoutingHandlers(uow=runtime.uow, rpc=runtime.rpc, clock=runtime.clock))


SERVICE = ServiceDefinition(
    name="cross-region-router",
    health=Rpc.ROUTE_HEALTH,
    schema=SCHEMA,
    wire=wire,
    routes=(
        Route(Rpc.ROUTE_SELECT, RouteSelectRequest),  # not built yet: answers not_implemented
    ),
)


def bootstrap(settings: Settings, **overrides: Any) -> tuple[FastStream, Runtime]:
    return build_app(SERVICE, settings, **overrides)
