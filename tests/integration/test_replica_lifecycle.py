"""Replica lifecycle on real NATS and Postgres: topology (demo fleet), the ledger and placement as processes;
`replica_state` events published as a node's agent publishes them. `placement.replicas` lists each state the
ranks fold into and the head's endpoint once ready; `placement.admit` admits only to ready replicas and names
the endpoint (a failed or loading replica is never chosen); `placement.assignments` answers a node's agent
with the replica parts on its node (a body naming another node than its subject is `forbidden`); a
replica's lease is renewed while its ranks report and lapses once they fall silent."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client

from hetsched.engine_sim import EngineLoad, publish_engine_status
from hetsched.stack import wait_healthy
from shared.contracts.base import ErrorCode, Rejected
from shared.contracts.engines import AssignmentsReply, AssignmentsRequest, ReplicaStateEvent
from shared.contracts.envelope import new_event
from shared.contracts.permissions import AGENT
from shared.contracts.placement import (
    AdmitReply,
    AdmitRequest,
    PlaceReply,
    PlaceRequest,
    ReleaseReply,
    ReleaseRequest,
    ReplicasReply,
    ReplicasRequest,
    ReplicaView,
)
from shared.contracts.subjects import Context, Rpc, Subjects
from shared.contracts.topology import TelemetryEventName
from shared.infra.catalog import demo_fleet_path
from shared.infra.outbox import msg_id_headers
from shared.infra.rpc import RpcClient
from shared.infra.settings import Settings
from tests.conftest import ServiceProcesses
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

STALE_S = 4.0
LEASE_S = 8  # HETSCHED_PLACEMENT_DEFAULT_LEASE_S: what a reporting replica's lease is renewed to
TENANT = "lifecycle"


class Stack:
    def __init__(self, rpc: RpcClient, nc: Client, subjects: Subjects) -> None:
        self.rpc = rpc
        self.nc = nc
        self.subjects = subjects
        self.placed: dict[str, PlaceReply] = {}

    async def place(self, name: str, *, model: str = "llama3.1-8b") -> PlaceReply:
        reply = await self.rpc.ask(
            Rpc.PLACEMENT_PLACE,
            PlaceRequest(
                request_id=f"lc-{name}",
                tenant=TENANT,
                model=model,
                context_tokens=8192,
                concurrency=4,
                region="us-west-1",
                backend="gpu",
                lease_s=LEASE_S,
            ),
            PlaceReply,
        )
        assert isinstance(reply, PlaceReply) and reply.status == "placed", reply
        assert reply.allocation_id is not None
        self.placed[name] = reply

        async def recorded() -> bool:  # placement records a direct placement from the ledger's event
            return await self.view(name) is not None

        await wait_for(recorded, 10, what="placement records the replica")
        return reply

    def ids(self, name: str) -> tuple[str, str]:
        reply = self.placed[name]
        assert reply.allocation_id is not None
        return reply.allocation_id, reply.placements[0].node

    async def state(self, name: str, state: str, **fields: Any) -> None:
        """One rank's report on `<prefix>.events.telemetry.replica_state.<node>`, as the node's agent sends it."""
        allocation_id, node = self.ids(name)
        body = ReplicaStateEvent(replica_id=allocation_id, node=fields.pop("node", node), state=state, **fields)  # type: ignore[arg-type]
        event = new_event(
            type=f"{Context.TELEMETRY.value}.{TelemetryEventName.REPLICA_STATE.value}",
            source=AGENT,
            payload=body.model_dump(mode="json"),
            occurred_at=datetime.now(UTC),
        )
        await self.nc.jetstream().publish(
            self.subjects.event(Context.TELEMETRY, TelemetryEventName.REPLICA_STATE, node=body.node),
            event.model_dump_json().encode(),
            headers=msg_id_headers(str(event.event_id)),
        )

    async def status(self, name: str) -> None:
        allocation_id, node = self.ids(name)
        status = EngineLoad(jitter=0).status(replica_id=allocation_id, node=node, rng=random.Random(0))
        await publish_engine_status(self.nc.jetstream(), self.subjects, status)

    async def view(self, name: str) -> ReplicaView | None:
        allocation_id, _node = self.ids(name)
        reply = await self.rpc.ask(Rpc.PLACEMENT_REPLICAS, ReplicasRequest(tenant=TENANT, limit=500), ReplicasReply)
        assert isinstance(reply, ReplicasReply), reply
        return next((r for r in reply.replicas if r.replica_id == allocation_id), None)

    async def listed_as(self, state: str) -> set[str]:
        reply = await self.rpc.ask(
            Rpc.PLACEMENT_REPLICAS, ReplicasRequest(tenant=TENANT, state=state, limit=500), ReplicasReply
        )
        assert isinstance(reply, ReplicasReply), reply
        return {r.replica_id for r in reply.replicas}

    async def admit(self, request_id: str, model: str = "llama3.1-8b") -> AdmitReply | Rejected:
        body = AdmitRequest(
            request_id=request_id, tenant=TENANT, model=model, input_tokens=500, output_tokens=64, region="us-west-1"
        )
        return await self.rpc.ask(Rpc.PLACEMENT_ADMIT, body, AdmitReply)

    async def release(self, name: str) -> None:
        allocation_id, _node = self.ids(name)
        reply = await self.rpc.ask(
            Rpc.PLACEMENT_RELEASE, ReleaseRequest(allocation_id=allocation_id, tenant=TENANT), ReleaseReply
        )
        assert isinstance(reply, ReleaseReply) or (
            isinstance(reply, Rejected) and reply.error.code is ErrorCode.NOT_FOUND  # its lease lapsed
        ), reply


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(service_processes: ServiceProcesses, settings: Settings) -> AsyncIterator[Stack]:
    service_processes.start(
        "topology_discovery", name="lc_topology", HETSCHED_TOPOLOGY_INVENTORY=str(demo_fleet_path())
    )
    service_processes.start("capacity_ledger", name="lc_ledger", HETSCHED_LEDGER_SWEEP_MS="200")
    service_processes.start(
        "placement",
        name="lc_placement",
        HETSCHED_ENGINE_STALE_S=str(STALE_S),
        HETSCHED_PLACEMENT_DEFAULT_LEASE_S=str(LEASE_S),
    )
    subjects = Subjects(settings.kit.subject_prefix)
    health = await wait_healthy(
        nats_url=settings.kit.nats_url or "",
        subjects=subjects,
        deadline_s=60,
        only={"topology_discovery", "capacity_ledger", "placement"},
    )
    assert all(h["status"] == "ok" for h in health.values()), health
    rpc = await RpcClient.connect(settings.kit.nats_url or "", subjects, timeout_s=10)
    nc = await nats.connect(settings.kit.nats_url or "")
    s = Stack(rpc, nc, subjects)

    async def first() -> bool:
        try:
            await s.place("a")
        except AssertionError:
            return False
        return True

    await wait_for(first, 30, what="placement sees the demo fleet")
    yield s
    for name in list(s.placed):  # the session's database is shared with later modules
        await s.release(name)
    await rpc.close()
    await nc.close()
    for name in ("lc_placement", "lc_ledger", "lc_topology"):
        service_processes.stop(name)


async def test_the_listing_follows_the_ranks_and_admission_takes_only_ready_replicas(stack: Stack) -> None:
    replica, _node = stack.ids("a")
    placed = await stack.view("a")
    assert placed is not None and placed.state == "placed"

    for state in ("starting", "loading"):
        await stack.state("a", state)

        async def listed(state: str = state) -> bool:
            return replica in await stack.listed_as(state)

        await wait_for(listed, 10, what=f"the replica is listed as {state}")
        view = await stack.view("a")
        assert view is not None and view.state == state and view.endpoint is None
        await stack.status("a")  # its engine's status alone does not make it ready while it loads
        refused = await stack.admit(f"r-{state}")
        assert isinstance(refused, Rejected) and refused.error.code is ErrorCode.NO_CAPACITY, refused

    await stack.state("a", "ready", endpoint="http://10.0.0.7:8100", pid=4242)
    await stack.status("a")

    async def admitted() -> AdmitReply | None:
        reply = await stack.admit(f"r-ready-{random.random()}")
        return reply if isinstance(reply, AdmitReply) and reply.status == "admitted" else None

    reply = await wait_for(admitted, 10, what="the ready replica takes requests")
    assert (reply.replica_id, reply.endpoint) == (replica, "http://10.0.0.7:8100")
    view = await stack.view("a")
    assert view is not None and (view.state, view.endpoint) == ("ready", "http://10.0.0.7:8100")
    assert replica in await stack.listed_as("ready")

    await stack.state("a", "failed", reason="exited with code 1 (3 crashes in a row)")
    await stack.status("a")  # still healthy by its status: the agent's word wins

    async def failed() -> bool:
        return replica in await stack.listed_as("failed")

    await wait_for(failed, 10, what="the replica is listed as failed")
    assert replica not in await stack.listed_as("ready")
    never = await stack.admit("r-after-failure")
    assert isinstance(never, Rejected) and never.error.code is ErrorCode.NO_CAPACITY, never


async def test_a_report_from_another_node_is_ignored(stack: Stack) -> None:
    await stack.place("b")
    replica, node = stack.ids("b")
    other = "dgx-h100-02" if node != "dgx-h100-02" else "dgx-h100-03"
    await stack.state("b", "failed", node=other)  # an agent speaking for a replica not on its node
    await stack.state("b", "loading")

    async def loading() -> bool:
        return replica in await stack.listed_as("loading")

    await wait_for(loading, 10, what="the replica's own node is heard")
    assert replica not in await stack.listed_as("failed")


async def test_a_nodes_agent_learns_the_parts_it_runs(stack: Stack) -> None:
    reply = await stack.place("c")
    replica, node = stack.ids("c")
    answer = await stack.rpc.ask(Rpc.PLACEMENT_ASSIGNMENTS, AssignmentsRequest(node=node), AssignmentsReply, scope=node)
    assert isinstance(answer, AssignmentsReply) and answer.node == node, answer
    part = next(a for a in answer.assignments if a.replica_id == replica)
    assert (part.model, part.tenant, part.rank, part.ranks, part.head_node) == ("llama3.1-8b", TENANT, 0, 1, node)
    assert reply.binding is not None and part.binding == reply.binding[0]
    assert part.launch == reply.launch and part.launch is not None
    assert part.tp == reply.tp and part.sku == reply.sku and not part.draining and part.stop_by is None
    assert isinstance(part.lease_expires_at, datetime)

    forbidden = await stack.rpc.ask(
        Rpc.PLACEMENT_ASSIGNMENTS, AssignmentsRequest(node="someone-else"), AssignmentsReply, scope=node
    )
    assert isinstance(forbidden, Rejected) and forbidden.error.code is ErrorCode.FORBIDDEN, forbidden
    nobody = await stack.rpc.ask(
        Rpc.PLACEMENT_ASSIGNMENTS, AssignmentsRequest(node="no-such-node"), AssignmentsReply, scope="no-such-node"
    )
    assert isinstance(nobody, AssignmentsReply) and nobody.assignments == [], nobody


async def test_a_lease_is_renewed_while_the_ranks_report_and_lapses_when_they_fall_silent(stack: Stack) -> None:
    await stack.place("d")
    replica, _node = stack.ids("d")
    first = await stack.view("d")
    assert first is not None and first.lease_expires_at is not None
    loop = asyncio.get_running_loop()
    until = loop.time() + 2 * LEASE_S  # twice the lease: without renewals it would have lapsed
    while loop.time() < until:
        await stack.state("d", "ready", endpoint="http://10.0.0.9:8100")
        await asyncio.sleep(1.0)
    still = await stack.view("d")
    assert still is not None, "a reporting replica's lease lapsed"
    assert still.lease_expires_at is not None and still.lease_expires_at > first.lease_expires_at

    async def gone() -> bool:  # silent: nothing renews it, the ledger expires it, placement ends it
        return await stack.view("d") is None

    await wait_for(gone, LEASE_S + STALE_S + 10, what="the silent replica's lease lapses")
    del stack.placed["d"]
    assert replica not in await stack.listed_as("ready")
