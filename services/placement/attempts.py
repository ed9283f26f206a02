"""What one attempt at a request id holds and how it can end without an answer yet, the settings of
attempts (``Ownership``, ``Queueing``), and the refusals every use case answers the same way."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.placement.records import Turn
from shared.contracts.base import ErrorCode, Rejected, rejected
from shared.contracts.ledger import CommitRequest
from shared.contracts.placement import PlaceReply
from shared.domain.capacity import AcceleratorCapacity
from shared.infra import deadline
from shared.infra.rpc import RpcError


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
class Claimed:
    """This attempt holds the intent (``turn``); ``commit``/``pending``: what an interrupted attempt sent."""

    turn: Turn
    commit: CommitRequest | None = None
    pending: PlaceReply | None = None
    queued: bool = False  # taken from the queue (a row in placement.queue goes when it is decided)


# -- an attempt that has no answer yet: what happens next ----------------------------------------------


@dataclass(frozen=True, slots=True)
class Lost:
    """Another attempt took the intent over: wait for its outcome."""


@dataclass(frozen=True, slots=True)
class Ordinary:
    """Nothing was reserved and nothing answered: the ordinary path (claim, then decide) takes over."""


@dataclass(frozen=True, slots=True)
class Stale:
    """The ledger refused on fresher figures than the view's: decide again on them."""

    fresher: dict[str, AcceleratorCapacity] = field(default_factory=dict)


LOST = Lost()
ORDINARY = Ordinary()


# -- refusals -----------------------------------------------------------------------------------------


def caller_gone() -> Rejected:
    return rejected(ErrorCode.DEADLINE_EXCEEDED, "the caller's deadline passed before the commit; nothing was reserved")


def too_late_to_commit(margin_s: float) -> Rejected:
    return rejected(
        ErrorCode.DEADLINE_EXCEEDED,
        f"the caller's deadline leaves less than a commit takes now (~{margin_s * 1000:.0f} ms); nothing was reserved",
    )


def ledger_silent(exc: RpcError) -> Rejected:
    return rejected(
        ErrorCode.INTERNAL,
        f"the ledger did not answer: {exc.reason}; retry with the same request_id to learn the outcome",
    )


def share_of_deadline(seconds: float) -> float:
    """``seconds``, or half of what the caller's deadline leaves if that is less: a wait on the way to an
    answer leaves the rest for the answer."""
    left = deadline.remaining_s()
    return seconds if left is None else min(seconds, left / 2)
