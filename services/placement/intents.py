"""A request id's intent, as one attempt writes it (``shared.domain.placement.ownership``): claimed,
its commit kept before it is sent, and finished with its outcome and event in one transaction (placed,
rejected, or queued: then it waits in ``placement.queue``). Every write of an attempt holds only while
the intent is still its own (its ``Turn``); one that lost it answers ``LOST``."""

from __future__ import annotations

from datetime import datetime, timedelta

from pydantic import BaseModel

from services.placement.admission import AdmissionHandlers
from services.placement.attempts import LOST, Claimed, Lost, Ownership, Queueing
from services.placement.mapping import to_reply
from services.placement.records import StoredIntent, Turn
from services.placement.store import DecisionStore
from services.placement.tally import QuotaTally
from shared.contracts.base import rejected
from shared.contracts.ledger import CommitRequest
from shared.contracts.placement import PlacementEvent, PlacementEventName, PlaceReply, PlaceRequest
from shared.contracts.subjects import Context
from shared.domain.placement.ownership import Answer, Fresh, IntentState, Refuse, Resume, rule
from shared.domain.placement.types import Decision
from shared.domain.quotas import Quota, QuotaExceeded, exceeded
from shared.infra import deadline
from shared.infra.uow import UnitOfWork, UnitOfWorkFactory


def emit(
    uow: UnitOfWork,
    request: PlaceRequest,
    reply: PlaceReply,
    event: PlacementEventName,
    decision_ms: float,
    attempts: int,
) -> None:
    """Announce a placement's outcome (with the transaction that records it)."""
    uow.emit(
        Context.PLACEMENT,
        event,
        PlacementEvent(
            request_id=request.request_id,
            tenant=request.tenant,
            model=request.model,
            reply=reply,
            decision_ms=round(decision_ms, 3),
            attempts=attempts,
            request=request if event is PlacementEventName.PLACEMENT_DECIDED else None,
        ),
        tenant=request.tenant,
        correlation_id=request.request_id,
    )


class Intents:
    """The intent's writes for placing a request: claim, keep the commit, finish, queue."""

    def __init__(
        self,
        *,
        store: DecisionStore,
        uow: UnitOfWorkFactory,
        ownership: Ownership,
        queueing: Queueing,
        tally: QuotaTally,
        admission: AdmissionHandlers | None,
    ) -> None:
        self._store = store
        self._uow = uow
        self._ownership = ownership
        self._queueing = queueing
        self._tally = tally
        self._admission = admission
        self.enqueued = 0  # requests this process put in the queue (the queue's loop reads no empty table)

    def claim_s(self) -> float:
        """An attempt holds its request id for one ledger round trip, or until its caller's deadline."""
        return min(self._ownership.claim_s, deadline.remaining_s(default_s=self._ownership.claim_s) or 0.0) or 0.001

    async def lock(self, request: PlaceRequest) -> StoredIntent | None:
        """The request id's intent, if it has one (locked for a transaction of its own)."""
        return await self._uow.run(
            lambda uow: self._store.lock(session=uow.session, tenant=request.tenant, request_id=request.request_id)
        )

    # -- claim ------------------------------------------------------------------------------------------

    async def claim(self, request: PlaceRequest, body: str) -> Claimed | BaseModel | Lost:
        """Take this request id for an attempt, or answer what it already decided."""
        return await self._uow.run(lambda uow: self._claim(uow, request, body))

    async def _claim(self, uow: UnitOfWork, request: PlaceRequest, body: str) -> Claimed | BaseModel | Lost:
        tenant, request_id = request.tenant, request.request_id
        stored = await self._store.lock(session=uow.session, tenant=tenant, request_id=request_id)
        ruling = rule(stored.intent if stored else None, body_hash=body, now=uow.now)
        until = uow.now + timedelta(seconds=self.claim_s())
        match ruling:
            case Fresh():
                inserted = await self._store.insert(
                    session=uow.session,
                    tenant=tenant,
                    request_id=request_id,
                    body_hash=body,
                    claimed_until=until,
                    now=uow.now,
                )
                return Claimed(Turn(tenant, request_id, 1)) if inserted else LOST
            case Answer() if stored is not None and stored.intent.status is IntentState.QUEUED:
                return await self._queued_reply(uow, stored) or LOST
            case Answer() if stored is not None and stored.reply is not None:
                return stored.reply
            case Refuse(code=code, message=message):
                return rejected(code, message)
            case Resume(recover=recover) if stored is not None:
                turn = await self._take(uow, stored, until=until, keep_commit=recover)
                if recover and stored.commit is not None and stored.reply is not None:
                    return Claimed(turn, commit=stored.commit, pending=stored.reply)
                return Claimed(turn)
            case _:  # Wait: another attempt holds it
                return LOST

    async def claim_queued(self, request: PlaceRequest, body: str) -> Claimed | None:
        """Take a queued request's intent for an attempt of the queue; None when there is nothing to do
        (another attempt holds it, or it is no longer waiting: then its queue row goes)."""

        async def work(uow: UnitOfWork) -> Claimed | None:
            stored = await self._store.lock(session=uow.session, tenant=request.tenant, request_id=request.request_id)
            intent = stored.intent if stored is not None else None
            if stored is not None and intent is not None and intent.body_hash in (None, body):
                until = uow.now + timedelta(seconds=self._ownership.claim_s)
                if intent.status is IntentState.QUEUED:
                    return Claimed(await self._take(uow, stored, until=until, keep_commit=False), queued=True)
                if intent.status is IntentState.COMMITTING:
                    if intent.claimed_until is not None and intent.claimed_until > uow.now:
                        return None  # being placed right now
                    # An interrupted attempt: recover its commit, as a retry would.
                    turn = await self._take(uow, stored, until=until, keep_commit=True)
                    if stored.commit is not None and stored.reply is not None:
                        return Claimed(turn, commit=stored.commit, pending=stored.reply, queued=True)
                    return Claimed(turn, queued=True)
            if intent is not None:
                await self._store.dequeue(session=uow.session, tenant=intent.tenant, request_id=intent.request_id)
            return None

        return await self._uow.run(work)

    async def _take(self, uow: UnitOfWork, stored: StoredIntent, *, until: datetime, keep_commit: bool) -> Turn:
        intent = stored.intent
        attempt = await self._store.take(
            session=uow.session,
            tenant=intent.tenant,
            request_id=intent.request_id,
            claimed_until=until,
            now=uow.now,
            keep_commit=keep_commit,
        )
        return Turn(intent.tenant, intent.request_id, attempt)

    # -- the fast path: a new request id's intent written with its decision --------------------------------

    async def insert_rejected(self, request: PlaceRequest, body: str, reply: PlaceReply, decision_ms: float) -> bool:
        """A new request id refused, recorded and announced; False when the id has an intent already."""

        async def work(uow: UnitOfWork) -> bool:
            if not await self._insert_decided(uow, request, body, IntentState.REJECTED):
                return False
            emit(uow, request, reply, PlacementEventName.PLACEMENT_REJECTED, decision_ms, 1)
            return True

        return await self._uow.run_grouped(work)

    async def insert_committing(
        self, request: PlaceRequest, body: str, commit: CommitRequest, pending: PlaceReply
    ) -> Claimed | None:
        """A new request id's intent, ``committing`` with the commit about to be sent; None when the id
        has an intent already."""

        async def work(uow: UnitOfWork) -> bool:
            return await self._insert_decided(uow, request, body, IntentState.COMMITTING, commit, pending)

        inserted = await self._uow.run_grouped(work)
        return Claimed(Turn(request.tenant, request.request_id, 1)) if inserted else None

    async def _insert_decided(
        self,
        uow: UnitOfWork,
        request: PlaceRequest,
        body: str,
        status: IntentState,
        commit: CommitRequest | None = None,
        pending: PlaceReply | None = None,
    ) -> bool:
        committing = status is IntentState.COMMITTING
        return await self._store.insert_decided(
            session=uow.session,
            tenant=request.tenant,
            request_id=request.request_id,
            body_hash=body,
            status=status,
            claimed_until=uow.now + timedelta(seconds=self.claim_s()) if committing else None,
            commit=commit,
            pending=pending,
            now=uow.now,
        )

    # -- an attempt's writes ------------------------------------------------------------------------------

    async def save(self, claim: Claimed, commit: CommitRequest, pending: PlaceReply) -> bool:
        """Keep the commit with the intent before it is sent: a retry asks the ledger again with it."""

        async def work(uow: UnitOfWork) -> bool:
            return await self._store.save_commit(
                session=uow.session,
                turn=claim.turn,
                commit=commit,
                pending=pending,
                claimed_until=uow.now + timedelta(seconds=self.claim_s()),
                now=uow.now,
            )

        return await self._uow.run_grouped(work)

    async def _finish(
        self,
        uow: UnitOfWork,
        claim: Claimed,
        status: IntentState,
        *,
        reply: PlaceReply | None = None,
        allocation_id: str | None = None,
        lease_expires_at: datetime | None = None,
    ) -> bool:
        """Record this attempt's outcome for the request's intent; False when another attempt took it."""
        return await self._store.finish(
            session=uow.session,
            turn=claim.turn,
            status=status,
            reply=reply,
            allocation_id=allocation_id,
            now=uow.now,
            lease_expires_at=lease_expires_at,
        )

    async def unclaim(self, claim: Claimed) -> None:
        """Let a retry take the intent over at once (the outcome of this attempt's commit is unknown)."""

        async def work(uow: UnitOfWork) -> None:
            await self._store.unclaim(session=uow.session, turn=claim.turn, now=uow.now)

        await self._uow.run_grouped(work)

    async def finish_rejected(self, claim: Claimed) -> None:
        """Nothing placed and nothing reserved: the same id (and body) may be retried."""

        async def work(uow: UnitOfWork) -> None:
            await self._finish(uow, claim, IntentState.REJECTED)

        await self._uow.run_grouped(work)

    async def record(
        self,
        request: PlaceRequest,
        claim: Claimed,
        reply: PlaceReply,
        event: PlacementEventName,
        decision_ms: float,
        attempts: int,
        lease_expires_at: datetime | None = None,
    ) -> BaseModel | Lost:
        """Record the outcome with the intent (placed: the reply, for the same request id, and when the
        ledger said its lease ends) and announce it, in one transaction; LOST when another attempt took the
        intent over meanwhile."""
        placed = reply.status == "placed"
        if placed:
            reply = reply.model_copy(update={"model": request.model})

        async def work(uow: UnitOfWork) -> bool:
            if claim.queued:  # decided: it leaves the queue with its outcome
                await self._store.dequeue(session=uow.session, tenant=request.tenant, request_id=request.request_id)
            status = IntentState.PLACED if placed else IntentState.REJECTED
            if not await self._finish(
                uow,
                claim,
                status,
                reply=reply if placed else None,
                allocation_id=reply.allocation_id if placed else None,
                lease_expires_at=lease_expires_at if placed else None,
            ):
                return False
            emit(uow, request, reply, event, decision_ms, attempts)
            return True

        if not await self._uow.run_grouped(work):
            return LOST
        if placed and self._admission is not None:
            self._admission.on_placed(request.tenant, reply)
        return reply

    # -- queued -----------------------------------------------------------------------------------------

    async def enqueue(self, request: PlaceRequest, claim: Claimed, decision: Decision) -> BaseModel | Lost:
        """Answer ``queued``: the intent waits in the queue (a new request joins its end, a request the
        queue retried keeps its place). Nothing is reserved. A new request past its tenant's
        ``queued_requests`` quota is refused ``quota_exceeded`` instead (its intent left ``rejected``
        with no answer, so the same id may come back; nothing queued, no event)."""
        timeout_s = request.queue_timeout_s or self._queueing.timeout_s
        reply = to_reply(decision).model_copy(
            update={
                "status": "queued",
                "error": None,
                "explanation": [
                    *decision.explanation,
                    f"queued: {decision.message or 'no capacity now'}; placed in arrival order as capacity frees, "
                    f"rejected if nothing fits within {timeout_s:g} s (queue_timeout_s)",
                ],
            }
        )
        quotas = self._tally.quotas
        limit = quotas.limit(request.tenant, Quota.QUEUED_REQUESTS)

        async def work(uow: UnitOfWork) -> int | Lost | QuotaExceeded | None:
            if limit is not None and not claim.queued:  # one the queue retried holds its place already
                waiting = await self._store.queued_of(
                    session=uow.session, tenant=request.tenant, request_id=request.request_id
                )
                over = exceeded(quotas, request.tenant, Quota.QUEUED_REQUESTS, used=waiting, asked=1)
                if over is not None:
                    finished = await self._finish(uow, claim, IntentState.REJECTED)
                    return over if finished else LOST
            if not await self._finish(uow, claim, IntentState.QUEUED, reply=reply):
                return LOST
            await self._store.enqueue(
                session=uow.session,
                request=request,
                enqueued_at=uow.now,
                deadline_at=uow.now + timedelta(seconds=timeout_s),
            )
            return await self._store.queue_position(
                session=uow.session, tenant=request.tenant, request_id=request.request_id
            )

        position = await self._uow.run(work)
        self.enqueued += 1
        if isinstance(position, Lost):
            return LOST
        if isinstance(position, QuotaExceeded):
            return self._tally.refuse(position)
        return reply.model_copy(update={"queue_position": position})

    async def _queued_reply(self, uow: UnitOfWork, stored: StoredIntent) -> PlaceReply | None:
        """A queued request's stored answer with its position now."""
        if stored.reply is None:
            return None
        position = await self._store.queue_position(
            session=uow.session, tenant=stored.intent.tenant, request_id=stored.intent.request_id
        )
        return stored.reply.model_copy(update={"queue_position": position})
