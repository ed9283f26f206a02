"""Wiring of the reservation-filler service (the shape of docs/SERVICE.md): its routes, consumers and loops,
and ``wire``, which builds its handlers once. The rules live in `shared/domain/reservations`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from faststream import FastStream

from services.reservation_filler.handlers import ReservationHandlers
from services.reservation_filler.metrics import ReservationMetrics
from services.reservation_filler.store import ReservationStore
from services.reservation_filler.tables import SCHEMA
from shared.contracts.ledger import LedgerEventName
from shared.contracts.reservation import (
    ReservationCancelRequest,
    ReservationCreateRequest,
    ReservationReclaimRequest,
    ReservationReportRequest,
    ReservationStatusRequest,
)
from shared.contracts.streams import restate_every_s
from shared.contracts.subjects import Context, Rpc
from shared.contracts.topology import TopologyEventName
from shared.domain.reservations import LendingPolicy
from shared.infra.catalog import load_regions, load_skus
from shared.infra.faults import fault_hook
from shared.infra.service import Consumer, Loop, Route, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings


@dataclass(frozen=True)
class Ctx:
    handlers: ReservationHandlers


def wire(runtime: Runtime) -> Ctx:
    settings = runtime.settings
    policy = LendingPolicy(
        fill_target=settings.reservations.fill_target,
        backoff_s=settings.reservations.backoff_s,
        backoff_max_s=settings.reservations.backoff_max_s,
    )
    handlers = ReservationHandlers(
        uow=runtime.uow,
        rpc=runtime.rpc,
        store=ReservationStore(),
        policy=policy,
        skus=load_skus(settings.kit.sku_catalog),
        regions=load_regions(settings.kit.regions_file),
        tick_s=settings.reservations.tick_s,
        log=runtime.log,
        # Tests only: `exit` dies as a SIGKILL would, between writing preemptions and asking the ledger.
        after_record=fault_hook(settings.reservations.fault_after_record),
        metrics=ReservationMetrics(runtime.metrics),
        quotas=settings.quotas(),
        restate_s=restate_every_s(settings.kit.stream_reservation_max_age_s),
    )
    return Ctx(handlers=handlers)


SERVICE = ServiceDefinition(
    name="reservation-filler",
    health=Rpc.RESERVATION_HEALTH,
    schema=SCHEMA,
    wire=wire,
    routes=(
        Route(Rpc.RESERVATION_CREATE, ReservationCreateRequest, lambda ctx: ctx.handlers.requests.create),
        Route(Rpc.RESERVATION_CANCEL, ReservationCancelRequest, lambda ctx: ctx.handlers.requests.cancel),
        Route(Rpc.RESERVATION_STATUS, ReservationStatusRequest, lambda ctx: ctx.handlers.requests.status),
        Route(Rpc.RESERVATION_REPORT, ReservationReportRequest, lambda ctx: ctx.handlers.requests.report),
        Route(Rpc.RESERVATION_RECLAIM, ReservationReclaimRequest, lambda ctx: ctx.handlers.reclaimer.reclaim),
    ),
    on_start=(lambda ctx: ctx.handlers.upkeep.start(),),
    consumers=(
        # The GPUs a reservation may take.
        Consumer(
            Context.TOPOLOGY,
            "topology",
            on={
                TopologyEventName.NODE_PROFILED: lambda ctx: ctx.handlers.uses.on_node_profiled,
                TopologyEventName.NODE_CHANGED: lambda ctx: ctx.handlers.uses.on_node_profiled,
                TopologyEventName.NODE_REMOVED: lambda ctx: ctx.handlers.uses.on_node_removed,
            },
        ),
        # Who uses each reserved GPU: the owner, a borrower, nobody.
        Consumer(
            Context.LEDGER,
            "ledger",
            on={
                LedgerEventName.ALLOCATION_COMMITTED: lambda ctx: ctx.handlers.uses.on_allocation_committed,
                LedgerEventName.ALLOCATION_RELEASED: lambda ctx: ctx.handlers.uses.on_allocation_ended,
                LedgerEventName.ALLOCATION_EXPIRED: lambda ctx: ctx.handlers.uses.on_allocation_ended,
            },
            # Requests' KV holds live inside a replica's allocation: they change nobody's use.
            skip=lambda payload: payload.kind == "request",
            # One per placement and release: a batch per transaction (the handlers write rows and events only).
            together=True,
        ),
    ),
    loops=(
        Loop("reservation-tick", lambda ctx: ctx.handlers.upkeep.tick),
        # RESERVATION outlives its max age for placement's fold from the first sequence (docs/RETENTION.md).
        Loop("reservation-restate", lambda ctx: ctx.handlers.upkeep.restate),
    ),
    calls=(Rpc.LEDGER_PREEMPT,),
)


def bootstrap(settings: Settings, **overrides: Any) -> tuple[FastStream, Runtime]:
    return build_app(SERVICE, settings, **overrides)
