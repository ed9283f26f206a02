"""What the rebalancer and the ledger judge when real engines run, end to end on real NATS and Postgres
(topology, the ledger, placement and the rebalancer as processes; windows shortened through the settings).

The test plays the node's agent and its engines, as the engine supervisor publishes them: each rank's
`replica_state`, each engine's `engine_status` and the node's GPU samples. The engines preallocate (vLLM's
`--gpu-memory-utilization` set to the ledger share): a serving replica's GPU holds exactly its reservation,
and the share fills 91% of the GPU (tightly packed). So:

- while a replica's engine loads (its GPU holds nothing of its reservation), neither the rebalancer (drift
  alarm, any plan) nor the ledger (`drift_detected`) says anything;
- ready, its engine idle, its GPU reading 91% used: never replicated (its KV use is what counts);
- its engine's KV use over 0.85: replicated once; the copy's engine (loading, then ready, giving no load
  report) reads 91% used too and is not replicated, having carried no load.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest
import pytest_asyncio
from pydantic import BaseModel

from shared.contracts.base import Rejected
from shared.contracts.engines import EngineState, ReplicaStateEvent
from shared.contracts.envelope import new_event
from shared.contracts.permissions import AGENT
from shared.contracts.placement import PlaceReply, PlaceRequest, ReleaseReply, ReleaseRequest
from shared.contracts.rebalance import PlanView
from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context, Rpc
from shared.contracts.topology import (
    EngineStatusEvent,
    GpuSample,
    GpuTelemetryEvent,
    TelemetryEventName,
    TopologyReportRequest,
)
from shared.infra.outbox import msg_id_headers
from shared.infra.settings import Settings
from tests.conftest import ServiceProcesses
from tests.integration.test_rebalancer import Stack, _nvswitch_without, _profile, rebalancer_stack
from tests.jetstream import read_all
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

NAMES = {s: f"re_{s}" for s in ("topology_discovery", "capacity_ledger", "placement", "rebalancer")}
NODE = "re-nv-0"
REGION = "re-region"
TENANT = "re-tenant"
GPU_BYTES = 85_899_345_920
PACKED = 0.91  # a serving replica's share of its GPU
HOT_WINDOW_S = 3.0
GRACE_S = 2.0
LOADING_S = 15.0  # how long the first replica's engine loads: five hot / drift windows


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(service_processes: ServiceProcesses, settings: Settings) -> AsyncIterator[Stack]:
    async with rebalancer_stack(
        service_processes,
        settings,
        NAMES,
        HETSCHED_REBALANCE_HOT_WINDOW_S=str(HOT_WINDOW_S),  # 0.85, as shipped
        HETSCHED_REBALANCE_COLD_UTIL="0.001",  # a node with idle GPUs is not consolidated in this module
        HETSCHED_REBALANCE_DRIFT_CHECK_S="0.5",  # drift as shipped (10%), checked often, lasting 3 s
        HETSCHED_REBALANCE_DRIFT_WINDOW_S="3",
        HETSCHED_REBALANCE_STATE_GRACE_S=str(GRACE_S),
        HETSCHED_REBALANCE_MIGRATIONS_PER_MIN="60",
        HETSCHED_REBALANCE_TICK_S="0.2",
        HETSCHED_AGENT_STATUS_S="1",
    ) as s:
        yield s


class Engine:
    """One replica's engine as its agent reports it: its state, its GPU's bytes, its load (None: no report)."""

    def __init__(self, gpu: int, share: int) -> None:
        self.gpu = gpu
        self.share = share
        self.state: EngineState = "starting"
        self.kv_usage: float | None = None
        self.running = 0

    def sample(self) -> GpuSample:
        used = self.share if self.state == "ready" else 0  # preallocated once up; nothing while loading
        size = round(self.share / PACKED)
        return GpuSample(index=self.gpu, memory_used_bytes=used, memory_free_bytes=size - used)


class Agent:
    """The node's agent: every 0.25 s each engine's `replica_state` and `engine_status`, and a GPU sample."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.engines: dict[str, Engine] = {}

    async def _publish(self, name: TelemetryEventName, payload: BaseModel) -> None:
        envelope = new_event(
            type=f"{Context.TELEMETRY.value}.{name.value}",
            source=AGENT,
            payload=payload.model_dump(mode="json"),
            occurred_at=datetime.now(UTC),
        )
        await self.stack.nc.jetstream().publish(
            self.stack.subjects.event(Context.TELEMETRY, name, node=NODE),
            envelope.model_dump_json().encode(),
            headers=msg_id_headers(str(envelope.event_id)),
        )

    async def once(self) -> None:
        mine = {e.gpu: e.sample() for e in self.engines.values()}
        idle = GpuSample(index=0, memory_used_bytes=GPU_BYTES // 50, memory_free_bytes=GPU_BYTES - GPU_BYTES // 50)
        gpus = [mine.get(i, idle.model_copy(update={"index": i})) for i in range(8)]
        await self._publish(TelemetryEventName.GPU, GpuTelemetryEvent(node=NODE, gpus=gpus))
        for replica_id, engine in list(self.engines.items()):
            state = ReplicaStateEvent(replica_id=replica_id, node=NODE, state=engine.state, engine="sim")
            await self._publish(TelemetryEventName.REPLICA_STATE, state)
            if engine.state == "ready" and engine.kv_usage is not None:
                status = EngineStatusEvent(
                    replica_id=replica_id,
                    node=NODE,
                    queue_depth=0,
                    kv_used_bytes=0,
                    kv_total_bytes=10**10,
                    latency_p50_ms=0.0,
                    latency_p99_ms=0.0,
                    running_requests=engine.running,
                    kv_usage=engine.kv_usage,
                )
                await self._publish(TelemetryEventName.ENGINE_STATUS, status)

    async def run(self) -> None:
        while True:
            await self.once()
            await asyncio.sleep(0.25)


async def _events(stack: Stack, context: Context, name: str) -> list[dict[str, Any]]:
    events = await read_all(
        stack.nc.jetstream(),
        stream=stream_name(context, stream_prefix=stack.settings.kit.stream_prefix),
        subject=stack.subjects.events_of(context),
    )
    return [e for e in events if e["type"].endswith(name)]


async def _plans(stack: Stack, ids: set[str]) -> list[PlanView]:
    status = await stack.status()
    return [p for p in status.plans if p.target in ids or p.target == NODE]


async def _drift_said(stack: Stack, ids: set[str]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The rebalancer's drift alarms about ``ids`` and the ledger's drift reports on the node's GPUs."""
    alarms = [e for e in await _events(stack, Context.REBALANCE, "drift_alarm") if e["payload"]["allocation_id"] in ids]
    ledger = [
        e
        for e in await _events(stack, Context.LEDGER, "drift_detected")
        if e["payload"]["accelerator_id"].startswith(f"{NODE}/")
    ]
    return alarms, ledger


async def _watch(stack: Stack, seconds: float, ids: set[str], what: str) -> None:
    """For ``seconds``: no plan about ``ids`` (or the node), no detector firing on them."""
    deadline = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < deadline:
        assert await _plans(stack, ids) == [], what
        status = await stack.status()
        firing = [(d.name, t.key) for d in status.detectors for t in d.targets if t.key in ids and t.phase == "firing"]
        assert firing == [], (what, firing)
        await asyncio.sleep(0.5)


def _gpu_of(reply: PlaceReply) -> int:
    (placement,) = reply.placements
    (acc,) = placement.accelerators
    return int(acc.rsplit("gpu", 1)[1])


async def test_loading_idle_and_busy_engines_are_judged_on_their_own_signals(stack: Stack) -> None:
    body = TopologyReportRequest(node=NODE, profile=_profile(NODE, _nvswitch_without(set()), region=REGION))
    msg = await stack.nc.request(
        stack.subjects.rpc(Rpc.TOPOLOGY_REPORT), json.dumps(body.model_dump(mode="json")).encode(), timeout=15
    )
    assert json.loads(msg.data)["status"] in ("accepted", "unchanged"), msg.data

    async def placed() -> PlaceReply | None:
        ask = PlaceRequest(
            request_id="re-1",
            tenant=TENANT,
            model="llama3.1-8b",
            context_tokens=8192,
            tp=1,
            region=REGION,
            backend="gpu",
            fallbacks=[],
        )
        reply = await stack.rpc.ask(Rpc.PLACEMENT_PLACE, ask, PlaceReply)
        return reply if isinstance(reply, PlaceReply) and reply.status == "placed" else None

    first = await wait_for(placed, 30, what="placement sees the reported node")
    original = first.allocation_id
    assert original is not None and first.hbm_per_accelerator is not None
    share = first.hbm_per_accelerator.total_bytes
    agent = Agent(stack)
    agent.engines[original] = Engine(_gpu_of(first), share)
    agent.engines[original].state = "loading"
    reporting = asyncio.create_task(agent.run())
    copy: str | None = None
    try:
        # 1. Loading: its GPU holds nothing of its reservation (a drift of 100%), for five windows.
        await _watch(stack, LOADING_S, {original}, "while its engine loads")
        assert await _drift_said(stack, {original}) == ([], [])

        # 2. Ready, idle: its GPU reads 91% used (preallocated), its KV cache is empty.
        engine = agent.engines[original]
        engine.state, engine.kv_usage, engine.running = "ready", 0.0, 0
        await _watch(stack, GRACE_S + 3 * HOT_WINDOW_S, {original}, "ready, its engine idle")

        # 3. Busy: KV over 0.85 for the window: one copy.
        engine.kv_usage, engine.running = 0.92, 12

        async def copied() -> PlanView | None:
            plans = [p for p in await _plans(stack, {original}) if p.kind == "replicate"]
            return plans[0] if plans and plans[0].steps[0].state == "done" else None

        plan = await wait_for(copied, 30, what="the busy replica is replicated")
        copy = plan.steps[0].new_allocation_id
        assert copy is not None
        ledger = await stack.ledger()
        (copy_gpu,) = [acc.id for acc in ledger.accelerators if copy in acc.allocations]
        agent.engines[copy] = Engine(int(copy_gpu.rsplit("gpu", 1)[1]), share)
        agent.engines[copy].state = "loading"
        await asyncio.sleep(3.0)
        agent.engines[copy].state = "ready"  # no load report: read on its GPU, which reads 91% used

        # The copy, ready and packed, is not replicated; the original, still busy, is not copied again.
        await _watch(stack, GRACE_S + 3 * HOT_WINDOW_S, {copy}, "the copy, ready, carrying no load")
        plans = await _plans(stack, {original, copy})
        assert [(p.kind, p.target) for p in plans] == [("replicate", original)], plans
        assert await _drift_said(stack, {original, copy}) == ([], [])
    finally:
        reporting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reporting
        for allocation_id in (copy, original):
            if allocation_id is not None:
                reply = await stack.rpc.ask(
                    Rpc.PLACEMENT_RELEASE, ReleaseRequest(allocation_id=allocation_id, tenant=TENANT), ReleaseReply
                )
                assert isinstance(reply, (ReleaseReply, Rejected)), reply
