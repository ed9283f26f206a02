"""Wiring of the placement service: its view of the fleet (``readmodel``), its handlers, their routes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from faststream import FastStream
from opentelemetry import metrics

from services.placement.handlers import PlacementHandlers, PlacementMetrics
from services.placement.readmodel import ReadModel
from services.placement.store import DecisionStore
from services.placement.tables import SCHEMA
from shared.contracts.placement import AdmitRequest, PlaceRequest, ReleaseRequest, RenewRequest
from shared.contracts.subjects import Rpc
from shared.infra.catalog import load_models, load_skus
from shared.infra.clock import monotonic_ms
from shared.infra.service import Loop, Route, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings


@dataclass(frozen=True)
class Ctx:
    handlers: PlacementHandlers
    readmodel: ReadModel


def wire(runtime: Runtime) -> Ctx:
    settings = runtime.settings
    readmodel = ReadModel(
        rpc=runtime.rpc,
        jetstream=lambda: runtime.jetstream,
        subjects=runtime.subjects,
        stream_prefix=settings.stream_prefix,
        skus=load_skus(settings.sku_catalog),
        models=load_models(settings.model_catalog),
        clock=runtime.clock,
        log=runtime.log,
        stale_after_ms=settings.placement_stale_after_ms,
        resync_ms=settings.placement_refresh_ms,
    )
    handlers = PlacementHandlers(
        view=readmodel,
        store=DecisionStore(),
        uow=runtime.uow,
        rpc=runtime.rpc,
        timer=monotonic_ms,
        default_lease_s=settings.placement_default_lease_s,
        metrics=PlacementMetrics.create(metrics.get_meter("hetsched.placement")),
    )
    return Ctx(handlers=handlers, readmodel=readmodel)


SERVICE = ServiceDefinition(
    name="placement",
    health=Rpc.PLACEMENT_HEALTH,
    schema=SCHEMA,
    wire=wire,
    routes=(
        Route(Rpc.PLACEMENT_PLACE, PlaceRequest, lambda ctx: ctx.handlers.place),
        Route(Rpc.PLACEMENT_EXPLAIN, PlaceRequest, lambda ctx: ctx.handlers.explain),
        Route(Rpc.PLACEMENT_RELEASE, ReleaseRequest, lambda ctx: ctx.handlers.release),
        Route(Rpc.PLACEMENT_RENEW, RenewRequest, lambda ctx: ctx.handlers.renew),
        Route(Rpc.PLACEMENT_ADMIT, AdmitRequest),
    ),
    on_start=(lambda ctx: ctx.readmodel.start(),),
    on_stop=(lambda ctx: ctx.readmodel.stop(),),
    loops=(Loop("placement-view", lambda ctx: ctx.readmodel.run),),
    checks=lambda ctx: ctx.readmodel.health(),
)


def bootstrap(settings: Settings, **overrides: Any) -> tuple[FastStream, Runtime]:
    return build_app(SERVICE, settings, **overrides)


__all__ = ["SERVICE", "Ctx", "bootstrap", "wire"]
