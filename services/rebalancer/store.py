"""The rebalancer's repository over its own tables (schema `rebalance`): SQL only, keyword-only parameters."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from services.rebalancer.tables import ActionRow, AllocationRow, NodeRow, PlanRow, PodRow, ReplicaRow, ThrottleRow

REPLICAS = ReplicaRow.__table__  # type: ignore[attr-defined]
ALLOCATIONS = AllocationRow.__table__  # type: ignore[attr-defined]
NODES = NodeRow.__table__  # type: ignore[attr-defined]
PODS = PodRow.__table__  # type: ignore[attr-defined]
PLANS = PlanRow.__table__  # type: ignore[attr-defined]
ACTIONS = ActionRow.__table__  # type: ignore[attr-defined]
THROTTLES = ThrottleRow.__table__  # type: ignore[attr-defined]

ACTIONS_KEPT = 500


@dataclass(frozen=True, slots=True)
class Allocation:
    allocation_id: str
    kind: str
    parent_id: str | None
    bytes: dict[str, int]


@dataclass(frozen=True, slots=True)
class Loaded:
    """Everything the rebalancer keeps in memory, as its tables hold it."""

    replicas: dict[str, dict[str, Any]]  # allocation id -> PlacementEvent body
    allocations: dict[str, Allocation]
    nodes: dict[str, dict[str, Any]]  # name -> NodeProfileEvent body
    pods: dict[str, dict[str, Any]]  # name -> TpuPodEvent body
    throttles: set[str]


async def load(*, session: AsyncSession) -> Loaded:
    replicas = {r.allocation_id: r.body for r in await session.execute(select(REPLICAS))}
    allocations = {
        r.allocation_id: Allocation(r.allocation_id, r.kind, r.parent_id, {k: int(v) for k, v in r.bytes.items()})
        for r in await session.execute(select(ALLOCATIONS))
    }
    nodes = {r.name: r.body for r in await session.execute(select(NODES))}
    pods = {r.name: r.body for r in await session.execute(select(PODS))}
    throttles = set((await session.execute(select(THROTTLES.c.node))).scalars())
    return Loaded(replicas=replicas, allocations=allocations, nodes=nodes, pods=pods, throttles=throttles)


async def put_replica(*, session: AsyncSession, allocation_id: str, tenant: str, body: dict[str, Any]) -> None:
    stmt = insert(REPLICAS).values(allocation_id=allocation_id, tenant=tenant, body=body)
    await session.execute(stmt.on_conflict_do_nothing(index_elements=[REPLICAS.c.allocation_id]))


async def drop_replica(*, session: AsyncSession, allocation_id: str) -> None:
    await session.execute(delete(REPLICAS).where(REPLICAS.c.allocation_id == allocation_id))


async def put_allocation(*, session: AsyncSession, allocation: Allocation) -> None:
    stmt = insert(ALLOCATIONS).values(
        allocation_id=allocation.allocation_id,
        kind=allocation.kind,
        parent_id=allocation.parent_id,
        bytes=allocation.bytes,
    )
    await session.execute(stmt.on_conflict_do_nothing(index_elements=[ALLOCATIONS.c.allocation_id]))


async def drop_allocation(*, session: AsyncSession, allocation_id: str) -> None:
    await session.execute(delete(ALLOCATIONS).where(ALLOCATIONS.c.allocation_id == allocation_id))


async def put_node(*, session: AsyncSession, name: str, body: dict[str, Any]) -> None:
    stmt = insert(NODES).values(name=name, body=body)
    await session.execute(stmt.on_conflict_do_update(index_elements=[NODES.c.name], set_={"body": body}))


async def drop_node(*, session: AsyncSession, name: str) -> None:
    await session.execute(delete(NODES).where(NODES.c.name == name))


async def put_pod(*, session: AsyncSession, name: str, body: dict[str, Any]) -> None:
    stmt = insert(PODS).values(name=name, body=body)
    await session.execute(stmt.on_conflict_do_update(index_elements=[PODS.c.name], set_={"body": body}))


async def add_plan(*, session: AsyncSession, plan_id: str, state: str, body: dict[str, Any], now: datetime) -> None:
    await session.execute(insert(PLANS).values(plan_id=plan_id, state=state, body=body, created_at=now, updated_at=now))


async def put_plan(*, session: AsyncSession, plan_id: str, state: str, body: dict[str, Any], now: datetime) -> None:
    """A plan whose id is fixed (a node's throttle): created the first time, its state replaced after."""
    stmt = insert(PLANS).values(plan_id=plan_id, state=state, body=body, created_at=now, updated_at=now)
    await session.execute(
        stmt.on_conflict_do_update(
            index_elements=[PLANS.c.plan_id], set_={"state": state, "body": body, "updated_at": now}
        )
    )


async def save_plan(*, session: AsyncSession, plan_id: str, state: str, body: dict[str, Any], now: datetime) -> None:
    await session.execute(
        update(PLANS).where(PLANS.c.plan_id == plan_id).values(state=state, body=body, updated_at=now)
    )


async def plans(
    *, session: AsyncSession, states: Iterable[str] | None = None, limit: int = 100, lock: bool = False
) -> list[dict[str, Any]]:
    """Plan bodies, oldest first (``states``: only those)."""
    stmt = select(PLANS.c.body).order_by(PLANS.c.created_at, PLANS.c.plan_id).limit(limit)
    if states is not None:
        stmt = stmt.where(PLANS.c.state.in_(list(states)))
    if lock:
        stmt = stmt.with_for_update(skip_locked=True)
    return list((await session.execute(stmt)).scalars())


async def recent_plans(*, session: AsyncSession, limit: int) -> list[dict[str, Any]]:
    stmt = select(PLANS.c.body).order_by(PLANS.c.updated_at.desc(), PLANS.c.plan_id).limit(limit)
    return list((await session.execute(stmt)).scalars())


async def add_action(*, session: AsyncSession, at: datetime, plan_id: str | None, what: str) -> None:
    await session.execute(insert(ACTIONS).values(at=at, plan_id=plan_id, what=what[:500]))


async def actions(*, session: AsyncSession, limit: int) -> list[tuple[datetime, str | None, str]]:
    rows = await session.execute(select(ACTIONS).order_by(ACTIONS.c.id.desc()).limit(limit))
    return [(r.at, r.plan_id, r.what) for r in rows]


async def trim_actions(*, session: AsyncSession) -> None:
    newest = (await session.execute(select(func.max(ACTIONS.c.id)))).scalar_one_or_none()
    if newest is not None and newest > ACTIONS_KEPT:
        await session.execute(delete(ACTIONS).where(ACTIONS.c.id <= newest - ACTIONS_KEPT))


async def set_throttle(*, session: AsyncSession, node: str, on: bool, now: datetime) -> None:
    if on:
        stmt = insert(THROTTLES).values(node=node, since=now)
        await session.execute(stmt.on_conflict_do_nothing(index_elements=[THROTTLES.c.node]))
    else:
        await session.execute(delete(THROTTLES).where(THROTTLES.c.node == node))
