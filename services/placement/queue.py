"""The queue: a request the domain refuses for capacity (``Decision.queueable``) that allows ``queue`` is
answered ``queued`` with its ``queue_position`` and kept in ``placement.queue`` (its intent ``queued``);
it reserves nothing. ``PlacementQueue.serve`` retries the queue whenever capacity frees (allocations
released or expired, nodes back) and every ``HETSCHED_PLACEMENT_QUEUE_RETRY_S``. A pass reads every
queued request (keyset pages of ``HETSCHED_PLACEMENT_QUEUE_PAGE`` rows) and visits them round robin by
tenant, each tenant's in arrival order (``shared.domain.placement.queue``): one past its
``queue_timeout_s`` is rejected ``no_capacity`` ("queue timeout"), each that now fits is committed as any
placement is, those that still do not fit keep their place (a request that does not fit holds back
neither a later one nor another tenant's), and a request of the same shape as one that did not fit
earlier in the pass is not decided again. The same request id asked again answers its current state."""

from __future__ import annotations

import asyncio
import logging

from sqlalchemy.ext.asyncio import AsyncSession

from services.placement.attempts import Queueing
from services.placement.deciding import Decider, View
from services.placement.intents import Intents, emit
from services.placement.mapping import body_hash, held_bytes
from services.placement.metrics import PlacementMetrics
from services.placement.place import Placing
from services.placement.reclaim import Reclaimer
from services.placement.records import QueuedRequest, Turn
from services.placement.store import DecisionStore
from services.placement.tally import QuotaTally
from shared.contracts.base import ErrorBody, ErrorCode, Rejected
from shared.contracts.placement import PlacementEventName, PlaceReply
from shared.domain.placement.ownership import IntentState
from shared.domain.placement.queue import round_robin
from shared.infra.clock import Clock
from shared.infra.locks import KeyedLocks
from shared.infra.uow import UnitOfWork, UnitOfWorkFactory

QUEUE_YIELD_EVERY = 64
"""A queue pass lets other work run after this many requests visited without an await."""


class PlacementQueue:
    """Serves the queued requests: places those that fit, times out those that waited too long."""

    def __init__(
        self,
        *,
        view: View,
        decider: Decider,
        tally: QuotaTally,
        intents: Intents,
        placing: Placing,
        reclaimer: Reclaimer,
        store: DecisionStore,
        uow: UnitOfWorkFactory,
        ids: KeyedLocks,
        clock: Clock,
        queueing: Queueing,
        metrics: PlacementMetrics,
        log: logging.Logger,
    ) -> None:
        self._view = view
        self._decider = decider
        self._tally = tally
        self._intents = intents
        self._placing = placing
        self._reclaimer = reclaimer
        self._store = store
        self._uow = uow
        self._ids = ids
        self._clock = clock
        self._queueing = queueing
        self._metrics = metrics
        self._log = log
        self._wake = asyncio.Event()
        # The last pass found the queue empty, and nothing was queued here since (``Intents.enqueued``): a
        # wake-up (every release frees capacity) needs no read; the periodic pass still reads, for the
        # requests other placement processes queue.
        self._empty = False
        self._enqueued_seen = -1

    def wake(self) -> None:
        """Capacity may have freed: retry the queue now (a pass already under way is followed by another)."""
        self._wake.set()

    async def serve(self) -> None:
        """Forever: a pass over the queue whenever woken, and every ``Queueing.retry_s`` anyway."""
        while True:
            periodic = False
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=self._queueing.retry_s)
            except TimeoutError:
                periodic = True
            self._wake.clear()
            if not periodic and self._empty and self._intents.enqueued == self._enqueued_seen:
                continue
            try:
                await self.serve_once()
            except Exception:
                self._log.exception("placement's queue pass failed; retrying")

    async def serve_once(self) -> dict[str, str]:
        """One pass over every queued request, round robin by tenant (each tenant's oldest first): time
        out what waited too long, place what fits now; a request shaped as one that did not fit earlier in
        this pass is not decided again (capacity only shrinks within a pass: one freed meanwhile wakes the
        next). The outcome per request id (``placed``, ``queued``, ``timed_out``, ``rejected``, ``skipped``).

        Read-your-writes holds here too: a pass decides only once the reservation view has applied every
        reservation answered before the pass began; if it cannot get there, the pass only times out."""
        self._enqueued_seen = self._intents.enqueued
        entries = round_robin(await self._queued(), tenant=lambda entry: entry.tenant)
        self._empty = not entries
        outcomes: dict[str, str] = {}
        if not entries:
            return outcomes
        behind = await self._reclaimer.known()  # a refusal: the view may miss a reservation
        unfit: set[str] = set()  # shapes that did not fit in this pass
        for visited, entry in enumerate(entries, 1):
            async with self._ids.hold((entry.tenant, entry.request_id)):
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
        decision, _elapsed_ms = self._decider.decide(snapshot, request)
        if not decision.placed and decision.queueable:
            return "queued"
        if decision.placed and self._tally.over(request, held_bytes(snapshot, decision)) is not None:
            return "queued"
        claim = await self._intents.claim_queued(request, body_hash(request))
        if claim is None:
            return "skipped"
        outcome = await self._placing.attempt(request, claim)
        if isinstance(outcome, PlaceReply):
            return outcome.status
        return "rejected" if isinstance(outcome, Rejected) else "skipped"

    async def _time_out(self, entry: QueuedRequest) -> str:
        """Reject a request that waited its ``queue_timeout_s`` out (unless an attempt holds it now)."""
        waited_s = round((entry.deadline_at - entry.enqueued_at).total_seconds())
        message = f"queue timeout: no capacity freed for this request within {waited_s} s"

        async def work(uow: UnitOfWork) -> str:
            stored = await self._store.lock(session=uow.session, tenant=entry.tenant, request_id=entry.request_id)
            status = stored.intent.status if stored is not None else None
            if status is IntentState.COMMITTING:
                return "skipped"  # an attempt is placing it: its outcome stands
            await self._store.dequeue(session=uow.session, tenant=entry.tenant, request_id=entry.request_id)
            if stored is None or status is not IntentState.QUEUED:
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
                turn=Turn(entry.tenant, entry.request_id, stored.intent.attempt),
                was=IntentState.QUEUED,
                status=IntentState.TIMED_OUT,
                reply=reply,
                now=uow.now,
            ):
                return "skipped"
            emit(uow, entry.request, reply, PlacementEventName.PLACEMENT_REJECTED, 0.0, 0)
            return "timed_out"

        return await self._uow.run(work)
