"""The accelerators the ledger counts on: locked in id order (the one lock order every transaction uses),
registered and resized from topology's events, made (un)available with their nodes; and each cluster's
cross-domain traffic, read under its advisory lock."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from services.capacity_ledger.store.rows import capacity_of, driver
from shared.domain.capacity import AcceleratorCapacity


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
    return {r["id"]: capacity_of(r, shared=shared.get(r["id"], False)) for r in rows}


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
    return [capacity_of(r) for r in rows]


async def newest_replica_commits(*, session: AsyncSession, node: str) -> dict[str, datetime]:
    """For each of a node's accelerators holding an active replica allocation: when the newest of them was
    committed (the drift check leaves an accelerator alone while its engine may still be loading)."""
    rows = (
        await session.execute(
            text(
                "SELECT s.accelerator_id, max(al.created_at) AS newest FROM ledger.shares s "
                "JOIN ledger.allocations al ON al.id = s.allocation_id "
                "JOIN ledger.accelerators acc ON acc.id = s.accelerator_id "
                "WHERE acc.node = :node AND s.active AND al.kind = 'replica' GROUP BY s.accelerator_id"
            ),
            {"node": node},
        )
    ).all()
    return {r.accelerator_id: r.newest for r in rows}
