"""``placement.place`` and ``placement.explain``: the DESIGN §4 pipeline. Take the request id (its intent,
recorded before anything is reserved) -> decide on the view -> keep the commit with the intent -> reserve
through the ledger (optimistic: the reserved bytes it decided on travel with the commit, and a
``conflict`` decides again on the fresher figures the ledger sent back) -> record the decision and its
event -> reply.

One request id, one outcome (``shared.domain.placement.ownership``): requests with the same id take
turns (a lock per id in this process, the intent's attempt and claim across processes); a retry of an
interrupted placement asks the ledger again with the commit it sent (the ledger answers a repeat with
the same allocation); a reused id with another body is ``conflict``. A request the domain refuses for
capacity (``Decision.queueable``) that allows ``queue`` is answered ``queued`` (``services.placement.queue``
serves it)."""

from __future__ import annotations

import asyncio

from pydantic import BaseModel

from services.placement.attempts import (
    LOST,
    ORDINARY,
    Claimed,
    Lost,
    Ordinary,
    Ownership,
    Stale,
    caller_gone,
    too_late_to_commit,
)
from services.placement.commit import Committer, Prepared
from services.placement.deciding import Decider, View
from services.placement.intents import Intents
from services.placement.mapping import body_hash, held_bytes, may_queue, to_reply
from services.placement.metrics import PlacementMetrics
from services.placement.reclaim import Reclaimer
from services.placement.tally import QuotaTally
from shared.contracts.base import ErrorCode, rejected
from shared.contracts.placement import PlacementEventName, PlaceRequest
from shared.domain.capacity import AcceleratorCapacity
from shared.domain.placement.view import overlay
from shared.infra import deadline
from shared.infra.fleet_view import to_domain
from shared.infra.locks import KeyedLocks

MAX_ATTEMPTS = 4
"""Commits tried per placement: each conflict decides again on fresher figures."""
WAIT_POLL_S = 0.05
"""How often a request waits for another process's attempt at the same request id to finish."""


class Placing:
    """Places a request (or explains what placing it would do)."""

    def __init__(
        self,
        *,
        view: View,
        decider: Decider,
        tally: QuotaTally,
        intents: Intents,
        committer: Committer,
        reclaimer: Reclaimer,
        ids: KeyedLocks,
        ownership: Ownership,
        metrics: PlacementMetrics,
        max_attempts: int = MAX_ATTEMPTS,
        poll_s: float = WAIT_POLL_S,
        direct: bool = True,
    ) -> None:
        self._view = view
        self._decider = decider
        self._tally = tally
        self._intents = intents
        self._committer = committer
        self._reclaimer = reclaimer
        self._ids = ids
        self._ownership = ownership
        self._metrics = metrics
        self._max_attempts = max_attempts
        self._poll_s = poll_s
        self._direct = direct  # False: every placement takes the intent path (three durable steps)

    async def place(self, request: PlaceRequest) -> BaseModel:
        if deadline.expired():
            return caller_gone()
        unsure = await self._reclaimer.known()
        if unsure is not None:
            return unsure
        async with self._ids.hold((request.tenant, request.request_id)):
            body = body_hash(request)
            reclaiming = await self._reclaimer.reclaim(request)
            if not isinstance(reclaiming, Ordinary):
                return reclaiming
            fast = await self._first(request, body)
            if not isinstance(fast, Ordinary):
                return fast
            waited_s = 0.0
            while True:
                claim = await self._intents.claim(request, body)
                if isinstance(claim, Claimed):
                    outcome = await self.attempt(request, claim)
                    if not isinstance(outcome, Lost):
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
        decision, _elapsed_ms = self._decider.decide(snapshot, request)
        reply = to_reply(decision, snapshot=snapshot, request=to_domain(request))
        explanation = ["dry run: nothing was reserved", *reply.explanation]
        if not decision.placed and decision.queueable and may_queue(request):
            explanation.append("placement.place would queue this request until capacity frees")
        over = self._tally.over(request, held_bytes(snapshot, decision)) if decision.placed else None
        if over is not None:
            explanation.append(f"placement.place would refuse this request: {over.message}")
        return reply.model_copy(update={"explanation": explanation})

    async def _first(self, request: PlaceRequest, body: str) -> BaseModel | Ordinary:
        """The fast path of a new request id: decide on the view first, then write its intent in one
        statement, grouped with concurrent requests' (``run_grouped``): ``committing`` with the commit it
        is about to send, or ``rejected``. ``ORDINARY`` when the id has an intent already, or the decision
        would queue: the ordinary path (claim, then decide) takes over, nothing having been reserved.
        The commit still leaves only after its intent is durable, as on the ordinary path."""
        snapshot = self._view.snapshot
        decision, decision_ms = self._decider.decide(snapshot, request)
        if not decision.placed:
            if decision.queueable and may_queue(request):
                return ORDINARY
            reply = to_reply(decision)
            if not await self._intents.insert_rejected(request, body, reply, decision_ms):
                return ORDINARY
            self._metrics.count(decision)
            return reply
        if deadline.expired():
            return caller_gone()
        if self._committer.too_late():
            return too_late_to_commit(self._committer.margin_s)
        held = held_bytes(snapshot, decision)
        over = self._tally.over(request, held)
        if over is not None:  # refused with nothing recorded, unless the id has an answer of its own already
            return ORDINARY if await self._intents.lock(request) is not None else self._tally.refuse(over)
        direct = (
            self._committer.prepare_direct(request, decision, snapshot, held, body=body, decision_ms=decision_ms)
            if self._direct
            else None
        )
        if direct is not None:
            return await self._place_direct(request, direct, body, decision_ms)
        prepared = self._committer.prepare(request, decision, snapshot, held)
        insert = self._intents.insert_committing(request, body, prepared.commit, prepared.pending)
        claim = await self._committer.written(prepared, insert)
        if claim is None:
            return ORDINARY
        outcome = await self._committer.send(request, claim, prepared, decision_ms, 1)
        if isinstance(outcome, Stale):  # the ordinary loop decides again on the fresher figures
            outcome = await self.attempt(request, claim, fresher=outcome.fresher, decision_ms=decision_ms, first=2)
        return ORDINARY if isinstance(outcome, Lost) else outcome

    async def _place_direct(
        self, request: PlaceRequest, prepared: Prepared, body: str, decision_ms: float
    ) -> BaseModel | Ordinary:
        """The direct path (docs/PLACEMENT.md, "One durable step"): the ledger's commit, carrying the
        placement's record, is the only durable step before the answer; a conflict decides again on the
        ledger's fresher figures. ``ORDINARY`` (nothing reserved) when a new decision would not place, or
        the request id belongs to the intent path."""
        fresher: dict[str, AcceleratorCapacity] = {}
        for attempt in range(1, self._max_attempts + 1):
            outcome = await self._committer.send_direct(request, prepared)
            if not isinstance(outcome, Stale):
                return outcome
            fresher.update(outcome.fresher)
            if attempt == self._max_attempts:  # no attempt left: assume nothing more (it would never be sent)
                break
            snapshot = overlay(self._view.snapshot, fresher)
            decision, elapsed_ms = self._decider.decide(snapshot, request)
            decision_ms += elapsed_ms
            if not decision.placed:  # the ordinary path records the refusal, or queues it
                return ORDINARY
            if deadline.expired():
                return caller_gone()
            if self._committer.too_late():
                return too_late_to_commit(self._committer.margin_s)
            held = held_bytes(snapshot, decision)
            if self._tally.over(request, held) is not None:
                return ORDINARY
            again = self._committer.prepare_direct(
                request, decision, snapshot, held, body=body, decision_ms=decision_ms, attempt=attempt + 1
            )
            if again is None:
                return ORDINARY
            prepared = again
        return rejected(ErrorCode.CONFLICT, f"the fleet kept changing under {self._max_attempts} attempts; retry")

    async def attempt(
        self,
        request: PlaceRequest,
        claim: Claimed,
        *,
        fresher: dict[str, AcceleratorCapacity] | None = None,
        decision_ms: float = 0.0,
        first: int = 1,
    ) -> BaseModel | Lost:
        """Place once for this request id: recover an interrupted commit, else decide and commit
        (``fresher``, ``first``: what earlier attempts of this call learnt from the ledger, and how many)."""
        intents = self._intents
        if deadline.expired():  # it waited its turn past the caller's deadline
            if claim.commit is not None:  # keep an interrupted commit recoverable by the next retry
                await intents.unclaim(claim)
            else:
                await intents.finish_rejected(claim)
            return caller_gone()
        if claim.commit is not None and claim.pending is not None:
            recovered = await self._committer.recover(request, claim)
            if not isinstance(recovered, Ordinary):
                return recovered
        fresher = {} if fresher is None else fresher
        for attempt in range(first, self._max_attempts + 1):
            snapshot = overlay(self._view.snapshot, fresher)
            decision, elapsed_ms = self._decider.decide(snapshot, request)
            decision_ms += elapsed_ms
            if not decision.placed:
                if decision.queueable and may_queue(request):
                    return await intents.enqueue(request, claim, decision)
                self._metrics.count(decision)
                reply = to_reply(decision)
                return await intents.record(
                    request, claim, reply, PlacementEventName.PLACEMENT_REJECTED, decision_ms, attempt
                )
            if deadline.expired() or self._committer.too_late():  # commit nothing the caller would not learn of
                await intents.finish_rejected(claim)
                return caller_gone() if deadline.expired() else too_late_to_commit(self._committer.margin_s)
            held = held_bytes(snapshot, decision)
            over = self._tally.over(request, held)
            if over is not None:
                if claim.queued:  # it keeps its place: the tenant's own replicas may end before its timeout
                    return await intents.enqueue(request, claim, decision)
                await intents.finish_rejected(claim)
                return self._tally.refuse(over)
            prepared = self._committer.prepare(request, decision, snapshot, held)
            if not await self._committer.written(prepared, intents.save(claim, prepared.commit, prepared.pending)):
                return LOST
            outcome = await self._committer.send(request, claim, prepared, decision_ms, attempt)
            if not isinstance(outcome, Stale):
                return outcome
            fresher.update(outcome.fresher)
        if claim.queued:  # the queue tries it again on its next pass
            return await intents.enqueue(request, claim, decision)
        await intents.finish_rejected(claim)
        return rejected(ErrorCode.CONFLICT, f"the fleet kept changing under {self._max_attempts} attempts; retry")
