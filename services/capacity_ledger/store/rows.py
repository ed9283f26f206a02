"""What the ledger's statements share: the asyncpg connection of the hot path and the mapping of rows to
the domain's records."""

from __future__ import annotations

from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession

from shared.domain.capacity import AcceleratorCapacity
from shared.domain.fleet import AcceleratorId
from shared.domain.ledger import AllocationRecord, AllocationState
from shared.domain.memory import MemoryShare


async def driver(*, session: AsyncSession) -> Any:
    """The asyncpg connection under the session's transaction: the hot path skips SQLAlchemy's statement
    machinery (it halves a single commit's time) while staying in the same transaction.

    SQLAlchemy opens the database transaction lazily, on its first statement; a raw statement before
    that would run in autocommit and silently drop its row locks, so this refuses to hand it out.
    """
    connection = await session.connection()
    raw = await connection.get_raw_connection()
    driver_connection = raw.driver_connection
    if driver_connection is None or not driver_connection.is_in_transaction():
        raise RuntimeError("run a statement through the session first: no database transaction is open yet")
    return driver_connection


def _index(accelerator_id: str) -> int:
    """The GPU index of an id (-1 for a TPU chip, which has a coordinate instead)."""
    try:
        gpu = AcceleratorId.parse(accelerator_id).gpu_index
    except ValueError:
        return -1
    return -1 if gpu is None else gpu


def capacity_of(row: Any, *, shared: bool = False) -> AcceleratorCapacity:
    return AcceleratorCapacity(
        id=row["id"],
        node=row["node"],
        index=_index(row["id"]),
        sku=row["sku"],
        usable=row["hbm_usable"],
        reserved=row["reserved"],
        available=row["available"],
        shared=shared,
    )


def share_of(weights: int, kv: int, activation: int, workspace: int) -> MemoryShare:
    return MemoryShare(weights=weights, kv=kv, activation=activation, workspace=workspace)


def record_of(row: Any) -> AllocationRecord:
    return AllocationRecord(
        id=row["id"],
        request_id=row["request_id"],
        tenant=row["tenant"],
        kind=row["kind"],
        state=AllocationState(row["state"]),
        lease_expires_at=row["lease_expires_at"],
        parent_id=row["parent_id"],
        preemptible=row["preemptible"],
        priority=row["priority"],
        sharing=row["sharing"],
        cross_domain_bytes_per_s=row["cross_domain_bytes_per_s"],
        cluster=row["cluster"],
    )
