"""What placement follows into memory (the kit's read side, ``shared.infra.follow``) and where each event
goes: the fleet view (seeded from the owners' snapshots: seed ``view``), admission (engines' status), the
quotas' tally, the queue's wake-up, the reservations and the rebalancer's word."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from services.placement.readmodel import FREEING
from shared.contracts.engines import ReplicaStateEvent
from shared.contracts.ledger import AllocationEvent, LedgerEventName
from shared.contracts.rebalance import RebalanceEventName
from shared.contracts.reservation import ReservationEventName
from shared.contracts.subjects import Context
from shared.contracts.topology import TelemetryEventName, TopologyEventName
from shared.domain.placement.lifecycle import LIVE
from shared.infra.follow import EventMeta, Fold, Follow, Seed, Start

# The seed of the fleet view: `fleet.get` and `ledger.snapshot`, loaded again every
# HETSCHED_PLACEMENT_REFRESH_MS when that is set. Its health check is `view`.
VIEW = Seed("view", load=lambda ctx: ctx.readmodel.load, every_s=lambda ctx: ctx.readmodel.resync_s)

FoldFactory = Callable[[Any], Fold]


def _fleet(name: str) -> FoldFactory:
    """A TOPOLOGY or TELEMETRY (gpu) event into the view; one that may have freed capacity wakes the queue."""

    def factory(ctx: Any) -> Fold:
        def fold(payload: Any, meta: EventMeta) -> None:
            ctx.readmodel.apply(name, payload, meta.occurred_at)
            if name in FREEING:
                ctx.handlers.queue.wake()

        return fold

    return factory


def _allocation(name: str) -> FoldFactory:
    """A LEDGER allocation event into the view, then into each tenant's placed-GPU tally. A `request`
    allocation (a retired kind: the ledger no longer makes them, and ends those left at its migration)
    lived inside its replica's pool and moves no HBM: skipped."""

    def factory(ctx: Any) -> Fold:
        def fold(payload: AllocationEvent, meta: EventMeta) -> None:
            if payload.kind == "request":
                return
            ctx.readmodel.apply(name, payload, meta.occurred_at)
            ctx.handlers.tally.on_view_allocation(name, payload)
            if name in FREEING:
                ctx.handlers.queue.wake()

        return fold

    return factory


def _engine_status(ctx: Any) -> Fold:
    """An engine's report: admission's figures for its replica, and (the first from one of the replica's
    nodes) the end of the replica's first lease."""

    def fold(payload: Any, _meta: EventMeta) -> None:
        ctx.admission.on_engine_status(payload)
        ctx.handlers.first_leases.engine_reported(payload.replica_id, payload.node)

    return fold


def _replica_state(ctx: Any) -> Fold:
    """One rank's lifecycle, from an agent on one of the replica's nodes: the replica's state (listing,
    admission's rotation, its endpoint); a live engine's report renews the replica's lease when due, and
    (the first from one of its nodes) ends its first lease."""

    def fold(payload: ReplicaStateEvent, meta: EventMeta) -> None:
        if not ctx.engines.report(payload, meta.occurred_at):
            return  # not one of ours, or another node's agent speaking for it
        ctx.admission.lifecycle_changed()
        if payload.state in LIVE and ctx.engines.alive(payload.replica_id):
            ctx.renewals.reported(payload.replica_id)  # before the first lease's end: that one is its renewal
            ctx.handlers.first_leases.engine_reported(payload.replica_id, payload.node)

    return fold


def _reservation(ctx: Any) -> Fold:
    def fold(payload: Any, _meta: EventMeta) -> None:
        if ctx.readmodel.reservation(payload):
            ctx.handlers.queue.wake()  # an offer or a reclaimed GPU may let a queued one fit

    return fold


def _throttle(on: bool) -> FoldFactory:
    def factory(ctx: Any) -> Fold:
        def fold(payload: Any, _meta: EventMeta) -> None:
            ctx.readmodel.throttle(payload, on=on)
            if not on:
                ctx.handlers.queue.wake()  # capacity came back: the queue may place now

        return fold

    return factory


def _is_admissions(name: str, _payload: Any) -> bool:
    """Events admission takes as they come, the view seeded or not: engines' status and lifecycle."""
    return name in (TelemetryEventName.ENGINE_STATUS, TelemetryEventName.REPLICA_STATE)


FOLLOWS = (
    Follow(
        Context.TOPOLOGY,
        start=Start.NEW,
        seed=VIEW,
        on={
            name: _fleet(name)
            for name in (
                TopologyEventName.NODE_PROFILED,
                TopologyEventName.NODE_CHANGED,
                TopologyEventName.NODE_LOST,
                TopologyEventName.NODE_RECOVERED,
                TopologyEventName.NODE_REMOVED,
                TopologyEventName.TPU_POD_PROFILED,
            )
        },
    ),
    Follow(
        Context.LEDGER,
        start=Start.NEW,
        seed=VIEW,
        on={
            LedgerEventName.ALLOCATION_COMMITTED: _allocation(LedgerEventName.ALLOCATION_COMMITTED),
            LedgerEventName.ALLOCATION_RELEASED: _allocation(LedgerEventName.ALLOCATION_RELEASED),
            LedgerEventName.ALLOCATION_EXPIRED: _allocation(LedgerEventName.ALLOCATION_EXPIRED),
            LedgerEventName.CAPACITY_CHANGED: _fleet(LedgerEventName.CAPACITY_CHANGED),
        },
    ),
    # GPU telemetry for each node's PCIe utilisation; engines' status and lifecycle for admission's rotation.
    Follow(
        Context.TELEMETRY,
        start=Start.NEW,
        seed=VIEW,
        on={
            TelemetryEventName.GPU: _fleet(TelemetryEventName.GPU),
            TelemetryEventName.ENGINE_STATUS: _engine_status,
            TelemetryEventName.REPLICA_STATE: _replica_state,
        },
        live=_is_admissions,
    ),
    # Each event carries its reservation's whole state: folded from the first sequence, no seed.
    Follow(
        Context.RESERVATION,
        on=dict.fromkeys(ReservationEventName, _reservation),
    ),
    Follow(
        Context.REBALANCE,
        on={
            RebalanceEventName.THROTTLE_STARTED: _throttle(True),
            RebalanceEventName.THROTTLE_ENDED: _throttle(False),
            RebalanceEventName.REPLICA_DRAINING: lambda ctx: (
                lambda payload, _meta: ctx.readmodel.replica_draining(payload)
            ),
            RebalanceEventName.PLAN_FINISHED: lambda ctx: lambda payload, _meta: ctx.readmodel.plan_finished(payload),
        },
    ),
)
