"""Tenancy: whose replicas a tenant's requests may use.

``own`` (the default): a tenant's requests go only to the replicas it placed and to those of the shared
owners (a platform team's pool serving everyone). ``any``: every replica serves every tenant. A replica
a tenant may not use is never a candidate, so nothing about it (its id, why it was passed over) reaches
that tenant's reply.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

TenancyMode = Literal["own", "any"]


@dataclass(frozen=True, slots=True)
class Tenancy:
    mode: TenancyMode = "own"
    shared_owners: frozenset[str] = field(default_factory=frozenset)

    @classmethod
    def of(cls, mode: TenancyMode = "own", shared_owners: Iterable[str] = ()) -> Tenancy:
        return cls(mode, frozenset(shared_owners))

    def allows(self, tenant: str, owner: str) -> bool:
        """Whether ``tenant``'s requests may run on a replica ``owner`` placed."""
        return self.mode == "any" or owner == tenant or owner in self.shared_owners
