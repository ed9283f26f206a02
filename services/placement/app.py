"""Wiring of the placement service: its view of the fleet (``readmodel``), its handlers, their routes, the
queue of requests waiting for capacity."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from faststream import FastStream

from services.placement.admission import AdmissionHandlers, Fairness
from services.placement.assignments import Assignments
from services.placement.attempts import Ownership, Queueing
from services.placement.engines import EngineStates
from services.placement.follows import FOLLOWS
from services.placement.handlers import PlacementHandlers
from services.placement.listing import ReplicaListing
from services.placement.metrics import PlacementMetrics, ViewMetrics
from services.placement.readmodel import ReadModel
from services.placement.renewals import Renewals
from services.placement.replicas import ReplicaBook
from services.placement.store import DecisionStore
from services.placement.tables import SCHEMA
from shared.contracts.engines import AssignmentsRequest
from shared.contracts.ledger import LedgerEventName
from shared.contracts.placement import (
    AdmitRequest,
    PlaceReply,
    PlaceRequest,
    ReleaseRequest,
    RenewRequest,
    ReplicasRequest,
)
from shared.contracts.subjects import Context, Rpc
from shared.domain.admission import AdmitPolicy, Tenancy
from shared.infra.catalog import load_model_groups, load_models, load_skus
from shared.infra.clock import monotonic_ms
from shared.infra.faults import fault_hook
from shared.infra.service import Consumer, Loop, Route, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings


@dataclass(frozen=True)
class Ctx:
    handlers: PlacementHandlers
    readmodel: ReadModel
    admission: AdmissionHandlers
    metrics: ViewMetrics
    listing: ReplicaListing
    engines: EngineStates
    renewals: Renewals
    assignments: Assignments


def wire(runtime: Runtime) -> Ctx:
    settings = runtime.settings
    models = load_models(settings.kit.model_catalog)
    readmodel = ReadModel(
        rpc=runtime.rpc,
        skus=load_skus(settings.kit.sku_catalog),
        models=models,
        clock=runtime.clock,
        log=runtime.log,
        resync_ms=settings.placement.refresh_ms,
        pcie_window_s=settings.placement.pcie_window_s,
    )
    reservations = runtime.follower(Context.RESERVATION)
    store = DecisionStore()

    async def load_placed() -> list[tuple[str, PlaceReply]]:
        return await runtime.uow.run(lambda uow: store.placed(session=uow.session))

    book = ReplicaBook(models=models, kv_shares=(settings.placement.admit_kv_guarantees or None))
    # The node agents' word on each replica's engines (replica_state), trusted from the replica's own nodes.
    engines = EngineStates(nodes_of=book.nodes_of, stale_s=settings.placement.engine_stale_s, clock=runtime.clock)
    admission = AdmissionHandlers(
        book=book,
        rpc=runtime.rpc,
        models=models,
        groups=load_model_groups(settings.kit.model_groups, models),
        policy=AdmitPolicy(
            stale_ms=settings.placement.engine_stale_s * 1000,
            max_queue_depth=settings.placement.admit_max_queue_depth,
            long_context_tokens=settings.placement.admit_long_context_tokens,
            strict_ttft_ms=settings.placement.admit_strict_ttft_ms,
        ),
        fairness=Fairness(
            rate_per_s=settings.placement.admit_tenant_rate,
            burst=settings.placement.admit_tenant_burst,
            ttl_s=settings.placement.admit_queue_ttl_s,
            weights=settings.placement.admit_tenant_weights,
        ),
        timer=monotonic_ms,
        log=runtime.log,
        load_placed=load_placed,
        draining=lambda: readmodel.draining,
        regions=readmodel.regions,
        admissible=engines.admissible,
        endpoint=engines.endpoint,
        tenancy=Tenancy.of(settings.placement.admit_tenancy, settings.placement.admit_shared_owners),
    )
    handlers = PlacementHandlers.build(
        view=readmodel,
        store=store,
        uow=runtime.uow,
        rpc=runtime.rpc,
        timer=monotonic_ms,
        default_lease_s=settings.placement.default_lease_s,
        first_lease_s=settings.placement.first_lease_s,
        metrics=PlacementMetrics.create(runtime.metrics),
        # An attempt holds its request id for one ledger round trip (and a second to record the outcome).
        ownership=Ownership(
            claim_s=settings.kit.rpc_timeout_ms / 1000 + 1,
            grace_s=settings.placement.intent_grace_s,
            reconcile_period_s=settings.placement.reconcile_period_s,
        ),
        clock=runtime.clock,
        log=runtime.log,
        # Tests only: `exit` dies the way a SIGKILL would, between the ledger's commit and the decision row.
        after_commit=fault_hook(settings.placement.fault_after_commit),
        queueing=Queueing(
            timeout_s=settings.placement.queue_timeout_s,
            retry_s=settings.placement.queue_retry_s,
            page=settings.placement.queue_page,
        ),
        quotas=settings.quotas(),
        admission=admission,
        reservations=readmodel.book,
        holds=readmodel.holds,
        throttled=lambda: readmodel.throttled,
        # Read-your-writes: a placement waits until the reservations answered before it are in the book.
        reservations_current=lambda timeout_s: reservations.caught_up(timeout_s=timeout_s),
    )
    metrics = ViewMetrics(
        runtime.metrics,
        snapshot=lambda: readmodel.snapshot,
        queue_depths=admission.queue_depths,
        replicas=lambda: engines.reported(readmodel.draining),
        kv_usage=lambda: book.kv_usage(now_ms=monotonic_ms(), stale_ms=settings.placement.engine_stale_s * 1000),
        preempted=lambda: book.preempted,
        load_expected_s=settings.placement.load_expected_s,
        log=runtime.log,
    )
    listing = ReplicaListing(
        store=store,
        uow=runtime.uow,
        models=models,
        knows_node=readmodel.knows_node,
        draining=lambda: readmodel.draining,
        serving=admission.serving,
        reported=engines.reported,
        endpoint=engines.endpoint,
    )
    renewals = Renewals(
        store=store,
        uow=runtime.uow,
        renew=handlers.lifecycle.renew,
        first_leases=handlers.first_leases,
        lease_s=settings.placement.default_lease_s,
        clock=runtime.clock,
        log=runtime.log,
    )
    assignments = Assignments(
        store=store,
        uow=runtime.uow,
        models=models,
        draining=lambda: readmodel.draining,
        deadlines=readmodel.preempted,
    )
    return Ctx(
        handlers=handlers,
        readmodel=readmodel,
        admission=admission,
        metrics=metrics,
        listing=listing,
        engines=engines,
        renewals=renewals,
        assignments=assignments,
    )


SERVICE = ServiceDefinition(
    name="placement",
    health=Rpc.PLACEMENT_HEALTH,
    schema=SCHEMA,
    wire=wire,
    routes=(
        Route(Rpc.PLACEMENT_PLACE, PlaceRequest, lambda ctx: ctx.handlers.placing.place),
        Route(Rpc.PLACEMENT_EXPLAIN, PlaceRequest, lambda ctx: ctx.handlers.placing.explain),
        Route(Rpc.PLACEMENT_RELEASE, ReleaseRequest, lambda ctx: ctx.handlers.lifecycle.release),
        Route(Rpc.PLACEMENT_RENEW, RenewRequest, lambda ctx: ctx.handlers.lifecycle.renew),
        Route(Rpc.PLACEMENT_ADMIT, AdmitRequest, lambda ctx: ctx.admission.admit),
        Route(Rpc.PLACEMENT_REPLICAS, ReplicasRequest, lambda ctx: ctx.listing.replicas),
        # A node agent's own subject (`.<node>`): the kit refuses a body naming another node.
        Route(Rpc.PLACEMENT_ASSIGNMENTS, AssignmentsRequest, lambda ctx: ctx.assignments.assignments),
    ),
    on_start=(
        lambda ctx: ctx.admission.start(),
        lambda ctx: ctx.handlers.tally.start(),
        lambda ctx: ctx.handlers.first_leases.load(),
    ),
    # The fleet view, admission's engines and holds, the reservations and the rebalancer's word: follows.py.
    follows=FOLLOWS,
    stale_after_ms=lambda settings: settings.placement.stale_after_ms,
    # What the ledger did to placement's allocations (committed / expired / released), durably: the
    # decisions learn that their allocation ended, and the reconciler finds those no decision owns.
    consumers=(
        Consumer(
            Context.LEDGER,
            "ledger",
            on={
                LedgerEventName.ALLOCATION_COMMITTED: lambda ctx: ctx.handlers.lifecycle.on_allocation_committed,
                LedgerEventName.ALLOCATION_EXPIRED: lambda ctx: ctx.handlers.lifecycle.on_allocation_expired,
                LedgerEventName.ALLOCATION_RELEASED: lambda ctx: ctx.handlers.lifecycle.on_allocation_released,
            },
            together=True,  # one per placement: a batch per transaction (the handlers only write rows)
            # `request` allocations (a retired kind, ended at the ledger's migration) concern no decision.
            skip=lambda payload: payload.kind == "request",
        ),
    ),
    loops=(
        Loop("placement-reconciler", lambda ctx: ctx.handlers.reconciler.run),
        Loop("placement-queue", lambda ctx: ctx.handlers.queue.serve),
        Loop("admission-queue", lambda ctx: ctx.admission.serve_queue),
        Loop("placement-metrics", lambda ctx: ctx.metrics.run),
    ),
    calls=(
        Rpc.LEDGER_COMMIT,
        Rpc.LEDGER_COMMIT_BATCH,
        Rpc.LEDGER_RELEASE,
        Rpc.LEDGER_RENEW,
        Rpc.LEDGER_SNAPSHOT,
        Rpc.FLEET_GET,
        Rpc.FLEET_DESCRIBE,
        Rpc.RESERVATION_RECLAIM,
        Rpc.RESERVATION_HEALTH,  # health probes the filler after a reclaim it did not answer
    ),
)


def bootstrap(settings: Settings, **overrides: Any) -> tuple[FastStream, Runtime]:
    return build_app(SERVICE, settings, **overrides)


__all__ = ["SERVICE", "Ctx", "bootstrap", "wire"]
