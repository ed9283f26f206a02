"""Small builders for the ledger's rule tests: accelerators, shares, commit intents."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from shared.domain.capacity import AcceleratorCapacity
from shared.domain.ledger import CommitIntent
from shared.domain.memory import MemoryShare

GB = 10**9
NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def gpu(
    acc_id: str, *, usable_gb: float = 80, reserved_gb: float = 0, available: bool = True, shared: bool = False
) -> AcceleratorCapacity:
    """An accelerator; ``shared``: what it holds belongs to shared replicas."""
    node, _, local = acc_id.partition("/")
    return AcceleratorCapacity(
        id=acc_id,
        node=node,
        index=int(local.removeprefix("gpu")),
        sku="H100-SXM-80GB",
        usable=int(usable_gb * GB),
        reserved=int(reserved_gb * GB),
        available=available,
        shared=shared,
    )


def view(*accelerators: AcceleratorCapacity) -> dict[str, AcceleratorCapacity]:
    return {a.id: a for a in accelerators}


def hbm(weights_gb: float = 0, kv_gb: float = 0, activation_gb: float = 0, workspace_gb: float = 0) -> MemoryShare:
    return MemoryShare(
        weights=int(weights_gb * GB),
        kv=int(kv_gb * GB),
        activation=int(activation_gb * GB),
        workspace=int(workspace_gb * GB),
    )


def intent(
    *shares: tuple[str, MemoryShare],
    rid: str = "r-1",
    tenant: str = "acme",
    expected: Mapping[str, int] | None = None,
    **extra: Any,
) -> CommitIntent:
    return CommitIntent(request_id=rid, tenant=tenant, shares=tuple(shares), expected=expected, **extra)
