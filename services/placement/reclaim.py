"""What a tenant's reservations do to its placements (docs/RESERVATIONS.md): read-your-writes (a placement
is decided only on a book that holds every reservation answered before it), and an owner's reclaim of its
soft or spot reservations from their borrowers."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime

from pydantic import BaseModel

from services.placement.attempts import ORDINARY, Ordinary, share_of_deadline
from services.placement.deciding import Decider, View
from services.placement.intents import Intents
from services.placement.mapping import may_queue
from shared.contracts.base import ErrorCode, Rejected, rejected
from shared.contracts.placement import PlaceRequest
from shared.contracts.reservation import ReservationReclaimReply, ReservationReclaimRequest
from shared.contracts.subjects import Rpc
from shared.domain.placement import decide
from shared.domain.reservations import ReservationBook, plan_reclaim, vacate
from shared.infra import deadline
from shared.infra.clock import Clock
from shared.infra.fleet_view import to_domain
from shared.infra.rpc import RpcClient, RpcError

RECLAIM_WAIT_S = 2.0
RECLAIM_POLL_S = 0.005
"""How long, and how often, an owner's placement waits for its view to hear that the borrowers it had
preempted (soft) are gone."""
RECLAIM_TIMEOUT_S = 3.0
"""How long an owner's placement waits for ``reservation.reclaim``: a live filler answers within its
``ledger.preempt`` timeout (2 s); one that died mid-reclaim must not hold the owner's answer until the
caller's deadline. Each wait of the reclaim path also takes at most half of what the deadline leaves."""
RESERVATION_SYNC_S = 2.0
"""How long a placement waits, at most, for its reservation view to reach the RESERVATION stream's end."""


class Reclaimer:
    """Reservations as the RESERVATION stream tells them (the read model's fold), for placing a request."""

    def __init__(
        self,
        *,
        view: View,
        decider: Decider,
        intents: Intents,
        rpc: RpcClient,
        clock: Clock,
        log: logging.Logger,
        reservations: ReservationBook,
        holds: Callable[[str], bool],
        reservations_current: Callable[[float], Awaitable[str | None]] | None,
    ) -> None:
        self._view = view
        self._decider = decider
        self._intents = intents
        self._rpc = rpc
        self._clock = clock
        self._log = log
        # The borrowers an owner may reclaim from; ``holds``: does the view still count an allocation.
        self._reservations = reservations
        self._holds = holds
        # Read-your-writes: waits, at most the seconds given, until the book holds every reservation event
        # in the stream when it was called; None once it does, else why not.
        self._reservations_current = reservations_current

    async def known(self) -> Rejected | None:
        """Read-your-writes: every reservation answered ``created`` before this request arrived is in the
        book it is decided on. A view that cannot get there within its share of the deadline refuses,
        retryable, having decided nothing."""
        if self._reservations_current is None:
            return None
        why = await self._reservations_current(share_of_deadline(RESERVATION_SYNC_S))
        if why is None:
            return None
        self._log.warning("placement's reservation view is not known to be current: %s", why)
        return rejected(
            ErrorCode.NO_CAPACITY,
            f"placement cannot confirm it knows every reservation yet ({why}); nothing was decided: retry",
            retry_after_s=RESERVATION_SYNC_S,
        )

    async def reclaim(self, request: PlaceRequest) -> BaseModel | Ordinary:
        """An owner's replica that fits nowhere it may go, but would if borrowers of its own soft or spot
        reservations left (the fewest, most recently lent first): have the reservation filler preempt them.
        Soft: the ledger ends them at once; this waits (bounded) until the view no longer counts them, then
        the ordinary path places. Spot: they have until their deadline; a request that may queue is queued
        by the ordinary path (placed when they leave), any other is refused now with the deadline, nothing
        recorded, so the same request id can come back; coming back, it counts the borrowers already told
        to leave for it instead of evicting more. ``ORDINARY``: the ordinary path takes over."""
        leaving = self._reservations.leaving_for(request.tenant, request.request_id)
        borrowed = self._reservations.borrowed_from(request.tenant)
        if not borrowed and not leaving:
            return ORDINARY
        snapshot = self._decider.rights(self._view.snapshot, request)
        wanted = to_domain(request)
        if decide(snapshot, wanted).placed:
            return ORDINARY
        if leaving and decide(vacate(snapshot, (b for b, _ in leaving)), wanted).placed:
            return await self._await_leaving(
                request, [p.allocation_id for _, p in leaving], [p.deadline_at for _, p in leaving]
            )
        if await self._intents.lock(request) is not None:  # a retry: the request id's own answer stands
            return ORDINARY
        plan = plan_reclaim(vacate(snapshot, (b for b, _ in leaving)), borrowed, lambda s: decide(s, wanted))
        if plan is None:
            return ORDINARY
        ask = ReservationReclaimRequest(
            request_id=request.request_id,
            tenant=request.tenant,
            allocation_ids=[borrow.allocation_id for _, borrow in plan.evict],
        )
        try:
            answer = await self._rpc.ask(
                Rpc.RESERVATION_RECLAIM,
                ask,
                ReservationReclaimReply,
                timeout_s=share_of_deadline(min(RECLAIM_TIMEOUT_S, self._rpc.timeout_s)),
            )
        except RpcError as exc:
            self._log.warning("reservation.reclaim unanswered: %s", exc)
            return self._unanswered(request, exc)
        if isinstance(answer, Rejected):
            self._log.warning("reservation.reclaim refused: %s", answer.error.message)
            return ORDINARY
        preemptions = [*answer.preemptions]
        return await self._await_leaving(
            request,
            [p.allocation_id for p in preemptions] + [p.allocation_id for _, p in leaving],
            [p.deadline_at for p in preemptions] + [p.deadline_at for _, p in leaving],
        )

    @staticmethod
    def _unanswered(request: PlaceRequest, exc: RpcError) -> BaseModel | Ordinary:
        """The filler did not answer (it died mid-reclaim, or is not running). A request that may queue
        takes the ordinary path, which queues it: a filler that comes back re-issues the preemptions it
        had written and the queue places the owner once they are gone. Any other is refused now,
        retryable, with nothing recorded for its request id."""
        if may_queue(request):
            return ORDINARY
        return rejected(
            ErrorCode.NO_CAPACITY,
            "this replica fits only if borrowers of the tenant's reservations leave, and the reservation "
            f"filler did not answer reservation.reclaim ({exc.reason}): retry (nothing was recorded for this "
            "request id)",
            retry_after_s=RECLAIM_TIMEOUT_S,
        )

    async def _await_leaving(
        self, request: PlaceRequest, allocations: list[str], deadlines: list[datetime]
    ) -> BaseModel | Ordinary:
        """Borrowers are leaving for this request: freed now (soft), wait until the view no longer counts
        them; leaving later (spot), queue (``ORDINARY``: the ordinary path queues it) or refuse with the
        deadline."""
        now = self._clock()
        if all(d <= now for d in deadlines):
            waited, limit_s = 0.0, share_of_deadline(RECLAIM_WAIT_S)
            while any(self._holds(a) for a in allocations) and waited < limit_s and not deadline.expired():
                await asyncio.sleep(RECLAIM_POLL_S)
                waited += RECLAIM_POLL_S
            return ORDINARY
        if may_queue(request):
            return ORDINARY
        until = max(deadlines)
        return rejected(
            ErrorCode.NO_CAPACITY,
            f"reclaiming {len(allocations)} borrower(s) of this tenant's spot reservation; they leave by "
            f"{until.isoformat()}: retry then (nothing was recorded for this request id)",
            deadline_at=until.isoformat(),
            retry_after_s=round(max(0.0, (until - now).total_seconds()), 3),
        )
