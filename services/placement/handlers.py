"""Placement's handlers: place / explain / release / renew over the pure pipeline, the LEDGER events that
tell decisions of their allocations, and the reconciler.

``place`` reads like the DESIGN §4 pipeline: take the request id (its intent, recorded before anything is
reserved) -> decide on the view -> keep the commit with the intent -> reserve through the ledger
(optimistic: the reserved bytes it decided on travel with the commit, and a ``conflict`` decides again
on the fresher figures the ledger sent back) -> record the decision and its event -> reply. While a
commit is in flight its bytes are assumed in the view (so concurrent decisions do not all pick the
same GPUs); whatever the ledger answers, or if it does not answer, the assumption is confirmed or
forgotten, never left behind.

One request id, one outcome (``shared.domain.placement.ownership``): requests with the same id take
turns (a lock per id in this process, the intent's attempt and claim across processes); a retry of an
interrupted placement asks the ledger again with the commit it sent (the ledger answers a repeat with
the same allocation); a reused id with another body is ``conflict``.

The queue: a request the domain refuses for capacity (``Decision.queueable``) that allows ``queue``
is answered ``queued`` with its ``queue_position`` and kept in ``placement.queue`` (its intent
``queued``); it reserves nothing. ``serve_queue`` retries the queue whenever capacity frees
(allocations released or expired, nodes back) and every ``HETSCHED_PLACEMENT_QUEUE_RETRY_S``. A pass
reads every queued request (keyset pages of ``HETSCHED_PLACEMENT_QUEUE_PAGE`` rows) and visits them
round robin by tenant, each tenant's in arrival order (``shared.domain.placement.queue``): one past
its ``queue_timeout_s`` is rejected ``no_capacity`` ("queue timeout"), each that now fits is
committed as any placement is, those that still do not fit keep their place (a request that does not
fit holds back neither a later one nor another tenant's), and a request of the same shape as one that
did not fit earlier in the pass is not decided again. The same request id asked again answers its
current state.

Quotas (``shared.domain.quotas``): a tenant's placed accelerators (``gpus_placed``, counted in
``Holdings`` from the placed decisions at start, the view's LEDGER feed and this process's commits
in flight) and its queued requests (``queued_requests``, counted in the enqueue's transaction) are
checked before anything is recorded; past one, ``quota_exceeded``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Protocol

from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession

from services.placement.admission import AdmissionHandlers
from services.placement.mapping import (
    body_hash,
    commit_held,
    crossing,
    held_bytes,
    ledger_key,
    may_queue,
    placement_request_id,
    to_commit,
    to_reply,
)
from services.placement.metrics import PlacementMetrics
from services.placement.store import DecisionStore, QueuedRequest, StoredIntent
from shared.contracts.base import ErrorBody, ErrorCode, Rejected, rejected
from shared.contracts.envelope import EventEnvelope
from shared.contracts.ledger import (
    AllocationEvent,
    CommitReply,
    CommitRequest,
    LedgerEvent,
    LedgerReleaseReply,
    LedgerReleaseRequest,
    LedgerRenewReply,
    LedgerRenewRequest,
)
from shared.contracts.placement import (
    PlaceReply,
    PlaceRequest,
    ReleaseReply,
    ReleaseRequest,
    RenewReply,
    RenewRequest,
)
from shared.contracts.placement_events import PlacementEvent, PlacementEventName, PlacementReleasedEvent
from shared.contracts.reservation import ReservationReclaimReply, ReservationReclaimRequest
from shared.contracts.subjects import Context, Rpc
from shared.domain.placement import decide
from shared.domain.placement.ownership import (
    Answer,
    DecisionStatus,
    Fresh,
    Refuse,
    Resume,
    Wait,
    is_stale,
    owns,
    rule,
    stale_before,
)
from shared.domain.placement.queue import round_robin
from shared.domain.placement.types import Decision, FleetSnapshot
from shared.domain.placement.view import AssumeKey, Crossing, LedgerAccelerator, overlay
from shared.domain.placement.withhold import withhold
from shared.domain.quotas import Holdings, Quota, QuotaExceeded, Quotas, exceeded
from shared.domain.reservations import ReservationBook, plan_reclaim, vacate
from shared.infra import deadline
from shared.infra.clock import Clock, MonotonicMs
from shared.infra.fleet_view import balance_to_domain, to_domain
from shared.infra.locks import KeyedLocks
from shared.infra.metrics import ServiceMetrics
from shared.infra.rpc import RpcClient, RpcError
from shared.infra.uow import UnitOfWork, UnitOfWorkFactory

MAX_ATTEMPTS = 4
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
"""Commits tried per placement: each conflict decides again on fresher figures."""
WAIT_POLL_S = 0.05
"""How often a request waits for another process's attempt at the same request id to finish."""
RECONCILE_BATCH = 500
QUEUE_YIELD_EVERY = 64
"""A queue pass lets other work run after this many requests visited without an await."""


class View(Protocol):
    """What the handlers need of the read model."""

    @property
    def snapshot(self) -> FleetSnapshot: ...

    def assume(
        self, key: AssumeKey, held: Mapping[str, int], *, shared: bool = False, crossing: Crossing | None = None
    ) -> int: ...

    def confirm(self, token: int, allocation_id: str) -> None: ...

    def forget(self, token: int) -> None: ...


@dataclass(frozen=True, slots=True)
class Ownership:
    """How long an attempt holds a request id, and when an untouched intent is abandoned."""

    claim_s: float
    grace_s: float
    reconcile_period_s: float = 30.0


@dataclass(frozen=True, slots=True)
class Queueing:
    """How long a queued request waits by default, how often the queue is retried without a wake, and how
    many queued rows one read of a pass takes (it reads them all, a page at a time)."""

    timeout_s: float = 600.0
    retry_s: float = 5.0
    page: int = 200


@dataclass(frozen=True, slots=True)
class _Claimed:
    """This attempt holds the intent; ``commit``/``pending``: what an interrupted attempt sent, if any."""

    attempt: int
    commit: CommitRequest | None = None
    pending: PlaceReply | None = None
    queued: bool = False  # taken from the queue (a row in placement.queue goes when it is decided)


class _Lost:
    """Another attempt took the intent over: wait for its outcome."""


LOST = _Lost()


def _ledger_error(reply: CommitReply | Rejected) -> ErrorBody:
    return reply.error or ErrorBody(code=ErrorCode.INTERNAL, message="the ledger refused without a reason")


def _committed(reply: CommitReply | Rejected) -> str | None:
    """The allocation id of a commit the ledger holds (new or a repeat), else None."""
    if isinstance(reply, CommitReply) and reply.status == "committed" and reply.allocation_id:
        return reply.allocation_id
    return None


FINISHING_KEPT = 256


def _too_late_to_commit(margin_s: float) -> Rejected:
    return rejected(
        ErrorCode.DEADLINE_EXCEEDED,
        f"the caller's deadline leaves less than a commit takes now (~{margin_s * 1000:.0f} ms); nothing was reserved",
    )


def _share_of_deadline(seconds: float) -> float:
    """``seconds``, or half of what the caller's deadline leaves if that is less: a wait on the way to an
    answer leaves the rest for the answer."""
    left = deadline.remaining_s()
    return seconds if left is None else min(seconds, left / 2)


def _caller_gone() -> Rejected:
    return rejected(ErrorCode.DEADLINE_EXCEEDED, "the caller's deadline passed before the commit; nothing was reserved")


def _ledger_silent(exc: RpcError) -> Rejected:
    return rejected(
        ErrorCode.INTERNAL,
        f"the ledger did not answer: {exc.reason}; retry with the same request_id to learn the outcome",
    )


class PlacementHandlers:
    def __init__(
        self,
        *,
        view: View,
        store: DecisionStore,
        uow: UnitOfWorkFactory,
        rpc: RpcClient,
        timer: MonotonicMs,
        default_lease_s: int,
        ownership: Ownership,
        clock: Clock,
        log: logging.Logger | None = None,
        after_commit: Callable[[], None] = lambda: None,
        max_attempts: int = MAX_ATTEMPTS,
        poll_s: float = WAIT_POLL_S,
        queueing: Queueing | None = None,
        admission: AdmissionHandlers | None = None,
        reservations: ReservationBook | None = None,
        holds: Callable[[str], bool] = lambda _allocation_id: False,
        throttled: Callable[[], set[str]] = set,
        metrics: PlacementMetrics | None = None,
        reservations_current: Callable[[float], Awaitable[str | None]] | None = None,
        quotas: Quotas | None = None,
    ) -> None:
        # Per-tenant quotas, and the accelerators each tenant's replicas hold (``gpus_placed``'s count).
        self._quotas = quotas or Quotas()
        self.holdings = Holdings()
        self._admission = admission
        # Reservations as the RESERVATION stream tells them (the read model's fold): what a tenant may not
        # use, and the borrowers an owner may reclaim from; ``holds``: does the view still count an allocation.
        self._reservations = reservations or ReservationBook()
        self._holds = holds
        # Read-your-writes (docs/RESERVATIONS.md): waits, at most the seconds given, until the book holds
        # every reservation event in the stream when it was called; None once it does, else why not.
        self._reservations_current = reservations_current
        self._throttled_nodes = throttled  # nodes the rebalancer throttles (REBALANCE events)
        self._withheld: dict[tuple[str, bool], tuple[int, frozenset[str]]] = {}
        self._view = view
        self._store = store
        self._uow = uow
        self._rpc = rpc
        self._timer = timer
        self._default_lease_s = default_lease_s
        self._metrics = metrics or PlacementMetrics.create(ServiceMetrics("placement"))
        self._ownership = ownership
        self._clock = clock
        self._log = log or logging.getLogger("hetsched.placement")
        self._after_commit = after_commit  # a fault-injection point for tests (HETSCHED_PLACEMENT_FAULT_AFTER_COMMIT)
        self._max_attempts = max_attempts
        self._poll_s = poll_s
        self._queueing = queueing or Queueing()
        self._queue_wake = asyncio.Event()
        self.ids = KeyedLocks()
        # How long recent commits took from sending to an answer ready (ms): a commit is only sent while
        # the caller's deadline leaves at least their 90th percentile, so an overloaded service refuses
        # early ("deadline_exceeded", nothing reserved) instead of reserving for a caller who is gone.
        self._finishing: deque[float] = deque(maxlen=FINISHING_KEPT)
        self._margin_s = 0.0

    # -- routes ----------------------------------------------------------------------------------

    async def place(self, request: PlaceRequest) -> BaseModel:
        if deadline.expired():
            return _caller_gone()
        unsure = await self._reservations_known()
        if unsure is not None:
            return unsure
        async with self.ids.hold((request.tenant, request.request_id)):
            body = body_hash(request)
            reclaiming = await self._reclaim(request)
            if reclaiming is not None:
                return reclaiming
            fast = await self._first(request, body)
            if fast is not None:
                return fast
            waited_s = 0.0
            while True:
                claim = await self._uow.run(lambda uow: self._claim(uow, request, body))
                if isinstance(claim, _Claimed):
                    outcome = await self._attempt(request, claim)
                    if not isinstance(outcome, _Lost):
                        return outcome
                elif isinstance(claim, BaseModel):
                    return claim
                # Another process holds this request id: its outcome is the answer (bounded by its claim).
                if deadline.expired() or waited_s > 2 * self._ownership.claim_s:
                    return rejected(ErrorCode.CONFLICT, "another request with this request_id is being placed; retry")
                await asyncio.sleep(self._poll_s)
                waited_s += self._poll_s

    async def explain(self, request: PlaceRequest) -> BaseModel:
        snapshot = self._view.snapshot
        decision, _elapsed_ms = self._decide(snapshot, request)
        reply = to_reply(decision, snapshot=snapshot, request=to_domain(request))
        explanation = ["dry run: nothing was reserved", *reply.explanation]
        if not decision.placed and decision.queueable and may_queue(request):
            explanation.append("placement.place would queue this request until capacity frees")
        over = self._over_quota(request, held_bytes(snapshot, decision)) if decision.placed else None
        if over is not None:
            explanation.append(f"placement.place would refuse this request: {over.message}")
        return reply.model_copy(update={"explanation": explanation})

    async def release(self, request: ReleaseRequest) -> BaseModel:
        if self._admission is not None:  # an admission's KV hold, released for the tenant that asked for it
            owner = self._admission.owner_of_hold(request.allocation_id, request.tenant)
            if isinstance(owner, Rejected):
                return ReleaseReply(status="rejected", error=owner.error)
            if owner is not None:
                return await self._admission.release_hold(request.allocation_id, owner)
        try:
            released = await self._rpc.ask(
                Rpc.LEDGER_RELEASE,
                LedgerReleaseRequest(allocation_id=request.allocation_id, tenant=request.tenant),
                LedgerReleaseReply,
            )
        except RpcError as exc:
            return ReleaseReply(status="rejected", error=ErrorBody(code=ErrorCode.INTERNAL, message=str(exc)))
        if isinstance(released, Rejected) or released.status != "released":
            return ReleaseReply(status="rejected", error=released.error)

        async def work(uow: UnitOfWork) -> None:
            await self._store.mark_released(session=uow.session, allocation_id=request.allocation_id)
            uow.emit(
                Context.PLACEMENT,
                PlacementEventName.PLACEMENT_RELEASED,
                PlacementReleasedEvent(allocation_id=request.allocation_id, tenant=request.tenant),
                tenant=request.tenant,
            )

        await self._uow.run_grouped(work)
        self.holdings.end(request.allocation_id)
        if self._admission is not None:
            self._admission.on_allocation_ended(request.allocation_id)
        return ReleaseReply(status="released")

    async def renew(self, request: RenewRequest) -> BaseModel:
        tenant = request.tenant
        if self._admission is not None:  # an admission's KV hold: renewed under its replica's owner
            owner = self._admission.owner_of_hold(request.allocation_id, request.tenant)
            if isinstance(owner, Rejected):
                return RenewReply(status="rejected", error=owner.error)
            tenant = owner or tenant
        try:
            renewed = await self._rpc.ask(
                Rpc.LEDGER_RENEW,
                LedgerRenewRequest(allocation_id=request.allocation_id, tenant=tenant, lease_s=request.lease_s),
                LedgerRenewReply,
            )
        except RpcError as exc:
            return RenewReply(status="rejected", error=ErrorBody(code=ErrorCode.INTERNAL, message=str(exc)))
        if isinstance(renewed, Rejected) or renewed.status != "renewed":
            return RenewReply(status="rejected", error=renewed.error)
        return RenewReply(status="renewed", lease_expires_at=renewed.lease_expires_at)

    # -- LEDGER events (a durable consumer: what the ledger did to placement's allocations) -------------

    async def on_allocation_committed(self, *, uow: UnitOfWork, event: EventEnvelope, payload: AllocationEvent) -> None:
        """Remember placement's replica allocations, so the reconciler can find those no decision owns."""
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

    async def on_allocation_expired(self, *, uow: UnitOfWork, event: EventEnvelope, payload: AllocationEvent) -> None:
        """A replica whose lease ran out is announced as ended (as a release is), for those who follow
        where replicas are (the router); a request's KV hold frees its replica's pool."""
        tenant = await self._store.mark_ended(
            session=uow.session, allocation_id=payload.allocation_id, status=DecisionStatus.EXPIRED, now=uow.now
        )
        if tenant is not None:
            uow.emit(
                Context.PLACEMENT,
                PlacementEventName.PLACEMENT_RELEASED,
                PlacementReleasedEvent(allocation_id=payload.allocation_id, tenant=tenant, reason="expired"),
                tenant=tenant,
            )
        self.holdings.end(payload.allocation_id)
        if self._admission is not None:
            self._admission.on_allocation_ended(payload.allocation_id)
        self.wake_queue()

    async def on_allocation_released(self, *, uow: UnitOfWork, event: EventEnvelope, payload: AllocationEvent) -> None:
        await self._store.mark_ended(
            session=uow.session, allocation_id=payload.allocation_id, status=DecisionStatus.RELEASED, now=uow.now
        )
        self.holdings.end(payload.allocation_id)
        if self._admission is not None:
            self._admission.on_allocation_ended(payload.allocation_id)
        self.wake_queue()

    # -- quotas ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Count what each tenant's replicas hold from the placed decisions (the view's LEDGER feed and
        this process's commits keep the count from then on)."""
        placed = await self._uow.read(lambda session: self._store.placed_allocations(session=session))
        for allocation in placed:
            self.holdings.add(allocation.allocation_id, allocation.tenant, allocation.accelerators)

    def on_view_allocation(self, name: str, payload: AllocationEvent) -> None:
        """A LEDGER allocation event the view applied (every placement process sees every one): a replica
        placement committed counts for its tenant until it ends."""
        if payload.kind != "replica" or placement_request_id(payload.request_id) is None:
            return
        if name == LedgerEvent.ALLOCATION_COMMITTED:
            self.holdings.add(payload.allocation_id, payload.tenant, (s.accelerator_id for s in payload.shares))
        elif name in (LedgerEvent.ALLOCATION_RELEASED, LedgerEvent.ALLOCATION_EXPIRED):
            self.holdings.end(payload.allocation_id)

    def _over_quota(self, request: PlaceRequest, held: Mapping[str, int]) -> QuotaExceeded | None:
        """The tenant's ``gpus_placed`` quota, were it to hold ``held``'s accelerators as well."""
        tenant = request.tenant
        return exceeded(
            self._quotas,
            tenant,
            Quota.GPUS_PLACED,
            used=self.holdings.held(tenant),
            asked=self.holdings.adds(tenant, held),
        )

    def _refuse(self, over: QuotaExceeded) -> Rejected:
        """``quota_exceeded``, naming the quota, its limit and the use now."""
        self._metrics.rejections.labels(ErrorCode.QUOTA_EXCEEDED).inc()
        return rejected(ErrorCode.QUOTA_EXCEEDED, over.message, **over.details())

    def _assume(
        self, key: AssumeKey, held: Mapping[str, int], *, shared: bool = False, crossing: Crossing | None = None
    ) -> int:
        """The view assumes a commit in flight, and the tenant (``key[0]``) holds its accelerators meanwhile."""
        token = self._view.assume(key, held, shared=shared, crossing=crossing)
        self.holdings.hold(token, key[0], held)
        return token

    def _forget(self, token: int) -> None:
        self._view.forget(token)
        self.holdings.forget(token)

    def _confirm(self, token: int, allocation_id: str) -> None:
        self._view.confirm(token, allocation_id)
        self.holdings.confirm(token, allocation_id)

    # -- the queue ---------------------------------------------------------------------------------

    def wake_queue(self) -> None:
        """Capacity may have freed: retry the queue now (a pass already under way is followed by another)."""
        self._queue_wake.set()

    async def serve_queue(self) -> None:
        """Forever: a pass over the queue whenever woken, and every ``Queueing.retry_s`` anyway."""
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._queue_wake.wait(), timeout=self._queueing.retry_s)
            self._queue_wake.clear()
            try:
                await self.serve_queue_once()
            except Exception:
                self._log.exception("placement's queue pass failed; retrying")

    async def serve_queue_once(self) -> dict[str, str]:
        """One pass over every queued request, round robin by tenant (each tenant's oldest first): time
        out what waited too long, place what fits now; a request shaped as one that did not fit earlier in
        this pass is not decided again (capacity only shrinks within a pass: one freed meanwhile wakes the
        next). The outcome per request id (``placed``, ``queued``, ``timed_out``, ``rejected``, ``skipped``).

        Read-your-writes holds here too: a pass decides only once the reservation view has applied every
        reservation answered before the pass began; if it cannot get there, the pass only times out."""
        entries = round_robin(await self._queued(), tenant=lambda entry: entry.tenant)
        outcomes: dict[str, str] = {}
        if not entries:
            return outcomes
        behind = await self._reservations_known()  # a refusal: the view may miss a reservation
        unfit: set[str] = set()  # shapes that did not fit in this pass
        for visited, entry in enumerate(entries, 1):
            async with self.ids.hold((entry.tenant, entry.request_id)):
                if entry.deadline_at <= self._clock():
                    outcome = await self._time_out(entry)
                elif behind is not None or (shape := entry.shape) in unfit:
                    outcome = "queued"
                else:
                    outcome = await self._serve(entry)
                    if outcome == "queued":
                        unfit.add(shape)
            outcomes[entry.request_id] = outcome
            if outcome == "timed_out":  # refused after all (one placed is counted where it is committed)
                self._metrics.rejections.labels(ErrorCode.NO_CAPACITY).inc()
            if visited % QUEUE_YIELD_EVERY == 0:
                await asyncio.sleep(0)
        return outcomes

    async def _queued(self) -> list[QueuedRequest]:
        """Every queued request in arrival order, read a page at a time (keyset on ``seq``)."""
        entries: list[QueuedRequest] = []
        page = self._queueing.page
        after: int | None = None
        while True:

            async def read(session: AsyncSession, after: int | None = after) -> list[QueuedRequest]:
                return await self._store.queued(session=session, limit=page, after=after)

            rows = await self._uow.read(read)
            entries.extend(rows)
            if len(rows) < page:
                return entries
            after = rows[-1].seq

    async def _serve(self, entry: QueuedRequest) -> str:
        request = entry.request
        # A dry decision first: a request that still does not fit (or would take its tenant past its
        # quota of placed GPUs: it waits for its own replicas to end, or its timeout) costs no writes.
        snapshot = self._view.snapshot
        decision, _elapsed_ms = self._decide(snapshot, request)
        if not decision.placed and decision.queueable:
            return "queued"
        if decision.placed and self._over_quota(request, held_bytes(snapshot, decision)) is not None:
            return "queued"
        body = body_hash(request)
        claim = await self._uow.run(lambda uow: self._claim(uow, request, body, dequeue=True))
        if not isinstance(claim, _Claimed):
            return "skipped"
        outcome = await self._attempt(request, claim)
        if isinstance(outcome, PlaceReply):
            return outcome.status
        return "rejected" if isinstance(outcome, Rejected) else "skipped"

    async def _claim_queued(self, uow: UnitOfWork, stored: StoredIntent | None, body: str) -> _Claimed | None:
        """Take a queued request's intent for an attempt of the queue; None when there is nothing to do
        (another attempt holds it, or it is no longer waiting: then its queue row goes)."""
        intent = stored.intent if stored is not None else None
        if intent is not None and intent.body_hash in (None, body):
            until = uow.now + timedelta(seconds=self._ownership.claim_s)
            if intent.status is DecisionStatus.QUEUED:
                attempt = await self._store.take(
                    session=uow.session,
                    tenant=intent.tenant,
                    request_id=intent.request_id,
                    claimed_until=until,
                    now=uow.now,
                    keep_commit=False,
                )
                return _Claimed(attempt=attempt, queued=True)
            if intent.status is DecisionStatus.COMMITTING:
                if intent.claimed_until is not None and intent.claimed_until > uow.now:
                    return None  # being placed right now
                assert stored is not None  # an interrupted attempt: recover its commit, as a retry would
                attempt = await self._store.take(
                    session=uow.session,
                    tenant=intent.tenant,
                    request_id=intent.request_id,
                    claimed_until=until,
                    now=uow.now,
                    keep_commit=True,
                )
                if stored.commit is not None and stored.reply is not None:
                    return _Claimed(attempt=attempt, commit=stored.commit, pending=stored.reply, queued=True)
                return _Claimed(attempt=attempt, queued=True)
        if intent is not None:
            await self._store.dequeue(session=uow.session, tenant=intent.tenant, request_id=intent.request_id)
        return None

    async def _time_out(self, entry: QueuedRequest) -> str:
        """Reject a request that waited its ``queue_timeout_s`` out (unless an attempt holds it now)."""
        waited_s = round((entry.deadline_at - entry.enqueued_at).total_seconds())
        message = f"queue timeout: no capacity freed for this request within {waited_s} s"

        async def work(uow: UnitOfWork) -> str:
            stored = await self._store.lock(session=uow.session, tenant=entry.tenant, request_id=entry.request_id)
            status = stored.intent.status if stored is not None else None
            if status is DecisionStatus.COMMITTING:
                return "skipped"  # an attempt is placing it: its outcome stands
            await self._store.dequeue(session=uow.session, tenant=entry.tenant, request_id=entry.request_id)
            if stored is None or status is not DecisionStatus.QUEUED:
                return "skipped"
            before = stored.reply.explanation if stored.reply is not None else []
            reply = PlaceReply(
                status="rejected",
                request_id=entry.request_id,
                explanation=[*before, message],
                error=ErrorBody(code=ErrorCode.NO_CAPACITY, message=message),
            )
            if not await self._store.settle(
                session=uow.session,
                tenant=entry.tenant,
                request_id=entry.request_id,
                attempt=stored.intent.attempt,
                was=DecisionStatus.QUEUED,
                status=DecisionStatus.TIMED_OUT,
                reply=reply,
                now=uow.now,
            ):
                return "skipped"
            self._emit(uow, entry.request, reply, PlacementEventName.PLACEMENT_REJECTED, 0.0, 0)
            return "timed_out"

        return await self._uow.run(work)

    async def _enqueue(self, request: PlaceRequest, claim: _Claimed, decision: Decision) -> BaseModel | _Lost:
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

        limit = self._quotas.limit(request.tenant, Quota.QUEUED_REQUESTS)

        async def work(uow: UnitOfWork) -> int | _Lost | QuotaExceeded | None:
            if limit is not None and not claim.queued:  # one the queue retried holds its place already
                waiting = await self._store.queued_of(
                    session=uow.session, tenant=request.tenant, request_id=request.request_id
                )
                over = exceeded(self._quotas, request.tenant, Quota.QUEUED_REQUESTS, used=waiting, asked=1)
                if over is not None:
                    finished = await self._finish(uow, request, claim, DecisionStatus.REJECTED)
                    return over if finished else LOST
            if not await self._finish(uow, request, claim, DecisionStatus.QUEUED, reply=reply):
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
        if isinstance(position, _Lost):
            return LOST
        if isinstance(position, QuotaExceeded):
            return self._refuse(position)
        return reply.model_copy(update={"queue_position": position})

    async def _queued_reply(self, uow: UnitOfWork, stored: StoredIntent) -> PlaceReply | None:
        """A queued request's stored answer with its position now."""
        if stored.reply is None:
            return None
        position = await self._store.queue_position(
            session=uow.session, tenant=stored.intent.tenant, request_id=stored.intent.request_id
        )
        return stored.reply.model_copy(update={"queue_position": position})

    # -- the reconciler ----------------------------------------------------------------------------

    async def reconcile(self) -> None:
        """Forever: abandon stuck intents and release the allocations no decision owns."""
        while True:
            await asyncio.sleep(self._ownership.reconcile_period_s)
            try:
                await self.reconcile_once()
            except Exception:
                self._log.exception("placement's reconciler failed; retrying")

    async def reconcile_once(self) -> list[str]:
        """One pass; the allocations it released."""
        grace_s = self._ownership.grace_s
        now = self._clock()
        stuck = await self._uow.read(
            lambda session: self._store.committing(
                session=session, touched_before=stale_before(now=now, grace_s=grace_s), limit=RECONCILE_BATCH
            )
        )
        for intent in stuck:
            if not is_stale(intent, now=now, grace_s=grace_s):
                continue

            async def abandon(
                uow: UnitOfWork,
                tenant: str = intent.tenant,
                rid: str = intent.request_id,
                attempt: int = intent.attempt,
            ) -> bool:
                return await self._store.abandon(
                    session=uow.session, tenant=tenant, request_id=rid, attempt=attempt, now=uow.now
                )

            if await self._uow.run(abandon):
                self._log.warning(
                    "abandoned a placement intent stuck in committing",
                    extra={"tenant": intent.tenant, "request_id": intent.request_id},
                )
        seen = await self._uow.read(
            lambda session: self._store.active_allocations(
                session=session, seen_before=stale_before(now=now, grace_s=grace_s), limit=RECONCILE_BATCH
            )
        )
        released: list[str] = []
        for allocation in seen:
            if owns(
                allocation.intent,
                allocation_id=allocation.allocation_id,
                seen_at=allocation.seen_at,
                now=now,
                grace_s=grace_s,
            ):
                continue
            try:
                reply = await self._rpc.ask(
                    Rpc.LEDGER_RELEASE,
                    LedgerReleaseRequest(allocation_id=allocation.allocation_id, tenant=allocation.tenant),
                    LedgerReleaseReply,
                )
            except RpcError as exc:
                self._log.warning("the reconciler could not release an allocation", extra={"error": exc.reason})
                continue
            if isinstance(reply, LedgerReleaseReply) and reply.status == "released":
                released.append(allocation.allocation_id)
                self._log.warning(
                    "released an allocation no placement decision owns",
                    extra={"allocation_id": allocation.allocation_id, "request_id": allocation.request_id},
                )
        return released

    # -- steps -----------------------------------------------------------------------------------

    async def _claim(
        self, uow: UnitOfWork, request: PlaceRequest, body: str, *, dequeue: bool = False
    ) -> _Claimed | BaseModel | _Lost | None:
        """Take this request id for an attempt, or answer what it already decided (``dequeue``: for the
        queue, which takes a queued request over; None when it has nothing to do)."""
        tenant, request_id = request.tenant, request.request_id
        stored = await self._store.lock(session=uow.session, tenant=tenant, request_id=request_id)
        if dequeue:
            return await self._claim_queued(uow, stored, body)
        ruling = rule(stored.intent if stored else None, body_hash=body, now=uow.now)
        until = uow.now + timedelta(seconds=self._claim_s())
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
                return _Claimed(attempt=1) if inserted else LOST
            case Answer() if stored is not None and stored.intent.status is DecisionStatus.QUEUED:
                return await self._queued_reply(uow, stored) or LOST
            case Answer() if stored is not None and stored.reply is not None:
                return stored.reply
            case Refuse(code=code, message=message):
                return rejected(code, message)
            case Resume(recover=recover) if stored is not None:
                attempt = await self._store.take(
                    session=uow.session,
                    tenant=tenant,
                    request_id=request_id,
                    claimed_until=until,
                    now=uow.now,
                    keep_commit=recover,
                )
                if recover and stored.commit is not None and stored.reply is not None:
                    return _Claimed(attempt=attempt, commit=stored.commit, pending=stored.reply)
                return _Claimed(attempt=attempt)
            case Wait():
                return LOST
            case _:
                return LOST

    def _claim_s(self) -> float:
        """An attempt holds its request id for one ledger round trip, or until its caller's deadline."""
        return min(self._ownership.claim_s, deadline.remaining_s(default_s=self._ownership.claim_s) or 0.0) or 0.001

    async def _first(self, request: PlaceRequest, body: str) -> BaseModel | None:
        """The fast path of a new request id: decide on the view first, then write its intent in one
        statement, grouped with concurrent requests' (``run_grouped``): ``committing`` with the commit it
        is about to send, or ``rejected``. None when the id has an intent already, or the decision
        would queue: the ordinary path (claim, then decide) takes over, nothing having been reserved.
        The commit still leaves only after its intent is durable, as on the ordinary path."""
        snapshot = self._view.snapshot
        decision, decision_ms = self._decide(snapshot, request)
        if not decision.placed:
            if decision.queueable and may_queue(request):
                return None
            reply = to_reply(decision)

            async def refuse(uow: UnitOfWork) -> bool:
                if not await self._store.insert_decided(
                    session=uow.session,
                    tenant=request.tenant,
                    request_id=request.request_id,
                    body_hash=body,
                    status=DecisionStatus.REJECTED,
                    claimed_until=None,
                    commit=None,
                    pending=None,
                    now=uow.now,
                ):
                    return False
                self._emit(uow, request, reply, PlacementEventName.PLACEMENT_REJECTED, decision_ms, 1)
                return True

            if not await self._uow.run_grouped(refuse):
                return None
            self._metrics.count(decision)
            return reply
        if deadline.expired():
            return _caller_gone()
        if self._too_late():
            return _too_late_to_commit(self._margin_s)
        held = held_bytes(snapshot, decision)
        over = self._over_quota(request, held)
        if over is not None:  # refused with nothing recorded, unless the id has an answer of its own already
            known = await self._uow.run(
                lambda uow: self._store.lock(session=uow.session, tenant=request.tenant, request_id=request.request_id)
            )
            return None if known is not None else self._refuse(over)
        commit = to_commit(request, decision, snapshot, lease_s=request.lease_s or self._default_lease_s)
        pending = to_reply(decision, snapshot=snapshot, request=to_domain(request))
        token = self._assume(
            ledger_key(request), held, shared=decision.sharing == "shared", crossing=crossing(decision)
        )

        async def intend(uow: UnitOfWork) -> bool:
            return await self._store.insert_decided(
                session=uow.session,
                tenant=request.tenant,
                request_id=request.request_id,
                body_hash=body,
                status=DecisionStatus.COMMITTING,
                claimed_until=uow.now + timedelta(seconds=self._claim_s()),
                commit=commit,
                pending=pending,
                now=uow.now,
            )

        try:
            intended = await self._uow.run_grouped(intend)
        except BaseException:
            self._forget(token)
            raise
        if not intended:
            self._forget(token)
            return None
        claim = _Claimed(attempt=1)
        outcome = await self._committed(request, claim, decision, commit, pending, token, decision_ms, 1)
        if isinstance(outcome, dict):  # the view was stale: the ordinary loop decides again on the fresher figures
            outcome = await self._attempt(request, claim, fresher=outcome, decision_ms=decision_ms, first=2)
        return None if isinstance(outcome, _Lost) else outcome

    async def _attempt(
        self,
        request: PlaceRequest,
        claim: _Claimed,
        *,
        fresher: dict[str, LedgerAccelerator] | None = None,
        decision_ms: float = 0.0,
        first: int = 1,
    ) -> BaseModel | _Lost:
        """Place once for this request id: recover an interrupted commit, else decide and commit
        (``fresher``, ``first``: what earlier attempts of this call learnt from the ledger, and how many)."""
        if deadline.expired():  # it waited its turn past the caller's deadline
            if claim.commit is not None:  # keep an interrupted commit recoverable by the next retry
                await self._unclaim(request, claim)
            else:
                await self._finish_rejected(request, claim)
            return _caller_gone()
        if claim.commit is not None and claim.pending is not None:
            recovered = await self._recover(request, claim, claim.commit, claim.pending)
            if recovered is not None:
                return recovered
        fresher = {} if fresher is None else fresher
        for attempt in range(first, self._max_attempts + 1):
            snapshot = overlay(self._view.snapshot, fresher)
            decision, elapsed_ms = self._decide(snapshot, request)
            decision_ms += elapsed_ms
            if not decision.placed:
                if decision.queueable and may_queue(request):
                    return await self._enqueue(request, claim, decision)
                self._metrics.count(decision)
                reply = to_reply(decision)
                return await self._record(
                    request, claim, reply, PlacementEventName.PLACEMENT_REJECTED, decision_ms, attempt
                )
            if deadline.expired() or self._too_late():  # commit nothing the caller would not learn of
                await self._finish_rejected(request, claim)
                return _caller_gone() if deadline.expired() else _too_late_to_commit(self._margin_s)
            held = held_bytes(snapshot, decision)
            over = self._over_quota(request, held)
            if over is not None:
                if claim.queued:  # it keeps its place: the tenant's own replicas may end before its timeout
                    return await self._enqueue(request, claim, decision)
                await self._finish_rejected(request, claim)
                return self._refuse(over)
            commit = to_commit(request, decision, snapshot, lease_s=request.lease_s or self._default_lease_s)
            pending = to_reply(decision, snapshot=snapshot, request=to_domain(request))
            # Assumed before anything awaits, so decisions made meanwhile see these bytes as taken (and
            # the tenant's quota counts them).
            token = self._assume(
                ledger_key(request), held, shared=decision.sharing == "shared", crossing=crossing(decision)
            )
            try:
                saved = await self._save(request, claim, commit, pending)
            except BaseException:
                self._forget(token)
                raise
            if not saved:
                self._forget(token)
                return LOST
            outcome = await self._committed(request, claim, decision, commit, pending, token, decision_ms, attempt)
            if not isinstance(outcome, dict):
                return outcome
            fresher.update(outcome)
        if claim.queued:  # the queue tries it again on its next pass
            return await self._enqueue(request, claim, decision)
        await self._finish_rejected(request, claim)
        return rejected(ErrorCode.CONFLICT, f"the fleet kept changing under {self._max_attempts} attempts; retry")

    def _finished(self, seconds: float) -> None:
        self._finishing.append(seconds)
        if len(self._finishing) % 16 == 0 or len(self._finishing) < 16:
            ordered = sorted(self._finishing)
            self._margin_s = ordered[int(0.9 * (len(ordered) - 1))]

    def _too_late(self) -> bool:
        """The caller's deadline leaves less than recent commits took to answer (their 90th percentile)."""
        left = deadline.remaining_s()
        return left is not None and left < self._margin_s

    async def _committed(
        self,
        request: PlaceRequest,
        claim: _Claimed,
        decision: Decision,
        commit: CommitRequest,
        pending: PlaceReply,
        token: int,
        decision_ms: float,
        attempt: int,
    ) -> BaseModel | _Lost | dict[str, LedgerAccelerator]:
        """Send the saved ``commit`` and record what the ledger said; on ``conflict``/``no_capacity`` the
        ledger's fresher figures for the GPUs it refused (the caller decides again on them)."""
        started_ms = self._timer()
        committed = await self._reserve(commit, token)
        if isinstance(committed, RpcError):
            await self._unclaim(request, claim)
            return _ledger_silent(committed)
        allocation_id = _committed(committed)
        if allocation_id is not None:
            assert isinstance(committed, CommitReply)
            self._after_commit()
            self._metrics.count(decision)
            note = f"reserved in the ledger after {attempt} attempt(s)"
            if committed.duplicate:
                note = "the ledger already held this request id (an earlier attempt's answer was lost)"
            reply = pending.model_copy(
                update={"allocation_id": allocation_id, "explanation": [*pending.explanation, note]}
            )
            recorded = await self._record(
                request, claim, reply, PlacementEventName.PLACEMENT_DECIDED, decision_ms, attempt
            )
            self._finished((self._timer() - started_ms) / 1000)
            return recorded
        error = _ledger_error(committed)
        if error.code not in (ErrorCode.CONFLICT, ErrorCode.NO_CAPACITY):
            await self._finish_rejected(request, claim)
            return rejected(error.code, f"ledger: {error.message}")
        # The view was stale: decide again with the ledger's figures for the GPUs it refused.
        return {
            balance.id: balance_to_domain(None, balance)
            for balance in (committed.view if isinstance(committed, CommitReply) else ())
        }

    async def _recover(
        self, request: PlaceRequest, claim: _Claimed, commit: CommitRequest, pending: PlaceReply
    ) -> BaseModel | _Lost | None:
        """An earlier attempt sent ``commit`` and was interrupted: ask the ledger again (a repeat answers
        with the same allocation). None: it never landed, decide afresh."""
        token = self._assume(ledger_key(request), commit_held(commit), shared=commit.sharing == "shared")
        committed = await self._reserve(commit, token)
        if isinstance(committed, RpcError):
            await self._unclaim(request, claim)
            return _ledger_silent(committed)
        allocation_id = _committed(committed)
        if allocation_id is None:
            return None
        note = "recovered: the ledger held this request id's commit (an earlier attempt was interrupted)"
        reply = pending.model_copy(update={"allocation_id": allocation_id, "explanation": [*pending.explanation, note]})
        return await self._record(request, claim, reply, PlacementEventName.PLACEMENT_DECIDED, 0.0, 1)

    def _rights(self, snapshot: FleetSnapshot, request: PlaceRequest) -> FleetSnapshot:
        """The snapshot as this tenant may use it: other tenants' reserved GPUs withheld, except those a
        soft or spot reservation lends now when the replica is preemptible."""
        if request.avoid_accelerators:  # the rebalancer moving a replica off them
            snapshot = withhold(snapshot, request.avoid_accelerators)
        throttled = self._throttled_nodes()
        if throttled:  # a node whose PCIe the rebalancer throttles takes no new replica (a cold start)
            snapshot = withhold(
                snapshot,
                (
                    snapshot.nodes[n].accelerator_id(a.index)
                    for n in throttled
                    if n in snapshot.nodes
                    for a in snapshot.nodes[n].accelerators
                ),
            )
        if self._reservations.empty:
            return snapshot
        key = (request.tenant, request.preemptible)
        cached = self._withheld.get(key)
        if cached is None or cached[0] != self._reservations.version:
            if len(self._withheld) > 4096:
                self._withheld.clear()
            cached = (
                self._reservations.version,
                self._reservations.withheld(request.tenant, preemptible=request.preemptible),
            )
            self._withheld[key] = cached
        return withhold(snapshot, cached[1]) if cached[1] else snapshot

    async def _reservations_known(self) -> Rejected | None:
        """Read-your-writes: every reservation answered ``created`` before this request arrived is in the
        book it is decided on. A view that cannot get there within its share of the deadline refuses,
        retryable, having decided nothing."""
        if self._reservations_current is None:
            return None
        why = await self._reservations_current(_share_of_deadline(RESERVATION_SYNC_S))
        if why is None:
            return None
        self._log.warning("placement's reservation view is not known to be current: %s", why)
        return rejected(
            ErrorCode.NO_CAPACITY,
            f"placement cannot confirm it knows every reservation yet ({why}); nothing was decided: retry",
            retry_after_s=RESERVATION_SYNC_S,
        )

    async def _reclaim(self, request: PlaceRequest) -> BaseModel | None:
        """An owner's replica that fits nowhere it may go, but would if borrowers of its own soft or spot
        reservations left (the fewest, most recently lent first): have the reservation filler preempt them.
        Soft: the ledger ends them at once; this waits (bounded) until the view no longer counts them, then
        the ordinary path places. Spot: they have until their deadline; a request that may queue is queued
        by the ordinary path (placed when they leave), any other is refused now with the deadline, nothing
        recorded, so the same request id can come back; coming back, it counts the borrowers already told
        to leave for it instead of evicting more. None: the ordinary path takes over."""
        leaving = self._reservations.leaving_for(request.tenant, request.request_id)
        borrowed = self._reservations.borrowed_from(request.tenant)
        if not borrowed and not leaving:
            return None
        snapshot = self._rights(self._view.snapshot, request)
        wanted = to_domain(request)
        if decide(snapshot, wanted).placed:
            return None
        if leaving and decide(vacate(snapshot, (b for b, _ in leaving)), wanted).placed:
            return await self._await_leaving(
                request, [p.allocation_id for _, p in leaving], [p.deadline_at for _, p in leaving]
            )
        stored = await self._uow.run(
            lambda uow: self._store.lock(session=uow.session, tenant=request.tenant, request_id=request.request_id)
        )
        if stored is not None:  # a retry: the request id's own answer stands
            return None
        plan = plan_reclaim(vacate(snapshot, (b for b, _ in leaving)), borrowed, lambda s: decide(s, wanted))
        if plan is None:
            return None
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
                timeout_s=_share_of_deadline(min(RECLAIM_TIMEOUT_S, self._rpc.timeout_s)),
            )
        except RpcError as exc:
            self._log.warning("reservation.reclaim unanswered: %s", exc)
            return self._reclaim_unanswered(request, exc)
        if isinstance(answer, Rejected):
            self._log.warning("reservation.reclaim refused: %s", answer.error.message)
            return None
        preemptions = [*answer.preemptions]
        return await self._await_leaving(
            request,
            [p.allocation_id for p in preemptions] + [p.allocation_id for _, p in leaving],
            [p.deadline_at for p in preemptions] + [p.deadline_at for _, p in leaving],
        )

    @staticmethod
    def _reclaim_unanswered(request: PlaceRequest, exc: RpcError) -> BaseModel | None:
        """The filler did not answer (it died mid-reclaim, or is not running). A request that may queue
        takes the ordinary path, which queues it: a filler that comes back re-issues the preemptions it
        had written and the queue places the owner once they are gone. Any other is refused now,
        retryable, with nothing recorded for its request id."""
        if may_queue(request):
            return None
        return rejected(
            ErrorCode.NO_CAPACITY,
            "this replica fits only if borrowers of the tenant's reservations leave, and the reservation "
            f"filler did not answer reservation.reclaim ({exc.reason}): retry (nothing was recorded for this "
            "request id)",
            retry_after_s=RECLAIM_TIMEOUT_S,
        )

    async def _await_leaving(
        self, request: PlaceRequest, allocations: list[str], deadlines: list[datetime]
    ) -> BaseModel | None:
        """Borrowers are leaving for this request: freed now (soft), wait until the view no longer counts
        them; leaving later (spot), queue (None: the ordinary path queues it) or refuse with the deadline."""
        now = self._clock()
        if all(d <= now for d in deadlines):
            waited, limit_s = 0.0, _share_of_deadline(RECLAIM_WAIT_S)
            while any(self._holds(a) for a in allocations) and waited < limit_s and not deadline.expired():
                await asyncio.sleep(RECLAIM_POLL_S)
                waited += RECLAIM_POLL_S
            return None
        if may_queue(request):
            return None
        until = max(deadlines)
        return rejected(
            ErrorCode.NO_CAPACITY,
            f"reclaiming {len(allocations)} borrower(s) of this tenant's spot reservation; they leave by "
            f"{until.isoformat()}: retry then (nothing was recorded for this request id)",
            deadline_at=until.isoformat(),
            retry_after_s=round(max(0.0, (until - now).total_seconds()), 3),
        )

    def _decide(self, snapshot: FleetSnapshot, request: PlaceRequest) -> tuple[Decision, float]:
        started = self._timer()
        rights = self._rights(snapshot, request)
        decision = decide(rights, to_domain(request))
        held = self._withheld.get((request.tenant, request.preemptible))
        if not decision.placed and held is not None and held[1] and not self._reservations.empty:
            withheld = held[1]
            note = f"{len(withheld)} GPU(s) reserved by other tenants were not considered" + (
                "" if request.preemptible else " (a preemptible replica may borrow those their owners lend)"
            )
            decision = replace(decision, explanation=(*decision.explanation, note))
        elapsed_ms = self._timer() - started
        self._metrics.decided(elapsed_ms)
        return decision, elapsed_ms

    async def _reserve(self, commit: CommitRequest, token: int) -> CommitReply | Rejected | RpcError:
        """Reserve (commit to the ledger) with the decision assumed in the view meanwhile (``token``);
        unreserve (forget the assumption) on any outcome but a new allocation, the ledger's silence
        included."""
        kept = False
        try:
            reply = await self._rpc.ask(Rpc.LEDGER_COMMIT, commit, CommitReply)
            # A duplicate holds what an earlier commit of this request id reserved: nothing new to count.
            allocation_id = _committed(reply)
            if allocation_id is not None and isinstance(reply, CommitReply) and not reply.duplicate:
                self._confirm(token, allocation_id)
                kept = True
            return reply
        except RpcError as exc:
            return exc
        finally:
            if not kept:
                self._forget(token)

    async def _save(self, request: PlaceRequest, claim: _Claimed, commit: CommitRequest, pending: PlaceReply) -> bool:
        """Keep the commit with the intent before it is sent: a retry asks the ledger again with it."""

        async def work(uow: UnitOfWork) -> bool:
            return await self._store.save_commit(
                session=uow.session,
                tenant=request.tenant,
                request_id=request.request_id,
                attempt=claim.attempt,
                commit=commit,
                pending=pending,
                claimed_until=uow.now + timedelta(seconds=self._claim_s()),
                now=uow.now,
            )

        return await self._uow.run_grouped(work)

    async def _finish(
        self,
        uow: UnitOfWork,
        request: PlaceRequest,
        claim: _Claimed,
        status: DecisionStatus,
        *,
        reply: PlaceReply | None = None,
        allocation_id: str | None = None,
    ) -> bool:
        """Record this attempt's outcome for the request's intent; False when another attempt took it."""
        return await self._store.finish(
            session=uow.session,
            tenant=request.tenant,
            request_id=request.request_id,
            attempt=claim.attempt,
            status=status,
            reply=reply,
            allocation_id=allocation_id,
            now=uow.now,
        )

    async def _unclaim(self, request: PlaceRequest, claim: _Claimed) -> None:
        async def work(uow: UnitOfWork) -> None:
            await self._store.unclaim(
                session=uow.session,
                tenant=request.tenant,
                request_id=request.request_id,
                attempt=claim.attempt,
                now=uow.now,
            )

        await self._uow.run_grouped(work)

    async def _finish_rejected(self, request: PlaceRequest, claim: _Claimed) -> None:
        """Nothing placed and nothing reserved: the same id (and body) may be retried."""

        async def work(uow: UnitOfWork) -> None:
            await self._finish(uow, request, claim, DecisionStatus.REJECTED)

        await self._uow.run_grouped(work)

    async def _record(
        self,
        request: PlaceRequest,
        claim: _Claimed,
        reply: PlaceReply,
        event: PlacementEventName,
        decision_ms: float,
        attempts: int,
    ) -> BaseModel | _Lost:
        """Record the outcome with the intent (placed: the reply, for the same request id) and announce
        it, in one transaction; LOST when another attempt took the intent over meanwhile."""

        if reply.status == "placed":
            reply = reply.model_copy(update={"model": request.model})

        async def work(uow: UnitOfWork) -> bool:
            placed = reply.status == "placed"
            if claim.queued:  # decided: it leaves the queue with its outcome
                await self._store.dequeue(session=uow.session, tenant=request.tenant, request_id=request.request_id)
            if not await self._finish(
                uow,
                request,
                claim,
                DecisionStatus.PLACED if placed else DecisionStatus.REJECTED,
                reply=reply if placed else None,
                allocation_id=reply.allocation_id if placed else None,
            ):
                return False
            self._emit(uow, request, reply, event, decision_ms, attempts)
            return True

        if not await self._uow.run_grouped(work):
            return LOST
        if reply.status == "placed" and self._admission is not None:
            self._admission.on_placed(request.tenant, reply)
        return reply

    @staticmethod
    def _emit(
        uow: UnitOfWork,
        request: PlaceRequest,
        reply: PlaceReply,
        event: PlacementEventName,
        decision_ms: float,
        attempts: int,
    ) -> None:
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
