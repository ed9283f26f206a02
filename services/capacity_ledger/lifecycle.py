"""An allocation's life after its commit: ``ledger.release`` (releases arriving together share one
transaction), ``ledger.renew``, ``ledger.preempt`` for the reservation filler, and the lease sweeper that
expires what was not renewed. Each end emits its event in the transaction that ends it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from pydantic import BaseModel

from services.capacity_ledger import mapping, store
from services.capacity_ledger.ports import Store, Units
from shared.contracts.base import ErrorCode, rejected
from shared.contracts.ledger import (
    LedgerEventName,
    LedgerPreemptReply,
    LedgerPreemptRequest,
    LedgerReleaseReply,
    LedgerReleaseRequest,
    LedgerRenewReply,
    LedgerRenewRequest,
    no_allocation,
)
from shared.contracts.subjects import Context
from shared.domain.ledger import (
    MAX_LEASE_S,
    Access,
    AllocationRecord,
    AllocationState,
    lease_too_long,
    may_change,
    renewal_end,
)
from shared.infra.clock import Clock
from shared.infra.grouping import Grouped
from shared.infra.uow import UnitOfWork


class LifecycleHandlers:
    """Release / renew / preempt, and the lease sweeper."""

    def __init__(
        self,
        *,
        uow: Units,
        clock: Clock,
        sweep_period_s: float,
        sweep_batch: int = 500,
        store: Store = store,
        log: logging.Logger | None = None,
    ) -> None:
        self._uow = uow
        self._clock = clock
        self._sweep_period_s = sweep_period_s
        self._sweep_batch = sweep_batch
        self._store = store
        self._log = log or logging.getLogger("hetsched.capacity-ledger")
        # Releases that arrive while one transaction of them runs are ended together in the next.
        self._releases: Grouped[tuple[str, str | None], Access] = Grouped(
            lambda items: self._end_many(items, AllocationState.RELEASED)
        )

    async def release(self, request: LedgerReleaseRequest) -> BaseModel:
        access = await self._end(request.allocation_id, tenant=request.tenant, state=AllocationState.RELEASED)
        if access in (Access.NOT_FOUND, Access.FORBIDDEN):  # alike: an id must not tell whether it exists
            return no_allocation(request.allocation_id)
        return LedgerReleaseReply(status="released", already=access is Access.ENDED)

    async def renew(self, request: LedgerRenewRequest) -> BaseModel:
        now = self._clock()
        end = renewal_end(now=now, lease_s=request.lease_s, lease_expires_at=request.lease_expires_at)
        if end is None:
            return rejected(ErrorCode.INVALID_REQUEST, "the new lease ends in the past")
        if lease_too_long(end, now=now):
            return rejected(ErrorCode.INVALID_REQUEST, f"the new lease is longer than {MAX_LEASE_S // 86400} days")

        async def work(uow: UnitOfWork) -> Access:
            allocation = await self._store.lock_allocation(session=uow.session, allocation_id=request.allocation_id)
            access = may_change(allocation, tenant=request.tenant)
            if access is Access.OK:
                await self._store.set_lease(session=uow.session, allocation_id=request.allocation_id, expires_at=end)
            return access

        access = await self._uow.run(work)
        if access in (Access.NOT_FOUND, Access.FORBIDDEN):  # alike: an id must not tell whether it exists
            return no_allocation(request.allocation_id)
        if access is Access.ENDED:
            return rejected(ErrorCode.CONFLICT, "the allocation was released or has expired")
        return LedgerRenewReply(status="renewed", lease_expires_at=end)

    async def preempt(self, request: LedgerPreemptRequest) -> BaseModel:
        """End a preemptible allocation for the reservation filler, in one transaction: at once when its
        deadline has passed (``allocation_released``), else by moving its lease end to the deadline (the
        sweeper ends it then with ``allocation_expired``). Never lengthens a lease; a repeat answers the same."""
        now = self._clock()

        async def work(uow: UnitOfWork) -> BaseModel:
            locked = await self._store.lock_allocations(session=uow.session, ids=[request.allocation_id])
            allocation = locked.get(request.allocation_id)
            access = may_change(allocation, tenant=None)
            if access is Access.NOT_FOUND:
                return rejected(ErrorCode.NOT_FOUND, f"no allocation {request.allocation_id!r}")
            if access is Access.ENDED:
                return LedgerPreemptReply(status="ended", already=True)
            assert allocation is not None
            if not allocation.preemptible:
                return rejected(ErrorCode.CONFLICT, "only a preemptible allocation may be preempted")
            if request.deadline_at > now:
                end = min(request.deadline_at, allocation.lease_expires_at)
                if end < allocation.lease_expires_at:
                    await self._store.set_lease(session=uow.session, allocation_id=allocation.id, expires_at=end)
                return LedgerPreemptReply(status="scheduled", lease_expires_at=end)
            for ended in await self._store.end_allocations(
                session=uow.session, allocations=[allocation], state=AllocationState.RELEASED, now=uow.now
            ):
                uow.emit(
                    Context.LEDGER,
                    LedgerEventName.ALLOCATION_RELEASED,
                    mapping.ended_event(ended),
                    tenant=ended.allocation.tenant,
                    correlation_id=ended.allocation.request_id,
                )
            return LedgerPreemptReply(status="ended")

        return await self._uow.run(work)

    # -- the lease sweeper ---------------------------------------------------------------------

    async def sweep_leases(self) -> None:
        """Forever: release allocations whose lease ended, each with an `allocation_expired` event."""
        while True:
            await asyncio.sleep(self._sweep_period_s)
            try:
                await self.sweep_once()
            except Exception:
                self._log.exception("lease sweep failed; retrying")

    async def sweep_once(self) -> int:
        """One pass of the sweeper; how many allocations it expired (in one transaction)."""
        now = self._clock()
        ids = await self._uow.read(
            lambda session: self._store.expired_ids(session=session, now=now, limit=self._sweep_batch)
        )
        if not ids:
            return 0
        accesses = await self._end_many([(allocation_id, None) for allocation_id in ids], AllocationState.EXPIRED)
        return sum(1 for access in accesses if access is Access.OK)

    async def _end(self, allocation_id: str, *, tenant: str | None, state: AllocationState) -> Access:
        """End an allocation (and the requests inside a replica) with an event each, if ``tenant`` may;
        releases arriving together share one transaction (``Grouped``)."""
        if state is AllocationState.RELEASED:
            return await self._releases.submit((allocation_id, tenant))
        (access,) = await self._end_many([(allocation_id, tenant)], state)
        return access

    async def _end_many(self, items: Sequence[tuple[str, str | None]], state: AllocationState) -> list[Access]:
        """End each ``(allocation id, tenant)`` the tenant may end, in one transaction, locked in id order;
        an id named twice ends once (the second is told it had ended)."""
        event = (
            LedgerEventName.ALLOCATION_RELEASED
            if state is AllocationState.RELEASED
            else LedgerEventName.ALLOCATION_EXPIRED
        )

        async def work(uow: UnitOfWork) -> list[Access]:
            locked = await self._store.lock_allocations(session=uow.session, ids=[i for i, _ in items])
            accesses: list[Access] = []
            chosen: dict[str, AllocationRecord] = {}
            for allocation_id, tenant in items:
                access = may_change(locked.get(allocation_id), tenant=tenant)
                if access is Access.OK and allocation_id in chosen:
                    access = Access.ENDED
                elif access is Access.OK:
                    chosen[allocation_id] = locked[allocation_id]
                accesses.append(access)
            for ended in await self._store.end_allocations(
                session=uow.session, allocations=list(chosen.values()), state=state, now=uow.now
            ):
                uow.emit(
                    Context.LEDGER,
                    event,
                    mapping.ended_event(ended),
                    tenant=ended.allocation.tenant,
                    correlation_id=ended.allocation.request_id,
                )
            return accesses

        return await self._uow.run(work)
