"""Wiring of the reservation-filler service: its routes and lifecycle (the logic lives in `shared/`)."""

from __future__ import annotations

from faststream import FastStream

from shared.contracts.reservation import (
    ReservationCancelRequest,
    ReservationCreateRequest,
    ReservationStatusRequest,
)
from shared.contracts.subjects import Rpc
from shared.infra.service import Route, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings

SERVICE = ServiceDefinition(
    name="reservation-filler",
    health=Rpc.RESERVATION_HEALTH,
    schema="reservation",
    routes=(
        Route(Rpc.RESERVATION_CREATE, ReservationCreateRequest),
        Route(Rpc.RESERVATION_CANCEL, ReservationCancelRequest),
        Route(Rpc.RESERVATION_STATUS, ReservationStatusRequest),
    ),
)


def bootstrap(settings: Settings) -> tuple[FastStream, Runtime]:
    return build_app(SERVICE, settings)
