"""Per-tenant quotas (issue 23): how much of the fleet one tenant may hold at once, and the tally of the
accelerators each tenant's placed replicas hold.

Three quotas, each a setting with a per-tenant override (``HETSCHED_QUOTA_*``; 0 means unlimited):

* ``gpus_reserved``: accelerators in the tenant's active reservations (the reservation filler checks it
  at ``reservation.create``);
* ``gpus_placed``: accelerators the tenant's live replicas hold, each counted once however many of its
  replicas share it (placement checks it before it commits, counting its own commits in flight);
* ``queued_requests``: the tenant's placements waiting in placement's queue (checked at enqueue).

A request past a quota is refused ``quota_exceeded`` with the quota, its limit and the use now, and
nothing is recorded. Pure: the services count, this decides.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Quota(StrEnum):
    GPUS_RESERVED = "gpus_reserved"
    GPUS_PLACED = "gpus_placed"
    QUEUED_REQUESTS = "queued_requests"


SETTING: Mapping[Quota, str] = {
    Quota.GPUS_RESERVED: "HETSCHED_QUOTA_GPUS_RESERVED_PER_TENANT",
    Quota.GPUS_PLACED: "HETSCHED_QUOTA_GPUS_PLACED_PER_TENANT",
    Quota.QUEUED_REQUESTS: "HETSCHED_QUOTA_QUEUED_REQUESTS_PER_TENANT",
}
UNIT: Mapping[Quota, str] = {
    Quota.GPUS_RESERVED: "accelerator(s)",
    Quota.GPUS_PLACED: "accelerator(s)",
    Quota.QUEUED_REQUESTS: "queued request(s)",
}


def parse_overrides(raw: Mapping[str, Mapping[str, int]]) -> dict[str, dict[Quota, int]]:
    """``{tenant: {quota name: limit}}`` (the setting's JSON) as quotas; ValueError on an unknown quota
    name or a negative limit."""
    out: dict[str, dict[Quota, int]] = {}
    for tenant, limits in raw.items():
        mine: dict[Quota, int] = {}
        for name, limit in limits.items():
            try:
                quota = Quota(name)
            except ValueError:
                known = ", ".join(q.value for q in Quota)
                raise ValueError(f"tenant {tenant!r}: no quota {name!r} (known: {known})") from None
            if limit < 0:
                raise ValueError(f"tenant {tenant!r}: quota {name} must be >= 0 (0: unlimited), not {limit}")
            mine[quota] = limit
        out[tenant] = mine
    return out


@dataclass(frozen=True, slots=True)
class Quotas:
    """The limits for every tenant (``limits``) and per tenant (``overrides``); 0 or absent: unlimited."""

    limits: Mapping[Quota, int] = field(default_factory=dict)
    overrides: Mapping[str, Mapping[Quota, int]] = field(default_factory=dict)

    def limit(self, tenant: str, quota: Quota) -> int | None:
        """The tenant's limit, None when unlimited."""
        mine = self.overrides.get(tenant)
        value = mine[quota] if mine is not None and quota in mine else self.limits.get(quota, 0)
        return value or None


@dataclass(frozen=True, slots=True)
class QuotaExceeded:
    """A request that would take ``tenant`` past ``limit``: it uses ``used`` now and asked ``asked`` more."""

    quota: Quota
    tenant: str
    limit: int
    used: int
    asked: int

    @property
    def message(self) -> str:
        unit = UNIT[self.quota]
        return (
            f"quota {self.quota.value} exceeded for tenant {self.tenant[:80]!r}: limit {self.limit} {unit}, in use "
            f"{self.used}, this request adds {self.asked} ({SETTING[self.quota]}); nothing was recorded"
        )

    def details(self) -> dict[str, Any]:
        return {"quota": self.quota.value, "limit": self.limit, "used": self.used, "asked": self.asked}


def exceeded(quotas: Quotas, tenant: str, quota: Quota, *, used: int, asked: int) -> QuotaExceeded | None:
    """The refusal when ``used + asked`` is past the tenant's limit, else None. Asking nothing new never
    exceeds (a tenant already past a lowered limit keeps what it holds)."""
    limit = quotas.limit(tenant, quota)
    if limit is None or asked <= 0 or used + asked <= limit:
        return None
    return QuotaExceeded(quota=quota, tenant=tenant, limit=limit, used=used, asked=asked)


ENDS_REMEMBERED = 65_536


class Holdings:
    """The accelerators each tenant's replicas hold: by allocation (what the ledger committed) and by
    token (a commit in flight, counted from when it was decided so that concurrent decisions cannot all
    pass the quota). An accelerator counts once per tenant however many of its replicas share it.

    Fed from several sources that may repeat or reorder one another (a start-up load, the ledger's
    events, the commits' answers): adding an allocation twice changes nothing, and an allocation that
    ended is not added again (the last ``ENDS_REMEMBERED`` ends are kept)."""

    def __init__(self, ends_remembered: int = ENDS_REMEMBERED) -> None:
        self._allocations: dict[str, tuple[str, frozenset[str]]] = {}
        self._pending: dict[int, tuple[str, frozenset[str]]] = {}
        self._counts: dict[str, Counter[str]] = {}
        self._ended: OrderedDict[str, None] = OrderedDict()
        self._ends_remembered = ends_remembered

    def _count(self, tenant: str, accelerators: frozenset[str], sign: int) -> None:
        counts = self._counts.setdefault(tenant, Counter())
        for acc in accelerators:
            counts[acc] += sign
            if counts[acc] <= 0:
                del counts[acc]
        if not counts:
            del self._counts[tenant]

    def add(self, allocation_id: str, tenant: str, accelerators: Iterable[str]) -> None:
        """A live allocation of ``tenant`` on ``accelerators`` (once; not after it ended)."""
        if allocation_id in self._allocations or allocation_id in self._ended:
            return
        held = frozenset(accelerators)
        self._allocations[allocation_id] = (tenant, held)
        self._count(tenant, held, 1)

    def end(self, allocation_id: str) -> None:
        """The allocation ended (released, expired, preempted): its accelerators are the tenant's no more."""
        self._ended[allocation_id] = None
        self._ended.move_to_end(allocation_id)
        while len(self._ended) > self._ends_remembered:
            self._ended.popitem(last=False)
        gone = self._allocations.pop(allocation_id, None)
        if gone is not None:
            self._count(gone[0], gone[1], -1)

    def hold(self, token: int, tenant: str, accelerators: Iterable[str]) -> None:
        """A commit decided for ``tenant`` and not answered yet (``token``: the view's assumption)."""
        if token in self._pending:
            return
        held = frozenset(accelerators)
        self._pending[token] = (tenant, held)
        self._count(tenant, held, 1)

    def forget(self, token: int) -> None:
        """The commit failed or was never answered (idempotent)."""
        pending = self._pending.pop(token, None)
        if pending is not None:
            self._count(pending[0], pending[1], -1)

    def confirm(self, token: int, allocation_id: str) -> None:
        """The ledger committed it as ``allocation_id``."""
        pending = self._pending.get(token)
        if pending is None:
            return
        self.add(allocation_id, pending[0], pending[1])
        self.forget(token)

    def held(self, tenant: str) -> int:
        """Accelerators the tenant holds, commits in flight included."""
        counts = self._counts.get(tenant)
        return len(counts) if counts else 0

    def adds(self, tenant: str, accelerators: Iterable[str]) -> int:
        """How many of ``accelerators`` the tenant does not hold yet."""
        counts = self._counts.get(tenant) or Counter()
        return sum(1 for acc in set(accelerators) if acc not in counts)
