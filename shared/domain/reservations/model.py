"""Reservations as values: who reserved which accelerators under which policy, who borrows them, which
are open to borrowers, and what reclaiming them left behind (preemptions, backoff).

A reservation is a tenant's claim on accelerators. ``hard``: only the owner ever runs there. ``soft``:
while the owner leaves them idle, other tenants' *preemptible* replicas may borrow them, and the owner's
demand evicts a borrower at once. ``spot``: the same, but a borrower is told to leave and has
``spot_eviction_s`` (5-30 s) before the ledger frees its allocation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

Policy = Literal["hard", "soft", "spot"]
POLICIES: tuple[Policy, ...] = ("hard", "soft", "spot")
LENDING: frozenset[str] = frozenset({"soft", "spot"})

DEFAULT_FILL_TARGET = 0.85
"""The brief (S1 §8.2): below this fill rate a reservation's idle accelerators are lent."""
DEFAULT_BACKOFF_S = 30.0
DEFAULT_BACKOFF_MAX_S = 1800.0


@dataclass(frozen=True, slots=True)
class LendingPolicy:
    """When idle reserved accelerators are lent, and how long a reclaimed one waits before it is lent
    again: ``backoff_s`` after the first reclaim, doubled (``factor``) by each reclaim that follows
    within ``backoff_max_s`` of the last, never more than ``backoff_max_s``."""

    fill_target: float = DEFAULT_FILL_TARGET
    backoff_s: float = DEFAULT_BACKOFF_S
    backoff_max_s: float = DEFAULT_BACKOFF_MAX_S
    factor: float = 2.0


@dataclass(frozen=True, slots=True)
class Use:
    """One live allocation as the filler learns it from the ledger: its tenant, whether it may be
    preempted, and its bytes per accelerator."""

    allocation_id: str
    tenant: str
    preemptible: bool
    bytes: Mapping[str, int]
    since: datetime

    @property
    def accelerators(self) -> frozenset[str]:
        return frozenset(self.bytes)


@dataclass(frozen=True, slots=True)
class Borrow:
    """Another tenant's allocation on some of a reservation's accelerators."""

    allocation_id: str
    tenant: str
    accelerators: tuple[str, ...]
    bytes: Mapping[str, int]
    lent_at: datetime


@dataclass(frozen=True, slots=True)
class Backoff:
    until: datetime
    strikes: int
    last: datetime


@dataclass(frozen=True, slots=True)
class Preemption:
    """A borrower told to leave: the ledger frees ``allocation_id`` by ``deadline_at``; ``done`` once the
    ledger acknowledged it (until then the filler re-issues it, e.g. after a crash)."""

    allocation_id: str
    tenant: str
    reservation_id: str
    deadline_at: datetime
    issued_at: datetime
    done: bool = False
    request_id: str | None = None  # the owner's placement it makes room for


@dataclass(frozen=True, slots=True)
class Reservation:
    id: str
    tenant: str
    policy: Policy
    accelerators: tuple[str, ...]
    created_at: datetime
    sku: str | None = None
    region: str | None = None
    spot_eviction_s: int = 30
    state: Literal["active", "cancelled"] = "active"
    offered: frozenset[str] = frozenset()
    borrowers: tuple[Borrow, ...] = ()  # oldest first
    backoff: Mapping[str, Backoff] = field(default_factory=dict)
    preemptions: tuple[Preemption, ...] = ()
    version: int = 1

    @property
    def active(self) -> bool:
        return self.state == "active"

    @property
    def lends(self) -> bool:
        return self.policy in LENDING

    def borrow(self, allocation_id: str) -> Borrow | None:
        return next((b for b in self.borrowers if b.allocation_id == allocation_id), None)

    def preemption(self, allocation_id: str) -> Preemption | None:
        return next((p for p in self.preemptions if p.allocation_id == allocation_id), None)


@dataclass(frozen=True, slots=True)
class Usage:
    """Each reserved accelerator is the owner's (it holds an owner allocation), lent (only other tenants'
    allocations), or idle."""

    owner_used: frozenset[str]
    lent: frozenset[str]
    idle: frozenset[str]

    @property
    def total(self) -> int:
        return len(self.owner_used) + len(self.lent) + len(self.idle)

    @property
    def fill_rate(self) -> float:
        """(owner use + lent use) / reserved: the brief's 1 - (idle) / total_reserved."""
        return (len(self.owner_used) + len(self.lent)) / self.total if self.total else 1.0

    @property
    def owner_fill(self) -> float:
        return len(self.owner_used) / self.total if self.total else 1.0


def fill_rate(usages: list[Usage]) -> float | None:
    """The fill rate of several reservations together (None: nothing reserved)."""
    total = sum(u.total for u in usages)
    if not total:
        return None
    return sum(len(u.owner_used) + len(u.lent) for u in usages) / total
