"""Allocations and their shares: the commit path (existing commits, replica pools, one statement for a
batch's writes) and their ends (release, expiry, lease moves), each journaled."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from services.capacity_ledger.store.accelerators import lock_accelerators
from services.capacity_ledger.store.rows import driver, record_of, share_of
from shared.domain.ledger import (
    AllocationRecord,
    AllocationState,
    CommitIntent,
    EndedAllocation,
    ExistingAllocation,
)
from shared.domain.memory import MemoryShare


@dataclass(frozen=True, slots=True)
class NewAllocation:
    """An accepted commit to write."""

    id: str
    intent: CommitIntent
    lease_expires_at: datetime
    created_at: datetime
    cluster: str | None = None  # of its accelerators: where its cross-domain traffic is charged


# -- commit ------------------------------------------------------------------------------------


async def existing_allocations(
    *, session: AsyncSession, keys: Iterable[tuple[str, str]]
) -> dict[tuple[str, str], ExistingAllocation]:
    """The allocations already stored under these (tenant, request_id) keys, with their shares."""
    wanted = sorted(set(keys))
    # Through the session on purpose: this is the batch's first statement and opens its transaction.
    rows = (
        await session.execute(
            text(
                "SELECT a.id, a.tenant, a.request_id, a.lease_expires_at, a.state, a.body_hash, a.record, "
                "COALESCE(json_agg(json_build_array(s.accelerator_id, s.weights, s.kv, s.activation, s.workspace)) "
                "FILTER (WHERE s.accelerator_id IS NOT NULL), '[]') AS shares "
                "FROM ledger.allocations a LEFT JOIN ledger.shares s ON s.allocation_id = a.id "
                "WHERE (a.tenant, a.request_id) IN "
                "(SELECT * FROM unnest(CAST(:tenants AS text[]), CAST(:rids AS text[]))) "
                "GROUP BY a.id"
            ),
            {"tenants": [k[0] for k in wanted], "rids": [k[1] for k in wanted]},
        )
    ).mappings()
    out: dict[tuple[str, str], ExistingAllocation] = {}
    for r in rows:
        shares = json.loads(r["shares"]) if isinstance(r["shares"], str) else r["shares"]
        out[(r["tenant"], r["request_id"])] = ExistingAllocation(
            id=r["id"],
            lease_expires_at=r["lease_expires_at"],
            shares=tuple((s[0], share_of(s[1], s[2], s[3], s[4])) for s in shares),
            state=r["state"],
            body_hash=r["body_hash"],
            record=json.loads(r["record"]) if isinstance(r["record"], str) else r["record"],
        )
    return out


async def insert_allocations(*, session: AsyncSession, allocations: Sequence[NewAllocation]) -> None:
    """Write accepted commits (allocations, shares, journal) in one statement: one round trip however
    many the batch holds. The shares' trigger keeps the reserved totals and refuses an over-commit."""
    if not allocations:
        return
    await (await driver(session=session)).execute(
        INSERT_COMMITS,
        json.dumps(
            [
                {
                    "id": a.id,
                    "request_id": a.intent.request_id,
                    "tenant": a.intent.tenant,
                    "kind": a.intent.kind,
                    "parent_id": a.intent.parent_id,
                    "sharing": a.intent.sharing,
                    "cross_domain_bytes_per_s": a.intent.cross_domain_bytes_per_s,
                    "cluster": a.cluster,
                    "state": AllocationState.ACTIVE.value,
                    "preemptible": a.intent.preemptible,
                    "priority": a.intent.priority,
                    "lease_expires_at": a.lease_expires_at.isoformat(),
                    "flagged": False,
                    "created_at": a.created_at.isoformat(),
                    "record": dict(a.intent.record) if a.intent.record is not None else None,
                    "body_hash": a.intent.body_hash,
                }
                for a in allocations
            ]
        ),
        json.dumps(
            [
                {
                    "allocation_id": a.id,
                    "accelerator_id": accelerator_id,
                    "weights": s.weights,
                    "kv": s.kv,
                    "activation": s.activation,
                    "workspace": s.workspace,
                    "total": s.total,
                    "counts": a.intent.counts_against_hbm,
                    "active": True,
                }
                for a in allocations
                for accelerator_id, s in a.intent.shares
            ]
        ),
        json.dumps(
            [
                {
                    "op": "commit",
                    "allocation_id": a.id,
                    "accelerator_id": accelerator_id,
                    "delta": s.total if a.intent.counts_against_hbm else 0,
                    "details": {"tenant": a.intent.tenant, "request_id": a.intent.request_id, "kind": a.intent.kind},
                }
                for a in allocations
                for accelerator_id, s in a.intent.shares
            ]
        ),
    )


INSERT_COMMITS = """
WITH a AS (
    INSERT INTO ledger.allocations (id, request_id, tenant, kind, parent_id, state, preemptible, priority,
                                    lease_expires_at, flagged, created_at, sharing, cross_domain_bytes_per_s,
                                    cluster, record, body_hash)
    SELECT id, request_id, tenant, kind, parent_id, state, preemptible, priority, lease_expires_at, flagged,
           created_at, sharing, cross_domain_bytes_per_s, cluster, record, body_hash
    FROM json_populate_recordset(NULL::ledger.allocations, $1::json)
    RETURNING 1
), s AS (
    INSERT INTO ledger.shares (allocation_id, accelerator_id, weights, kv, activation, workspace, total, counts,
                               active)
    SELECT allocation_id, accelerator_id, weights, kv, activation, workspace, total, counts, active
    FROM json_populate_recordset(NULL::ledger.shares, $2::json)
    RETURNING 1
), j AS (
    INSERT INTO ledger.journal (op, allocation_id, accelerator_id, delta, details)
    SELECT op, allocation_id, accelerator_id, delta, details
    FROM json_to_recordset($3::json)
         AS x(op text, allocation_id text, accelerator_id text, delta bigint, details jsonb)
    RETURNING 1
)
SELECT (SELECT count(*) FROM a), (SELECT count(*) FROM s), (SELECT count(*) FROM j)
"""


# -- release / expire / renew ----------------------------------------------------------------


async def lock_allocation(*, session: AsyncSession, allocation_id: str) -> AllocationRecord | None:
    """The allocation, locked for the rest of the transaction (the transaction's first statement)."""
    row = (
        (
            await session.execute(
                text("SELECT * FROM ledger.allocations WHERE id = :id FOR UPDATE"), {"id": allocation_id}
            )
        )
        .mappings()
        .first()
    )
    return None if row is None else record_of(row)


async def lock_allocations(*, session: AsyncSession, ids: Sequence[str]) -> dict[str, AllocationRecord]:
    """The allocations of ``ids`` that exist, locked in id order for the rest of the transaction (so two
    transactions locking overlapping sets cannot deadlock on them)."""
    rows = (
        (
            await session.execute(
                text("SELECT * FROM ledger.allocations WHERE id = ANY(:ids) ORDER BY id FOR UPDATE"),
                {"ids": sorted(set(ids))},
            )
        )
        .mappings()
        .all()
    )
    return {row["id"]: record_of(row) for row in rows}


async def end_allocations(
    *, session: AsyncSession, allocations: Sequence[AllocationRecord], state: AllocationState, now: datetime
) -> list[EndedAllocation]:
    """End locked, active allocations and the active requests inside those that are replicas, in a few
    statements for all of them; their shares stop counting. Returns each ended allocation with the
    shares it gave back: the named ones in order, then the requests inside them."""
    if not allocations:
        return []
    apg = await driver(session=session)  # the allocations' lock opened the transaction
    named = {a.id for a in allocations}
    children = await apg.fetch(
        "SELECT * FROM ledger.allocations WHERE parent_id = ANY($1::text[]) AND state = 'active' "
        "ORDER BY id FOR UPDATE",
        sorted(named),
    )
    ended = [*allocations, *(record_of(c) for c in children if c["id"] not in named)]
    ids = [a.id for a in ended]
    share_rows = await apg.fetch(
        "SELECT allocation_id, accelerator_id, weights, kv, activation, workspace, total, counts "
        "FROM ledger.shares WHERE allocation_id = ANY($1::text[]) AND active",
        ids,
    )
    await lock_accelerators(session=session, ids=[s["accelerator_id"] for s in share_rows if s["counts"]])
    await apg.execute("UPDATE ledger.shares SET active = false WHERE allocation_id = ANY($1::text[]) AND active", ids)
    await apg.execute(
        "UPDATE ledger.allocations SET state = $2, ended_at = $3 WHERE id = ANY($1::text[])", ids, state.value, now
    )
    with_shares = {s["allocation_id"] for s in share_rows}
    journal = [
        (state.value, s["allocation_id"], s["accelerator_id"], -s["total"] if s["counts"] else 0) for s in share_rows
    ] + [(state.value, a.id, None, 0) for a in ended if a.id not in with_shares]
    await apg.executemany(
        "INSERT INTO ledger.journal (op, allocation_id, accelerator_id, delta, details) VALUES ($1, $2, $3, $4, '{}')",
        journal,
    )
    shares: dict[str, list[tuple[str, MemoryShare]]] = {}
    for s in share_rows:
        shares.setdefault(s["allocation_id"], []).append(
            (s["accelerator_id"], share_of(s["weights"], s["kv"], s["activation"], s["workspace"]))
        )
    return [EndedAllocation(a, tuple(shares.get(a.id, ()))) for a in ended]


async def set_lease(*, session: AsyncSession, allocation_id: str, expires_at: datetime) -> None:
    """Move a locked allocation's lease end (journaled)."""
    await session.execute(
        text("UPDATE ledger.allocations SET lease_expires_at = :at WHERE id = :id"),
        {"id": allocation_id, "at": expires_at},
    )
    await session.execute(
        text(
            "INSERT INTO ledger.journal (op, allocation_id, accelerator_id, delta, details) "
            "VALUES ('renew', :id, NULL, 0, CAST(:details AS jsonb))"
        ),
        {"id": allocation_id, "details": json.dumps({"lease_expires_at": expires_at.isoformat()})},
    )


async def expired_ids(*, session: AsyncSession, now: datetime, limit: int) -> list[str]:
    """Active allocations whose lease ended before ``now``, oldest first."""
    rows = await session.execute(
        text(
            "SELECT id FROM ledger.allocations WHERE state = 'active' AND lease_expires_at < :now "
            "ORDER BY lease_expires_at LIMIT :limit"
        ),
        {"now": now, "limit": limit},
    )
    return [r.id for r in rows]
