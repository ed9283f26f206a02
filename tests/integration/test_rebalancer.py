"""The rebalancer end to end on real NATS and Postgres: topology, the ledger, placement and the rebalancer
as processes, windows shortened through the settings. Synthetic GPU telemetry, published over NATS as the
nodes' agents publish it, drives the cold detector (two half-idle L40S nodes: one is drained onto the
other, make-before-break, and ends with nothing on it) and the hot detector (a replica's GPU above 0.85:
a copy placed onto other GPUs); the detectors and plans appear in `rebalance.status`; PCIe above 0.7
throttles the node (placement places nothing new there) until it clears."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client

from hetsched.stack import wait_healthy
from shared.contracts.base import Rejected
from shared.contracts.envelope import new_event
from shared.contracts.ledger import SnapshotReply, SnapshotRequest
from shared.contracts.permissions import AGENT
from shared.contracts.placement import PlaceReply, PlaceRequest, ReleaseReply, ReleaseRequest
from shared.contracts.rebalance import RebalanceStatusReply, RebalanceStatusRequest
from shared.contracts.subjects import Context, Rpc, Subjects
from shared.contracts.topology import (
    GPU_TELEMETRY,
    GpuSample,
    GpuTelemetryEvent,
    NodeProfilePayload,
    TopologyReportRequest,
)
from shared.domain.fleet import Accelerator, NodeProfile
from shared.domain.topology import LinkMatrix
from shared.infra.catalog import demo_fleet_path
from shared.infra.profiles import profile_to_payload
from shared.infra.rpc import RpcClient
from shared.infra.settings import Settings
from tests.conftest import ServiceProcesses
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

L40S = "L40S-48GB"
NODES = ("l40s-01", "l40s-02")  # the demo fleet's two L40S nodes (us-west-1, rack r3)
GPU_BYTES = 48 * 1024**3
TENANT = "rb-tenant"
NAMES = {s: f"rb_{s}" for s in ("topology_discovery", "capacity_ledger", "placement", "rebalancer")}


class Stack:
    def __init__(self, rpc: RpcClient, nc: Client, settings: Settings) -> None:
        self.rpc = rpc
        self.nc = nc
        self.settings = settings
        self.subjects = Subjects(settings.kit.subject_prefix)

    async def place(self, rid: str, **extra: Any) -> PlaceReply:
        request = PlaceRequest(
            request_id=rid,
            tenant=TENANT,
            model="llama3.1-8b",
            context_tokens=8192,
            tp=1,
            region="us-west-1",
            skus=[L40S],
            backend="gpu",
            fallbacks=[],
            **extra,
        )
        reply = await self.rpc.ask(Rpc.PLACEMENT_PLACE, request, PlaceReply)
        assert isinstance(reply, PlaceReply) and reply.status == "placed", reply
        return reply

    async def telemetry(self, node: str, used: dict[int, float], *, pcie: float = 0.0) -> None:
        """One sample from the node's agent: HBM used per GPU index (a fraction; others idle)."""
        link = 2.0e9 * 16  # L40S: PCIe Gen4 x16, one direction (about 32 GB/s)
        gpus = [
            GpuSample(
                index=i,
                memory_used_bytes=int(GPU_BYTES * used.get(i, 0.02)),
                memory_free_bytes=GPU_BYTES - int(GPU_BYTES * used.get(i, 0.02)),
                pcie_rx_bytes_per_s=pcie * link,
                pcie_tx_bytes_per_s=0.0,
            )
            for i in range(8)
        ]
        payload = GpuTelemetryEvent(node=node, gpus=gpus)
        envelope = new_event(
            type="telemetry.gpu", source=AGENT, payload=payload.model_dump(mode="json"), occurred_at=datetime.now(UTC)
        )
        subject = self.subjects.event(Context.TELEMETRY, GPU_TELEMETRY, node=node)
        await self.nc.jetstream().publish(subject, envelope.model_dump_json().encode())

    async def status(self) -> RebalanceStatusReply:
        reply = await self.rpc.ask(Rpc.REBALANCE_STATUS, RebalanceStatusRequest(), RebalanceStatusReply)
        assert isinstance(reply, RebalanceStatusReply), reply
        return reply

    async def ledger(self) -> SnapshotReply:
        reply = await self.rpc.ask(Rpc.LEDGER_SNAPSHOT, SnapshotRequest(), SnapshotReply)
        assert isinstance(reply, SnapshotReply), reply
        return reply

    async def on_node(self, node: str) -> set[str]:
        return {a for acc in (await self.ledger()).accelerators if acc.node == node for a in acc.allocations}


@contextlib.asynccontextmanager
async def rebalancer_stack(
    processes: ServiceProcesses, settings: Settings, names: dict[str, str], **rebalancer_env: str
) -> AsyncIterator[Stack]:
    """Topology (the demo fleet), ledger, placement and a rebalancer (``rebalancer_env``: its settings) as
    processes named by ``names``, healthy; a ``Stack`` on them; everything stopped after."""
    processes.start(
        "topology_discovery", name=names["topology_discovery"], HETSCHED_TOPOLOGY_INVENTORY=str(demo_fleet_path())
    )
    processes.start("capacity_ledger", name=names["capacity_ledger"])
    processes.start("placement", name=names["placement"])
    processes.start("rebalancer", name=names["rebalancer"], **rebalancer_env)
    subjects = Subjects(settings.kit.subject_prefix)
    health = await wait_healthy(nats_url=settings.kit.nats_url or "", subjects=subjects, deadline_s=60, only=set(names))
    assert all(h["status"] == "ok" for h in health.values()), health
    rpc = await RpcClient.connect(settings.kit.nats_url or "", subjects, timeout_s=15)
    nc = await nats.connect(settings.kit.nats_url or "")
    try:
        yield Stack(rpc, nc, settings)
    finally:
        await rpc.close()
        await nc.close()
        for name in reversed(names.values()):
            processes.stop(name)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(service_processes: ServiceProcesses, settings: Settings) -> AsyncIterator[Stack]:
    async with rebalancer_stack(
        service_processes,
        settings,
        NAMES,
        HETSCHED_REBALANCE_HOT_WINDOW_S="2",
        HETSCHED_REBALANCE_COLD_WINDOW_S="3",
        HETSCHED_REBALANCE_PCIE_WINDOW_S="2",
        HETSCHED_REBALANCE_MIGRATIONS_PER_MIN="60",
        HETSCHED_REBALANCE_TICK_S="0.2",
        HETSCHED_REBALANCE_DRIFT_RATIO="100",  # synthetic HBM figures: no drift plans in this module
    ) as s:
        yield s
        # The session's database is shared with later modules: give back what this module's tenant holds.
        placed = await s.rpc.ask(Rpc.LEDGER_SNAPSHOT, SnapshotRequest(), SnapshotReply)
        assert isinstance(placed, SnapshotReply)
        for node in NODES:
            for allocation_id in {a for acc in placed.accelerators if acc.node == node for a in acc.allocations}:
                reply = await s.rpc.ask(
                    Rpc.PLACEMENT_RELEASE, ReleaseRequest(allocation_id=allocation_id, tenant=TENANT), ReleaseReply
                )
                assert isinstance(reply, (ReleaseReply, Rejected)), reply


async def _keep_reporting(stack: Stack, samples: dict[str, dict[int, float]], seconds: float, **kw: float) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while asyncio.get_running_loop().time() < deadline:
        for node, used in samples.items():
            await stack.telemetry(node, used, **kw)
        await asyncio.sleep(0.25)


async def test_cold_nodes_are_consolidated_and_a_hot_replica_is_replicated(stack: Stack) -> None:
    async def ready() -> PlaceReply | None:
        try:
            return await stack.place("rb-a")
        except AssertionError:
            return None

    first = await wait_for(ready, 60, what="placement sees the demo fleet")
    node_a = first.placements[0].node
    other = next(n for n in NODES if n != node_a)
    # The second replica on the other L40S node (the rebalancer's own way of steering: GPUs withheld).
    gpus_a = [f"{node_a}/gpu{i}" for i in range(8)]
    second = await stack.place("rb-b", avoid_accelerators=gpus_a)
    assert second.placements[0].node == other
    index = {
        first.allocation_id: int(first.placements[0].accelerators[0].rsplit("gpu", 1)[1]),
        second.allocation_id: int(second.placements[0].accelerators[0].rsplit("gpu", 1)[1]),
    }

    # Both nodes half idle: each replica's GPU at 20%, the rest at 2% -> node HBM use far under 0.30.
    samples = {node_a: {index[first.allocation_id]: 0.2}, other: {index[second.allocation_id]: 0.2}}
    reporter = asyncio.create_task(_keep_reporting(stack, samples, 60))
    # Checked against the ledger all along: the tenant's replicas on the two nodes never drop below two
    # (a copy is placed before its original is released: 2 -> 3 -> 2, never 1).
    counts: list[int] = []

    async def watch() -> None:
        while True:
            live: set[str] = set()
            for node in NODES:
                live |= await stack.on_node(node)
            counts.append(len(live))
            await asyncio.sleep(0.05)

    watcher = asyncio.create_task(watch())
    try:

        async def consolidated() -> RebalanceStatusReply | None:
            status = await stack.status()
            done = [p for p in status.plans if p.kind == "consolidate" and p.state == "done"]
            return status if done else None

        status = await wait_for(consolidated, 40, what="a consolidation plan runs to the end")
    finally:
        reporter.cancel()
        watcher.cancel()
    assert counts and min(counts) >= 2, counts
    cold = next(d for d in status.detectors if d.name == "hbm_cold")
    assert (cold.threshold, cold.above) == (0.30, False)
    plan = next(p for p in status.plans if p.kind == "consolidate" and p.state == "done")
    assert [s.action for s in plan.steps] == ["place", "release"]  # make-before-break: copy, then release
    drained = plan.target
    assert drained in NODES
    kept = next(n for n in NODES if n != drained)
    moved = plan.steps[0].allocation_id
    copy = plan.steps[0].new_allocation_id
    assert copy is not None
    # The drained node holds nothing; the copy runs on the node kept, beside the replica already there.
    assert await stack.on_node(drained) == set()
    assert copy in await stack.on_node(kept)
    assert moved not in await stack.on_node(kept)
    assert any("released" in a.what for a in status.recent)

    # Hot: one replica's GPU at 95% for longer than the window -> a copy on other GPUs.
    hot_id = next(iter(await stack.on_node(kept) - {copy}))
    copy_index = next(
        int(acc.id.rsplit("gpu", 1)[1]) for acc in (await stack.ledger()).accelerators if copy in acc.allocations
    )
    hot_index = next(
        int(acc.id.rsplit("gpu", 1)[1]) for acc in (await stack.ledger()).accelerators if hot_id in acc.allocations
    )
    reporter = asyncio.create_task(_keep_reporting(stack, {kept: {hot_index: 0.95, copy_index: 0.2}}, 60))
    try:

        async def replicated() -> RebalanceStatusReply | None:
            status = await stack.status()
            done = [p for p in status.plans if p.kind == "replicate" and p.state == "done" and p.target == hot_id]
            return status if done else None

        status = await wait_for(replicated, 40, what="the hot replica is copied")
    finally:
        reporter.cancel()
    hot = next(d for d in status.detectors if d.name == "hbm_hot")
    assert hot.threshold == 0.85
    plan = next(p for p in status.plans if p.kind == "replicate" and p.target == hot_id)
    (step,) = plan.steps
    assert step.action == "place" and step.new_allocation_id is not None
    assert hot_id in await stack.on_node(kept)  # the hot replica keeps serving
    ledger = await stack.ledger()
    where = next(acc.id for acc in ledger.accelerators if step.new_allocation_id in acc.allocations)
    assert where not in step.avoid  # not on the hot replica's own GPU
    for acc in ledger.accelerators:
        assert acc.hbm_reserved_bytes <= acc.hbm_usable_bytes


async def test_a_saturated_pcie_link_throttles_new_replicas_on_the_node_until_it_clears(stack: Stack) -> None:
    node = NODES[0]
    reporter = asyncio.create_task(_keep_reporting(stack, {node: {}}, 30, pcie=0.9))
    try:

        async def throttled() -> bool:
            status = await stack.status()
            return any(p.kind == "throttle" and p.target == node and p.state == "running" for p in status.plans)

        await wait_for(throttled, 20, what="the PCIe detector throttles the node")
        # Placement withholds the node from new replicas: one asked for it alone is refused.
        others = [f"{n}/gpu{i}" for n in NODES if n != node for i in range(8)]

        async def refused() -> bool:
            reply = await stack.rpc.ask(
                Rpc.PLACEMENT_EXPLAIN,
                PlaceRequest(
                    request_id="rb-throttled",
                    tenant=TENANT,
                    model="llama3.1-8b",
                    context_tokens=8192,
                    tp=1,
                    region="us-west-1",
                    skus=[L40S],
                    backend="gpu",
                    fallbacks=[],
                    avoid_accelerators=others,
                ),
                PlaceReply,
            )
            return isinstance(reply, Rejected) or reply.status == "rejected"

        await wait_for(refused, 20, what="placement hears of the throttle")
    finally:
        reporter.cancel()
    reporter = asyncio.create_task(_keep_reporting(stack, {node: {}}, 30, pcie=0.1))
    try:

        async def cleared() -> bool:
            status = await stack.status()
            return any(p.kind == "throttle" and p.target == node and p.state == "done" for p in status.plans)

        await wait_for(cleared, 20, what="the throttle ends once PCIe is back under 0.7 - hysteresis")
    finally:
        reporter.cancel()
    pcie = next(d for d in (await stack.status()).detectors if d.name == "pcie_hot")
    assert pcie.threshold == 0.7


async def test_bad_input_on_the_status_subject_gets_a_typed_error(stack: Stack) -> None:
    for body in (b"not json", b"[]", b'{"version": "99"}'):
        msg = await stack.nc.request(stack.subjects.rpc(Rpc.REBALANCE_STATUS), body, timeout=10)
        assert b'"rejected"' in msg.data, msg.data


def _profile(name: str, links: LinkMatrix, *, region: str = "rb-region") -> NodeProfilePayload:
    """An 8-GPU H100 node as its agent reports it, in a region of its own (so requests can aim at it)."""
    return profile_to_payload(
        NodeProfile(
            name=name,
            region=region,
            cluster="c1",
            rack="r-rb",
            sku="H100-SXM-80GB",
            accelerators=tuple(Accelerator(index=i, sku="H100-SXM-80GB", hbm_bytes=85_899_345_920) for i in range(8)),
            links=links,
            source="nvml",
        )
    )


def _nvswitch_without(down: set[frozenset[int]]) -> LinkMatrix:
    codes = [["X" if i == j else "SYS" if frozenset((i, j)) in down else "NV18" for j in range(8)] for i in range(8)]
    return LinkMatrix.from_codes(codes, numa=[i // 4 for i in range(8)])


async def test_a_tp_group_whose_nvlink_goes_down_is_replaced_on_a_clique_and_the_old_one_released(
    stack: Stack,
) -> None:
    name = "rb-nv-0"

    async def report(links: LinkMatrix) -> None:
        body = TopologyReportRequest(node=name, profile=_profile(name, links)).model_dump(mode="json")
        msg = await stack.nc.request(stack.subjects.rpc(Rpc.TOPOLOGY_REPORT), json.dumps(body).encode(), timeout=15)
        assert json.loads(msg.data)["status"] in ("accepted", "unchanged"), msg.data

    await report(_nvswitch_without(set()))

    async def placed() -> PlaceReply | None:
        reply = await stack.rpc.ask(
            Rpc.PLACEMENT_PLACE,
            PlaceRequest(
                request_id="rb-tp2",
                tenant=TENANT,
                model="llama3.1-8b",
                context_tokens=8192,
                tp=2,
                region="rb-region",
                backend="gpu",
                fallbacks=[],
            ),
            PlaceReply,
        )
        return reply if isinstance(reply, PlaceReply) and reply.status == "placed" else None

    group = await wait_for(placed, 30, what="placement sees the reported node")
    old = group.allocation_id
    pair = sorted(int(a.rsplit("gpu", 1)[1]) for a in group.placements[0].accelerators)
    assert len(pair) == 2

    # The link between the group's two GPUs goes down: the agent reports the node again.
    await report(_nvswitch_without({frozenset(pair)}))

    async def replaced() -> RebalanceStatusReply | None:
        status = await stack.status()
        done = [p for p in status.plans if p.kind == "replace" and p.target == name and p.state == "done"]
        return status if done else None

    status = await wait_for(replaced, 40, what="the TP group is re-placed")
    plan = next(p for p in status.plans if p.kind == "replace" and p.target == name)
    assert [s.action for s in plan.steps] == ["place", "release"]
    assert plan.steps[0].allocation_id == old
    copy = plan.steps[0].new_allocation_id
    ledger = await stack.ledger()
    gpus = sorted(int(acc.id.rsplit("gpu", 1)[1]) for acc in ledger.accelerators if copy in acc.allocations)
    assert len(gpus) == 2 and frozenset(gpus) != frozenset(pair)  # an NVLinked pair again
    assert not any(old in acc.allocations for acc in ledger.accelerators)  # the old group released
    reply = await stack.rpc.ask(
        Rpc.PLACEMENT_RELEASE, ReleaseRequest(allocation_id=copy or "", tenant=TENANT), ReleaseReply
    )
    assert isinstance(reply, ReleaseReply), reply
