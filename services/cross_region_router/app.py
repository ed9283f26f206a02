"""Wiring of the cross-region-router service (the shape of docs/SERVICE.md): its routes, consumers and loops,
and ``wire``, which builds its handlers once. The rules live in `shared/domain/routing`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from faststream import FastStream

from services.cross_region_router.handlers import RoutingHandlers
from services.cross_region_router.metrics import RouterMetrics
from services.cross_region_router.store import RoutingStore
from services.cross_region_router.tables import SCHEMA
from shared.contracts.placement import PlacementEventName
from shared.contracts.routing import RouteRegionRequest, RouteSelectRequest
from shared.contracts.subjects import Context, Rpc
from shared.domain.routing import AffinityRule, RoutePolicy
from shared.infra.catalog import load_model_groups, load_models, load_regions, watch_regions
from shared.infra.service import Consumer, Loop, Route, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings


@dataclass(frozen=True)
class Ctx:
    handlers: RoutingHandlers


def wire(runtime: Runtime) -> Ctx:
    settings = runtime.settings
    models = load_models(settings.kit.model_catalog)
    policy = RoutePolicy(
        weights=settings.routing.weights,
        damping_s=settings.routing.damping_s,
        affinity=AffinityRule(window_days=settings.routing.affinity_days),
    )
    handlers = RoutingHandlers(
        uow=runtime.uow,
        rpc=runtime.rpc,
        store=RoutingStore(),
        clock=runtime.clock,
        regions=load_regions(settings.kit.regions_file),
        models=models,
        groups=load_model_groups(settings.kit.model_groups, models),
        policy=policy,
        log=runtime.log,
        flush_s=settings.routing.flush_ms / 1000,
        regions_changed=watch_regions(settings.kit.regions_file),
        metrics=RouterMetrics(runtime.metrics),
        write_spacing_s=settings.routing.write_spacing_ms / 1000,
    )
    return Ctx(handlers=handlers)


SERVICE = ServiceDefinition(
    name="cross-region-router",
    health=Rpc.ROUTE_HEALTH,
    schema=SCHEMA,
    wire=wire,
    routes=(
        Route(Rpc.ROUTE_SELECT, RouteSelectRequest, lambda ctx: ctx.handlers.select),
        Route(Rpc.ROUTE_REGION, RouteRegionRequest, lambda ctx: ctx.handlers.region),
    ),
    on_start=(lambda ctx: ctx.handlers.start(),),
    # Where replicas are (capacity per region): placement announces each placed, released or expired.
    consumers=(
        Consumer(
            Context.PLACEMENT,
            "placement",
            on={
                PlacementEventName.PLACEMENT_DECIDED: lambda ctx: ctx.handlers.on_placement_decided,
                PlacementEventName.PLACEMENT_RELEASED: lambda ctx: ctx.handlers.on_placement_released,
            },
            together=True,
        ),
    ),
    loops=(Loop("route-traffic-flush", lambda ctx: ctx.handlers.flush),),
    calls=(Rpc.PLACEMENT_ADMIT,),
)


def bootstrap(settings: Settings, **overrides: Any) -> tuple[FastStream, Runtime]:
    return build_app(SERVICE, settings, **overrides)
