"""Planning a batch of commits against the locked view: which are accepted, which repeat an earlier
commit, which are refused and why. The store reads the inputs and writes the accepted ones; every
rule in between is here.

A commit whose (tenant, request_id) exists returns that allocation (a duplicate) and reserves
nothing; the same key with other shares is ``invalid_request``, and a key whose allocation has ended
(released or expired) is ``conflict`` (a retry never learns of a reservation that holds nothing).
A replica that does not fit is refused with the fresh view: ``conflict`` when the caller's
``expected`` view differs from the current one (it decided on stale data), else ``no_capacity``. Not
fitting is short of bytes, or an accelerator held by replicas it may not join (``sharing``: an
exclusive group takes only idle GPUs, a shared replica only idle or shared ones). The ledger holds
replicas only: a commit of kind ``request`` is ``invalid_request`` (placement counts admissions in its
own memory; rows of that kind written before are ended by migration 0017).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from shared.domain.capacity import AcceleratorCapacity
from shared.domain.errors import ErrorCode
from shared.domain.ledger.fit import Refusal, Shares, apply_shares, check_fit
from shared.domain.ledger.sharing import EXCLUSIVE, Sharing, allocation_cluster, check_sharing, held_by
from shared.domain.memory import MemoryShare

AllocationKind = Literal["replica", "request"]  # `request`: rows written before admissions left the ledger

REQUEST_RETIRED = (
    "the ledger holds replicas only: kind `request` is refused (admissions are counted by placement in memory, "
    "per replica; use placement.admit)"
)


@dataclass(frozen=True, slots=True)
class CommitIntent:
    """One commit as the ledger's rules see it (``shares``: accelerator id -> bytes, in request order)."""

    request_id: str
    tenant: str
    shares: tuple[tuple[str, MemoryShare], ...]
    kind: AllocationKind = "replica"
    parent_id: str | None = None
    preemptible: bool = False
    priority: int = 0
    lease_s: int | None = None
    lease_expires_at: datetime | None = None
    expected: Mapping[str, int] | None = None
    sharing: Sharing = EXCLUSIVE  # a replica's: may it sit with other replicas (see ``sharing``)
    cross_domain_bytes_per_s: int = 0  # a replica's TP traffic across NVLink domains
    # The caller's hash of its request: a repeat of the request id with the same hash is the same commit
    # whatever shares it asks for (the caller decided again), one with another hash is refused.
    body_hash: str | None = None
    record: Mapping[str, Any] | None = None  # the caller's, kept with the allocation (opaque to the rules)

    @property
    def key(self) -> tuple[str, str]:
        return (self.tenant, self.request_id)

    @property
    def accelerator_ids(self) -> list[str]:
        return [accelerator_id for accelerator_id, _ in self.shares]

    @property
    def counts_against_hbm(self) -> bool:
        """A replica's bytes count on its accelerators (a retired ``request`` lived inside its replica's KV
        pool)."""
        return self.kind == "replica"


@dataclass(frozen=True, slots=True)
class ExistingAllocation:
    """An allocation already stored under a commit's (tenant, request_id)."""

    id: str
    lease_expires_at: datetime
    shares: tuple[tuple[str, MemoryShare], ...]
    state: str = "active"  # or `released` / `expired`: an ended allocation is never answered as committed
    body_hash: str | None = None
    record: Mapping[str, Any] | None = None  # the caller's record, returned with a repeat


@dataclass(frozen=True, slots=True)
class Accepted:
    """Write it: a new allocation with this lease, its cross-domain traffic charged to ``cluster``."""

    lease_expires_at: datetime
    cluster: str | None = None


@dataclass(frozen=True, slots=True)
class Duplicate:
    """The same commit as an earlier one: that allocation, nothing more reserved."""

    allocation_id: str
    lease_expires_at: datetime
    view: tuple[AcceleratorCapacity, ...]
    record: Mapping[str, Any] | None = None  # what the first commit's caller kept with it


@dataclass(frozen=True, slots=True)
class Refused:
    """Nothing written. ``view`` is the fresh view of its accelerators when it did not fit, else None."""

    code: ErrorCode
    message: str
    view: tuple[AcceleratorCapacity, ...] | None = None


Outcome = Accepted | Duplicate | Refused


@dataclass(frozen=True, slots=True)
class CommitPlan:
    """One outcome per intent, in the intents' order, and the view after the accepted ones."""

    outcomes: tuple[Outcome, ...]
    view: Mapping[str, AcceleratorCapacity]

    @property
    def accepted(self) -> list[tuple[int, Accepted]]:
        return [(i, o) for i, o in enumerate(self.outcomes) if isinstance(o, Accepted)]


def same_shares(a: Shares, b: Shares) -> bool:
    """Whether two commits ask for the same bytes on the same accelerators (in any order)."""
    return sorted(a, key=_share_key) == sorted(b, key=_share_key)


def _share_key(item: tuple[str, MemoryShare]) -> tuple[str, int, int, int, int]:
    accelerator_id, share = item
    return (accelerator_id, share.weights, share.kv, share.activation, share.workspace)


def view_of(view: Mapping[str, AcceleratorCapacity], ids: Sequence[str]) -> tuple[AcceleratorCapacity, ...]:
    """The known accelerators among ``ids``, each once, in id order (what a reply shows)."""
    return tuple(view[i] for i in sorted(set(ids)) if i in view)


def is_stale(expected: Mapping[str, int] | None, view: Mapping[str, AcceleratorCapacity], ids: Sequence[str]) -> bool:
    """Whether the caller decided on reserved bytes that are no longer the ledger's."""
    if expected is None:
        return False
    return any(expected.get(a) is not None and a in view and expected[a] != view[a].reserved for a in ids)


def refusal_code(intent: CommitIntent, view: Mapping[str, AcceleratorCapacity]) -> ErrorCode:
    """A commit that does not fit: ``conflict`` if the caller's view was stale, else ``no_capacity``."""
    return ErrorCode.CONFLICT if is_stale(intent.expected, view, intent.accelerator_ids) else ErrorCode.NO_CAPACITY


MAX_LEASE_S = 30 * 86400  # the longest lease a commit or renewal may ask for (as `lease_s`'s bound)


def lease_too_long(end: datetime, *, now: datetime) -> bool:
    """Whether a lease ending at ``end`` is longer than ``MAX_LEASE_S`` from ``now``."""
    return end > now + timedelta(seconds=MAX_LEASE_S)


def lease_end(intent: CommitIntent, *, now: datetime, default_lease_s: int) -> datetime:
    """The lease a commit gets: its absolute end, else ``lease_s`` (or the default) from now."""
    return intent.lease_expires_at or now + timedelta(seconds=intent.lease_s or default_lease_s)


def plan_commits(
    intents: Sequence[CommitIntent],
    *,
    view: Mapping[str, AcceleratorCapacity],
    existing: Mapping[tuple[str, str], ExistingAllocation],
    now: datetime,
    default_lease_s: int,
    clusters: Mapping[str, str | None] | None = None,
    crossing: Mapping[str, int] | None = None,
    crossing_budget: int = 0,
) -> CommitPlan:
    """Decide every commit of a batch in order; each is all-or-nothing, and later ones see the bytes
    earlier ones reserved and the replicas that hold each accelerator. ``clusters``: the cluster of
    each accelerator, for the allocation's ``cluster``. ``crossing``: the cross-domain traffic active
    replicas send per cluster (bytes/s); with a ``crossing_budget`` (bytes/s per cluster, 0: none), a
    replica whose traffic would take its cluster past it is refused
    ``no_capacity`` (the hard limit; placement shares it out by SLO below it)."""
    outcomes: list[Outcome] = []
    seen: set[tuple[str, str]] = set()
    crossing_used = dict(crossing or {})
    for intent in intents:
        ids = intent.accelerator_ids
        if intent.kind == "request":
            outcomes.append(Refused(ErrorCode.INVALID_REQUEST, REQUEST_RETIRED))
            continue
        if intent.key in existing or intent.key in seen:
            outcomes.append(_duplicate(intent, existing.get(intent.key), view, ids))
            continue
        if intent.lease_expires_at is not None and intent.lease_expires_at <= now:
            outcomes.append(Refused(ErrorCode.INVALID_REQUEST, "lease_expires_at is in the past"))
            continue
        if intent.lease_expires_at is not None and lease_too_long(intent.lease_expires_at, now=now):
            outcomes.append(Refused(ErrorCode.INVALID_REQUEST, "lease_expires_at is more than 30 days away"))
            continue
        unknown = sorted({a for a in ids if a not in view})
        if unknown:
            outcomes.append(Refused(ErrorCode.NOT_FOUND, f"unknown accelerator(s): {', '.join(unknown)}"))
            continue
        problem = check_replica(intent, view)
        if problem is None and crossing_budget > 0 and intent.cross_domain_bytes_per_s > 0:
            problem = check_crossing(intent, allocation_cluster(ids, clusters or {}), crossing_used, crossing_budget)
        if problem is not None:
            outcomes.append(problem)
            continue
        view = held_by(apply_shares(view, intent.shares), ids, intent.sharing)
        charged = allocation_cluster(ids, clusters or {})
        if charged is not None and intent.cross_domain_bytes_per_s > 0:
            crossing_used[charged] = crossing_used.get(charged, 0) + intent.cross_domain_bytes_per_s
        seen.add(intent.key)
        cluster = allocation_cluster(ids, clusters or {})
        outcomes.append(Accepted(lease_end(intent, now=now, default_lease_s=default_lease_s), cluster))
    return CommitPlan(tuple(outcomes), view)


def check_crossing(intent: CommitIntent, cluster: str | None, used: Mapping[str, int], budget: int) -> Refused | None:
    """Whether the replica's cross-domain traffic fits its cluster's budget (None when it does)."""
    if cluster is None:
        return None
    now = used.get(cluster, 0)
    if now + intent.cross_domain_bytes_per_s <= budget:
        return None
    return Refused(
        ErrorCode.NO_CAPACITY,
        f"cluster {cluster}'s cross-domain budget: {now / 1e9:.1f} GB/s in use + "
        f"{intent.cross_domain_bytes_per_s / 1e9:.1f} GB/s > {budget / 1e9:.0f} GB/s",
    )


def check_replica(intent: CommitIntent, view: Mapping[str, AcceleratorCapacity]) -> Refused | None:
    """Whether a replica may take its accelerators (None when it may): each one available, one it may
    join (its ``sharing`` against what holds it) and with the bytes free. A refusal names every
    accelerator that stops it, one reason each (unavailable before held, held before short of bytes),
    and carries the fresh view."""
    blocked = {r.accelerator_id: r for r in check_sharing(view, intent.accelerator_ids, intent.sharing)}
    fit = check_fit(view, intent.shares)
    if not blocked and fit.ok:
        return None
    reasons: dict[str, str] = {}
    for r in fit.refusals:
        if r.reason is not Refusal.SHORT:
            reasons.setdefault(r.accelerator_id, r.describe())
    for accelerator_id, refusal in blocked.items():
        reasons.setdefault(accelerator_id, refusal.describe(intent.sharing))
    for r in fit.refusals:
        reasons.setdefault(r.accelerator_id, r.describe())
    ordered = [reasons.pop(a) for a in intent.accelerator_ids if a in reasons]
    return Refused(refusal_code(intent, view), "; ".join(ordered), view_of(view, intent.accelerator_ids))


def _duplicate(
    intent: CommitIntent,
    row: ExistingAllocation | None,
    view: Mapping[str, AcceleratorCapacity],
    ids: Sequence[str],
) -> Outcome:
    if row is None:  # not stored: an earlier commit of this same batch has the key
        return Refused(ErrorCode.INVALID_REQUEST, "request_id appears twice in this batch")
    if intent.body_hash is not None and row.body_hash is not None:
        if intent.body_hash != row.body_hash:
            return Refused(ErrorCode.CONFLICT, "request_id was already used for a different request")
    elif not same_shares(row.shares, intent.shares):
        return Refused(ErrorCode.INVALID_REQUEST, "request_id was already used for different shares")
    if row.state != "active":  # a retry must not learn of a reservation that no longer holds anything
        return Refused(
            ErrorCode.CONFLICT, f"request_id was committed as {row.id}, which was {row.state}; use a new request_id"
        )
    return Duplicate(row.id, row.lease_expires_at, view_of(view, ids), row.record)
