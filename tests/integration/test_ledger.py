"""capacity-ledger on real NATS and Postgres: commits, idempotency, typed refusals that change nothing,
conflicts with a fresh view, leases, lost nodes, drift, KV pools of replicas, and replay."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client

from services.stack import wait_healthy
from shared.contracts.envelope import new_event
from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context, Rpc, Subjects
from shared.domain.ledger import replay_reserved
from shared.infra.catalog import demo_fleet_path
from shared.infra.db import plain_url
from shared.infra.settings import Settings
from tests.conftest import ServiceProcesses
from tests.jetstream import read_all

pytestmark = pytest.mark.asyncio(loop_scope="session")
GB = 10**9
H100_USABLE = 85_899_345_920 * 23 // 25  # 80 GiB x 0.92 = 79,027,398,246 bytes


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def ledger(service_processes: ServiceProcesses, settings: Settings) -> AsyncIterator[Client]:
    service_processes.start(
        "topology_discovery", name="ledger_topology", HETSCHED_TOPOLOGY_INVENTORY=str(demo_fleet_path())
    )
    service_processes.start("capacity_ledger", name="ledger", HETSCHED_LEDGER_SWEEP_MS="100")
    health = await wait_healthy(
        nats_url=settings.nats_url or "",
        subjects=Subjects(settings.subject_prefix),
        deadline_s=60,
        only={"topology_discovery", "capacity_ledger"},
    )
    assert all(h["status"] == "ok" for h in health.values()), health
    client = await nats.connect(settings.nats_url or "")
    deadline = time.monotonic() + 30
    # The demo's 76 GPUs and its TPU chips (256 + 512): tests compare whole snapshots before and after.
    while len((await call(client, settings, Rpc.LEDGER_SNAPSHOT, {}))["accelerators"]) < 76 + 256 + 512:
        assert time.monotonic() < deadline, "the ledger never learnt the demo fleet's accelerators"
        await asyncio.sleep(0.2)
    yield client
    await client.close()
    for name in ("ledger", "ledger_topology"):
        service_processes.stop(name)


async def call(nc: Client, settings: Settings, rpc: Rpc, body: dict[str, Any]) -> dict[str, Any]:
    msg = await nc.request(
        Subjects(settings.subject_prefix).rpc(rpc), json.dumps(body, default=str).encode(), timeout=10
    )
    reply: dict[str, Any] = json.loads(msg.data)
    return reply


def commit(
    acc: str | list[str], gb: float, *, tenant: str = "acme", rid: str | None = None, **extra: Any
) -> dict[str, Any]:
    accs = [acc] if isinstance(acc, str) else acc
    return {
        "request_id": rid or f"r-{uuid.uuid4().hex[:8]}",
        "tenant": tenant,
        "shares": [{"accelerator_id": a, "weights": int(gb * GB)} for a in accs],
        **extra,
    }


async def reserved(nc: Client, settings: Settings, node: str) -> dict[str, int]:
    snap = await call(nc, settings, Rpc.LEDGER_SNAPSHOT, {"node": node})
    return {a["id"]: a["hbm_reserved"] for a in snap["accelerators"]}


async def ledger_events(nc: Client, settings: Settings, event: str = ">") -> list[dict[str, Any]]:
    return await read_all(
        nc.jetstream(),
        stream=stream_name(Context.LEDGER, stream_prefix=settings.stream_prefix),
        subject=f"{settings.subject_prefix}.events.ledger.{event}",
    )


async def test_capacity_comes_from_topology_with_the_ceiling(ledger: Client, settings: Settings) -> None:
    snap = await call(ledger, settings, Rpc.LEDGER_SNAPSHOT, {"node": "dgx-h100-01"})
    assert [a["id"] for a in snap["accelerators"]] == [f"dgx-h100-01/gpu{i}" for i in range(8)]
    assert all(a["hbm_usable"] == H100_USABLE and a["available"] for a in snap["accelerators"])


async def test_same_commit_twice_reserves_once(ledger: Client, settings: Settings) -> None:
    body = commit(["dgx-h100-01/gpu0", "dgx-h100-01/gpu1"], 20, rid="twice-1")
    first = await call(ledger, settings, Rpc.LEDGER_COMMIT, body)
    second = await call(ledger, settings, Rpc.LEDGER_COMMIT, body)
    assert first["status"] == second["status"] == "committed"
    assert second["allocation_id"] == first["allocation_id"] and second["duplicate"] and not first["duplicate"]
    now = await reserved(ledger, settings, "dgx-h100-01")
    assert now["dgx-h100-01/gpu0"] == now["dgx-h100-01/gpu1"] == 20 * GB
    other = await call(
        ledger, settings, Rpc.LEDGER_COMMIT, {**body, "shares": [{"accelerator_id": "dgx-h100-01/gpu0", "weights": 1}]}
    )
    assert other["error"]["code"] == "invalid_request"  # same id, different content
    assert (
        await call(ledger, settings, Rpc.LEDGER_RELEASE, {"allocation_id": first["allocation_id"], "tenant": "acme"})
    )["status"] == "released"
    again = await call(
        ledger, settings, Rpc.LEDGER_RELEASE, {"allocation_id": first["allocation_id"], "tenant": "acme"}
    )
    assert again["status"] == "released" and again["already"]
    assert (await reserved(ledger, settings, "dgx-h100-01"))["dgx-h100-01/gpu0"] == 0


async def test_bad_input_gets_typed_errors_and_changes_nothing(ledger: Client, settings: Settings) -> None:
    held = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit("dgx-h100-02/gpu0", 5, tenant="globex"))
    before = await call(ledger, settings, Rpc.LEDGER_SNAPSHOT, {})
    past = (datetime.now(UTC) - timedelta(minutes=5)).isoformat()
    cases = [
        (
            Rpc.LEDGER_COMMIT,
            {**commit("dgx-h100-02/gpu1", 1), "shares": [{"accelerator_id": "dgx-h100-02/gpu1", "weights": -5}]},
            "invalid_request",
        ),
        (Rpc.LEDGER_COMMIT, commit("no-such-node/gpu0", 1), "not_found"),
        (Rpc.LEDGER_COMMIT, commit(["dgx-h100-02/gpu1", "no-such-node/gpu0"], 1), "not_found"),  # all or nothing
        (Rpc.LEDGER_COMMIT, commit("dgx-h100-02/gpu1", 1, lease_expires_at=past), "invalid_request"),
        (Rpc.LEDGER_COMMIT, commit("dgx-h100-02/gpu1", 1, kind="request"), "invalid_request"),  # no parent
        (Rpc.LEDGER_RELEASE, {"allocation_id": held["allocation_id"], "tenant": "acme"}, "forbidden"),
        (Rpc.LEDGER_RENEW, {"allocation_id": held["allocation_id"], "tenant": "acme", "lease_s": 60}, "forbidden"),
        (
            Rpc.LEDGER_RENEW,
            {"allocation_id": held["allocation_id"], "tenant": "globex", "lease_expires_at": past},
            "invalid_request",
        ),
        (Rpc.LEDGER_RELEASE, {"allocation_id": "al-nope", "tenant": "acme"}, "not_found"),
    ]
    for rpc, body, code in cases:
        reply = await call(ledger, settings, rpc, body)
        assert reply["status"] == "rejected" and reply["error"]["code"] == code, (body, reply)
    assert await call(ledger, settings, Rpc.LEDGER_SNAPSHOT, {}) == before


async def test_a_stale_view_is_a_conflict_with_the_fresh_view(ledger: Client, settings: Settings) -> None:
    acc = "dgx-h100-02/gpu3"
    seen = (await reserved(ledger, settings, "dgx-h100-02"))[acc]
    first = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(acc, 60, expected={acc: seen}))
    assert first["status"] == "committed"
    late = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(acc, 30, expected={acc: seen}))
    assert late["error"]["code"] == "conflict"
    assert late["view"] == [{"id": acc, "usable": H100_USABLE, "reserved": 60 * GB, "available": True}]
    fresh = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(acc, 30, expected={acc: 60 * GB}))
    assert fresh["error"]["code"] == "no_capacity" and "short by" in fresh["error"]["message"]
    fits = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(acc, 19, expected={acc: 60 * GB}))
    assert fits["status"] == "committed"  # 60 + 19 = 79 GB <= 79.03 GB usable


async def test_an_unrenewed_lease_expires_with_an_event(ledger: Client, settings: Settings) -> None:
    acc = "dgx-h100-02/gpu4"
    short = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(acc, 10, lease_s=1))
    kept = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(acc, 10, lease_s=1))
    renewed = await call(
        ledger, settings, Rpc.LEDGER_RENEW, {"allocation_id": kept["allocation_id"], "tenant": "acme", "lease_s": 120}
    )
    assert renewed["status"] == "renewed"
    await asyncio.sleep(1.6)
    assert (await reserved(ledger, settings, "dgx-h100-02"))[acc] == 10 * GB
    expired = [
        e
        for e in await ledger_events(ledger, settings, "allocation_expired")
        if e["payload"]["allocation_id"] == short["allocation_id"]
    ]
    assert len(expired) == 1 and expired[0]["payload"]["shares"][0]["total"] == 10 * GB


async def test_lost_node_is_unavailable_and_its_allocations_flagged(ledger: Client, settings: Settings) -> None:
    held = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit("hgx-h200-01/gpu0", 50))
    js = ledger.jetstream()
    subjects = Subjects(settings.subject_prefix)

    async def topology(event: str) -> None:
        env = new_event(
            type=f"topology.{event}",
            source="test",
            occurred_at=datetime.now(UTC),
            payload={"node": "hgx-h200-01", "region": "us-east-1", "accelerators": []},
        )
        await js.publish(
            subjects.event(Context.TOPOLOGY, event),
            env.model_dump_json().encode(),
            headers={"Nats-Msg-Id": str(env.event_id)},
        )

    await topology("node_lost")
    for _ in range(100):
        snap = await call(ledger, settings, Rpc.LEDGER_SNAPSHOT, {"node": "hgx-h200-01"})
        if not snap["accelerators"][0]["available"]:
            break
        await asyncio.sleep(0.1)
    assert not any(a["available"] for a in snap["accelerators"])
    refused = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit("hgx-h200-01/gpu1", 1))
    assert refused["error"]["code"] == "no_capacity" and "unavailable" in refused["error"]["message"]
    flagged = await ledger_events(ledger, settings, "allocations_flagged")
    assert any(held["allocation_id"] in e["payload"]["allocation_ids"] for e in flagged)
    await topology("node_recovered")
    for _ in range(100):
        snap = await call(ledger, settings, Rpc.LEDGER_SNAPSHOT, {"node": "hgx-h200-01"})
        if snap["accelerators"][0]["available"]:
            break
        await asyncio.sleep(0.1)
    assert (await call(ledger, settings, Rpc.LEDGER_COMMIT, commit("hgx-h200-01/gpu1", 1)))["status"] == "committed"


async def test_drift_after_two_samples_over_ten_percent(ledger: Client, settings: Settings) -> None:
    js = ledger.jetstream()
    subject = Subjects(settings.subject_prefix).event(Context.TELEMETRY, "gpu")

    async def sample(used_gb: float) -> None:
        env = new_event(
            type="telemetry.gpu",
            source="test",
            occurred_at=datetime.now(UTC),
            payload={"node": "l40s-01", "gpus": [{"index": 5, "memory_used_bytes": int(used_gb * GB)}]},
        )
        await js.publish(subject, env.model_dump_json().encode(), headers={"Nats-Msg-Id": str(env.event_id)})

    # l40s-01/gpu5 has nothing reserved; usable = 48 GiB x 0.92 = 47.4 GB, so 10% = 4.74 GB.
    await sample(4.0)
    await sample(30.0)
    await asyncio.sleep(1.0)
    assert not [
        e
        for e in await ledger_events(ledger, settings, "drift_detected")
        if e["payload"]["accelerator_id"] == "l40s-01/gpu5"
    ]  # one sample over is not drift
    await sample(30.0)
    for _ in range(50):
        drift = [
            e
            for e in await ledger_events(ledger, settings, "drift_detected")
            if e["payload"]["accelerator_id"] == "l40s-01/gpu5"
        ]
        if drift:
            break
        await asyncio.sleep(0.1)
    assert len(drift) == 1 and drift[0]["payload"]["difference_bytes"] == 30 * GB


async def test_requests_live_inside_their_replica_kv_pool(ledger: Client, settings: Settings) -> None:
    acc = "dgx-a100-01/gpu0"
    replica = await call(
        ledger,
        settings,
        Rpc.LEDGER_COMMIT,
        {
            "request_id": "rep-1",
            "tenant": "acme",
            "shares": [{"accelerator_id": acc, "weights": 20 * GB, "kv": 10 * GB}],
        },
    )
    child = {"kind": "request", "parent_id": replica["allocation_id"], "tenant": "acme"}
    ok = await call(
        ledger,
        settings,
        Rpc.LEDGER_COMMIT,
        {**child, "request_id": "q-1", "shares": [{"accelerator_id": acc, "kv": 6 * GB}]},
    )
    assert ok["status"] == "committed"
    over = await call(
        ledger,
        settings,
        Rpc.LEDGER_COMMIT,
        {**child, "request_id": "q-2", "shares": [{"accelerator_id": acc, "kv": 5 * GB}]},
    )
    assert over["error"]["code"] == "no_capacity" and "KV pool" in over["error"]["message"]
    stranger = await call(
        ledger,
        settings,
        Rpc.LEDGER_COMMIT,
        {**child, "tenant": "globex", "request_id": "q-3", "shares": [{"accelerator_id": acc, "kv": 1 * GB}]},
    )
    assert stranger["error"]["code"] == "forbidden"
    assert (await reserved(ledger, settings, "dgx-a100-01"))[acc] == 30 * GB  # requests add nothing on top
    await call(ledger, settings, Rpc.LEDGER_RELEASE, {"allocation_id": replica["allocation_id"], "tenant": "acme"})
    released = [e["payload"]["allocation_id"] for e in await ledger_events(ledger, settings, "allocation_released")]
    assert ok["allocation_id"] in released  # the request went with its replica


async def test_replaying_the_ledger_stream_rebuilds_the_tables(ledger: Client, settings: Settings) -> None:
    import asyncpg

    await asyncio.sleep(0.5)  # let the relay publish the last commits
    rebuilt = replay_reserved(await ledger_events(ledger, settings))
    conn = await asyncpg.connect(plain_url(settings.database_url or ""))
    try:
        rows = await conn.fetch("SELECT id, reserved FROM ledger.accelerators WHERE reserved <> 0")
        sums = await conn.fetch(
            "SELECT accelerator_id, sum(total) AS s FROM ledger.shares WHERE active AND counts GROUP BY 1"
        )
    finally:
        await conn.close()
    tables = {r["id"]: r["reserved"] for r in rows}
    assert tables and rebuilt == tables
    assert {r["accelerator_id"]: r["s"] for r in sums} == tables  # the trigger kept the totals exact


async def test_fleet_get_shows_what_the_ledger_reserved(ledger: Client, settings: Settings) -> None:
    from shared.infra.fleet_client import fetch_fleet

    held = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit("dgx-h100-01/gpu5", 30))
    assert held["status"] == "committed"
    fleet = await fetch_fleet(ledger, Subjects(settings.subject_prefix))
    node = next(n for n in fleet["nodes"] if n["name"] == "dgx-h100-01")
    assert next(a for a in node["accelerators"] if a["index"] == 5)["hbm_reserved"] == 30 * GB


async def test_tpu_chips_are_ledger_accelerators(ledger: Client, settings: Settings) -> None:
    for _ in range(100):
        snap = await call(ledger, settings, Rpc.LEDGER_SNAPSHOT, {"node": "v5e-pod-1"})
        if len(snap["accelerators"]) == 256:
            break
        await asyncio.sleep(0.1)
    chips = {a["id"]: a for a in snap["accelerators"]}
    assert len(chips) == 256 and "v5e-pod-1/15.15" in chips
    assert chips["v5e-pod-1/0.0"]["hbm_usable"] == 16 * 2**30 * 23 // 25  # 16 GiB x 0.92
    v5p = await call(ledger, settings, Rpc.LEDGER_SNAPSHOT, {"node": "v5p-pod-1"})
    assert len(v5p["accelerators"]) == 512 and v5p["accelerators"][0]["id"] == "v5p-pod-1/0.0.0"
