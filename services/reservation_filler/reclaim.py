"""Reclaim (placement asks, for an owner): preempt borrowers of the owner's soft and spot reservations.

The preemptions are written, with their ``preempted`` events, *before* the ledger is asked to end the
borrowers' allocations; the answer marks them done. A filler killed in between finds them not done when it
starts (and on every tick, ``Upkeep``) and asks again: ``ledger.preempt`` is idempotent and only ever
shortens a preemptible allocation's lease.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

from pydantic import BaseModel

from services.reservation_filler.events import emit
from services.reservation_filler.store import ReservationStore
from shared.contracts.base import Rejected, rejected
from shared.contracts.ledger import LedgerPreemptReply, LedgerPreemptRequest
from shared.contracts.reservation import (
    ReservationEventName,
    ReservationReclaimReply,
    ReservationReclaimRequest,
)
from shared.contracts.subjects import Rpc
from shared.domain.errors import ErrorCode
from shared.domain.reservations import LendingPolicy, Preemption, preemption_done, reclaim
from shared.infra.reservations import preemption_view
from shared.infra.rpc import RpcClient, RpcError
from shared.infra.uow import UnitOfWork, UnitOfWorkFactory

PREEMPT_TIMEOUT_S = 2.0


class Reclaimer:
    def __init__(
        self,
        *,
        uow: UnitOfWorkFactory,
        store: ReservationStore,
        rpc: RpcClient,
        policy: LendingPolicy,
        log: logging.Logger,
        after_record: Callable[[], None] = lambda: None,
    ) -> None:
        self._uow = uow
        self._store = store
        self._rpc = rpc
        self._policy = policy
        self._log = log
        self._after_record = after_record  # a fault-injection point for tests (shared.infra.faults)
        self._marking: set[asyncio.Task[None]] = set()

    async def reclaim(self, request: ReservationReclaimRequest) -> BaseModel:
        """Placement, for an owner: preempt these borrowers of its reservations (LIFO was placement's
        choice). Written first, then the ledger is asked; the reply says which the ledger acknowledged."""

        async def work(uow: UnitOfWork) -> list[Preemption] | Rejected:
            reservations = await self._store.load_many(session=uow.session, tenant=request.tenant, lock=True)
            wanted = set(request.allocation_ids)
            issued: list[Preemption] = []
            for reservation in reservations:
                mine = [a for a in request.allocation_ids if reservation.borrow(a) is not None]
                if not mine or not reservation.lends:
                    continue
                after, preemptions = reclaim(
                    reservation, mine, now=uow.now, policy=self._policy, request_id=request.request_id
                )
                issued += preemptions
                wanted -= set(mine)
                if after.version != reservation.version:
                    await self._store.save(session=uow.session, reservation=after, now=uow.now)
                    for p in preemptions:
                        if reservation.preemption(p.allocation_id) is None:
                            emit(uow, ReservationEventName.PREEMPTED, after, preemption=p, reason="owner_demand")
            if not issued:
                return rejected(
                    ErrorCode.NOT_FOUND,
                    "none of these allocations borrows a soft or spot reservation of this tenant",
                    allocation_ids=sorted(wanted)[:64],
                )
            return issued

        outcome = await self._uow.run(work)
        if isinstance(outcome, Rejected):
            return outcome
        self._after_record()
        acknowledged = await self.issue([p for p in outcome if not p.done])
        views = [preemption_view(p if p.done else replace(p, done=p.allocation_id in acknowledged)) for p in outcome]
        return ReservationReclaimReply(status="preempted", preemptions=views)

    async def issue(self, preemptions: Sequence[Preemption]) -> set[str]:
        """Ask the ledger to end each borrower's allocation by its deadline; mark those it acknowledged
        done. The allocation ids acknowledged."""
        if not preemptions:
            return set()

        async def one(p: Preemption) -> str | None:
            ask = LedgerPreemptRequest(
                allocation_id=p.allocation_id, deadline_at=p.deadline_at, reservation_id=p.reservation_id
            )
            try:
                answer = await self._rpc.ask(Rpc.LEDGER_PREEMPT, ask, LedgerPreemptReply, timeout_s=PREEMPT_TIMEOUT_S)
            except RpcError as exc:
                self._log.warning("ledger.preempt %s: %s (re-issued on the next tick)", p.allocation_id, exc)
                return None
            if isinstance(answer, Rejected) and answer.error.code is not ErrorCode.NOT_FOUND:
                self._log.warning("ledger.preempt %s refused: %s", p.allocation_id, answer.error.message)
            return p.allocation_id  # ended, scheduled, or gone: nothing more to ask

        acknowledged = {a for a in await asyncio.gather(*(one(p) for p in preemptions)) if a is not None}
        if acknowledged:
            # Recorded after the answer goes back (the owner's placement is waiting); a crash before it
            # only makes the next tick ask the ledger again, which answers the same.
            task = asyncio.create_task(self._mark_done({p.reservation_id for p in preemptions}, acknowledged))
            self._marking.add(task)
            task.add_done_callback(self._marked)
        return acknowledged

    async def settled(self) -> None:
        """Return once the acknowledgements being recorded now are (what handler tests wait for)."""
        while self._marking:
            await asyncio.gather(*self._marking, return_exceptions=True)

    def _marked(self, task: asyncio.Task[None]) -> None:
        self._marking.discard(task)
        if not task.cancelled() and task.exception() is not None:
            self._log.warning("could not record acknowledged preemptions: %s", task.exception())

    async def _mark_done(self, reservation_ids: set[str], allocation_ids: set[str]) -> None:
        async def work(uow: UnitOfWork) -> None:
            for reservation in await self._store.load_many(session=uow.session, ids=reservation_ids, lock=True):
                after = reservation
                acknowledged = [p for p in reservation.preemptions if p.allocation_id in allocation_ids and not p.done]
                for p in acknowledged:
                    after = preemption_done(after, p.allocation_id)
                if after.version == reservation.version:
                    continue
                await self._store.save(session=uow.session, reservation=after, now=uow.now)
                for p in acknowledged:  # the ledger will end it by its deadline
                    emit(uow, ReservationEventName.PREEMPTED, after, preemption=p, reason="acknowledged")

        await self._uow.run(work)
