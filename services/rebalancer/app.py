"""Wiring of the rebalancer service: its routes and lifecycle (the logic lives in `shared/`)."""

from __future__ import annotations

from faststream import FastStream

from shared.contracts.rebalance import RebalanceStatusRequest
from shared.contracts.subjects import Rpc
from shared.infra.service import Route, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings

SERVICE = ServiceDefinition(
    name="rebalancer",
    health=Rpc.REBALANCE_HEALTH,
    schema="rebalance",
    routes=(Route(Rpc.REBALANCE_STATUS, RebalanceStatusRequest),),
)


def bootstrap(settings: Settings) -> tuple[FastStream, Runtime]:
    return build_app(SERVICE, settings)
