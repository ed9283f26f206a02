"""Reserving a decision in the ledger (DESIGN §4, optimistic): the commit is prepared and assumed in the
view before anything awaits (so concurrent decisions do not all pick the same GPUs), sent, and the
assumption confirmed or forgotten whatever the ledger answers, or if it does not answer, never left
behind. A ``conflict``/``no_capacity`` carries the ledger's fresher figures (``Stale``: decide again)."""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

from services.placement.attempts import ORDINARY, Claimed, Lost, Ordinary, Stale, ledger_silent
from services.placement.intents import Intents
from services.placement.mapping import body_hash, commit_held, crossing, ledger_key, to_commit, to_reply
from services.placement.metrics import PlacementMetrics
from services.placement.records import PlacementRecord
from services.placement.tally import QuotaTally
from shared.contracts.base import ErrorBody, ErrorCode, Rejected, rejected
from shared.contracts.ledger import RECORD_MAX_BYTES, AcceleratorBalance, CommitReply, CommitRequest
from shared.contracts.placement import PlacementEventName, PlaceReply, PlaceRequest
from shared.contracts.subjects import Rpc
from shared.domain.placement.types import Decision, FleetSnapshot
from shared.infra import deadline
from shared.infra.clock import MonotonicMs
from shared.infra.fleet_view import balance_to_domain, to_domain
from shared.infra.rpc import RpcClient, RpcError

T = TypeVar("T")

FINISHING_KEPT = 256
"""Recent commits' times kept for the margin a caller's deadline must leave."""


def _ledger_error(reply: CommitReply | Rejected) -> ErrorBody:
    return reply.error or ErrorBody(code=ErrorCode.INTERNAL, message="the ledger refused without a reason")


def _committed(reply: CommitReply | Rejected) -> str | None:
    """The allocation id of a commit the ledger holds (new or a repeat), else None."""
    if isinstance(reply, CommitReply) and reply.status == "committed" and reply.allocation_id:
        return reply.allocation_id
    return None


def _fresh_view(reply: CommitReply | Rejected) -> list[AcceleratorBalance]:
    """The ledger's figures for the accelerators a refused commit asked for: ``error.details["view"]``
    (``CommitReply.view`` from a ledger that still answers in its own model); none when unreadable."""
    if isinstance(reply, CommitReply) and reply.view:
        return list(reply.view)
    details = reply.error.details if reply.error is not None else None
    try:
        return _BALANCES.validate_python((details or {}).get("view") or [])
    except ValidationError:
        return []


_BALANCES = TypeAdapter(list[AcceleratorBalance])


@dataclass(frozen=True, slots=True)
class Prepared:
    """A decision ready to send: the commit, the reply it would give, and its assumption in the view."""

    decision: Decision
    commit: CommitRequest
    pending: PlaceReply
    token: int


class Committer:
    """Prepares, sends and records the ledger's commits of placement's decisions."""

    def __init__(
        self,
        *,
        rpc: RpcClient,
        intents: Intents,
        tally: QuotaTally,
        timer: MonotonicMs,
        metrics: PlacementMetrics,
        default_lease_s: int,
        after_commit: Callable[[], None],
        first_lease_s: int | None = None,
        placed: Callable[[PlaceRequest, PlaceReply, int], None] = lambda _request, _reply, _lease_s: None,
    ) -> None:
        self._rpc = rpc
        self._intents = intents
        self._tally = tally
        self._timer = timer
        self._metrics = metrics
        self._default_lease_s = default_lease_s
        self._after_commit = after_commit  # a fault-injection point for tests (HETSCHED_PLACEMENT_FAULT_AFTER_COMMIT)
        self._first_lease_s = first_lease_s  # None: every commit gets its whole lease at once
        self._placed = placed  # a placement answered on the direct path: (request, reply, the lease asked for)
        # How long recent commits took from sending to an answer ready (ms): a commit is only sent while
        # the caller's deadline leaves at least their 90th percentile, so an overloaded service refuses
        # early ("deadline_exceeded", nothing reserved) instead of reserving for a caller who is gone.
        self._finishing: deque[float] = deque(maxlen=FINISHING_KEPT)
        self.margin_s = 0.0

    def too_late(self) -> bool:
        """The caller's deadline leaves less than recent commits took to answer (their 90th percentile)."""
        left = deadline.remaining_s()
        return left is not None and left < self.margin_s

    def _finished(self, seconds: float) -> None:
        self._finishing.append(seconds)
        if len(self._finishing) % 16 == 0 or len(self._finishing) < 16:
            ordered = sorted(self._finishing)
            self.margin_s = ordered[int(0.9 * (len(ordered) - 1))]

    def prepare(
        self, request: PlaceRequest, decision: Decision, snapshot: FleetSnapshot, held: Mapping[str, int]
    ) -> Prepared:
        """The commit of a placed decision and the reply it would give, assumed in the view before anything
        awaits (decisions made meanwhile see these bytes as taken, and the tenant's quota counts them)."""
        commit = to_commit(request, decision, snapshot, lease_s=request.lease_s or self._default_lease_s).model_copy(
            update={"body_hash": body_hash(request)}
        )
        pending = to_reply(decision, snapshot=snapshot, request=to_domain(request))
        token = self._tally.assume(
            ledger_key(request), held, shared=decision.sharing == "shared", crossing=crossing(decision)
        )
        return Prepared(decision=decision, commit=commit, pending=pending, token=token)

    def prepare_direct(
        self,
        request: PlaceRequest,
        decision: Decision,
        snapshot: FleetSnapshot,
        held: Mapping[str, int],
        *,
        body: str,
        decision_ms: float,
        attempt: int = 1,
    ) -> Prepared | None:
        """A placed decision ready for the direct path (docs/PLACEMENT.md, "One durable step"): the ledger's
        commit is the only durable step, so it carries the placement's record (the request and the reply it
        would give) and the request's hash, and holds a short first lease until the caller renews or an engine
        reports. None when the record is too large to keep with the commit (the intent path takes it)."""
        lease_s = request.lease_s or self._default_lease_s
        first_s = min(lease_s, self._first_lease_s or lease_s)
        decided = to_reply(decision, snapshot=snapshot, request=to_domain(request))
        note = f"reserved in the ledger after {attempt} attempt(s)"
        pending = decided.model_copy(update={"model": request.model, "explanation": [*decided.explanation, note]})
        record = PlacementRecord(
            request=request, reply=pending, lease_s=lease_s, decision_ms=round(decision_ms, 3), attempts=attempt
        ).model_dump(mode="json", exclude_none=True)
        if len(json.dumps(record, separators=(",", ":"))) > RECORD_MAX_BYTES:
            return None
        commit = to_commit(request, decision, snapshot, lease_s=first_s).model_copy(
            update={"body_hash": body, "record": record}
        )
        token = self._tally.assume(
            ledger_key(request), held, shared=decision.sharing == "shared", crossing=crossing(decision)
        )
        return Prepared(decision=decision, commit=commit, pending=pending, token=token)

    async def send_direct(self, request: PlaceRequest, prepared: Prepared) -> BaseModel | Stale | Ordinary:
        """Send a direct commit and answer from what the ledger said: placed (a repeat of the request id:
        the first commit's reply, from its record), refused, or ``Stale`` (decide again on the fresher
        figures). Nothing is written here: placement's records follow from the LEDGER event."""
        started_ms = self._timer()
        committed = await self._reserve(prepared.commit, prepared.token)
        if isinstance(committed, RpcError):
            return ledger_silent(committed)
        allocation_id = _committed(committed)
        if allocation_id is not None:
            assert isinstance(committed, CommitReply)
            self._after_commit()
            self._metrics.count(prepared.decision)
            reply = prepared.pending
            kept = PlacementRecord.read(committed.record) if committed.duplicate else None
            if committed.duplicate:  # a repeat of the request id: the first commit's answer, word for word
                if kept is None:  # placed on the intent path: its stored decision answers
                    return ORDINARY
                reply = kept.reply
            reply = reply.model_copy(update={"allocation_id": allocation_id})
            self._placed(request, reply, kept.lease_s if kept is not None else request.lease_s or self._default_lease_s)
            self._finished((self._timer() - started_ms) / 1000)
            return reply
        error = _ledger_error(committed)
        fresher = _fresh_view(committed)
        # A conflict without figures is not a stale view (the request id was used for another request).
        if error.code not in (ErrorCode.CONFLICT, ErrorCode.NO_CAPACITY) or not fresher:
            return rejected(error.code, f"ledger: {error.message}")
        return Stale({balance.id: balance_to_domain(None, balance) for balance in fresher})

    async def written(self, prepared: Prepared, write: Awaitable[T]) -> T:
        """Write the intent that goes with a prepared commit (before it is sent); its assumption is
        forgotten when the write fails or finds the intent taken (answers falsy)."""
        try:
            done = await write
        except BaseException:
            self._tally.forget(prepared.token)
            raise
        if not done:
            self._tally.forget(prepared.token)
        return done

    async def send(
        self, request: PlaceRequest, claim: Claimed, prepared: Prepared, decision_ms: float, attempt: int
    ) -> BaseModel | Lost | Stale:
        """Send the saved commit and record what the ledger said; on ``conflict``/``no_capacity`` the
        ledger's fresher figures for the GPUs it refused (the caller decides again on them)."""
        started_ms = self._timer()
        committed = await self._reserve(prepared.commit, prepared.token)
        if isinstance(committed, RpcError):
            await self._intents.unclaim(claim)
            return ledger_silent(committed)
        allocation_id = _committed(committed)
        if allocation_id is not None:
            assert isinstance(committed, CommitReply)
            self._after_commit()
            self._metrics.count(prepared.decision)
            note = f"reserved in the ledger after {attempt} attempt(s)"
            pending = prepared.pending
            if committed.duplicate:
                note = "the ledger already held this request id (an earlier attempt's answer was lost)"
                kept = PlacementRecord.read(committed.record)
                pending = kept.reply if kept is not None else pending  # the first commit's accelerators
            reply = pending.model_copy(
                update={"allocation_id": allocation_id, "explanation": [*pending.explanation, note]}
            )
            recorded = await self._intents.record(
                request,
                claim,
                reply,
                PlacementEventName.PLACEMENT_DECIDED,
                decision_ms,
                attempt,
                lease_expires_at=committed.lease_expires_at,
            )
            self._finished((self._timer() - started_ms) / 1000)
            return recorded
        error = _ledger_error(committed)
        if error.code not in (ErrorCode.CONFLICT, ErrorCode.NO_CAPACITY):
            await self._intents.finish_rejected(claim)
            return rejected(error.code, f"ledger: {error.message}")
        # The view was stale: decide again with the ledger's figures for the GPUs it refused.
        return Stale({balance.id: balance_to_domain(None, balance) for balance in _fresh_view(committed)})

    async def recover(self, request: PlaceRequest, claim: Claimed) -> BaseModel | Lost | Ordinary:
        """An earlier attempt sent ``claim.commit`` and was interrupted: ask the ledger again (a repeat
        answers with the same allocation). ``ORDINARY``: it never landed, decide afresh."""
        commit, pending = claim.commit, claim.pending
        assert commit is not None and pending is not None
        token = self._tally.assume(ledger_key(request), commit_held(commit), shared=commit.sharing == "shared")
        committed = await self._reserve(commit, token)
        if isinstance(committed, RpcError):
            await self._intents.unclaim(claim)
            return ledger_silent(committed)
        allocation_id = _committed(committed)
        if allocation_id is None:
            return ORDINARY
        note = "recovered: the ledger held this request id's commit (an earlier attempt was interrupted)"
        reply = pending.model_copy(update={"allocation_id": allocation_id, "explanation": [*pending.explanation, note]})
        lease = committed.lease_expires_at if isinstance(committed, CommitReply) else None
        return await self._intents.record(
            request, claim, reply, PlacementEventName.PLACEMENT_DECIDED, 0.0, 1, lease_expires_at=lease
        )

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
                self._tally.confirm(token, allocation_id)
                kept = True
            return reply
        except RpcError as exc:
            return exc
        finally:
            if not kept:
                self._tally.forget(token)
