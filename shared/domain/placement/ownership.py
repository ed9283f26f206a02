"""Who owns a placement's HBM: the rules over placement's intents (one per tenant and request id).

Placement records an intent (status ``committing``, the request body's hash) before it asks the ledger
to commit, and keeps the last commit it sent with it; the ledger knows the commit as
``placement/<request_id>`` and answers a repeat with the same allocation. So a placement interrupted
between the ledger's commit and its own decision row finds its intent on the client's retry, asks the
ledger again with the same commit, and answers ``placed`` with that allocation.

Statuses: ``committing`` (in flight, or interrupted), ``placed`` (owns ``allocation_id``),
``rejected`` (nothing placed; the same id with the same body may be retried), ``abandoned`` (stuck in
``committing`` past the grace period: the reconciler releases what it may have reserved), ``expired``
and ``released`` (the ledger ended the allocation), ``queued`` (waiting in placement's queue for
capacity; it reserves nothing) and ``timed_out`` (it waited its ``queue_timeout_s`` out: rejected).
Only ``placed`` and a ``committing`` intent inside the grace period own an allocation; the reconciler
releases any other allocation of placement's.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from shared.domain.errors import ErrorCode


class IntentState(StrEnum):
    """Where an intent stands (the statuses above; the `status` column of `placement.decisions`). Not the
    outcome of one decision: that is ``shared.domain.placement.types.DecisionStatus``."""

    COMMITTING = "committing"
    PLACED = "placed"
    REJECTED = "rejected"
    ABANDONED = "abandoned"
    EXPIRED = "expired"
    RELEASED = "released"
    QUEUED = "queued"
    TIMED_OUT = "timed_out"


ENDED = frozenset({IntentState.EXPIRED, IntentState.RELEASED})
OWNS = frozenset({IntentState.PLACED, IntentState.COMMITTING})


@dataclass(frozen=True, slots=True)
class Intent:
    """One (tenant, request id) as placement recorded it."""

    tenant: str
    request_id: str
    body_hash: str | None
    status: IntentState
    attempt: int
    claimed_until: datetime | None
    updated_at: datetime
    allocation_id: str | None = None


# -- what a request with this id does ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fresh:
    """No intent yet: record one and decide."""


@dataclass(frozen=True, slots=True)
class Answer:
    """Placed before: the stored reply, nothing more reserved."""


@dataclass(frozen=True, slots=True)
class Refuse:
    """A typed refusal; nothing is decided or reserved."""

    code: ErrorCode
    message: str


@dataclass(frozen=True, slots=True)
class Wait:
    """Another request with this id is being placed (claimed until ``until``): wait for its outcome."""

    until: datetime


@dataclass(frozen=True, slots=True)
class Resume:
    """Take the intent over: ``recover`` when an earlier attempt may have committed (ask the ledger
    again with the commit it sent), else decide afresh (a rejected placement is retried)."""

    recover: bool


Ruling = Fresh | Answer | Refuse | Wait | Resume


def rule(intent: Intent | None, *, body_hash: str, now: datetime) -> Ruling:
    """What a ``placement.place`` with this (tenant, request id) and body does, given its intent."""
    if intent is None:
        return Fresh()
    if intent.body_hash is not None and intent.body_hash != body_hash:
        return Refuse(ErrorCode.CONFLICT, f"request id {intent.request_id!r} was used with another request body")
    match intent.status:
        case IntentState.PLACED | IntentState.QUEUED | IntentState.TIMED_OUT:
            return Answer()  # queued: its place in the queue (the queue places it, not a retry)
        case IntentState.REJECTED:
            return Resume(recover=False)
        case IntentState.COMMITTING:
            if intent.claimed_until is not None and intent.claimed_until > now:
                return Wait(intent.claimed_until)
            return Resume(recover=True)
        case IntentState.ABANDONED:
            return Refuse(
                ErrorCode.CONFLICT,
                f"request id {intent.request_id!r} was abandoned mid-commit and its reservation released; "
                "place with a new request id",
            )
        case _:
            return Refuse(
                ErrorCode.CONFLICT,
                f"request id {intent.request_id!r} was placed as {intent.allocation_id} and that allocation "
                f"was {intent.status.value}; place with a new request id",
            )


# -- the reconciler --------------------------------------------------------------------------------------


def stale_before(*, now: datetime, grace_s: float) -> datetime:
    """Intents still ``committing`` last touched before this are abandoned; placement's allocations first
    seen before this with no intent at all are released."""
    return now - timedelta(seconds=grace_s)


def owns(intent: Intent | None, *, allocation_id: str, seen_at: datetime, now: datetime, grace_s: float) -> bool:
    """Whether a decision owns the ledger allocation of its request id (else the reconciler releases it)."""
    cutoff = stale_before(now=now, grace_s=grace_s)
    if intent is None:
        return seen_at >= cutoff  # the intent row may be on its way (a commit is never sent before it)
    if intent.status is IntentState.PLACED:
        return intent.allocation_id in (None, allocation_id)
    if intent.status is IntentState.COMMITTING:
        # still being worked on: recent, or an attempt holds its claim (it may yet answer `placed`)
        return not is_stale(intent, now=now, grace_s=grace_s)
    return False


def is_stale(intent: Intent, *, now: datetime, grace_s: float) -> bool:
    """A ``committing`` intent no attempt has touched for the grace period, and nobody holds: abandoned."""
    return (
        intent.status is IntentState.COMMITTING
        and intent.updated_at < stale_before(now=now, grace_s=grace_s)
        and (intent.claimed_until is None or intent.claimed_until <= now)
    )


__all__ = [
    "ENDED",
    "OWNS",
    "Answer",
    "Fresh",
    "Intent",
    "IntentState",
    "Refuse",
    "Resume",
    "Ruling",
    "Wait",
    "is_stale",
    "owns",
    "rule",
    "stale_before",
]
