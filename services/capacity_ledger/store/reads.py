"""Plain reads for others: the snapshot pages readers seed from, and the figures the gauges show."""

from __future__ import annotations

from dataclasses import dataclass, field

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession

from services.capacity_ledger.store.rows import capacity_of
from shared.domain.capacity import AcceleratorCapacity
from shared.domain.ledger import CrossDomainUse


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
        entries=[LedgerEntry(capacity_of(r, shared=r["shared"]), tuple(r["allocations"])) for r in page],
        next_cursor=page[-1]["id"] if more and page else None,
        cross_domain=[CrossDomainUse(c.id, c.cluster, c.cross_domain_bytes_per_s) for c in crossing],
    )


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
