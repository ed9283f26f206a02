"""topology-discovery on real NATS and Postgres: the demo inventory, an agent's life (report, a garbled
output, lost, recovered), answers from Postgres after a restart, and bad reports."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client

from services.stack import wait_healthy
from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context, Rpc, Subjects
from shared.infra.catalog import demo_fleet_path
from shared.infra.settings import Settings
from tests.conftest import ServiceProcesses
from tests.jetstream import read_all

pytestmark = pytest.mark.asyncio(loop_scope="session")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "topo"
HEARTBEAT_S = 0.3
FLEET = "topology_fleet"
AGENT = "topology_agent"


@pytest_asyncio.fixture(loop_scope="session")
async def nc(settings: Settings) -> AsyncIterator[Client]:
    client = await nats.connect(settings.nats_url or "")
    yield client
    await client.close()


async def ask(nc: Client, settings: Settings, rpc: Rpc, body: dict[str, Any]) -> dict[str, Any]:
    msg = await nc.request(Subjects(settings.subject_prefix).rpc(rpc), json.dumps(body).encode(), timeout=15)
    reply: dict[str, Any] = json.loads(msg.data)
    return reply


async def events(nc: Client, settings: Settings, event: str) -> list[dict[str, Any]]:
    subjects = Subjects(settings.subject_prefix)
    return await read_all(
        nc.jetstream(),
        stream=stream_name(Context.TOPOLOGY, stream_prefix=settings.stream_prefix),
        subject=subjects.event(Context.TOPOLOGY, event),
    )


async def eventually(check: Any, *, timeout_s: float = 20.0, interval_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        result = await check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise AssertionError(f"not true within {timeout_s}s")
        await asyncio.sleep(interval_s)


def start_fleet(procs: ServiceProcesses, inventory: Path | None) -> None:
    env = {"HETSCHED_TOPOLOGY_HEARTBEAT_S": str(HEARTBEAT_S), "HETSCHED_TOPOLOGY_MISSED_HEARTBEATS": "3"}
    if inventory is not None:
        env["HETSCHED_TOPOLOGY_INVENTORY"] = str(inventory)
    procs.start("topology_discovery", name=FLEET, **env)


async def wait_topology_healthy(settings: Settings) -> None:
    health = await wait_healthy(
        nats_url=settings.nats_url or "",
        subjects=Subjects(settings.subject_prefix),
        deadline_s=60,
        only={"topology_discovery"},
    )
    assert health["topology_discovery"]["status"] == "ok", health


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fleet_service(service_processes: ServiceProcesses, settings: Settings) -> AsyncIterator[ServiceProcesses]:
    start_fleet(service_processes, demo_fleet_path())
    await wait_topology_healthy(settings)
    yield service_processes
    for name in (AGENT, FLEET):
        if name in service_processes.procs:
            service_processes.stop(name)


async def test_demo_inventory_is_served_with_domains_and_pods(
    fleet_service: ServiceProcesses, nc: Client, settings: Settings
) -> None:
    reply = await eventually(lambda: _fleet_with(nc, settings, lambda f: len(f["nodes"]) == 13))
    nodes = {n["name"]: n for n in reply["nodes"]}
    assert nodes["hgx-h100-4x4-01"]["kind"] == "4+4"
    assert nodes["dgx-a100-01"]["kind"] == "fully_connected"  # from its topo_file
    assert {a["index"] for a in nodes["dgx-h100-01"]["accelerators"]} == set(range(8))
    kinds = {d["kind"] for d in reply["domains"]}
    assert {"fully_connected", "pair", "single", "multi_node"} <= kinds
    assert {p["name"]: p["chips"] for p in reply["tpu_pods"]} == {"v5e-pod-1": 256, "v5p-pod-1": 512}
    profiled = await eventually(lambda: _events_at_least(nc, settings, "node_profiled", 13))
    assert len({e["payload"]["node"] for e in profiled}) == 13
    assert all(e["_msg_id"] == e["event_id"] for e in profiled)  # Nats-Msg-Id = event id


async def _fleet_with(nc: Client, settings: Settings, predicate: Any) -> dict[str, Any] | None:
    reply = await ask(nc, settings, Rpc.FLEET_GET, {})
    return reply if reply.get("status") == "ok" and predicate(reply) else None


async def _events_at_least(
    nc: Client, settings: Settings, event: str, count: int, node: str | None = None
) -> list[dict[str, Any]] | None:
    found = [e for e in await events(nc, settings, event) if node is None or e["payload"]["node"] == node]
    return found if len(found) >= count else None


def _node(reply: dict[str, Any], name: str) -> dict[str, Any] | None:
    return next((n for n in reply["nodes"] if n["name"] == name), None)


async def test_agent_reports_keeps_profile_on_garbage_and_is_lost_then_recovered(
    fleet_service: ServiceProcesses, nc: Client, settings: Settings, tmp_path: Path
) -> None:
    topo = tmp_path / "topo.txt"
    shutil.copy(FIXTURES / "four_plus_four.txt", topo)
    agent_env = {
        "HETSCHED_TOPOLOGY_MODE": "agent",
        "HETSCHED_TOPOLOGY_PROVIDER": "nvidia-smi",
        "HETSCHED_TOPOLOGY_SMI_TOPO_FILE": str(topo),
        "HETSCHED_TOPOLOGY_SKU": "H100-SXM-80GB",
        "HETSCHED_TOPOLOGY_NODE": "agent-01",
        "HETSCHED_REGION": "us-west-1",
        "HETSCHED_TOPOLOGY_HEARTBEAT_S": str(HEARTBEAT_S),
        "HETSCHED_TOPOLOGY_SCAN_S": "0.3",
    }
    fleet_service.start("topology_discovery", name=AGENT, **agent_env)
    reply = await eventually(lambda: _fleet_with(nc, settings, lambda f: _node(f, "agent-01") is not None))
    node = _node(reply, "agent-01")
    assert node is not None and node["kind"] == "4+4" and node["source"] == "nvidia-smi"

    # A truncated output: the failure is published with its line, and the profile stays as it was.
    topo.write_text("\n".join((FIXTURES / "four_plus_four.txt").read_text().splitlines()[:4]) + "\n")
    failed = await eventually(lambda: _events_at_least(nc, settings, "node_profile_failed", 1, "agent-01"))
    error = failed[-1]["payload"]["error"]
    assert failed[-1]["payload"]["node"] == "agent-01" and error["line"] is not None
    assert "expected" in error["message"]
    reply = await ask(nc, settings, Rpc.FLEET_GET, {})
    node = _node(reply, "agent-01")
    assert node is not None and node["kind"] == "4+4" and len(node["accelerators"]) == 8

    # The agent dies: after three missed heartbeats the node is published as lost.
    shutil.copy(FIXTURES / "four_plus_four.txt", topo)
    await asyncio.sleep(HEARTBEAT_S * 2)
    fleet_service.stop(AGENT, kill=True)
    killed_at = time.monotonic()
    lost = await eventually(lambda: _events_at_least(nc, settings, "node_lost", 1, "agent-01"))
    print(f"\nnode_lost seen {time.monotonic() - killed_at:.2f}s after kill -9 (3 x {HEARTBEAT_S}s heartbeat)")
    assert lost[-1]["payload"]["node"] == "agent-01"
    assert lost[-1]["payload"]["accelerators"][0] == "agent-01/gpu0"
    reply = await ask(nc, settings, Rpc.FLEET_GET, {})
    assert (_node(reply, "agent-01") or {}).get("state") == "lost"

    fleet_service.start("topology_discovery", name=AGENT, **agent_env)
    recovered = await eventually(lambda: _events_at_least(nc, settings, "node_recovered", 1, "agent-01"))
    assert recovered[-1]["payload"]["node"] == "agent-01"
    reply = await ask(nc, settings, Rpc.FLEET_GET, {})
    assert (_node(reply, "agent-01") or {}).get("state") == "up"
    fleet_service.stop(AGENT)


async def test_bad_reports_get_typed_errors_and_change_nothing(
    fleet_service: ServiceProcesses, nc: Client, settings: Settings
) -> None:
    before = await ask(nc, settings, Rpc.FLEET_GET, {})
    cases = [
        {"node": "x"},  # neither profile nor error
        {"node": "x", "profile": {"name": "x"}},  # a profile that describes nothing
        {
            "node": "x",
            "profile": {
                "name": "y",
                "region": "r",
                "cluster": "c",
                "rack": "k",
                "sku": "s",
                "links": [["X"]],
                "accelerators": [{"index": 0, "sku": "s", "hbm_bytes": 1}],
                "source": "nvml",
            },
        },  # for another node
        {
            "node": "dgx-h100-01",
            "profile": {
                "name": "dgx-h100-01",
                "region": "r",
                "cluster": "c",
                "rack": "k",
                "sku": "s",
                "links": [["X"]],
                "source": "nvml",
                "accelerators": [{"index": 0, "sku": "s", "hbm_bytes": 1}],
            },
        },
    ]
    codes = [(await ask(nc, settings, Rpc.TOPOLOGY_REPORT, body))["error"]["code"] for body in cases]
    assert codes == ["invalid_request", "invalid_request", "invalid_request", "conflict"]
    after = await ask(nc, settings, Rpc.FLEET_GET, {})
    assert after == before
    assert (await ask(nc, settings, Rpc.FLEET_DESCRIBE, {"node": "nope"}))["error"]["code"] == "not_found"


async def test_restarted_service_answers_from_postgres_without_rescanning(
    fleet_service: ServiceProcesses, nc: Client, settings: Settings
) -> None:
    # The agent of the previous test is gone: let its node settle as lost before taking the picture.
    before = await eventually(
        lambda: _fleet_with(nc, settings, lambda f: (_node(f, "agent-01") or {"state": "lost"})["state"] == "lost")
    )
    profiled_before = len(await events(nc, settings, "node_profiled"))
    fleet_service.stop(FLEET)
    start_fleet(fleet_service, None)  # no inventory at all: the answer can only come from Postgres
    await wait_topology_healthy(settings)
    after = await ask(nc, settings, Rpc.FLEET_GET, {})
    assert after == before
    fleet_service.stop(FLEET)
    start_fleet(fleet_service, demo_fleet_path())  # the same file again: recognised, not re-loaded
    await wait_topology_healthy(settings)
    assert await ask(nc, settings, Rpc.FLEET_GET, {}) == before
    await asyncio.sleep(0.5)
    assert len(await events(nc, settings, "node_profiled")) == profiled_before
    assert "inventory unchanged since last load" in fleet_service.log(FLEET)


async def test_large_answers_come_in_pages_that_add_up(
    fleet_service: ServiceProcesses, nc: Client, settings: Settings
) -> None:
    from shared.infra.fleet_client import fetch_fleet

    whole = await ask(nc, settings, Rpc.FLEET_GET, {})
    assert whole["next_cursor"] is None and whole["total_nodes"] == len(whole["nodes"])
    first = await ask(nc, settings, Rpc.FLEET_GET, {"limit": 5})
    assert len(first["nodes"]) == 5 and first["next_cursor"] == first["nodes"][-1]["name"]
    assert first["tpu_pods"] and first["total_nodes"] == whole["total_nodes"]
    second = await ask(nc, settings, Rpc.FLEET_GET, {"limit": 5, "cursor": first["next_cursor"]})
    assert second["nodes"][0]["name"] > first["nodes"][-1]["name"] and second["tpu_pods"] == []
    merged = await fetch_fleet(nc, Subjects(settings.subject_prefix), limit=5)
    assert [n["name"] for n in merged["nodes"]] == [n["name"] for n in whole["nodes"]]
    assert sorted(d["id"] for d in merged["domains"]) == sorted(d["id"] for d in whole["domains"])
    west = await fetch_fleet(nc, Subjects(settings.subject_prefix), region="us-west-1")
    assert west["nodes"] and {n["region"] for n in west["nodes"]} == {"us-west-1"}
    assert {p["region"] for p in west["tpu_pods"]} == {"us-west-1"}
