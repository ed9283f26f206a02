"""The router's repository over its own tables (schema `routing`): SQL only, keyword-only parameters."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from services.cross_region_router.tables import RegionStateRow, ReplicaRow, SessionRouteRow, TenantRouteRow, TrafficRow

TENANTS = TenantRouteRow.__table__  # type: ignore[attr-defined]
SESSIONS = SessionRouteRow.__table__  # type: ignore[attr-defined]
TRAFFIC = TrafficRow.__table__  # type: ignore[attr-defined]
REGIONS = RegionStateRow.__table__  # type: ignore[attr-defined]
REPLICAS = ReplicaRow.__table__  # type: ignore[attr-defined]


@dataclass(frozen=True, slots=True)
class StoredTenant:
    """A tenant's region and when it last switched to it (damping)."""

    region: str
    switched_at: datetime


@dataclass(frozen=True, slots=True)
class StoredReplica:
    """A replica placement announced: where requests for its model can go."""

    allocation_id: str
    region: str
    model: str
    sku: str | None = None


@dataclass(frozen=True, slots=True)
class Loaded:
    """Everything the router keeps in memory, as its tables hold it."""

    tenants: dict[str, StoredTenant]
    sessions: dict[tuple[str, str], str]  # (tenant, session id) -> region
    traffic: dict[str, dict[tuple[str, int], int]]  # tenant -> (region, day) -> requests
    regions: dict[str, str]  # region -> operator state (up | drain | down)
    replicas: tuple[StoredReplica, ...]


class RoutingStore:
    """Tenants' and sessions' regions, traffic per day, regions' operator states and the replicas placement
    announced, in schema `routing`."""

    async def load(self, *, session: AsyncSession, since_day: int, sessions_since: datetime) -> Loaded:
        """All of it: traffic from ``since_day`` on, sessions seen since ``sessions_since``."""
        tenants = {r.tenant: StoredTenant(r.region, r.switched_at) for r in await session.execute(select(TENANTS))}
        sessions = {
            (r.tenant, r.session_id): r.region
            for r in await session.execute(select(SESSIONS).where(SESSIONS.c.updated_at >= sessions_since))
        }
        traffic: dict[str, dict[tuple[str, int], int]] = {}
        for r in await session.execute(select(TRAFFIC).where(TRAFFIC.c.day >= since_day)):
            traffic.setdefault(r.tenant, {})[(r.region, r.day)] = r.requests
        regions = {r.region: r.state for r in await session.execute(select(REGIONS))}
        replicas = tuple(
            StoredReplica(r.allocation_id, r.region, r.model, r.sku)
            for r in await session.execute(select(REPLICAS).order_by(REPLICAS.c.allocation_id))
        )
        return Loaded(tenants=tenants, sessions=sessions, traffic=traffic, regions=regions, replicas=replicas)

    async def save_tenant(self, *, session: AsyncSession, tenant: str, region: str, switched_at: datetime) -> None:
        stmt = insert(TENANTS).values(tenant=tenant, region=region, switched_at=switched_at)
        await session.execute(
            stmt.on_conflict_do_update(
                index_elements=[TENANTS.c.tenant], set_={"region": region, "switched_at": switched_at}
            )
        )

    async def save_session(
        self, *, session: AsyncSession, tenant: str, session_id: str, region: str, now: datetime
    ) -> None:
        stmt = insert(SESSIONS).values(tenant=tenant, session_id=session_id, region=region, updated_at=now)
        await session.execute(
            stmt.on_conflict_do_update(constraint="sessions_pkey", set_={"region": region, "updated_at": now})
        )

    async def forget_sessions(self, *, session: AsyncSession, before: datetime) -> int:
        """Delete the sessions not seen since ``before``; how many went."""
        done = await session.execute(delete(SESSIONS).where(SESSIONS.c.updated_at < before))
        return int(done.rowcount or 0)  # type: ignore[attr-defined]

    async def add_traffic(self, *, session: AsyncSession, counts: Mapping[tuple[str, str, int], int]) -> None:
        """Add routed-request counts per (tenant, region, day)."""
        if not counts:
            return
        rows = [{"tenant": t, "region": r, "day": d, "requests": n} for (t, r, d), n in sorted(counts.items())]
        stmt = insert(TRAFFIC).values(rows)
        await session.execute(
            stmt.on_conflict_do_update(
                constraint="traffic_pkey", set_={"requests": TRAFFIC.c.requests + stmt.excluded.requests}
            )
        )

    async def forget_traffic(self, *, session: AsyncSession, before_day: int) -> None:
        await session.execute(delete(TRAFFIC).where(TRAFFIC.c.day < before_day))

    async def save_region(self, *, session: AsyncSession, region: str, state: str, now: datetime) -> None:
        stmt = insert(REGIONS).values(region=region, state=state, changed_at=now)
        await session.execute(
            stmt.on_conflict_do_update(index_elements=[REGIONS.c.region], set_={"state": state, "changed_at": now})
        )

    async def add_replica(self, *, session: AsyncSession, replica: StoredReplica) -> None:
        """Record a replica; one already recorded (a redelivered event) stays as it is."""
        params = {"allocation_id": replica.allocation_id, "region": replica.region, "model": replica.model}
        await session.execute(_ADD_REPLICA, params | {"sku": replica.sku})

    async def remove_replicas(self, *, session: AsyncSession, allocation_ids: Iterable[str]) -> None:
        ids = list(allocation_ids)
        if ids:
            await session.execute(_REMOVE_REPLICAS, {"ids": ids})


# One per placement and per release (the consumer's hot path): built once, not per call.
_ADD_REPLICA = text(
    f"INSERT INTO {REPLICAS.fullname} (allocation_id, region, model, sku) "
    "VALUES (:allocation_id, :region, :model, :sku) ON CONFLICT (allocation_id) DO NOTHING"
)
_REMOVE_REPLICAS = text(f"DELETE FROM {REPLICAS.fullname} WHERE allocation_id = ANY(CAST(:ids AS text[]))")
