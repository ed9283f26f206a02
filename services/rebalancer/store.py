"""The rebalancer's repository over its own tables (schema `rebalance`): SQL only, keyword-only parameters,
typed results (contract models and the read model's ``Allocation``)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, func, select, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from services.rebalancer.readmodel import Allocation
from services.rebalancer.tables import ActionRow, AllocationRow, NodeRow, PlanRow, PodRow, ReplicaRow, ThrottleRow
from shared.contracts.placement import PlacementEvent
from shared.contracts.rebalance import ActionView, PlanView
from shared.contracts.topology import NodeProfileEvent, TpuPodEvent

REPLICAS = ReplicaRow.__table__  # type: ignore[attr-defined]
ALLOCATIONS = AllocationRow.__table__  # type: ignore[attr-defined]
NODES = NodeRow.__table__  # type: ignore[attr-defined]
PODS = PodRow.__table__  # type: ignore[attr-defined]
PLANS = PlanRow.__table__  # type: ignore[attr-defined]
ACTIONS = ActionRow.__table__  # type: ignore[attr-defined]
THROTTLES = ThrottleRow.__table__  # type: ignore[attr-defined]

ACTIONS_KEPT = 500

# One per placement, release, commit and end (the consumers' hot path): built once, not per call.
_PUT_REPLICA = text(
    f"INSERT INTO {REPLICAS.fullname} (allocation_id, tenant, body) "
    "VALUES (:allocation_id, :tenant, CAST(:body AS jsonb)) ON CONFLICT (allocation_id) DO NOTHING"
)
_DROP_REPLICA = text(f"DELETE FROM {REPLICAS.fullname} WHERE allocation_id = :allocation_id")
_PUT_ALLOCATION = text(
    f"INSERT INTO {ALLOCATIONS.fullname} (allocation_id, kind, parent_id, bytes) "
    "VALUES (:allocation_id, :kind, :parent_id, CAST(:bytes AS jsonb)) ON CONFLICT (allocation_id) DO NOTHING"
)
_DROP_ALLOCATION = text(f"DELETE FROM {ALLOCATIONS.fullname} WHERE allocation_id = :allocation_id")


@dataclass(frozen=True, slots=True)
class Loaded:
    """Everything the rebalancer keeps in memory, as its tables hold it."""

    replicas: dict[str, PlacementEvent]  # allocation id -> its placement_decided event
    allocations: dict[str, Allocation]
    nodes: dict[str, NodeProfileEvent]
    pods: dict[str, TpuPodEvent]
    throttles: set[str]


class RebalanceStore:
    """Reads and writes of schema `rebalance`, each in the caller's session."""

    async def load(self, *, session: AsyncSession) -> Loaded:
        replicas = {
            r.allocation_id: PlacementEvent.model_validate(r.body) for r in await session.execute(select(REPLICAS))
        }
        allocations = {
            r.allocation_id: Allocation(r.allocation_id, r.kind, r.parent_id, {k: int(v) for k, v in r.bytes.items()})
            for r in await session.execute(select(ALLOCATIONS))
        }
        nodes = {r.name: NodeProfileEvent.model_validate(r.body) for r in await session.execute(select(NODES))}
        pods = {r.name: TpuPodEvent.model_validate(r.body) for r in await session.execute(select(PODS))}
        throttles = set((await session.execute(select(THROTTLES.c.node))).scalars())
        return Loaded(replicas=replicas, allocations=allocations, nodes=nodes, pods=pods, throttles=throttles)

    async def put_replica(
        self, *, session: AsyncSession, allocation_id: str, tenant: str, event: PlacementEvent
    ) -> None:
        params = {"allocation_id": allocation_id, "tenant": tenant, "body": event.model_dump_json()}
        await session.execute(_PUT_REPLICA, params)

    async def drop_replica(self, *, session: AsyncSession, allocation_id: str) -> None:
        await session.execute(_DROP_REPLICA, {"allocation_id": allocation_id})

    async def put_allocation(self, *, session: AsyncSession, allocation: Allocation) -> None:
        params = {
            "allocation_id": allocation.allocation_id,
            "kind": allocation.kind,
            "parent_id": allocation.parent_id,
            "bytes": json.dumps(allocation.bytes),
        }
        await session.execute(_PUT_ALLOCATION, params)

    async def drop_allocation(self, *, session: AsyncSession, allocation_id: str) -> None:
        await session.execute(_DROP_ALLOCATION, {"allocation_id": allocation_id})

    async def put_node(self, *, session: AsyncSession, event: NodeProfileEvent) -> None:
        body = event.model_dump(mode="json")
        stmt = insert(NODES).values(name=event.node, body=body)
        await session.execute(stmt.on_conflict_do_update(index_elements=[NODES.c.name], set_={"body": body}))

    async def drop_node(self, *, session: AsyncSession, name: str) -> None:
        await session.execute(delete(NODES).where(NODES.c.name == name))

    async def put_pod(self, *, session: AsyncSession, event: TpuPodEvent) -> None:
        body = event.model_dump(mode="json")
        stmt = insert(PODS).values(name=event.pod, body=body)
        await session.execute(stmt.on_conflict_do_update(index_elements=[PODS.c.name], set_={"body": body}))

    async def add_plan(self, *, session: AsyncSession, plan: PlanView, now: datetime) -> None:
        body = plan.model_dump(mode="json")
        await session.execute(
            insert(PLANS).values(plan_id=plan.plan_id, state=plan.state, body=body, created_at=now, updated_at=now)
        )

    async def put_plan(self, *, session: AsyncSession, plan: PlanView, now: datetime) -> None:
        """A plan whose id is fixed (a node's throttle): created the first time, its state replaced after."""
        body = plan.model_dump(mode="json")
        stmt = insert(PLANS).values(plan_id=plan.plan_id, state=plan.state, body=body, created_at=now, updated_at=now)
        await session.execute(
            stmt.on_conflict_do_update(
                index_elements=[PLANS.c.plan_id], set_={"state": plan.state, "body": body, "updated_at": now}
            )
        )

    async def save_plan(self, *, session: AsyncSession, plan: PlanView, now: datetime) -> None:
        body = plan.model_dump(mode="json")
        await session.execute(
            update(PLANS).where(PLANS.c.plan_id == plan.plan_id).values(state=plan.state, body=body, updated_at=now)
        )

    async def plans(
        self, *, session: AsyncSession, states: Iterable[str] | None = None, limit: int = 100, lock: bool = False
    ) -> list[PlanView]:
        """Plans, oldest first (``states``: only those)."""
        stmt = select(PLANS.c.body).order_by(PLANS.c.created_at, PLANS.c.plan_id).limit(limit)
        if states is not None:
            stmt = stmt.where(PLANS.c.state.in_(list(states)))
        if lock:
            stmt = stmt.with_for_update(skip_locked=True)
        return [PlanView.model_validate(body) for body in (await session.execute(stmt)).scalars()]

    async def recent_plans(self, *, session: AsyncSession, limit: int) -> list[PlanView]:
        """Plans, the last changed first."""
        stmt = select(PLANS.c.body).order_by(PLANS.c.updated_at.desc(), PLANS.c.plan_id).limit(limit)
        return [PlanView.model_validate(body) for body in (await session.execute(stmt)).scalars()]

    async def add_action(self, *, session: AsyncSession, at: datetime, plan_id: str | None, what: str) -> None:
        await session.execute(insert(ACTIONS).values(at=at, plan_id=plan_id, what=what[:500]))

    async def actions(self, *, session: AsyncSession, limit: int) -> list[ActionView]:
        """The last actions, newest first."""
        rows = await session.execute(select(ACTIONS).order_by(ACTIONS.c.id.desc()).limit(limit))
        return [ActionView(at=r.at, plan_id=r.plan_id, what=r.what) for r in rows]

    async def trim_actions(self, *, session: AsyncSession) -> None:
        newest = (await session.execute(select(func.max(ACTIONS.c.id)))).scalar_one_or_none()
        if newest is not None and newest > ACTIONS_KEPT:
            await session.execute(delete(ACTIONS).where(ACTIONS.c.id <= newest - ACTIONS_KEPT))

    async def set_throttle(self, *, session: AsyncSession, node: str, on: bool, now: datetime) -> None:
        if on:
            stmt = insert(THROTTLES).values(node=node, since=now)
            await session.execute(stmt.on_conflict_do_nothing(index_elements=[THROTTLES.c.node]))
        else:
            await session.execute(delete(THROTTLES).where(THROTTLES.c.node == node))
