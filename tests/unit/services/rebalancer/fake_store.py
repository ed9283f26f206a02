"""An in-memory ``RebalanceStore``: the rebalancer's tables as dicts and lists, same interface.

Writes land at once (no transaction of its own): what a rolled-back unit of work must not change is the
handlers' memory, which the tests check."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from services.rebalancer.readmodel import Allocation
from services.rebalancer.store import ACTIONS_KEPT, Loaded, RebalanceStore
from shared.contracts.placement import PlacementEvent
from shared.contracts.rebalance import ActionView, PlanView
from shared.contracts.topology import NodeProfileEvent, TpuPodEvent


@dataclass
class _PlanRow:
    plan: PlanView
    created_at: datetime
    updated_at: datetime


@dataclass
class FakeRebalanceStore(RebalanceStore):
    replicas: dict[str, PlacementEvent] = field(default_factory=dict)
    allocations: dict[str, Allocation] = field(default_factory=dict)
    nodes: dict[str, NodeProfileEvent] = field(default_factory=dict)
    pods: dict[str, TpuPodEvent] = field(default_factory=dict)
    throttles: dict[str, datetime] = field(default_factory=dict)
    plan_rows: dict[str, _PlanRow] = field(default_factory=dict)
    action_rows: list[ActionView] = field(default_factory=list)  # oldest first

    async def load(self, *, session: Any) -> Loaded:
        return Loaded(
            replicas=dict(self.replicas),
            allocations=dict(self.allocations),
            nodes=dict(self.nodes),
            pods=dict(self.pods),
            throttles=set(self.throttles),
        )

    async def put_replica(self, *, session: Any, allocation_id: str, tenant: str, event: PlacementEvent) -> None:
        self.replicas.setdefault(allocation_id, event)

    async def drop_replica(self, *, session: Any, allocation_id: str) -> None:
        self.replicas.pop(allocation_id, None)

    async def put_allocation(self, *, session: Any, allocation: Allocation) -> None:
        self.allocations.setdefault(allocation.allocation_id, allocation)

    async def drop_allocation(self, *, session: Any, allocation_id: str) -> None:
        self.allocations.pop(allocation_id, None)

    async def put_node(self, *, session: Any, event: NodeProfileEvent) -> None:
        self.nodes[event.node] = event

    async def drop_node(self, *, session: Any, name: str) -> None:
        self.nodes.pop(name, None)

    async def put_pod(self, *, session: Any, event: TpuPodEvent) -> None:
        self.pods[event.pod] = event

    async def add_plan(self, *, session: Any, plan: PlanView, now: datetime) -> None:
        assert plan.plan_id not in self.plan_rows, f"plan {plan.plan_id} added twice"
        self.plan_rows[plan.plan_id] = _PlanRow(plan, now, now)

    async def put_plan(self, *, session: Any, plan: PlanView, now: datetime) -> None:
        row = self.plan_rows.get(plan.plan_id)
        self.plan_rows[plan.plan_id] = _PlanRow(plan, row.created_at if row else now, now)

    async def save_plan(self, *, session: Any, plan: PlanView, now: datetime) -> None:
        row = self.plan_rows.get(plan.plan_id)
        if row is not None:
            self.plan_rows[plan.plan_id] = _PlanRow(plan, row.created_at, now)

    async def plans(
        self, *, session: Any, states: Iterable[str] | None = None, limit: int = 100, lock: bool = False
    ) -> list[PlanView]:
        wanted = set(states) if states is not None else None
        rows = sorted(self.plan_rows.values(), key=lambda r: (r.created_at, r.plan.plan_id))
        return [r.plan for r in rows if wanted is None or r.plan.state in wanted][:limit]

    async def recent_plans(self, *, session: Any, limit: int) -> list[PlanView]:
        rows = sorted(self.plan_rows.values(), key=lambda r: r.plan.plan_id)
        rows.sort(key=lambda r: r.updated_at, reverse=True)
        return [r.plan for r in rows][:limit]

    async def add_action(self, *, session: Any, at: datetime, plan_id: str | None, what: str) -> None:
        self.action_rows.append(ActionView(at=at, plan_id=plan_id, what=what[:500]))

    async def actions(self, *, session: Any, limit: int) -> list[ActionView]:
        return list(reversed(self.action_rows))[:limit]

    async def trim_actions(self, *, session: Any) -> None:
        del self.action_rows[:-ACTIONS_KEPT]

    async def set_throttle(self, *, session: Any, node: str, on: bool, now: datetime) -> None:
        if on:
            self.throttles.setdefault(node, now)
        else:
            self.throttles.pop(node, None)

    def plan_list(self) -> list[PlanView]:
        """Every plan, oldest first (a test's read)."""
        return [r.plan for r in sorted(self.plan_rows.values(), key=lambda r: (r.created_at, r.plan.plan_id))]
