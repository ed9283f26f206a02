"""The ledger's SQL over its own schema. Every transaction locks accelerator rows in id order before
touching shares, so concurrent commits, releases, expiries and capacity changes never deadlock; the
database trigger refuses any over-commit even if the code above were wrong.

No rules here: what to write is decided in ``shared.domain.ledger``. The commit path talks to the
asyncpg connection under the session's transaction (see ``driver``) because it is the hot path.

Who holds an accelerator (``AcceleratorCapacity.shared``) is read in a statement of its own *after*
the rows are locked: under READ COMMITTED a statement that waited for a row lock re-reads only the
locked row, so a join in the locking statement could miss the shares of the transaction it waited for.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from shared.domain.capacity import AcceleratorCapacity
from shared.domain.fleet import AcceleratorId
from shared.domain.ledger import (
    AllocationRecord,
    AllocationState,
    CommitIntent,
    CrossDomainUse,
    EndedAllocation,
    ExistingAllocation,
    ReplicaPool,
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


@dataclass(frozen=True, slots=True)
class AcceleratorSpec:
    """An accelerator as topology reports it, with the usable bytes the ledger allows on it (``usable``: what
    the code expects; the database sets the column itself from total x ceiling, migration 0015)."""

    id: str
    sku: str
    hbm_total: int
    ceiling: float
    usable: int
    cluster: str | None = None  # the node's cluster (a TPU pod's events carry none)


@dataclass(frozen=True, slots=True)
class NodeAvailability:
    """A node's accelerators after an availability change, and the active allocations flagged on them."""

    view: dict[str, AcceleratorCapacity]
    flagged: list[str]


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    """One accelerator of a snapshot with the allocations that count on it."""

    capacity: AcceleratorCapacity
    allocations: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class SnapshotPage:
    entries: list[LedgerEntry]
    next_cursor: str | None
    cross_domain: list[CrossDomainUse] = field(default_factory=list)  # the whole fleet's, whatever the page


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


def _capacity(row: Any, *, shared: bool = False) -> AcceleratorCapacity:
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


def _share(weights: int, kv: int, activation: int, workspace: int) -> MemoryShare:
    return MemoryShare(weights=weights, kv=kv, activation=activation, workspace=workspace)


def _record(row: Any) -> AllocationRecord:
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


async def lock_accelerators(*, session: AsyncSession, ids: Iterable[str]) -> dict[str, AcceleratorCapacity]:
    """Lock the rows (id order: the one lock order every transaction uses) and return their state,
    with whether the replicas holding each are all ``shared`` (read once the locks are held)."""
    wanted = sorted(set(ids))
    if not wanted:
        return {}
    apg = await driver(session=session)
    rows = await apg.fetch(
        "SELECT id, node, sku, hbm_usable, reserved, available FROM ledger.accelerators "
        "WHERE id = ANY($1) ORDER BY id FOR UPDATE",
        wanted,
    )
    held = await apg.fetch(
        "SELECT s.accelerator_id, bool_and(al.sharing = 'shared') AS shared FROM ledger.shares s "
        "JOIN ledger.allocations al ON al.id = s.allocation_id "
        "WHERE s.accelerator_id = ANY($1) AND s.active AND s.counts GROUP BY s.accelerator_id",
        wanted,
    )
    shared = {h["accelerator_id"]: bool(h["shared"]) for h in held}
    return {r["id"]: _capacity(r, shared=shared.get(r["id"], False)) for r in rows}


async def lock_crossing(*, session: AsyncSession, clusters: Iterable[str]) -> dict[str, int]:
    """The cross-domain traffic active replicas send per cluster, read under a transaction-scoped
    advisory lock per cluster (sorted: one lock order), so two commits charging one cluster's budget
    are decided one after the other."""
    wanted = sorted(set(clusters))
    if not wanted:
        return {}
    apg = await driver(session=session)
    for cluster in wanted:
        await apg.execute("SELECT pg_advisory_xact_lock(hashtextextended('ledger.crossing:' || $1, 0))", cluster)
    rows = await apg.fetch(
        "SELECT cluster, sum(cross_domain_bytes_per_s)::bigint AS used FROM ledger.allocations "
        "WHERE state = 'active' AND cross_domain_bytes_per_s > 0 AND cluster = ANY($1) GROUP BY cluster",
        wanted,
    )
    return {r["cluster"]: int(r["used"]) for r in rows}


async def accelerator_clusters(*, session: AsyncSession, ids: Iterable[str]) -> dict[str, str | None]:
    """The cluster of each accelerator (None when its events did not say, as for a TPU pod's chips)."""
    wanted = sorted(set(ids))
    if not wanted:
        return {}
    rows = await (await driver(session=session)).fetch(
        "SELECT id, cluster FROM ledger.accelerators WHERE id = ANY($1)", wanted
    )
    return {r["id"]: r["cluster"] for r in rows}


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
                "SELECT a.id, a.tenant, a.request_id, a.lease_expires_at, a.state, "
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
            shares=tuple((s[0], _share(s[1], s[2], s[3], s[4])) for s in shares),
            state=r["state"],
        )
    return out


async def lock_replica_pools(*, session: AsyncSession, ids: Iterable[str]) -> dict[str, ReplicaPool]:
    """Lock the replica allocations requests will live in, with their KV pools and what is in use."""
    wanted = sorted(set(ids))
    if not wanted:
        return {}
    apg = await driver(session=session)
    rows = await apg.fetch(
        "SELECT id, tenant, state, kind FROM ledger.allocations WHERE id = ANY($1::text[]) ORDER BY id FOR UPDATE",
        wanted,
    )
    found = [r["id"] for r in rows]
    pools: dict[str, dict[str, int]] = {i: {} for i in found}
    used: dict[str, dict[str, int]] = {i: {} for i in found}
    shares = await apg.fetch(
        "SELECT s.allocation_id, a.parent_id, s.accelerator_id, s.kv FROM ledger.shares s "
        "JOIN ledger.allocations a ON a.id = s.allocation_id "
        "WHERE s.active AND (s.allocation_id = ANY($1::text[]) OR a.parent_id = ANY($1::text[]))",
        found,
    )
    for s in shares:
        if s["allocation_id"] in pools:
            pools[s["allocation_id"]][s["accelerator_id"]] = s["kv"]
        elif s["parent_id"] in used:
            into = used[s["parent_id"]]
            into[s["accelerator_id"]] = into.get(s["accelerator_id"], 0) + s["kv"]
    return {
        r["id"]: ReplicaPool(
            id=r["id"],
            tenant=r["tenant"],
            kind=r["kind"],
            active=r["state"] == AllocationState.ACTIVE,
            pool=pools[r["id"]],
            used=used[r["id"]],
        )
        for r in rows
    }


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
                                    cluster)
    SELECT id, request_id, tenant, kind, parent_id, state, preemptible, priority, lease_expires_at, flagged,
           created_at, sharing, cross_domain_bytes_per_s, cluster
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
    return None if row is None else _record(row)


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
    return {row["id"]: _record(row) for row in rows}


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
    ended = [*allocations, *(_record(c) for c in children if c["id"] not in named)]
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
            (s["accelerator_id"], _share(s["weights"], s["kv"], s["activation"], s["workspace"]))
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


# -- snapshot ----------------------------------------------------------------------------------


async def snapshot(*, session: AsyncSession, node: str | None, after: str | None, limit: int) -> SnapshotPage:
    """Accelerators in id order after ``after`` (the cursor), at most ``limit``; ``next_cursor`` is the
    last id of the page while more follow."""
    rows = (
        (
            await session.execute(
                text(
                    "SELECT a.id, a.node, a.sku, a.hbm_usable, a.reserved, a.available, "
                    "COALESCE(array_agg(s.allocation_id ORDER BY s.allocation_id) "
                    "FILTER (WHERE s.allocation_id IS NOT NULL AND s.counts), '{}') AS allocations, "
                    "COALESCE(bool_and(al.sharing = 'shared') FILTER (WHERE s.counts), false) AS shared "
                    "FROM ledger.accelerators a LEFT JOIN ledger.shares s ON s.accelerator_id = a.id AND s.active "
                    "LEFT JOIN ledger.allocations al ON al.id = s.allocation_id "
                    "WHERE (CAST(:node AS text) IS NULL OR a.node = :node) "
                    "AND (CAST(:after AS text) IS NULL OR a.id > :after) "
                    "GROUP BY a.id ORDER BY a.id LIMIT :limit"
                ),
                {"node": node, "after": after, "limit": limit + 1},
            )
        )
        .mappings()
        .all()
    )
    more = len(rows) > limit
    page = rows[:limit]
    crossing = await session.execute(
        text(
            "SELECT id, cluster, cross_domain_bytes_per_s FROM ledger.allocations "
            "WHERE state = 'active' AND kind = 'replica' AND cross_domain_bytes_per_s > 0 ORDER BY id"
        )
    )
    return SnapshotPage(
        entries=[LedgerEntry(_capacity(r, shared=r["shared"]), tuple(r["allocations"])) for r in page],
        next_cursor=page[-1]["id"] if more and page else None,
        cross_domain=[CrossDomainUse(c.id, c.cluster, c.cross_domain_bytes_per_s) for c in crossing],
    )


# -- capacity (from topology events) ---------------------------------------------------------


async def upsert_capacity(
    *, session: AsyncSession, node: str, accelerators: Sequence[AcceleratorSpec]
) -> dict[str, AcceleratorCapacity]:
    """Register or resize a node's accelerators; reserved bytes are kept."""
    await session.execute(
        text("SELECT id FROM ledger.accelerators WHERE node = :node ORDER BY id FOR UPDATE"), {"node": node}
    )
    ids = [a.id for a in accelerators]
    await lock_accelerators(session=session, ids=ids)
    if accelerators:
        await session.execute(
            text(
                # No `reserved`: only the shares trigger writes it (migration 0009), a new row starts at 0. No
                # `hbm_usable`: the capacity trigger sets it from total x ceiling, never below `reserved` (0015).
                # A cluster the event does not carry (a TPU pod's) keeps the one known.
                "INSERT INTO ledger.accelerators (id, node, sku, hbm_total, ceiling, available, cluster) "
                "VALUES (:id, :node, :sku, :total, :ceiling, true, :cluster) "
                "ON CONFLICT (id) DO UPDATE SET node = EXCLUDED.node, sku = EXCLUDED.sku, "
                "hbm_total = EXCLUDED.hbm_total, ceiling = EXCLUDED.ceiling, "
                "cluster = COALESCE(EXCLUDED.cluster, ledger.accelerators.cluster), updated_at = now()"
            ),
            [
                {
                    "id": a.id,
                    "node": node,
                    "sku": a.sku,
                    "total": a.hbm_total,
                    "ceiling": a.ceiling,
                    "cluster": a.cluster,
                }
                for a in sorted(accelerators, key=lambda a: a.id)
            ],
        )
    return await lock_accelerators(session=session, ids=ids)


async def held_above_reported(*, session: AsyncSession, ids: Sequence[str]) -> dict[str, tuple[int, int]]:
    """Accelerators whose usable HBM the capacity trigger holds above total x ceiling because more than that
    is reserved on them (a device reported smaller under live allocations): id -> (usable, what the report
    gives)."""
    rows = await session.execute(
        text(
            "SELECT id, hbm_usable, reported FROM (SELECT id, hbm_usable, "
            "CAST(floor(hbm_total * round(CAST(ceiling AS numeric), 6)) AS bigint) AS reported "
            "FROM ledger.accelerators WHERE id = ANY(:ids)) AS a WHERE hbm_usable > reported ORDER BY id"
        ),
        {"ids": list(ids)},
    )
    return {r.id: (r.hbm_usable, r.reported) for r in rows}


async def set_node_available(*, session: AsyncSession, node: str, available: bool) -> NodeAvailability:
    """Mark a node's accelerators (un)available; when unavailable, flag the active allocations on them."""
    ids = [
        r.id
        for r in await session.execute(
            text("SELECT id FROM ledger.accelerators WHERE node = :node ORDER BY id FOR UPDATE"), {"node": node}
        )
    ]
    if not ids:
        return NodeAvailability({}, [])
    await session.execute(
        text("UPDATE ledger.accelerators SET available = :available, updated_at = now() WHERE node = :node"),
        {"node": node, "available": available},
    )
    flagged: list[str] = []
    if not available:
        flagged = [
            r.id
            for r in await session.execute(
                text(
                    "UPDATE ledger.allocations SET flagged = true WHERE state = 'active' AND id IN "
                    "(SELECT allocation_id FROM ledger.shares WHERE active AND accelerator_id = ANY(:ids)) RETURNING id"
                ),
                {"ids": ids},
            )
        ]
    await session.execute(
        text(
            "INSERT INTO ledger.journal (op, allocation_id, accelerator_id, delta, details) "
            "SELECT :op, NULL, id, 0, CAST(:details AS jsonb) FROM unnest(CAST(:ids AS text[])) AS id"
        ),
        {
            "op": "available" if available else "unavailable",
            "ids": ids,
            "details": json.dumps({"node": node, "flagged": len(flagged)}),
        },
    )
    return NodeAvailability(await lock_accelerators(session=session, ids=ids), sorted(flagged))


async def node_accelerators(*, session: AsyncSession, node: str) -> list[AcceleratorCapacity]:
    """A node's accelerators as the ledger has them (not locked)."""
    rows = (
        (
            await session.execute(
                text(
                    "SELECT id, node, sku, hbm_usable, reserved, available FROM ledger.accelerators "
                    "WHERE node = :node ORDER BY id"
                ),
                {"node": node},
            )
        )
        .mappings()
        .all()
    )
    return [_capacity(r) for r in rows]


# -- metrics (read by the gauges' refresh loop) ------------------------------------------------


@dataclass(frozen=True, slots=True)
class AcceleratorFigures:
    """One accelerator's HBM as the ledger holds it."""

    id: str
    node: str
    sku: str
    usable: int
    reserved: int
    available: bool


@dataclass(frozen=True, slots=True)
class GroupFigures:
    """A live replica allocation on more than one accelerator (a TP group)."""

    accelerators: tuple[str, ...]
    cross_domain_bytes_per_s: int


@dataclass(frozen=True, slots=True)
class MetricsFigures:
    accelerators: list[AcceleratorFigures]
    groups: list[GroupFigures]
    cross_domain_bytes_per_s: int  # of every live replica allocation


async def metrics_figures(*, session: AsyncSession) -> MetricsFigures:
    """What the gauges show: every accelerator's HBM, the live TP groups, the cross-domain TP traffic.
    Three plain reads (no locks); the active-shares and cross-domain partial indexes serve them."""
    accelerators = (
        await session.execute(
            text("SELECT id, node, sku, hbm_usable, reserved, available FROM ledger.accelerators ORDER BY id")
        )
    ).all()
    groups = (
        await session.execute(
            text(
                "SELECT a.cross_domain_bytes_per_s AS crossing, "
                "array_agg(s.accelerator_id ORDER BY s.accelerator_id) AS accelerators "
                "FROM ledger.allocations a JOIN ledger.shares s ON s.allocation_id = a.id AND s.active "
                "WHERE a.state = 'active' AND a.kind = 'replica' GROUP BY a.id HAVING count(*) > 1"
            )
        )
    ).all()
    crossing = (
        await session.execute(
            text(
                "SELECT COALESCE(sum(cross_domain_bytes_per_s), 0)::bigint FROM ledger.allocations "
                "WHERE state = 'active' AND kind = 'replica' AND cross_domain_bytes_per_s > 0"
            )
        )
    ).scalar_one()
    return MetricsFigures(
        accelerators=[
            AcceleratorFigures(r.id, r.node, r.sku, r.hbm_usable, r.reserved, r.available) for r in accelerators
        ],
        groups=[GroupFigures(tuple(g.accelerators), g.crossing) for g in groups],
        cross_domain_bytes_per_s=int(crossing),
    )
