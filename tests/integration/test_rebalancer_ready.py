"""Make-before-break in the engines, end to end on real NATS and Postgres: a TP group whose NVLink goes down
is re-placed, and its old replica is drained and released only once the copy's engine reports `ready`.
The test plays the node's agent: it publishes `replica_state` (TELEMETRY, the node's own subject) for the
old group (ready: an agent runs engines on the node) and for the copy (loading, then ready), as the engine
supervisor does every status interval. Its own stack: the rebalancer learns that the node runs engines
within 3 status intervals (`HETSCHED_AGENT_STATUS_S=1`: 3 s)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
import pytest_asyncio

from shared.contracts.base import Rejected
from shared.contracts.engines import EngineState, ReplicaStateEvent
from shared.contracts.envelope import new_event
from shared.contracts.ledger import SnapshotReply, SnapshotRequest
from shared.contracts.permissions import AGENT
from shared.contracts.placement import PlaceReply, PlaceRequest, ReleaseReply, ReleaseRequest
from shared.contracts.rebalance import PlanView, RebalanceStatusReply, RebalanceStatusRequest
from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context, Rpc
from shared.contracts.topology import TelemetryEventName, TopologyReportRequest
from shared.domain.topology import LinkMatrix
from shared.infra.outbox import msg_id_headers
from shared.infra.settings import Settings
from tests.conftest import ServiceProcesses
from tests.integration.test_rebalancer import Stack, _nvswitch_without, _profile, rebalancer_stack
from tests.jetstream import read_all
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

NAMES = {s: f"ry_{s}" for s in ("topology_discovery", "capacity_ledger", "placement", "rebalancer")}
NODE = "ry-nv-0"
REGION = "ry-region"
TENANT = "ry-tenant"
LOADING_S = 6.0  # how long the copy loads: twice the rebalancer's 3 s stale window, 30 of its ticks


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(service_processes: ServiceProcesses, settings: Settings) -> AsyncIterator[Stack]:
    async with rebalancer_stack(
        service_processes,
        settings,
        NAMES,
        HETSCHED_REBALANCE_HOT_UTIL="1",  # only the NVLink re-placement acts in this module
        HETSCHED_REBALANCE_COLD_UTIL="0.001",
        HETSCHED_REBALANCE_DRIFT_RATIO="100",
        HETSCHED_REBALANCE_MIGRATIONS_PER_MIN="60",
        HETSCHED_REBALANCE_TICK_S="0.2",
        HETSCHED_REBALANCE_WAIT_FOR_READY="auto",
        HETSCHED_AGENT_STATUS_S="1",
    ) as s:
        yield s


class Agent:
    """The node's agent as the rebalancer hears it: each engine's `replica_state`, every 0.25 s."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.states: dict[str, EngineState] = {}

    async def publish(self, replica_id: str, state: EngineState) -> None:
        payload = ReplicaStateEvent(replica_id=replica_id, node=NODE, state=state, engine="sim")
        envelope = new_event(
            type=f"{Context.TELEMETRY.value}.{TelemetryEventName.REPLICA_STATE.value}",
            source=AGENT,
            payload=payload.model_dump(mode="json"),
            occurred_at=datetime.now(UTC),
        )
        await self.stack.nc.jetstream().publish(
            self.stack.subjects.event(Context.TELEMETRY, TelemetryEventName.REPLICA_STATE, node=NODE),
            envelope.model_dump_json().encode(),
            headers=msg_id_headers(str(envelope.event_id)),
        )

    async def run(self) -> None:
        while True:
            for replica_id, state in list(self.states.items()):
                await self.publish(replica_id, state)
            await asyncio.sleep(0.25)


async def _report(stack: Stack, links: LinkMatrix) -> None:
    body = TopologyReportRequest(node=NODE, profile=_profile(NODE, links, region=REGION)).model_dump(mode="json")
    msg = await stack.nc.request(stack.subjects.rpc(Rpc.TOPOLOGY_REPORT), json.dumps(body).encode(), timeout=15)
    assert json.loads(msg.data)["status"] in ("accepted", "unchanged"), msg.data


async def _plan(stack: Stack, old: str) -> PlanView | None:
    status = await stack.rpc.ask(Rpc.REBALANCE_STATUS, RebalanceStatusRequest(), RebalanceStatusReply)
    assert isinstance(status, RebalanceStatusReply), status
    return next(
        (p for p in status.plans if p.kind == "replace" and p.target == NODE and p.steps[0].allocation_id == old), None
    )


async def _held(stack: Stack) -> set[str]:
    ledger = await stack.rpc.ask(Rpc.LEDGER_SNAPSHOT, SnapshotRequest(), SnapshotReply)
    assert isinstance(ledger, SnapshotReply), ledger
    return {a for acc in ledger.accelerators if acc.node == NODE for a in acc.allocations}


async def test_the_old_replica_is_released_only_once_its_copy_reports_ready(stack: Stack) -> None:
    await _report(stack, _nvswitch_without(set()))

    async def placed() -> PlaceReply | None:
        reply = await stack.rpc.ask(
            Rpc.PLACEMENT_PLACE,
            PlaceRequest(
                request_id="ry-tp2",
                tenant=TENANT,
                model="llama3.1-8b",
                context_tokens=8192,
                tp=2,
                region=REGION,
                backend="gpu",
                fallbacks=[],
            ),
            PlaceReply,
        )
        return reply if isinstance(reply, PlaceReply) and reply.status == "placed" else None

    group = await wait_for(placed, 30, what="placement sees the reported node")
    old = group.allocation_id
    assert old is not None
    pair = sorted(int(a.rsplit("gpu", 1)[1]) for a in group.placements[0].accelerators)
    agent = Agent(stack)
    agent.states[old] = "ready"  # the node's agent runs the old group's engine
    reporting = asyncio.create_task(agent.run())
    copy: str | None = None
    try:
        await asyncio.sleep(1.0)  # the rebalancer hears that the node runs engines
        await _report(stack, _nvswitch_without({frozenset(pair)}))  # the group's NVLink goes down

        async def copied() -> str | None:
            plan = await _plan(stack, old)
            return plan.steps[0].new_allocation_id if plan is not None and plan.steps[0].state == "done" else None

        copy = await wait_for(copied, 40, what="the TP group's copy is placed")
        agent.states[copy] = "loading"

        # While the copy loads, the old group keeps serving: not drained, not released, its step pending.
        deadline = asyncio.get_running_loop().time() + LOADING_S
        while asyncio.get_running_loop().time() < deadline:
            plan = await _plan(stack, old)
            assert plan is not None and plan.state == "running", plan
            assert [s.state for s in plan.steps] == ["done", "pending"], plan
            assert {old, copy} <= await _held(stack)
            await asyncio.sleep(0.3)
        events = await read_all(
            stack.nc.jetstream(),
            stream=stream_name(Context.REBALANCE, stream_prefix=stack.settings.kit.stream_prefix),
            subject=stack.subjects.events_of(Context.REBALANCE),
        )
        draining = [
            e for e in events if e["type"].endswith("replica_draining") and e["payload"]["allocation_id"] == old
        ]
        assert draining == []

        agent.states[copy] = "ready"

        async def replaced() -> PlanView | None:
            plan = await _plan(stack, old)
            return plan if plan is not None and plan.state == "done" else None

        plan = await wait_for(replaced, 30, what="the old group is released once its copy is ready")
        assert [s.state for s in plan.steps] == ["done", "done"]
        held = await _held(stack)
        assert old not in held and copy in held
    finally:
        reporting.cancel()
        for allocation_id in (copy, old):  # what this test placed (the old one is gone unless it failed)
            if allocation_id is not None:
                reply = await stack.rpc.ask(
                    Rpc.PLACEMENT_RELEASE, ReleaseRequest(allocation_id=allocation_id, tenant=TENANT), ReleaseReply
                )
                assert isinstance(reply, (ReleaseReply, Rejected)), reply
