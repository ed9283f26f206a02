"""Wiring of the rebalancer service (the shape of docs/SERVICE.md): its routes, consumers and loops,
and ``wire``, which builds its handlers once. The logic will live in `shared/domain/`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from faststream import FastStream

from services.rebalancer.handlers import RebalanceHandlers
from services.rebalancer.tables import SCHEMA
from shared.contracts.rebalance import RebalanceStatusRequest
from shared.contracts.subjects import Rpc
from shared.infra.service import Route, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings


@dataclass(frozen=True)
class Ctx:
    handlers: RebalanceHandlers


def wire(runtime: Runtime) -> Ctx:
    return Ctx(handlers=RebalanceHandlers(uow=runtime.uow, rpc=runtime.rpc, clock=runtime.clock))


SERVICE = ServiceDefinition(
    name="rebalancer",
    health=Rpc.REBALANCE_HEALTH,
    schema=SCHEMA,
    wire=wire,
    routes=(
        Route(Rpc.REBALANCE_STATUS, RebalanceStatusRequest),  # not built yet: answers not_implemented
    ),
)


def bootstrap(settings: Settings, **overrides: Any) -> tuple[FastStream, Runtime]:
    return build_app(SERVICE, settings, **overrides)
