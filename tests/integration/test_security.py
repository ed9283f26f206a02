"""Issue 11 on the real bus: every forgery the hostile probe tried, now refused.

An authenticated NATS server runs here from the same ``auth.conf`` `hetsched up` writes (identities
and permissions from ``shared.contracts.permissions``); topology (demo fleet), ledger and placement
run as processes with their own NKeys and a database of their own. Each attempt is made as the
identities an attacker could hold (a gateway of another tenant, a node's agent, another service) and
must be refused (a permission violation, ``forbidden``, or ignored and dead-lettered) with nothing
changed in the ledger or in topology.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import nats
import pytest
import pytest_asyncio

from hetsched.engine_sim import EngineLoad, publish_engine_status
from shared.contracts.envelope import new_event
from shared.contracts.permissions import (
    EVENT_PUBLISHERS,
    agent_identity,
    gateway_identity,
    inbox_prefix,
    service_identity,
)
from shared.contracts.streams import deadletter_stream_name
from shared.contracts.subjects import Context, Rpc
from shared.contracts.topology import EngineStatusEvent, GpuSample, GpuTelemetryEvent, NodeStateEvent
from shared.infra import deadletter
from shared.infra.catalog import demo_fleet_path
from shared.infra.identity import (
    new_seed,
    write_secret,
)
from shared.infra.settings import Settings
from tests.conftest import REPO
from tests.integration.secure_stack import Caller, SecureBus, secure_stack
from tests.integration.test_placement import agent_profile
from tests.jetstream import read_all
from tests.servers import RealServers
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

AGENT_NODE = "sec-agent-01"
RUNNING_AGENT = "sec-agent-02"  # a real agent process with its own credential
GHOST_NODE = "ghost-01"
VICTIM_NODE = "dgx-h100-01"  # a demo-fleet node an attacker would like to lose or inflate
PREFIX_AGENT = "dgx-h100-0"  # a node whose name is a prefix of the demo fleet's dgx-h100-01 and -02 (issue 23)
TOPO_FIXTURES = REPO / "tests" / "fixtures" / "topo"
SERVICES_RUN = ("topology_discovery", "capacity_ledger", "placement")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def bus(
    servers: RealServers, settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[SecureBus]:
    async with secure_stack(
        servers,
        settings,
        tmp_path_factory.mktemp("secure"),
        tag="s",
        services=SERVICES_RUN,
        gateways={"acme-gw": ["acme"], "globex-gw": ["globex"]},
        agents=(AGENT_NODE, RUNNING_AGENT, PREFIX_AGENT),
        env={"HETSCHED_TOPOLOGY_INVENTORY": str(demo_fleet_path()), "HETSCHED_TOPOLOGY_HEARTBEAT_S": "0.5"},
    ) as state:
        # Healthy is not yet settled: the ledger may still be applying the fleet's TOPOLOGY events, and the
        # tests compare snapshots taken before and after an attack.
        await wait_for(lambda: ledger_holds_the_fleet(state), 60, what="the ledger holds every node and pod")
        yield state


async def snapshot(bus: SecureBus) -> list[dict[str, Any]]:
    """The ledger's accelerators as it answers ``ledger.snapshot`` (asked as the operator)."""
    operator = await bus.connect("operator")
    reply = await operator.request(bus.subjects.rpc(Rpc.LEDGER_SNAPSHOT), {"limit": 10_000})
    # The agent test's own node comes and goes (it sends no heartbeats): that is not what is compared.
    accelerators: list[dict[str, Any]] = [a for a in reply["accelerators"] if a["node"] != AGENT_NODE]
    return sorted(accelerators, key=lambda a: a["id"])


async def ledger_holds_the_fleet(bus: SecureBus) -> bool:
    """Every node and TPU pod topology lists has its accelerators in the ledger (a pod's every chip)."""
    operator = await bus.connect("operator")
    fleet = await operator.request(bus.subjects.rpc(Rpc.FLEET_GET), {"limit": 10_000})
    ledger = await snapshot(bus)
    held = {a["node"] for a in ledger}
    chips = {pod["name"]: sum(1 for a in ledger if a["node"] == pod["name"]) for pod in fleet["tpu_pods"]}
    return {node["name"] for node in fleet["nodes"]} <= held and all(
        chips[pod["name"]] == pod["chips"] for pod in fleet["tpu_pods"]
    )


async def fleet_nodes(bus: SecureBus, who: str = "operator") -> set[str]:
    caller = await bus.connect(who)
    reply = await caller.request(bus.subjects.rpc(Rpc.FLEET_GET), {"limit": 10_000})
    return {node["name"] for node in reply["nodes"]}


async def last_sequence(bus: SecureBus, context: Context) -> int:
    operator = await bus.connect("operator")
    info = await operator.nc.jetstream().stream_info(bus.stream(context))
    return int(info.state.last_seq)


def event(context: Context, name: str, payload: dict[str, Any], *, source: str | None = None) -> bytes:
    envelope = new_event(
        type=f"{context.value}.{name}",
        source=source or EVENT_PUBLISHERS[context],
        payload=payload,
        occurred_at=datetime.now(UTC),
    )
    return envelope.model_dump_json().encode()


ATTACKERS = (gateway_identity("globex-gw"), agent_identity(AGENT_NODE), service_identity("placement"))


async def test_an_anonymous_connection_is_refused(bus: SecureBus) -> None:
    with pytest.raises(Exception, match="Authorization Violation"):
        await nats.connect(bus.url, max_reconnect_attempts=0, allow_reconnect=False, connect_timeout=5)
    forged = new_seed()  # an NKey the server never heard of
    path = bus.directory / "unknown.nk"
    write_secret(path, forged)
    with pytest.raises(Exception, match="Authorization Violation"):
        await nats.connect(bus.url, nkeys_seed=str(path), max_reconnect_attempts=0, allow_reconnect=False)


async def test_forged_topology_events_are_refused_and_change_nothing(bus: SecureBus) -> None:
    """Rows 1-2: a forged ``node_changed`` (a 1 PB L40S) and a forged ``node_lost`` for a healthy node."""
    before, topology_seq = await snapshot(bus), await last_sequence(bus, Context.TOPOLOGY)
    lost = NodeStateEvent(node=VICTIM_NODE, region="us-west-1", accelerators=[f"{VICTIM_NODE}/gpu0"])
    inflated = {"node": "l40s-01", "profile": {"name": "l40s-01", "accelerators": [{"hbm_bytes": 10**15}]}}
    for who in ATTACKERS:
        caller = await bus.connect(who)
        for name, payload in (("node_lost", lost.model_dump(mode="json")), ("node_changed", inflated)):
            subject = bus.subjects.event(Context.TOPOLOGY, name)
            await caller.publish(subject, event(Context.TOPOLOGY, name, payload))
            await caller.refused(subject)
    assert await last_sequence(bus, Context.TOPOLOGY) == topology_seq, "nothing reached the TOPOLOGY stream"
    assert await snapshot(bus) == before


async def test_an_event_whose_source_is_not_its_publisher_is_dead_lettered(bus: SecureBus) -> None:
    """Even on a subject the sender may publish (the operator's), a ``node_lost`` that says it comes from
    someone other than topology is not applied: the ledger dead-letters it with one log line."""
    before = await snapshot(bus)
    operator = await bus.connect("operator")
    js = operator.nc.jetstream()
    lost = NodeStateEvent(node=VICTIM_NODE, region="us-west-1", accelerators=[f"{VICTIM_NODE}/gpu0"])
    body = event(Context.TOPOLOGY, "node_lost", lost.model_dump(mode="json"), source="evil")
    event_id = json.loads(body)["event_id"]
    await js.publish(bus.subjects.event(Context.TOPOLOGY, "node_lost"), body, headers={"Nats-Msg-Id": event_id})
    await wait_for_letter(bus, event_id, "from topology-discovery, not from 'evil'")
    assert await snapshot(bus) == before


async def wait_for_letter(bus: SecureBus, event_id: str, reason: str) -> None:
    operator = await bus.connect("operator")
    stream = deadletter_stream_name(stream_prefix=bus.settings.kit.stream_prefix)

    async def parked() -> bool:
        with contextlib.suppress(Exception):
            for letter in await deadletter.list_dead_letters(operator.nc.jetstream(), stream=stream, limit=10_000):
                if event_id in letter.body.decode(errors="replace") and reason in letter.error:
                    return True
        return False

    await wait_for(parked, 30, what=f"event {event_id} dead-lettered ({reason})")


async def test_a_forged_allocation_committed_is_refused_and_placement_still_places(bus: SecureBus) -> None:
    """Row 3: the forgery never enters the LEDGER stream, so replay agrees with the table."""
    ledger_seq = await last_sequence(bus, Context.LEDGER)
    subject = bus.subjects.event(Context.LEDGER, "allocation_committed")
    for who in ATTACKERS:
        caller = await bus.connect(who)
        payload = {"allocation_id": "al-forged", "tenant": "acme", "shares": [{"accelerator": f"{VICTIM_NODE}/gpu0"}]}
        await caller.publish(subject, event(Context.LEDGER, "allocation_committed", payload))
        await caller.refused(subject)
    assert await last_sequence(bus, Context.LEDGER) == ledger_seq
    gateway = await bus.connect(gateway_identity("acme-gw"))
    placed = []
    for i in range(10):
        reply = await gateway.request(
            bus.subjects.scoped(Rpc.PLACEMENT_PLACE, "acme"),
            {
                "request_id": f"sec-{i}-{uuid.uuid4().hex[:6]}",
                "tenant": "acme",
                "model": "llama3-8b",
                "context_tokens": 4096,
            },
        )
        placed.append(reply["status"])
    assert placed == ["placed"] * 10


async def test_an_agent_speaks_only_for_its_own_node(bus: SecureBus) -> None:
    """Row 4 (a ghost node reported, with heartbeats) and row 5 (forged telemetry)."""
    agent = await bus.connect(agent_identity(AGENT_NODE))
    ghost = agent_profile(GHOST_NODE).model_dump(mode="json")
    # Its own subject, another node's body: forbidden. Another node's subject: the server refuses it.
    reply = await agent.request(
        bus.subjects.scoped(Rpc.TOPOLOGY_REPORT, AGENT_NODE), {"node": GHOST_NODE, "profile": ghost}
    )
    assert reply["error"]["code"] == "forbidden"
    await agent.publish(bus.subjects.scoped(Rpc.TOPOLOGY_REPORT, GHOST_NODE), json.dumps({"node": GHOST_NODE}).encode())
    await agent.refused(bus.subjects.scoped(Rpc.TOPOLOGY_REPORT, GHOST_NODE))
    for _ in range(3):
        await agent.publish(bus.subjects.heartbeat(GHOST_NODE), json.dumps({"node": GHOST_NODE}).encode())
    await agent.refused(bus.subjects.heartbeat(GHOST_NODE))
    assert GHOST_NODE not in await fleet_nodes(bus)
    # Positive control: its own node is accepted.
    own = agent_profile(AGENT_NODE).model_dump(mode="json")
    reply = await agent.request(
        bus.subjects.scoped(Rpc.TOPOLOGY_REPORT, AGENT_NODE), {"node": AGENT_NODE, "profile": own}
    )
    assert reply["status"] in ("accepted", "unchanged"), reply
    await wait_for(lambda: fleet_has(bus, AGENT_NODE), 30, what="the agent's own node in the fleet")

    # Telemetry naming another node: on that node's subject the server refuses it; on its own subject
    # the ledger dead-letters it (the payload names another node than the subject). No drift follows.
    drifts = len(await drift_events(bus))
    sample = GpuTelemetryEvent(
        node=VICTIM_NODE, gpus=[GpuSample(index=i, memory_used_bytes=70 * 2**30) for i in range(8)]
    ).model_dump(mode="json")
    victim_subject = bus.subjects.event(Context.TELEMETRY, "gpu", node=VICTIM_NODE)
    await agent.publish(victim_subject, event(Context.TELEMETRY, "gpu", sample))
    await agent.refused(victim_subject)
    js = agent.nc.jetstream()
    last = b""
    for _ in range(4):  # more samples than the drift detector needs in a row
        last = event(Context.TELEMETRY, "gpu", sample)
        await js.publish(bus.subjects.event(Context.TELEMETRY, "gpu", node=AGENT_NODE), last)
    await wait_for_letter(bus, json.loads(last)["event_id"], "names node")
    assert len(await drift_events(bus)) == drifts


async def drift_events(bus: SecureBus) -> list[dict[str, Any]]:
    operator = await bus.connect("operator")
    return await read_all(
        operator.nc.jetstream(),
        stream=bus.stream(Context.LEDGER),
        subject=bus.subjects.event(Context.LEDGER, "drift_detected"),
    )


async def fleet_has(bus: SecureBus, node: str) -> bool:
    return node in await fleet_nodes(bus)


async def test_a_gateway_acts_only_for_its_own_tenants(bus: SecureBus) -> None:
    """Row 6: ``placement.release`` naming another tenant (tenant names are public) is refused."""
    acme = await bus.connect(gateway_identity("acme-gw"))
    globex = await bus.connect(gateway_identity("globex-gw"))
    placed = await acme.request(
        bus.subjects.scoped(Rpc.PLACEMENT_PLACE, "acme"),
        {
            "request_id": f"victim-{uuid.uuid4().hex[:8]}",
            "tenant": "acme",
            "model": "llama3-8b",
            "context_tokens": 4096,
        },
    )
    assert placed["status"] == "placed", placed
    allocation = placed["allocation_id"]
    release = {"allocation_id": allocation, "tenant": "acme"}
    reply = await globex.request(bus.subjects.scoped(Rpc.PLACEMENT_RELEASE, "globex"), release)
    assert reply["error"]["code"] == "forbidden"
    for subject in (bus.subjects.scoped(Rpc.PLACEMENT_RELEASE, "acme"), bus.subjects.rpc(Rpc.PLACEMENT_RELEASE)):
        await globex.publish(subject, json.dumps(release).encode())
        await globex.refused(subject)
    held = [a for a in await snapshot(bus) if allocation in a["allocations"]]
    assert held, "the victim's allocation is still held"
    # Nor can it listen: events name tenants, and other callers' replies are not its own.
    for subject in (f"{bus.subjects.prefix}.events.>", "_INBOX.>", f"{bus.subjects.prefix}.placement.place"):
        await globex.nc.subscribe(subject)
        await globex.nc.flush()
        await globex.refused(subject, verb="subscription")
    # Its own tenant's release works.
    reply = await acme.request(bus.subjects.scoped(Rpc.PLACEMENT_RELEASE, "acme"), release)
    assert reply["status"] == "released", reply


async def test_only_placement_reaches_the_ledger(bus: SecureBus) -> None:
    """Row 7: an anonymous ``ledger.commit`` (a whole node for 30 days) — and one from any identity
    other than placement, the reservation filler or the operator — never reaches the ledger."""
    before = await snapshot(bus)
    commit = {
        "request_id": "grab-node",
        "tenant": "mallory",
        "lease_s": 30 * 24 * 3600,
        "shares": [{"accelerator": f"{VICTIM_NODE}/gpu{i}", "weights_bytes": 70 * 2**30} for i in range(8)],
    }
    subject = bus.subjects.rpc(Rpc.LEDGER_COMMIT)
    for who in (gateway_identity("acme-gw"), agent_identity(AGENT_NODE), service_identity("topology")):
        caller = await bus.connect(who)
        await caller.publish(subject, json.dumps(commit).encode())
        await caller.refused(subject)
    await asyncio.sleep(0.5)
    assert await snapshot(bus) == before


async def test_only_the_operator_reaches_the_jetstream_api(bus: SecureBus) -> None:
    """Row 8: ``$JS.API.STREAM.PURGE.TELEMETRY`` (and deleting a stream) from anyone but the operator."""
    telemetry = bus.stream(Context.TELEMETRY)
    ledger = bus.stream(Context.LEDGER)
    operator = await bus.connect("operator")
    js = operator.nc.jetstream()
    messages = {s: (await js.stream_info(s)).state.messages for s in (telemetry, ledger)}
    for who in (*ATTACKERS, service_identity("ledger")):
        caller = await bus.connect(who)
        for verb in (f"STREAM.PURGE.{telemetry}", f"STREAM.DELETE.{ledger}", f"STREAM.PURGE.{ledger}"):
            await caller.publish(f"$JS.API.{verb}")
            await caller.refused(f"$JS.API.{verb}")
    assert {s: (await js.stream_info(s)).state.messages for s in (telemetry, ledger)} == messages


async def test_an_agent_process_works_with_its_own_credential(bus: SecureBus, tmp_path: Path) -> None:
    """The agent as deployed (topology in agent mode, nvidia-smi from captured output) connects with
    its node's credential: its report lands on its node's subject and its heartbeats keep the node up
    past several missed-heartbeat windows."""
    assert bus.procs is not None
    identity = agent_identity(RUNNING_AGENT)
    bus.procs.start(
        "topology_discovery",
        name="running-agent",
        HETSCHED_TOPOLOGY_MODE="agent",
        HETSCHED_TOPOLOGY_PROVIDER="nvidia-smi",
        HETSCHED_TOPOLOGY_SMI_TOPO_FILE=str(TOPO_FIXTURES / "four_plus_four.txt"),
        HETSCHED_TOPOLOGY_SKU="H100-SXM-80GB",
        HETSCHED_TOPOLOGY_NODE=RUNNING_AGENT,
        HETSCHED_REGION="us-west-1",
        HETSCHED_TOPOLOGY_HEARTBEAT_S="0.5",
        HETSCHED_TOPOLOGY_SCAN_S="0.5",
        HETSCHED_NATS_NKEY_SEED_FILE=str(bus.seeds[identity]),
        HETSCHED_NATS_INBOX_PREFIX=inbox_prefix(identity),
    )
    try:

        async def state() -> str | None:
            operator = await bus.connect("operator")
            reply = await operator.request(bus.subjects.rpc(Rpc.FLEET_GET), {"limit": 10_000})
            node = next((n for n in reply["nodes"] if n["name"] == RUNNING_AGENT), None)
            return node["state"] if node else None

        await wait_for(lambda: _is_up(state), 60, what=f"{RUNNING_AGENT} reported and up")
        # Its beats arrive on its node's subject; after more of them than three missed-beat windows hold,
        # the node is still up (a refused beat would have let it be lost).
        operator = await bus.connect("operator")
        beats: list[bytes] = []

        async def on_beat(msg: Any) -> None:
            beats.append(msg.data)

        subscription = await operator.nc.subscribe(bus.subjects.heartbeat(RUNNING_AGENT), cb=on_beat)
        await wait_for(lambda: len(beats) >= 8, 30, what="eight heartbeats from the agent")
        await subscription.unsubscribe()
        assert await state() == "up", bus.procs.log("running-agent")[-3000:]
    finally:
        bus.procs.stop("running-agent")


async def _is_up(state: Any) -> bool:
    return bool(await state() == "up")


# -- issue 23: a hostile probe after the hardening ------------------------------------------------------

H100_4X4 = [f"hgx-h100-4x4-01/gpu{i}" for i in range(8)]  # avoided: the replica lands on dgx-h100-01 or -02


async def place_as(caller: Caller, bus: SecureBus, tenant: str, model: str, **fields: Any) -> dict[str, Any]:
    body = {
        "request_id": f"i23-{model}-{uuid.uuid4().hex[:8]}",
        "tenant": tenant,
        "model": model,
        "context_tokens": 4096,
        "concurrency": 8,  # room for a few admissions' KV
        "tp": 1,
        "backend": "gpu",
        "fallbacks": [],
        **fields,
    }
    reply = await caller.request(bus.subjects.scoped(Rpc.PLACEMENT_PLACE, tenant), body)
    assert reply["status"] == "placed", reply
    return reply


async def admit_as(caller: Caller, bus: SecureBus, tenant: str, model: str, **fields: Any) -> dict[str, Any]:
    body = {
        "request_id": f"i23-adm-{uuid.uuid4().hex[:8]}",
        "tenant": tenant,
        "model": model,
        "input_tokens": 1000,
        "output_tokens": 200,
        **fields,
    }
    return await caller.request(bus.subjects.scoped(Rpc.PLACEMENT_ADMIT, tenant), body)


async def engine_reports(bus: SecureBus, placed: dict[str, Any], **load: Any) -> None:
    """The replica's engine, as its own node's agent reports it (published here as the operator)."""
    operator = await bus.connect("operator")
    status = EngineLoad(jitter=0, queue_depth=0, **load).status(
        replica_id=placed["allocation_id"], node=placed["placements"][0]["node"], rng=random.Random(0)
    )
    await publish_engine_status(operator.nc.jetstream(), bus.subjects, status)


async def admitted_to(caller: Caller, bus: SecureBus, tenant: str, replica: dict[str, Any]) -> dict[str, Any]:
    """An admission to ``replica``'s model once placement has its engine's report. The engine reports
    again before each try, as a running one does: a report that comes before admission has heard of the
    replica (from the LEDGER events) is ignored."""
    model = replica["model"]
    request_id = f"i23-adm-{uuid.uuid4().hex[:8]}"  # one request, asked again (never a queue of them)
    last: list[dict[str, Any]] = []

    async def once() -> dict[str, Any] | None:
        await engine_reports(bus, replica)
        last[:] = [await admit_as(caller, bus, tenant, model, request_id=request_id)]
        return last[0] if last[0]["status"] == "admitted" else None

    try:
        return await wait_for(once, 30, interval_s=0.2, what=f"{model} in rotation for {tenant}")
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {last}") from None


async def release_as(caller: Caller, bus: SecureBus, tenant: str, allocation_id: str) -> dict[str, Any]:
    return await caller.request(
        bus.subjects.scoped(Rpc.PLACEMENT_RELEASE, tenant), {"allocation_id": allocation_id, "tenant": tenant}
    )


async def test_failed_replica_id_counts_only_for_a_replica_the_caller_has_an_admission_on(bus: SecureBus) -> None:
    """Row 2: acme naming globex's replica as failed took it out of rotation for globex until its engine
    reported again. Now a tenant's word counts only once it holds an admission on that replica, and a
    tenant's requests never land on another tenant's replica (``HETSCHED_ADMIT_TENANCY=own``): acme's word
    on globex's replica is ignored, and acme's answer is the `no_capacity` of a tenant with no replica,
    naming nothing of globex's."""
    globex = await bus.connect(gateway_identity("globex-gw"))
    acme = await bus.connect(gateway_identity("acme-gw"))
    model = "llama3.1-8b"
    replica = await place_as(globex, bus, "globex", model)
    first = await admitted_to(globex, bus, "globex", replica)
    assert first["replica_id"] == replica["allocation_id"]

    probe = await admit_as(acme, bus, "acme", model, failed_replica_id=replica["allocation_id"])
    assert probe["status"] == "rejected" and probe["error"]["code"] == "no_capacity", probe
    assert probe["error"]["details"] == {"failed_replica_ignored": True}
    assert replica["allocation_id"] not in json.dumps(probe)
    plain = await admit_as(acme, bus, "acme", model)  # the same answer as without naming it
    assert (plain["status"], plain["error"]["code"]) == ("rejected", "no_capacity"), plain
    assert replica["allocation_id"] not in json.dumps(plain)
    again = await admit_as(globex, bus, "globex", model)  # still in rotation: acme's word did not count
    assert again["status"] == "admitted" and again["replica_id"] == replica["allocation_id"], again

    # globex holds admissions on it: its word is heard (its only replica leaves rotation).
    heard = await admit_as(globex, bus, "globex", model, failed_replica_id=replica["allocation_id"])
    assert heard["status"] == "rejected" and heard["error"]["code"] == "no_capacity", heard
    assert heard["error"]["details"] == {"failed_replica_ignored": False}

    for hold in (first, again):
        assert (await release_as(globex, bus, "globex", hold["allocation_id"]))["status"] == "released"
    back = await admitted_to(globex, bus, "globex", replica)  # its engine reports: back in rotation
    assert (await release_as(globex, bus, "globex", back["allocation_id"]))["status"] == "released"
    assert (await release_as(globex, bus, "globex", replica["allocation_id"]))["status"] == "released"


async def test_an_agent_whose_node_name_is_a_prefix_cannot_report_for_another_nodes_replica(bus: SecureBus) -> None:
    """Row 3: the agent of `dgx-h100-0`, on its own subject, reported a replica on `dgx-h100-0X` unhealthy
    and placement believed it (its node check was a prefix match). Now node names compare exactly."""
    acme = await bus.connect(gateway_identity("acme-gw"))
    victim = await place_as(
        acme, bus, "acme", "gemma2-9b", skus=["H100-SXM-80GB"], region="us-west-1", avoid_accelerators=H100_4X4
    )
    node = victim["placements"][0]["node"]
    assert node.startswith(PREFIX_AGENT) and node != PREFIX_AGENT, node
    marker = await place_as(acme, bus, "acme", "mistral-7b-v0.1")
    await admitted_to(acme, bus, "acme", victim)

    agent = await bus.connect(agent_identity(PREFIX_AGENT))
    forged = EngineStatusEvent(
        replica_id=victim["allocation_id"],
        node=PREFIX_AGENT,  # its own node, as its subject says: the consumers' subject check passes
        queue_depth=0,
        kv_used_bytes=0,
        kv_total_bytes=1,
        latency_p50_ms=1.0,
        latency_p99_ms=1.0,
        healthy=False,
    )
    await agent.nc.jetstream().publish(
        bus.subjects.event(Context.TELEMETRY, "engine_status", node=PREFIX_AGENT),
        event(Context.TELEMETRY, "engine_status", forged.model_dump(mode="json")),
    )
    # Placement applies TELEMETRY in stream order: once the marker's report (published after the forgery)
    # has put the marker in rotation, the forgery has been applied too.
    await admitted_to(acme, bus, "acme", marker)
    after = await admit_as(acme, bus, "acme", "gemma2-9b")
    assert after["status"] == "admitted" and after["replica_id"] == victim["allocation_id"], after
    for placed in (victim, marker):
        assert (await release_as(acme, bus, "acme", placed["allocation_id"]))["status"] == "released"


async def test_another_tenants_allocation_id_is_answered_as_an_unknown_one(bus: SecureBus) -> None:
    """The probe's information leak: `forbidden` for another tenant's allocation id (on the caller's own
    subject) against `not_found` for an id that does not exist told which ids exist. Both are now
    `not_found` with one message, for a replica and for an admission's KV hold, on release and renew."""
    acme = await bus.connect(gateway_identity("acme-gw"))
    globex = await bus.connect(gateway_identity("globex-gw"))
    model = "mamba2-2.7b"
    replica = await place_as(acme, bus, "acme", model)
    hold = await admitted_to(acme, bus, "acme", replica)

    def answer(reply: dict[str, Any], allocation_id: str) -> tuple[str, str, str]:
        error = reply["error"]
        return reply["status"], error["code"], error["message"].replace(allocation_id, "<id>")

    for verb, extra in ((Rpc.PLACEMENT_RELEASE, {}), (Rpc.PLACEMENT_RENEW, {"lease_s": 60})):
        answers = set()
        for allocation_id in (replica["allocation_id"], hold["allocation_id"], f"al-{uuid.uuid4().hex}"):
            body = {"allocation_id": allocation_id, "tenant": "globex", **extra}
            reply = await globex.request(bus.subjects.scoped(verb, "globex"), body)
            answers.add(answer(reply, allocation_id))
        assert answers == {("rejected", "not_found", "no allocation '<id>' for this tenant")}, (verb, answers)
    for allocation_id in (replica["allocation_id"], hold["allocation_id"]):  # both still held: acme renews them
        body = {"allocation_id": allocation_id, "tenant": "acme", "lease_s": 300}
        renewed = await acme.request(bus.subjects.scoped(Rpc.PLACEMENT_RENEW, "acme"), body)
        assert renewed["status"] == "renewed", renewed
    assert (await release_as(acme, bus, "acme", hold["allocation_id"]))["status"] == "released"
    assert (await release_as(acme, bus, "acme", replica["allocation_id"]))["status"] == "released"
