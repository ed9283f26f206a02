"""Who may end or renew an allocation, and the lease a renewal asks for."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from enum import StrEnum

from shared.domain.ledger.sharing import EXCLUSIVE, Sharing
from shared.domain.memory import MemoryShare


class AllocationState(StrEnum):
    ACTIVE = "active"
    RELEASED = "released"
    EXPIRED = "expired"


@dataclass(frozen=True, slots=True)
class AllocationRecord:
    """A stored allocation (without its shares)."""

    id: str
    request_id: str
    tenant: str
    kind: str
    state: AllocationState
    lease_expires_at: datetime
    parent_id: str | None = None
    preemptible: bool = False
    priority: int = 0
    sharing: Sharing = EXCLUSIVE
    cross_domain_bytes_per_s: int = 0
    cluster: str | None = None

    @property
    def counts_against_hbm(self) -> bool:
        return self.kind == "replica"


@dataclass(frozen=True, slots=True)
class EndedAllocation:
    """An allocation just released or expired, with the shares it gave back."""

    allocation: AllocationRecord
    shares: tuple[tuple[str, MemoryShare], ...]


class Access(StrEnum):
    """What may happen to an allocation a caller names."""

    OK = "ok"
    NOT_FOUND = "not_found"
    FORBIDDEN = "forbidden"
    ENDED = "ended"


def may_change(allocation: AllocationRecord | None, *, tenant: str | None) -> Access:
    """Whether ``tenant`` may release or renew ``allocation`` (``tenant=None``: the ledger itself,
    e.g. the lease sweeper). An ended allocation is ``ENDED``: a release says "already", a renewal
    is a conflict."""
    if allocation is None:
        return Access.NOT_FOUND
    if tenant is not None and allocation.tenant != tenant:
        return Access.FORBIDDEN
    if allocation.state is not AllocationState.ACTIVE:
        return Access.ENDED
    return Access.OK


def renewal_end(*, now: datetime, lease_s: int | None, lease_expires_at: datetime | None) -> datetime | None:
    """The new lease end a renewal asks for, or None when it would end in the past."""
    end = lease_expires_at or now + timedelta(seconds=lease_s or 0)
    return end if end > now else None
