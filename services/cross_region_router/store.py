"""The router's repository over its own tables (schema `routing`): SQL only, keyword-only parameters."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, select, text
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from services.cross_region_router.tables import (
    SCHEMA,
    RegionStateRow,
    ReplicaRow,
    SessionRouteRow,
    TenantRouteRow,
    TrafficRow,
)

TENANTS = TenantRouteRow.__table__  # type: ignore[attr-defined]
SESSIONS = SessionRouteRow.__table__  # type: ignore[attr-defined]
TRAFFIC = TrafficRow.__table__  # type: ignore[attr-defined]
REGIONS = RegionStateRow.__table__  # type: ignore[attr-defined]
REPLICAS = ReplicaRow.__table__  # type: ignore[attr-defined]

# Rows as arrays (unnest): one statement text whatever the number of rows. An empty array inserts nothing.
SAVE_ROUTES = (
    f"WITH tenants AS (INSERT INTO {SCHEMA}.tenants (tenant, region, switched_at) "
    "SELECT * FROM unnest($1::text[], $2::text[], $3::timestamptz[]) "
    "ON CONFLICT (tenant) DO UPDATE SET region = excluded.region, switched_at = excluded.switched_at) "
    f"INSERT INTO {SCHEMA}.sessions (tenant, session_id, region, updated_at) "
    "SELECT t, s, r, $7::timestamptz FROM unnest($4::text[], $5::text[], $6::text[]) AS v(t, s, r) "
    "ON CONFLICT ON CONSTRAINT sessions_pkey DO UPDATE SET region = excluded.region, updated_at = excluded.updated_at"
)
ADD_TRAFFIC = text(
    f"INSERT INTO {SCHEMA}.traffic (tenant, region, day, requests) "
    "SELECT * FROM unnest(CAST(:tenants AS text[]), CAST(:regions AS text[]), CAST(:days AS integer[]), "
    "CAST(:requests AS bigint[])) "
    "ON CONFLICT ON CONSTRAINT traffic_pkey DO UPDATE SET requests = traffic.requests + excluded.requests"
)


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

    async def save_routes(
        self,
        *,
        connection: Any,
        tenants: Mapping[str, StoredTenant],
        sessions: Mapping[tuple[str, str], str],
        now: datetime,
    ) -> None:
        """Upsert tenants' regions (with their switch times) and sessions' regions (seen ``now``) in one
        statement on the asyncpg ``connection`` (``UnitOfWorkFactory.run_on_driver``), whatever the number
        of rows: the requests a group commit writes together cost one round trip (its text never changes,
        so it is prepared once per connection)."""
        await connection.execute(
            SAVE_ROUTES,
            list(tenants),
            [t.region for t in tenants.values()],
            [t.switched_at for t in tenants.values()],
            [tenant for tenant, _id in sessions],
            [session_id for _tenant, session_id in sessions],
            list(sessions.values()),
            now,
        )

    async def forget_sessions(self, *, session: AsyncSession, before: datetime) -> int:
        """Delete the sessions not seen since ``before``; how many went."""
        done = await session.execute(delete(SESSIONS).where(SESSIONS.c.updated_at < before))
        return int(done.rowcount or 0)  # type: ignore[attr-defined]

    async def add_traffic(self, *, session: AsyncSession, counts: Mapping[tuple[str, str, int], int]) -> None:
        """Add routed-request counts per (tenant, region, day)."""
        if not counts:
            return
        keys = sorted(counts)
        await session.execute(
            ADD_TRAFFIC,
            {
                "tenants": [t for t, _r, _d in keys],
                "regions": [r for _t, r, _d in keys],
                "days": [d for _t, _r, d in keys],
                "requests": [counts[key] for key in keys],
            },
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
