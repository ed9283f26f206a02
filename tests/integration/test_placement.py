"""placement on real NATS and Postgres with topology and the ledger: decisions reserved through the
ledger, idempotent by request id, dry runs that reserve nothing, TPU slices, typed refusals, events, and
a view of the fleet that converges to the ledger's while placements churn and nodes come and go."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import random
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from functools import partial
from typing import Any

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client

from hetsched.stack import wait_healthy
from services.placement.app import SERVICE, Ctx, wire
from shared.contracts.envelope import new_event
from shared.contracts.health import HealthRequest
from shared.contracts.ledger import SnapshotReply
from shared.contracts.permissions import AGENT
from shared.contracts.placement import PlaceReply, PlaceRequest, ReleaseRequest
from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context, Rpc, Subjects
from shared.contracts.topology import (
    GPU_TELEMETRY,
    GpuSample,
    GpuTelemetryEvent,
    Heartbeat,
    NodeProfilePayload,
    TopologyReportRequest,
)
from shared.domain.fleet import Accelerator, AcceleratorId, NodeProfile
from shared.domain.placement.view import FleetView
from shared.domain.topology import nvswitch
from shared.infra.catalog import demo_fleet_path
from shared.infra.profiles import profile_to_payload
from shared.infra.rpc import RpcClient
from shared.infra.service import Runtime, build_app
from shared.infra.settings import Settings
from tests.conftest import ServiceProcesses
from tests.jetstream import read_all
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

HEARTBEAT_S = 0.25
CHURN_REGION = "churn-1"


async def call(nc: Client, settings: Settings, rpc: Rpc, body: dict[str, Any]) -> dict[str, Any]:
    msg = await nc.request(Subjects(settings.kit.subject_prefix).rpc(rpc), json.dumps(body).encode(), timeout=15)
    reply: dict[str, Any] = json.loads(msg.data)
    return reply


async def reserved(nc: Client, settings: Settings, node: str) -> dict[str, int]:
    snap = await call(nc, settings, Rpc.LEDGER_SNAPSHOT, {"node": node})
    return {a["id"]: a["hbm_reserved_bytes"] for a in snap["accelerators"]}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(service_processes: ServiceProcesses, settings: Settings) -> AsyncIterator[Client]:
    service_processes.start(
        "topology_discovery",
        name="pl_topology",
        HETSCHED_TOPOLOGY_INVENTORY=str(demo_fleet_path()),
        # Agent-reported nodes (the churn test's) are lost after a second of silence; inventory ones never.
        HETSCHED_TOPOLOGY_HEARTBEAT_S=str(HEARTBEAT_S),
        HETSCHED_TOPOLOGY_MISSED_HEARTBEATS="4",
    )
    service_processes.start("capacity_ledger", name="pl_ledger")
    service_processes.start("placement", name="pl_placement")
    health = await wait_healthy(
        nats_url=settings.kit.nats_url or "",
        subjects=Subjects(settings.kit.subject_prefix),
        deadline_s=60,
        only={"topology_discovery", "capacity_ledger", "placement"},
    )
    assert all(h["status"] == "ok" for h in health.values()), health
    nc = await nats.connect(settings.kit.nats_url or "")
    probe = {"request_id": "probe", "tenant": "t", "model": "llama3-8b", "context_tokens": 4096, "backend": "tpu"}

    async def sees_the_demo_fleet() -> bool:  # GPUs and TPU chips known
        return bool((await call(nc, settings, Rpc.PLACEMENT_EXPLAIN, probe))["status"] == "placed")

    async def ledger_knows_it_all() -> bool:  # 76 GPUs, 768 TPU chips: tests compare whole ledger snapshots
        return len((await call(nc, settings, Rpc.LEDGER_SNAPSHOT, {}))["accelerators"]) >= 76 + 256 + 512

    await wait_for(sees_the_demo_fleet, 30, what="placement sees the demo fleet")
    await wait_for(ledger_knows_it_all, 30, what="the ledger knows the whole demo fleet")
    yield nc
    await nc.close()
    for name in ("pl_placement", "pl_ledger", "pl_topology"):
        service_processes.stop(name)


def place_body(rid: str, **extra: Any) -> dict[str, Any]:
    return {
        "request_id": rid,
        "tenant": "acme",
        "model": "llama3-70b",
        "dtype": "fp8",
        "context_tokens": 8192,
        "concurrency": 16,
        "backend": "gpu",
        **extra,
    }


async def test_place_reserves_through_the_ledger_once(stack: Client, settings: Settings) -> None:
    first = await call(stack, settings, Rpc.PLACEMENT_PLACE, place_body("p-1"))
    assert first["status"] == "placed", first
    assert first["backend"] == "gpu" and first["allocation_id"] and first["tp"] >= 1
    accs = [a for p in first["placements"] for a in p["accelerators"]]
    assert len(accs) == first["tp"]
    node = first["placements"][0]["node"]
    per = first["hbm_per_accelerator"]["total_bytes"]
    after = await reserved(stack, settings, node)
    assert all(after[a] >= per for a in accs)
    again = await call(stack, settings, Rpc.PLACEMENT_PLACE, place_body("p-1"))
    assert again["allocation_id"] == first["allocation_id"]
    assert await reserved(stack, settings, node) == after  # the same request id reserved once
    assert first["explanation"] and "total" in first["score"]


async def test_explain_reserves_nothing(stack: Client, settings: Settings) -> None:
    before = await call(stack, settings, Rpc.LEDGER_SNAPSHOT, {})
    reply = await call(stack, settings, Rpc.PLACEMENT_EXPLAIN, place_body("dry-1"))
    assert reply["status"] == "placed" and reply["allocation_id"] is None
    assert reply["explanation"][0].startswith("dry run")
    assert await call(stack, settings, Rpc.LEDGER_SNAPSHOT, {}) == before


async def test_release_gives_the_bytes_back(stack: Client, settings: Settings) -> None:
    placed = await call(stack, settings, Rpc.PLACEMENT_PLACE, place_body("p-rel", model="llama3-8b", dtype="bf16"))
    assert placed["status"] == "placed", placed
    node = placed["placements"][0]["node"]
    acc = placed["placements"][0]["accelerators"][0]
    held = (await reserved(stack, settings, node))[acc]
    other = await call(
        stack, settings, Rpc.PLACEMENT_RELEASE, {"allocation_id": placed["allocation_id"], "tenant": "globex"}
    )
    unknown = await call(stack, settings, Rpc.PLACEMENT_RELEASE, {"allocation_id": "al-nope", "tenant": "globex"})
    # Another tenant's allocation is answered as an unknown one (issue 23): the same code, the same message.
    assert other["status"] == unknown["status"] == "rejected"
    assert other["error"]["code"] == unknown["error"]["code"] == "not_found"
    assert other["error"]["message"].replace(placed["allocation_id"], "ID") == unknown["error"]["message"].replace(
        "al-nope", "ID"
    )
    done = await call(
        stack, settings, Rpc.PLACEMENT_RELEASE, {"allocation_id": placed["allocation_id"], "tenant": "acme"}
    )
    assert done["status"] == "released"
    assert (await reserved(stack, settings, node))[acc] == held - placed["hbm_per_accelerator"]["total_bytes"]


async def test_a_tpu_request_gets_a_whole_legal_slice(stack: Client, settings: Settings) -> None:
    reply = await call(
        stack,
        settings,
        Rpc.PLACEMENT_PLACE,
        {
            "request_id": "tpu-1",
            "tenant": "acme",
            "model": "llama3-8b",
            "context_tokens": 4096,
            "concurrency": 8,
            "backend": "tpu",
        },
    )
    assert reply["status"] == "placed", reply
    tpu = reply["tpu_slice"]
    assert reply["backend"] == "tpu" and tpu["pod"] in ("v5e-pod-1", "v5p-pod-1")
    reported = {AcceleratorId.tpu(tpu["pod"], coord) for coord in slice_coords(tpu["origin"], tpu["shape"])}
    snap = await call(stack, settings, Rpc.LEDGER_SNAPSHOT, {"node": tpu["pod"]})
    held = [a for a in snap["accelerators"] if reply["allocation_id"] in a["allocations"]]
    assert {a["id"] for a in held} == reported  # the chips reserved are the slice it reports, no others
    assert all(a["hbm_reserved_bytes"] == a["hbm_usable_bytes"] for a in held)  # whole chips


def slice_coords(origin: list[int], shape: list[int]) -> list[tuple[int, ...]]:
    return list(itertools.product(*(range(o, o + n) for o, n in zip(origin, shape, strict=True))))


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ({"model": "gpt-17"}, "unknown_model"),
        ({"skus": ["B300-SXM"]}, "unknown_sku"),
        ({"context_tokens": 0}, "invalid_request"),
        ({"concurrency": -4}, "invalid_request"),
        ({"tp": 3}, "invalid_request"),
        ({"context_tokens": 10_000_000}, "invalid_request"),
        ({"version": 9}, "unsupported_version"),
    ],
)
async def test_bad_input_is_refused_and_reserves_nothing(
    stack: Client, settings: Settings, body: dict[str, Any], code: str
) -> None:
    before = await call(stack, settings, Rpc.LEDGER_SNAPSHOT, {})
    reply = await call(stack, settings, Rpc.PLACEMENT_PLACE, place_body(f"bad-{code}-{len(str(body))}", **body))
    assert reply["status"] == "rejected" and reply["error"]["code"] == code, reply
    assert await call(stack, settings, Rpc.LEDGER_SNAPSHOT, {}) == before


async def test_a_request_nothing_can_hold_is_explained(stack: Client, settings: Settings) -> None:
    reply = await call(
        stack,
        settings,
        Rpc.PLACEMENT_PLACE,
        # Exact (no fallbacks): with the default ladder a capacity refusal may wait in the queue instead.
        place_body("huge", model="llama3-405b", dtype="fp16", context_tokens=131072, concurrency=64, fallbacks=[]),
    )
    assert reply["status"] == "rejected" and reply["error"]["code"] == "no_capacity"
    assert any("short" in line or "NVLink" in line or "KV" in line for line in reply["explanation"]), reply


async def test_every_decision_is_an_event(stack: Client, settings: Settings) -> None:
    placed = await call(stack, settings, Rpc.PLACEMENT_PLACE, place_body("ev-1", model="llama3-8b", dtype="bf16"))
    assert placed["status"] == "placed", placed
    await call(stack, settings, Rpc.PLACEMENT_PLACE, place_body("ev-2", model="gpt-17"))
    released = {"allocation_id": placed["allocation_id"], "tenant": "acme"}
    assert (await call(stack, settings, Rpc.PLACEMENT_RELEASE, released))["status"] == "released"

    async def mine() -> list[dict[str, Any]] | None:
        found = await read_all(
            stack.jetstream(),
            stream=stream_name(Context.PLACEMENT, stream_prefix=settings.kit.stream_prefix),
            subject=f"{settings.kit.subject_prefix}.events.placement.>",
        )
        ours = [
            e
            for e in found
            if e["payload"].get("request_id") in ("ev-1", "ev-2")
            or e["payload"].get("allocation_id") == placed["allocation_id"]
        ]
        return ours if len(ours) >= 3 else None

    found = await wait_for(mine, 20, what="the decided, rejected and released events")
    assert sorted(e["type"] for e in found) == [
        "placement.placement_decided",
        "placement.placement_rejected",
        "placement.placement_released",
    ]
    decided = next(e for e in found if e["type"].endswith("decided"))
    assert PlaceReply.model_validate(decided["payload"]["reply"]).allocation_id == placed["allocation_id"]
    assert decided["payload"]["reply"]["explanation"]


# -- the view under churn --------------------------------------------------------------------------------


def _failures(processes: ServiceProcesses) -> dict[str, list[str]]:
    """The lines around each handler failure in every service log of this run (a flake's evidence)."""
    found: dict[str, list[str]] = {}
    for name in list(processes.procs):
        lines = processes.log(name).splitlines()
        for i, line in enumerate(lines):
            if "handler failed" in line or "Traceback" in line:
                found.setdefault(name, []).extend(lines[i : i + 30])
    return found


def agent_profile(name: str) -> NodeProfilePayload:
    """An 8-GPU H100 node as its agent reports it, in a region of its own (so requests can aim at it)."""
    profile = NodeProfile(
        name=name,
        region=CHURN_REGION,
        cluster="c1",
        rack="r-churn",
        sku="H100-SXM-80GB",
        accelerators=tuple(Accelerator(index=i, sku="H100-SXM-80GB", hbm_bytes=85_899_345_920) for i in range(8)),
        links=nvswitch(8),
        source="nvml",
    )
    return profile_to_payload(profile)


async def test_the_view_converges_to_the_ledger_while_placements_churn_and_nodes_come_and_go(
    stack: Client, settings: Settings, service_processes: ServiceProcesses
) -> None:
    """A second placement replica runs in this process so its view can be read; requests reach both.
    Nodes are reported (added) and fall silent (lost), one recovers; meanwhile placements and releases
    run concurrently. Then the view must equal the ledger's snapshot."""
    subjects = Subjects(settings.kit.subject_prefix)
    kept: list[Ctx] = []

    def wire_and_keep(runtime: Runtime) -> Ctx:
        kept.append(wire(runtime))
        return kept[-1]

    app, _runtime = build_app(dataclasses.replace(SERVICE, wire=wire_and_keep), settings)
    rpc = await RpcClient.connect(settings.kit.nats_url or "", subjects, timeout_s=15)
    nodes = [f"churn-{k}" for k in range(3)]
    beating = set(nodes)
    rng = random.Random(9)
    held: list[str] = []
    outcomes: dict[str, int] = {}

    async def heartbeats() -> None:
        while True:
            for name in sorted(beating):
                await stack.publish(subjects.heartbeat(name), Heartbeat(node=name).model_dump_json().encode())
            await asyncio.sleep(HEARTBEAT_S / 2)

    async def worker(w: int) -> None:
        for i in range(10):
            region = CHURN_REGION if rng.random() < 0.5 else None
            model, dtype = rng.choice([("llama3-8b", "bf16"), ("llama3-70b", "fp8"), ("mixtral-8x7b", "bf16")])
            request = PlaceRequest(
                request_id=f"churn-{w}-{i}",
                tenant="churn",
                model=model,
                dtype=dtype,
                context_tokens=8192,
                concurrency=8,
                backend="gpu",
                region=region,
            )
            reply = await rpc.call(Rpc.PLACEMENT_PLACE, request)
            status = reply.model_dump().get("status", "?")
            outcomes[status] = outcomes.get(status, 0) + 1
            if isinstance(reply, PlaceReply) and reply.allocation_id:
                held.append(reply.allocation_id)
                if reply.region == CHURN_REGION:
                    outcomes["on a churn node"] = outcomes.get("on a churn node", 0) + 1
            if held and rng.random() < 0.5:
                await release(held.pop(rng.randrange(len(held))))

    async def release(allocation_id: str) -> None:
        reply = await rpc.call(Rpc.PLACEMENT_RELEASE, ReleaseRequest(allocation_id=allocation_id, tenant="churn"))
        # Seen twice in ~20 full runs as `internal` (not reproduced alone): say which process failed and why.
        assert reply.model_dump()["status"] == "released", (reply, _failures(service_processes))

    async def ledger_says(node: str, *, available: bool) -> bool:
        snap = await rpc.ledger_snapshot(node=node)
        return (
            isinstance(snap, SnapshotReply)
            and bool(snap.accelerators)
            and all(a.available is available for a in snap.accelerators)
        )

    async def fleet_changes() -> None:
        await wait_for(lambda: set(nodes) <= set(view().snapshot.nodes), 30, what="the new nodes in the view")
        beating.difference_update(nodes[:2])  # two fall silent: lost
        for name in nodes[:2]:
            await wait_for(partial(ledger_says, name, available=False), 30, what=f"{name} lost")
        beating.add(nodes[0])  # one beats again: recovered
        await wait_for(lambda: ledger_says(nodes[0], available=True), 30, what=f"{nodes[0]} recovered")

    def view() -> FleetView:
        return kept[0].readmodel.view

    async with app:
        await wait_for(lambda: kept[0].readmodel.synced_at is not None, 30, what="the replica's first sync")
        beat = asyncio.create_task(heartbeats())
        try:
            for name in nodes:
                reply = await rpc.call(
                    Rpc.TOPOLOGY_REPORT, TopologyReportRequest(node=name, profile=agent_profile(name))
                )
                assert reply.model_dump()["status"] == "accepted", reply
            await asyncio.gather(fleet_changes(), *(worker(w) for w in range(6)))
        finally:
            beat.cancel()
        for allocation_id in held:
            await release(allocation_id)
        assert outcomes.get("placed", 0) >= 10 and outcomes.get("on a churn node", 0) >= 3, outcomes

        async def difference() -> str:
            """What still differs between placement's view and the ledger's snapshot ("" once none)."""
            snap = await rpc.ledger_snapshot()
            assert isinstance(snap, SnapshotReply)
            ledger = {a.id: (a.hbm_usable_bytes, a.hbm_reserved_bytes, a.available) for a in snap.accelerators}
            current = view()
            if current.assumed:
                return f"{current.assumed} commits still assumed (outcomes {outcomes})"
            balances = current.ledger_balances()
            if balances != ledger:
                differ = sorted(k for k in set(balances) | set(ledger) if balances.get(k) != ledger.get(k))
                return "balances differ: " + ", ".join(
                    f"{k} view={balances.get(k)} ledger={ledger.get(k)}" for k in differ[:5]
                )
            # What decisions read agrees too: every GPU of the snapshot as the ledger has it, lost nodes out.
            capacity = current.snapshot.capacity
            differ = [acc for acc, c in capacity.items() if (c.usable, c.reserved, c.available) != ledger.get(acc)]
            if differ:
                return "capacity differs: " + ", ".join(f"{a} ledger={ledger.get(a)}" for a in differ[:5])
            up = {name for name in nodes if await ledger_says(name, available=True)}
            seen = set(nodes) & set(current.snapshot.nodes)
            if up != seen:
                return f"nodes up in the ledger {sorted(up)}, in the view {sorted(seen)}"
            return ""

        last = ["not checked"]

        async def converged() -> bool:
            last[0] = await difference()
            return not last[0]

        # All silent now: every churn node ends lost, and the view must follow the ledger there.
        try:
            await wait_for(converged, 60, interval_s=0.25, what="placement's view equal to the ledger's snapshot")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {last[0]}") from None
        health = await rpc.call(Rpc.PLACEMENT_HEALTH, HealthRequest())
        assert health.model_dump()["checks"].get("view") == "ok", health
    await rpc.close()


# -- the queue (issue 12) --------------------------------------------------------------------------------

QUEUE_REGION = "queue-1"


async def test_a_queued_request_is_placed_once_a_release_frees_its_capacity(stack: Client, settings: Settings) -> None:
    """One 8-GPU node alone in its region: a TP=8 group takes it whole, a second waits `queued`
    (reserving nothing) and is placed, on the same request id, once the first is released; a third
    with a 1 s `queue_timeout_s` is rejected `no_capacity` meanwhile."""
    subjects = Subjects(settings.kit.subject_prefix)
    name = "queue-0"
    profile = agent_profile(name)
    profile = profile.model_copy(update={"region": QUEUE_REGION, "cluster": "queue-c", "rack": "r-queue"})
    beating = True

    async def heartbeats() -> None:
        while beating:
            await stack.publish(subjects.heartbeat(name), Heartbeat(node=name).model_dump_json().encode())
            await asyncio.sleep(HEARTBEAT_S / 2)

    def body(rid: str) -> dict[str, Any]:
        return place_body(rid, model="llama3-70b", dtype="fp8", tp=8, region=QUEUE_REGION, concurrency=4)

    beat = asyncio.create_task(heartbeats())
    try:
        report = TopologyReportRequest(node=name, profile=profile).model_dump(mode="json")
        assert (await call(stack, settings, Rpc.TOPOLOGY_REPORT, report))["status"] == "accepted"

        async def placeable() -> bool:
            return bool((await call(stack, settings, Rpc.PLACEMENT_EXPLAIN, body("q-probe")))["status"] == "placed")

        await wait_for(placeable, 30, what="placement sees the queue node")
        first = await call(stack, settings, Rpc.PLACEMENT_PLACE, body("q-first"))
        assert first["status"] == "placed" and first["sharing"] == "exclusive", first
        held = await reserved(stack, settings, name)

        waiting = await call(stack, settings, Rpc.PLACEMENT_PLACE, body("q-second"))
        assert waiting["status"] == "queued" and waiting["queue_position"] >= 1, waiting
        assert waiting["allocation_id"] is None and waiting["error"] is None
        again = await call(stack, settings, Rpc.PLACEMENT_PLACE, body("q-second"))
        assert again["status"] == "queued" and again["queue_position"] == waiting["queue_position"]
        assert await reserved(stack, settings, name) == held  # queued: nothing reserved

        late = {**body("q-late"), "queue_timeout_s": 1}
        assert (await call(stack, settings, Rpc.PLACEMENT_PLACE, late))["status"] == "queued"

        async def timed_out() -> dict[str, Any] | None:
            reply = await call(stack, settings, Rpc.PLACEMENT_PLACE, late)
            return reply if reply["status"] == "rejected" else None

        rejection = await wait_for(timed_out, 30, what="the queued request's timeout")
        assert rejection["error"]["code"] == "no_capacity" and "queue timeout" in rejection["error"]["message"]

        released = {"allocation_id": first["allocation_id"], "tenant": "acme"}
        assert (await call(stack, settings, Rpc.PLACEMENT_RELEASE, released))["status"] == "released"

        async def placed() -> dict[str, Any] | None:
            reply = await call(stack, settings, Rpc.PLACEMENT_PLACE, body("q-second"))
            return reply if reply["status"] == "placed" else None

        second = await wait_for(placed, 30, what="the queued request placed after the release")
        assert second["allocation_id"] and second["allocation_id"] != first["allocation_id"]
        accs = [a for p in second["placements"] for a in p["accelerators"]]
        assert sorted(accs) == sorted(AcceleratorId.gpu(name, i) for i in range(8))
        per = second["hbm_per_accelerator"]["total_bytes"]
        assert await reserved(stack, settings, name) == dict.fromkeys(accs, per)  # its share, nothing else
        assert second["binding"] and second["launch"]["vllm"]
        done = {"allocation_id": second["allocation_id"], "tenant": "acme"}
        assert (await call(stack, settings, Rpc.PLACEMENT_RELEASE, done))["status"] == "released"
    finally:
        beating = False
        await beat


async def test_gpu_telemetry_from_a_nodes_own_agent_sets_its_pcie_utilisation(
    stack: Client, settings: Settings
) -> None:
    """A placement replica in this process (so its view can be read) follows the TELEMETRY stream: the
    node's PCIe utilisation is the lowest sample over the window; a sample naming the node on another
    node's subject, or from another source than an agent, is dropped."""
    subjects = Subjects(settings.kit.subject_prefix)
    kept: list[Ctx] = []

    def wire_and_keep(runtime: Runtime) -> Ctx:
        kept.append(wire(runtime))
        return kept[-1]

    name = "pcie-0"
    profile = agent_profile(name).model_copy(update={"region": "pcie-1", "cluster": "pcie-c", "rack": "r-pcie"})
    app, _runtime = build_app(dataclasses.replace(SERVICE, wire=wire_and_keep), settings)
    link = 3.938e9 * 16  # H100 SXM: PCIe Gen5 x16, one direction
    now = datetime.now(UTC)

    async def publish(at: datetime, util: float, *, subject_node: str = name, source: str = AGENT) -> None:
        payload = GpuTelemetryEvent(node=name, gpus=[GpuSample(index=0, pcie_rx_bytes_per_s=util * link)])
        envelope = new_event(
            type="telemetry.gpu", source=source, payload=payload.model_dump(mode="json"), occurred_at=at
        )
        subject = subjects.event(Context.TELEMETRY, GPU_TELEMETRY, node=subject_node)
        await stack.jetstream().publish(subject, envelope.model_dump_json().encode())

    async with app:
        await wait_for(lambda: kept[0].readmodel.synced_at is not None, 30, what="the replica's first sync")
        report = TopologyReportRequest(node=name, profile=profile).model_dump(mode="json")
        assert (await call(stack, settings, Rpc.TOPOLOGY_REPORT, report))["status"] in ("accepted", "unchanged")
        await wait_for(lambda: name in kept[0].readmodel.view.profiles, 30, what="the node's profile in the view")
        await publish(now - timedelta(seconds=61), 0.9)
        await publish(now - timedelta(seconds=40), 0.1, subject_node="someone-else")  # forged: dropped
        await publish(now - timedelta(seconds=30), 0.1, source="placement")  # not an agent: dropped
        await publish(now, 0.85)

        def utilisation() -> float | None:
            return kept[0].readmodel.view.snapshot.pcie_util.get(name)

        await wait_for(lambda: utilisation() is not None, 30, what="the node's PCIe utilisation")
        assert utilisation() == pytest.approx(0.85)
