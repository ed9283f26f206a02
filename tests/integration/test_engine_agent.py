"""A node agent running engines, with the services as processes (demo fleet topology, ledger, placement) on
real NATS and Postgres: the agent of the node a replica was placed on starts its simulated engine, placement
lists it ready with its endpoint and keeps renewing its lease while the agent reports; SIGKILL the agent and
its engine dies with it, nothing renews the lease, it lapses, and the ledger and placement release the
replica. A spot borrower's engine is stopped by its preemption's deadline when the owner reclaims."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import nats
import psutil
import pytest
import pytest_asyncio
from nats.aio.client import Client

from shared.contracts.subjects import Rpc, Subjects
from shared.infra.settings import Settings
from tests.conftest import ServiceProcesses
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

PLACEMENT = "ea_placement"
FILLER = "ea_filler"
LEASE_S = 8  # short: a silent agent's replica lapses within a few seconds
PROBE = {"request_id": "ea-probe", "tenant": "t", "model": "llama3-8b", "context_tokens": 4096, "backend": "gpu"}


async def call(nc: Client, settings: Settings, rpc: Rpc, body: dict[str, Any], timeout: float = 15) -> dict[str, Any]:
    msg = await nc.request(Subjects(settings.kit.subject_prefix).rpc(rpc), json.dumps(body).encode(), timeout=timeout)
    reply: dict[str, Any] = json.loads(msg.data)
    return reply


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def nc(service_processes: ServiceProcesses, settings: Settings) -> AsyncIterator[Client]:
    await service_processes.start_demo_ledger(prefix="ea_", sweep_ms=200)
    service_processes.start(
        "placement",
        name=PLACEMENT,
        HETSCHED_PLACEMENT_FIRST_LEASE_S=str(LEASE_S),
        HETSCHED_PLACEMENT_DEFAULT_LEASE_S=str(LEASE_S),
        HETSCHED_ENGINE_STALE_S="3",
    )
    client = await nats.connect(settings.kit.nats_url or "")

    async def sees_the_fleet() -> bool:
        try:
            return (await call(client, settings, Rpc.PLACEMENT_EXPLAIN, PROBE, timeout=2)).get("status") == "placed"
        except (TimeoutError, nats.errors.NoRespondersError):
            return False

    await wait_for(sees_the_fleet, 60, interval_s=0.2, what="placement sees the demo fleet")
    service_processes.start("reservation_filler", name=FILLER, HETSCHED_RESERVATION_TICK_S="0.2")
    yield client
    await client.close()
    for name in (FILLER, PLACEMENT, "ea_ledger", "ea_topology"):
        if name in service_processes.procs:
            service_processes.stop(name)


def start_agent(processes: ServiceProcesses, node: str) -> subprocess.Popen[bytes]:
    """``node``'s agent running simulated engines (the inventory defines the node: it only runs engines)."""
    return processes.start(
        "topology_discovery",
        name="ea_agent",
        HETSCHED_TOPOLOGY_MODE="agent",
        HETSCHED_TOPOLOGY_NODE=node,
        HETSCHED_TOPOLOGY_PROVIDER="none",
        HETSCHED_AGENT_ENGINE="sim",
        HETSCHED_AGENT_SIM_SPEEDUP="20",
        HETSCHED_AGENT_BIND_HOST="127.0.0.1",
        HETSCHED_AGENT_ADVERTISE_HOST="127.0.0.1",
        HETSCHED_AGENT_PORT_MIN="18600",
        HETSCHED_AGENT_PORT_MAX="18699",
        HETSCHED_AGENT_RECONCILE_S="0.5",
        HETSCHED_AGENT_STATUS_S="1",
    )


async def replica_row(nc: Client, settings: Settings, tenant: str, replica_id: str) -> dict[str, Any] | None:
    reply = await call(nc, settings, Rpc.PLACEMENT_REPLICAS, {"tenant": tenant, "limit": 500})
    return next((r for r in reply.get("replicas", []) if r["replica_id"] == replica_id), None)


def engine_of(agent: subprocess.Popen[bytes]) -> psutil.Process | None:
    children = [p for p in psutil.Process(agent.pid).children(recursive=True) if p.is_running()]
    return next((p for p in children if "hetsched.engines.sim_server" in " ".join(p.cmdline())), None)


async def test_an_agent_runs_its_nodes_engine_and_its_death_lets_the_lease_lapse(
    nc: Client, settings: Settings, service_processes: ServiceProcesses
) -> None:
    body = {
        "request_id": "ea-1",
        "tenant": "acme",
        "model": "llama3-8b",
        "dtype": "bf16",
        "context_tokens": 4096,
        "concurrency": 4,
        "backend": "gpu",
        "lease_s": LEASE_S,
    }
    placed = await call(nc, settings, Rpc.PLACEMENT_PLACE, body)
    assert placed["status"] == "placed", placed
    replica_id, node = placed["allocation_id"], placed["binding"][0]["node"]
    agent = start_agent(service_processes, node)
    try:

        async def row() -> dict[str, Any] | None:
            return await replica_row(nc, settings, "acme", replica_id)

        async def ready() -> dict[str, Any] | None:
            found = await row()
            return found if found is not None and found["state"] == "ready" else None

        shown = await wait_for(ready, 60, interval_s=0.3, what="the replica ready")
        assert shown["endpoint"] and shown["endpoint"].startswith("http://127.0.0.1:186")
        engine = engine_of(agent)
        assert engine is not None and engine.environ()["HETSCHED_REPLICA_ID"] == replica_id
        first_end = datetime.fromisoformat(shown["lease_expires_at"])

        # Reporting keeps the lease renewed: after two leases' time it still holds, its end moved on.
        async def renewed() -> bool:
            found = await row()
            return found is not None and datetime.fromisoformat(found["lease_expires_at"]) > first_end

        await wait_for(renewed, 3 * LEASE_S, interval_s=0.5, what="the lease renewed while the agent reports")
        snapshot = await call(nc, settings, Rpc.LEDGER_SNAPSHOT, {})
        assert replica_id in {a for acc in snapshot["accelerators"] for a in acc["allocations"]}

        # The agent dies: its engine dies with it, nothing renews, the lease lapses, the replica is released.
        engine_pid = engine.pid
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(timeout=10)
        service_processes.procs.pop("ea_agent")
        await wait_for(
            lambda: not psutil.pid_exists(engine_pid) or psutil.Process(engine_pid).status() == "zombie",
            10,
            what="the engine gone with its agent",
        )

        async def released() -> bool:
            snap = await call(nc, settings, Rpc.LEDGER_SNAPSHOT, {})
            held = {a for acc in snap["accelerators"] for a in acc["allocations"]}
            return replica_id not in held and await row() is None

        await wait_for(released, 4 * LEASE_S, interval_s=0.5, what="the lapsed replica released")
    finally:
        if "ea_agent" in service_processes.procs:
            service_processes.stop("ea_agent", kill=True)
        await call(nc, settings, Rpc.PLACEMENT_RELEASE, {"allocation_id": replica_id, "tenant": "acme"})


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


async def test_a_spot_preemption_stops_the_borrowers_engine_by_its_deadline(
    nc: Client, settings: Settings, service_processes: ServiceProcesses
) -> None:
    h200, east, notice_s = "H200-SXM-141GB", "us-east-1", 5

    def spot(rid: str, tenant: str, **extra: Any) -> dict[str, Any]:
        return {
            "request_id": rid,
            "tenant": tenant,
            "model": "llama3.1-8b",
            "context_tokens": 8192,
            "tp": 1,
            "region": east,
            "skus": [h200],
            "backend": "gpu",
            "fallbacks": [],
            **extra,
        }

    # One free H200 reserved by hooli (spot); every other H200 is avoided by both requests below, so the
    # borrower can only borrow that one and the owner can only get it back by a reclaim.
    snapshot = await call(nc, settings, Rpc.LEDGER_SNAPSHOT, {})
    h200s = [a["id"] for a in snapshot["accelerators"] if a["id"].startswith("hgx-h200-")]
    free = [a["id"] for a in snapshot["accelerators"] if a["id"] in h200s and a["available"] and not a["allocations"]]
    created: dict[str, Any] = {}
    for accelerator in free:  # the first one no earlier module of the run keeps in a reservation
        created = await call(
            nc,
            settings,
            Rpc.RESERVATION_CREATE,
            {"tenant": "hooli", "policy": "spot", "accelerators": [accelerator], "spot_eviction_s": notice_s},
        )
        if created.get("status") == "created":
            break
    assert created.get("status") == "created", (free, created)
    (lent,) = created["accelerators"]
    avoid = [a for a in h200s if a != lent]
    borrowers: list[str] = []
    agent: subprocess.Popen[bytes] | None = None
    try:

        async def borrowed() -> dict[str, Any] | None:
            ask = spot("ea-b-1", "globex", preemptible=True, avoid_accelerators=avoid)
            reply = await call(nc, settings, Rpc.PLACEMENT_PLACE, ask)
            return reply if reply.get("status") == "placed" else None

        reply = await wait_for(borrowed, 15, what="placement learns the spot offer")
        assert [a for p in reply["placements"] for a in p["accelerators"]] == [lent], reply
        borrowers.append(reply["allocation_id"])
        # Its caller keeps it (as `hetsched place` does): no first lease lapses under the test.
        renew = {"allocation_id": borrowers[-1], "tenant": "globex", "lease_s": 600}
        assert (await call(nc, settings, Rpc.PLACEMENT_RENEW, renew))["status"] == "renewed"
        last = borrowers[-1]
        agent = start_agent(service_processes, reply["binding"][0]["node"])

        async def running() -> psutil.Process | None:
            found = await replica_row(nc, settings, "globex", last)
            engine = engine_of(agent) if agent is not None else None
            return engine if found is not None and found["state"] == "ready" and engine is not None else None

        engine = await wait_for(running, 60, interval_s=0.3, what="the borrower's engine ready")
        # The owner asks: the borrower is preempted with a notice of `notice_s`; its engine must be gone by then.
        refused = await call(nc, settings, Rpc.PLACEMENT_PLACE, spot("ea-owner", "hooli", avoid_accelerators=avoid))
        asked = asyncio.get_running_loop().time()
        assert refused["status"] == "rejected" and refused["error"]["code"] == "no_capacity", refused
        await wait_for(lambda: gone(engine.pid), notice_s + 5, interval_s=0.1, what="the borrower's engine stopped")
        took = asyncio.get_running_loop().time() - asked
        print(f"\nthe spot borrower's engine stopped {took:.2f} s after the reclaim (notice {notice_s} s)")
        # By its deadline: the reclaim set it before placement answered; the agent learns it at its next pass
        # (0.5 s) and SIGKILL, at the latest, lands on it (slack for one late pass on a loaded machine).
        assert took <= notice_s + 1.5, took
    finally:
        if agent is not None and "ea_agent" in service_processes.procs:
            service_processes.stop("ea_agent", kill=True)
        for allocation_id in borrowers:
            await call(nc, settings, Rpc.PLACEMENT_RELEASE, {"allocation_id": allocation_id, "tenant": "globex"})
        cancelled = await call(
            nc, settings, Rpc.RESERVATION_CANCEL, {"reservation_id": created["reservation_id"], "tenant": "hooli"}
        )
        assert cancelled["status"] == "cancelled", cancelled
