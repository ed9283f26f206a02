"""Wiring of the reservation-filler service (the shape of docs/SERVICE.md): its routes, consumers and loops,
and ``wire``, which builds its handlers once. The logic will live in `shared/domain/`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from faststream import FastStream

from services.reservation_filler.handlers import ReservationHandlers
from services.reservation_filler.tables import SCHEMA
from shared.contracts.reservation import ReservationCancelRequest, ReservationCreateRequest, ReservationStatusRequest
from shared.contracts.subjects import Rpc
from shared.infra.service import Route, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings


@dataclass(frozen=True)
class Ctx:
    handlers: ReservationHandlers


def wire(runtime: Runtime) -> Ctx:
    return Ctx(handlers=ReservationHandlers(uow=runtime.uow, rpc=runtime.rpc, clock=runtime.clock))


SERVICE = ServiceDefinition(
    name="reservation-filler",
    health=Rpc.RESERVATION_HEALTH,
    schema=SCHEMA,
    wire=wire,
    routes=(
        Route(Rpc.RESERVATION_CREATE, ReservationCreateRequest),  # not built yet: answers not_implemented
        Route(Rpc.RESERVATION_CANCEL, ReservationCancelRequest),  # not built yet: answers not_implemented
        Route(Rpc.RESERVATION_STATUS, ReservationStatusRequest),  # not built yet: answers not_implemented
    ),
)


def bootstrap(settings: Settings, **overrides: Any) -> tuple[FastStream, Runtime]:
    return build_app(SERVICE, settings, **overrides)
