"""A placed replica's life after its placement: ``placement.release`` and ``placement.renew`` through the
ledger, and what the ledger did to placement's allocations (LEDGER events, a durable consumer): committed
(remembered for the reconciler), expired or released (the decision learns it ended; capacity may have
freed, so the queue wakes)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime

from pydantic import BaseModel

from services.placement.admission import AdmissionHandlers
from services.placement.first_lease import FirstLeases
from services.placement.intents import emit
from services.placement.ledger_calls import ask_ledger
from services.placement.mapping import body_hash, placement_request_id
from services.placement.records import PlacementRecord
from services.placement.store import DecisionStore
from services.placement.tally import QuotaTally
from shared.contracts.base import ErrorBody, ErrorCode, Rejected
from shared.contracts.envelope import EventEnvelope
from shared.contracts.ledger import (
    AllocationEvent,
    LedgerReleaseReply,
    LedgerReleaseRequest,
    LedgerRenewReply,
    LedgerRenewRequest,
)
from shared.contracts.placement import (
    PlacementEventName,
    PlacementReleasedEvent,
    ReleaseReply,
    ReleaseRequest,
    RenewReply,
    RenewRequest,
)
from shared.contracts.subjects import Context, Rpc
from shared.domain.placement.ownership import IntentState
from shared.infra import deadline
from shared.infra.rpc import RpcClient
from shared.infra.uow import UnitOfWork, UnitOfWorkFactory

RECORD_WAIT_S = 5.0
RECORD_POLL_S = 0.05
"""How long, and how often, a renewal waits for a just-placed replica's decision row to record its lease."""


class Lifecycle:
    """Release and renew placed replicas (and admissions, in memory), and follow their end in the ledger."""

    def __init__(
        self,
        *,
        store: DecisionStore,
        uow: UnitOfWorkFactory,
        rpc: RpcClient,
        tally: QuotaTally,
        admission: AdmissionHandlers | None,
        freed: Callable[[], None],
        first_leases: FirstLeases | None = None,
        first_lease_s: int | None = None,
    ) -> None:
        self._store = store
        self._uow = uow
        self._rpc = rpc
        self._tally = tally
        self._admission = admission
        self._freed = freed  # capacity may have freed: the queue's wake
        self._first_leases = first_leases
        self._first_lease_s = first_lease_s

    async def release(self, request: ReleaseRequest) -> BaseModel:
        if self._admission is not None and self._admission.is_admission(request.allocation_id):
            # an admission (in memory only), released for the tenant that asked for it
            return self._admission.release_hold(request.allocation_id, request.tenant)
        released = await ask_ledger(
            self._rpc,
            Rpc.LEDGER_RELEASE,
            LedgerReleaseRequest(allocation_id=request.allocation_id, tenant=request.tenant),
            LedgerReleaseReply,
        )
        if isinstance(released, Rejected):
            return released
        if released.status != "released":
            return _refused(released.error)
        # The ledger's release is the only durable step: the decision learns it ended, and
        # `placement_released` is announced, from `allocation_released` (in the ledger's order, so after
        # the decision a placement's `allocation_committed` recorded).
        self._ended(request.allocation_id)
        return ReleaseReply(status="released")

    async def renew(self, request: RenewRequest) -> BaseModel:
        tenant = request.tenant
        if self._admission is not None and self._admission.is_admission(request.allocation_id):
            return self._admission.renew_hold(request.allocation_id, tenant, request.lease_s)
        renewed = await ask_ledger(
            self._rpc,
            Rpc.LEDGER_RENEW,
            LedgerRenewRequest(allocation_id=request.allocation_id, tenant=tenant, lease_s=request.lease_s),
            LedgerRenewReply,
        )
        if isinstance(renewed, Rejected):
            return renewed
        if renewed.status != "renewed":
            return _refused(renewed.error)
        if self._first_leases is not None:  # the caller's first renew: its own lease from now on
            self._first_leases.forget(request.allocation_id)
        lease = renewed.lease_expires_at
        if lease is not None:  # the replica's lease end as `placement.replicas` lists it
            await self._record_lease(request.allocation_id, lease)
        return RenewReply(status="renewed", lease_expires_at=lease)

    async def _record_lease(self, allocation_id: str, lease: datetime) -> None:
        """Record a renewed lease end on the replica's decision. A replica placed on the direct path a moment
        ago may not have its row yet (it follows the ledger's event): the renewal waits for it, within the
        caller's deadline, so that `placement.replicas` shows the lease the caller was just told, not the
        first lease the row is written with."""

        async def work(uow: UnitOfWork) -> bool:
            return await self._store.lease_renewed(
                session=uow.session, allocation_id=allocation_id, lease_expires_at=lease
            )

        waited_s = 0.0
        limit_s = min(RECORD_WAIT_S, deadline.remaining_s(default_s=RECORD_WAIT_S) or 0.0)
        while not await self._uow.run_grouped(work) and waited_s < limit_s:
            await asyncio.sleep(RECORD_POLL_S)
            waited_s += RECORD_POLL_S

    # -- LEDGER events (a durable consumer: what the ledger did to placement's allocations) -------------

    async def on_allocation_committed(self, *, uow: UnitOfWork, event: EventEnvelope, payload: AllocationEvent) -> None:
        """Remember placement's replica allocations, so the reconciler can find those no decision owns. One
        committed on the direct path carries its record: its decision is recorded and announced here,
        off the placement's critical path (the same transaction, so the reconciler sees both at once)."""
        request_id = placement_request_id(payload.request_id)
        if payload.kind != "replica" or request_id is None:
            return
        await self._store.allocation_seen(
            session=uow.session,
            allocation_id=payload.allocation_id,
            tenant=payload.tenant,
            request_id=request_id,
            now=uow.now,
        )
        kept = PlacementRecord.read(payload.record)
        if kept is None:  # the intent path records its own decisions
            return
        reply = kept.reply.model_copy(update={"allocation_id": payload.allocation_id})
        first = self._first_lease_s is not None and kept.lease_s > self._first_lease_s
        if not await self._store.record_placed(
            session=uow.session,
            tenant=payload.tenant,
            request_id=request_id,
            body_hash=body_hash(kept.request),
            reply=reply,
            lease_expires_at=payload.lease_expires_at,
            lease_s=kept.lease_s if first else None,
            now=uow.now,
        ):
            return
        emit(uow, kept.request, reply, PlacementEventName.PLACEMENT_DECIDED, kept.decision_ms, kept.attempts)
        nodes = [p.node for p in reply.placements]

        def remember() -> None:
            if self._admission is not None:
                self._admission.on_placed(payload.tenant, reply)
            if first and self._first_leases is not None:
                self._first_leases.add(payload.allocation_id, tenant=payload.tenant, lease_s=kept.lease_s, nodes=nodes)

        uow.after_commit(remember)

    async def on_allocation_expired(self, *, uow: UnitOfWork, event: EventEnvelope, payload: AllocationEvent) -> None:
        """A replica whose lease ran out is announced as ended (as a release is), for those who follow
        where replicas are (the router)."""
        tenant = await self._store.mark_ended(
            session=uow.session, allocation_id=payload.allocation_id, status=IntentState.EXPIRED, now=uow.now
        )
        if tenant is not None:
            uow.emit(
                Context.PLACEMENT,
                PlacementEventName.PLACEMENT_RELEASED,
                PlacementReleasedEvent(allocation_id=payload.allocation_id, tenant=tenant, reason="expired"),
                tenant=tenant,
            )
        self._ended(payload.allocation_id)
        self._freed()

    async def on_allocation_released(self, *, uow: UnitOfWork, event: EventEnvelope, payload: AllocationEvent) -> None:
        """A released replica is announced as ended, for those who follow where replicas are."""
        tenant = await self._store.mark_ended(
            session=uow.session, allocation_id=payload.allocation_id, status=IntentState.RELEASED, now=uow.now
        )
        if tenant is not None:
            uow.emit(
                Context.PLACEMENT,
                PlacementEventName.PLACEMENT_RELEASED,
                PlacementReleasedEvent(allocation_id=payload.allocation_id, tenant=tenant),
                tenant=tenant,
            )
        self._ended(payload.allocation_id)
        self._freed()

    def _ended(self, allocation_id: str) -> None:
        """An allocation ended: its tenant no longer holds it, nor admission its replica or hold."""
        self._tally.holdings.end(allocation_id)
        if self._first_leases is not None:
            self._first_leases.forget(allocation_id)
        if self._admission is not None:
            self._admission.on_allocation_ended(allocation_id)


def _refused(error: ErrorBody | None) -> Rejected:
    """A ledger reply that says no in its own model (a deprecated shape): passed on as ``Rejected``."""
    return Rejected(error=error or ErrorBody(code=ErrorCode.INTERNAL, message="the ledger refused without a reason"))
