"""Wiring of the placement service: its routes and lifecycle (the logic lives in `shared/`)."""

from __future__ import annotations

from faststream import FastStream

from shared.contracts.placement import AdmitRequest, PlaceRequest, ReleaseRequest, RenewRequest
from shared.contracts.subjects import Rpc
from shared.infra.service import Route, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings

SERVICE = ServiceDefinition(
    name="placement",
    health=Rpc.PLACEMENT_HEALTH,
    schema="placement",
    routes=(
        Route(Rpc.PLACEMENT_PLACE, PlaceRequest),
        Route(Rpc.PLACEMENT_EXPLAIN, PlaceRequest),
        Route(Rpc.PLACEMENT_RELEASE, ReleaseRequest),
        Route(Rpc.PLACEMENT_RENEW, RenewRequest),
        Route(Rpc.PLACEMENT_ADMIT, AdmitRequest),
    ),
)


def bootstrap(settings: Settings) -> tuple[FastStream, Runtime]:
    return build_app(SERVICE, settings)
