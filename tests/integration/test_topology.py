"""topology-discovery on real NATS and Postgres: the demo inventory, an agent's life (report, a garbled
output, lost, recovered), answers from Postgres after a restart, and bad reports."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from prometheus_client.parser import text_string_to_metric_families

from hetsched.stack import probe_health, wait_healthy
from shared.contracts.envelope import EventEnvelope, new_event
from shared.contracts.fleet import FleetGetReply
from shared.contracts.ledger import AllocationEvent, LedgerEventName, ShareOut
from shared.contracts.permissions import EVENT_PUBLISHERS
from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context, Rpc, Subjects
from shared.contracts.topology import AcceleratorProfile, NodeProfilePayload, TopologyReportReply, TopologyReportRequest
from shared.domain.fleet import AcceleratorId
from shared.infra.catalog import demo_fleet_path, load_inventory
from shared.infra.rpc import RpcClient
from shared.infra.settings import Settings
from tests.conftest import ServiceProcesses
from tests.jetstream import read_all
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "topo"
HEARTBEAT_S = 0.3
GB = 10**9
FLEET = "topology_fleet"
AGENT = "topology_agent"


@pytest_asyncio.fixture(loop_scope="session")
async def nc(settings: Settings) -> AsyncIterator[Client]:
    client = await nats.connect(settings.kit.nats_url or "")
    yield client
    await client.close()


async def ask(nc: Client, settings: Settings, rpc: Rpc, body: dict[str, Any]) -> dict[str, Any]:
    msg = await nc.request(Subjects(settings.kit.subject_prefix).rpc(rpc), json.dumps(body).encode(), timeout=15)
    reply: dict[str, Any] = json.loads(msg.data)
    return reply


async def events(nc: Client, settings: Settings, event: str) -> list[dict[str, Any]]:
    subjects = Subjects(settings.kit.subject_prefix)
    return await read_all(
        nc.jetstream(),
        stream=stream_name(Context.TOPOLOGY, stream_prefix=settings.kit.stream_prefix),
        subject=subjects.event(Context.TOPOLOGY, event),
    )


def _sample(url: str, name: str, **labels: str) -> float | None:
    """One sample of the service's ``/metrics`` (the first whose labels include ``labels``), or None."""
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and set(labels.items()) <= set(sample.labels.items()):
                return float(sample.value)
    return None


async def eventually(check: Any, *, timeout_s: float = 20.0) -> Any:
    return await wait_for(check, timeout_s, interval_s=0.1)


def start_fleet(procs: ServiceProcesses, inventory: Path | None) -> None:
    env = {"HETSCHED_TOPOLOGY_HEARTBEAT_S": str(HEARTBEAT_S), "HETSCHED_TOPOLOGY_MISSED_HEARTBEATS": "3"}
    if inventory is not None:
        env["HETSCHED_TOPOLOGY_INVENTORY"] = str(inventory)
    procs.start("topology_discovery", name=FLEET, **env)


async def wait_topology_healthy(settings: Settings) -> None:
    health = await wait_healthy(
        nats_url=settings.kit.nats_url or "",
        subjects=Subjects(settings.kit.subject_prefix),
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
    # The run's database is shared: other tests may have added agent nodes, so the demo's 13 are a subset.
    demo = {n.name for n in load_inventory(demo_fleet_path())[0].nodes}
    assert len(demo) == 13
    reply = await eventually(lambda: _fleet_with(nc, settings, lambda f: demo <= {n["name"] for n in f["nodes"]}))
    nodes = {n["name"]: n for n in reply["nodes"]}
    assert nodes["hgx-h100-4x4-01"]["kind"] == "4+4"
    assert nodes["dgx-a100-01"]["kind"] == "fully_connected"  # from its topo_file
    assert {a["index"] for a in nodes["dgx-h100-01"]["accelerators"]} == set(range(8))
    kinds = {d["kind"] for d in reply["domains"]}
    assert {"fully_connected", "pair", "single", "multi_node"} <= kinds
    assert {p["name"]: p["chips"] for p in reply["tpu_pods"]} == {"v5e-pod-1": 256, "v5p-pod-1": 512}
    profiled = await eventually(lambda: _events_at_least(nc, settings, "node_profiled", 13))
    assert demo <= {e["payload"]["node"] for e in profiled}
    ours = [e for e in profiled if e["source"] == "topology-discovery"]  # other tests publish their own
    assert ours and all(e["_msg_id"] == e["event_id"] for e in ours)  # Nats-Msg-Id = event id


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
    # The fleet's metrics endpoint (asked before the agent starts: it answers the same health subject).
    health = await probe_health(RpcClient(nc, Subjects(settings.kit.subject_prefix)), "topology_discovery")
    metrics_url = str(health["metrics_url"])
    fleet_service.start("topology_discovery", name=AGENT, **agent_env)
    reply = await eventually(lambda: _fleet_with(nc, settings, lambda f: _node(f, "agent-01") is not None))
    node = _node(reply, "agent-01")
    assert node is not None and node["kind"] == "4+4" and node["source"] == "nvidia-smi"
    confirmed = "hetsched_node_last_profile_timestamp_seconds"
    await eventually(lambda: _sample(metrics_url, confirmed, node="agent-01") is not None)

    # A truncated output: the failure is published with its line, and the profile stays as it was.
    topo.write_text("\n".join((FIXTURES / "four_plus_four.txt").read_text().splitlines()[:4]) + "\n")
    failed = await eventually(lambda: _events_at_least(nc, settings, "node_profile_failed", 1, "agent-01"))
    error = failed[-1]["payload"]["error"]
    assert failed[-1]["payload"]["node"] == "agent-01" and error["line"] is not None
    assert "expected" in error["message"]
    reply = await ask(nc, settings, Rpc.FLEET_GET, {})
    node = _node(reply, "agent-01")
    assert node is not None and node["kind"] == "4+4" and len(node["accelerators"]) == 8
    # Counted, and its heartbeats (every 0.3 s) no longer confirm its profile.
    await eventually(lambda: (_sample(metrics_url, "hetsched_node_profile_failures_total", node="agent-01") or 0) >= 1)
    stamped = _sample(metrics_url, confirmed, node="agent-01")
    await asyncio.sleep(4 * HEARTBEAT_S)
    assert _sample(metrics_url, confirmed, node="agent-01") == stamped

    # Its profile parses again (unchanged): the agent reports it, and the profile is confirmed again.
    shutil.copy(FIXTURES / "four_plus_four.txt", topo)
    await eventually(lambda: (_sample(metrics_url, confirmed, node="agent-01") or 0) > (stamped or 0))

    # The agent dies: after three missed heartbeats the node is published as lost.
    shutil.copy(FIXTURES / "four_plus_four.txt", topo)
    await eventually(lambda: _fleet_with(nc, settings, lambda f: (_node(f, "agent-01") or {}).get("state") == "up"))
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
    # The decision is taken (and logged) before the service answers; no load means no events to relay.
    assert "inventory unchanged since last load" in fleet_service.log(FLEET)
    assert len(await events(nc, settings, "node_profiled")) == profiled_before


async def test_large_answers_come_in_pages_that_add_up(
    fleet_service: ServiceProcesses, nc: Client, settings: Settings
) -> None:
    whole = await ask(nc, settings, Rpc.FLEET_GET, {})
    assert whole["next_cursor"] is None and whole["total_nodes"] == len(whole["nodes"])
    first = await ask(nc, settings, Rpc.FLEET_GET, {"limit": 5})
    assert len(first["nodes"]) == 5 and first["next_cursor"] == first["nodes"][-1]["name"]
    assert first["tpu_pods"] and first["total_nodes"] == whole["total_nodes"]
    second = await ask(nc, settings, Rpc.FLEET_GET, {"limit": 5, "cursor": first["next_cursor"]})
    assert second["nodes"][0]["name"] > first["nodes"][-1]["name"] and second["tpu_pods"] == []
    rpc = RpcClient(nc, Subjects(settings.kit.subject_prefix))
    merged = await rpc.fleet(limit=5)
    assert isinstance(merged, FleetGetReply)
    assert [n.name for n in merged.nodes] == [n["name"] for n in whole["nodes"]]
    assert sorted(d.id for d in merged.domains) == sorted(d["id"] for d in whole["domains"])
    west = await rpc.fleet(region="us-west-1")
    assert isinstance(west, FleetGetReply)
    assert west.nodes and {n.region for n in west.nodes} == {"us-west-1"}
    assert {p.region for p in west.tpu_pods} == {"us-west-1"}
    # What a service building its own view of the fleet reads at start: every node with its whole profile.
    full = await rpc.fleet(limit=5, profiles=True)
    assert isinstance(full, FleetGetReply) and len(full.nodes) == whole["total_nodes"]
    assert all(n.profile is not None and n.profile.name == n.name for n in full.nodes)
    assert all(n.profile is None for n in merged.nodes)


async def test_reserved_bytes_follow_ledger_events_once_each(
    fleet_service: ServiceProcesses, nc: Client, settings: Settings
) -> None:
    """fleet.get's hbm_reserved comes from topology's own read model of LEDGER events, never the ledger's
    tables: each allocation's shares count once, whether its release comes before or after its commit."""
    links = [["X", "NV18", "NV18"], ["NV18", "X", "NV18"], ["NV18", "NV18", "X"]]
    profile = NodeProfilePayload(
        name="reserved-01",
        region="us-west-1",
        cluster="c1",
        rack="r1",
        sku="H100-SXM-80GB",
        source="nvml",
        links=links,
        accelerators=[AcceleratorProfile(index=i, sku="H100-SXM-80GB", hbm_bytes=80 * GB) for i in range(3)],
    )
    rpc = RpcClient(nc, Subjects(settings.kit.subject_prefix))
    reply = await rpc.ask(
        Rpc.TOPOLOGY_REPORT, TopologyReportRequest(node="reserved-01", profile=profile), TopologyReportReply
    )
    assert isinstance(reply, TopologyReportReply) and reply.status in ("accepted", "unchanged")
    gpu = [AcceleratorId.gpu("reserved-01", i) for i in range(3)]
    js = nc.jetstream()

    async def publish(
        name: LedgerEventName, payload: AllocationEvent, *, again: EventEnvelope | None = None
    ) -> EventEnvelope:
        env = again or new_event(
            type=f"ledger.{name.value}",
            source=EVENT_PUBLISHERS[Context.LEDGER],
            occurred_at=datetime.now(UTC),
            payload=payload.model_dump(mode="json"),
        )
        # A fresh Nats-Msg-Id each time: a redelivered event must be dropped by topology's inbox, not by JetStream.
        await js.publish(
            Subjects(settings.kit.subject_prefix).event(Context.LEDGER, name),
            env.model_dump_json().encode(),
            headers={"Nats-Msg-Id": str(uuid.uuid4())},
        )
        return env

    def allocation(shares: dict[str, int], *, counts: bool = True) -> AllocationEvent:
        return AllocationEvent(
            allocation_id=f"al-{uuid.uuid4().hex[:8]}",
            request_id="r-1",
            tenant="acme",
            kind="replica" if counts else "request",
            counts_against_hbm=counts,
            shares=[
                ShareOut(
                    accelerator_id=a, weights_bytes=b, kv_bytes=0, activation_bytes=0, workspace_bytes=0, total_bytes=b
                )
                for a, b in shares.items()
            ],
        )

    def reserved(fleet: dict[str, Any]) -> dict[str, int]:
        node = _node(fleet, "reserved-01") or {"accelerators": []}
        assert all({"hbm_reserved", "hbm_total"}.isdisjoint(a) for a in node["accelerators"])  # each figure once
        assert all(a["hbm_total_bytes"] == 80 * GB for a in node["accelerators"])
        return {a["id"]: a["hbm_reserved_bytes"] for a in node["accelerators"]}

    async def shows(expected: dict[str, int]) -> dict[str, Any]:
        found: dict[str, Any] = await eventually(lambda: _fleet_with(nc, settings, lambda f: reserved(f) == expected))
        return found

    kept = allocation({gpu[0]: 10 * GB})
    held = allocation({gpu[0]: 5 * GB, gpu[1]: 7 * GB})
    early = allocation({gpu[1]: 2 * GB})
    await publish(LedgerEventName.ALLOCATION_COMMITTED, kept)
    committed = await publish(LedgerEventName.ALLOCATION_COMMITTED, held)
    await publish(LedgerEventName.ALLOCATION_COMMITTED, allocation({gpu[1]: 3 * GB}, counts=False))  # a KV-pool request
    await publish(LedgerEventName.ALLOCATION_COMMITTED, held, again=committed)  # the same event again
    await publish(LedgerEventName.ALLOCATION_EXPIRED, early)  # its release seen before its commit
    await publish(LedgerEventName.ALLOCATION_COMMITTED, early)
    await publish(LedgerEventName.ALLOCATION_RELEASED, held)
    await shows({gpu[0]: 10 * GB, gpu[1]: 0, gpu[2]: 0})

    # A consumer handles a fetched batch concurrently: two markers, each published after the previous
    # one showed, prove every earlier event has been handled (a late duplicate would have moved gpu0).
    for step in (1, 2):
        await publish(LedgerEventName.ALLOCATION_COMMITTED, allocation({gpu[2]: 1}))
        fleet = await shows({gpu[0]: 10 * GB, gpu[1]: 0, gpu[2]: step})
    assert reserved(fleet)[gpu[0]] == 10 * GB
