"""Wiring of the capacity-ledger service: its routes and lifecycle (the logic lives in `shared/`)."""

from __future__ import annotations

from faststream import FastStream

from shared.contracts.base import Request
from shared.contracts.ledger import SnapshotRequest
from shared.contracts.subjects import Rpc
from shared.infra.service import Route, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings

SERVICE = ServiceDefinition(
    name="capacity-ledger",
    health=Rpc.LEDGER_HEALTH,
    schema="ledger",
    routes=(
        Route(Rpc.LEDGER_COMMIT, Request),
        Route(Rpc.LEDGER_RELEASE, Request),
        Route(Rpc.LEDGER_RENEW, Request),
        Route(Rpc.LEDGER_SNAPSHOT, SnapshotRequest),
    ),
)


def bootstrap(settings: Settings) -> tuple[FastStream, Runtime]:
    return build_app(SERVICE, settings)
