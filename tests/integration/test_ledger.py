"""capacity-ledger on real NATS and Postgres: commits, idempotency, typed refusals that change nothing,
conflicts with a fresh view, leases, lost and removed nodes, capacity events, drift, KV pools of
replicas, snapshot pages, batch order, exclusive and shared replicas, cross-domain traffic per cluster,
the database's own guards, and replay.

Tests about bytes stack several replicas on one GPU: those replicas are ``shared`` (an exclusive one,
the default, holds its GPUs alone).

Events are asynchronous (outbox -> relay -> JetStream): every test that looks for one polls with a
deadline. To show an event did *not* happen, a test sends a later event through the same ordered
consumer whose effect it can see (a barrier) and only then counts."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client

from shared.contracts.base import Rejected
from shared.contracts.envelope import new_event
from shared.contracts.permissions import EVENT_PUBLISHERS, NODE_SCOPED_EVENTS
from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context, Rpc, Subjects
from shared.domain.ledger import replay_cross_domain, replay_reserved
from shared.infra.db import plain_url
from shared.infra.rpc import RpcClient
from shared.infra.settings import Settings
from tests.bench.ledger_stress import allocation_events
from tests.conftest import ServiceProcesses
from tests.jetstream import read_all
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")
GB = 10**9
H100_USABLE = 85_899_345_920 * 23 // 25  # 80 GiB x 0.92 = 79,027,398,246 bytes
DEMO_ACCELERATORS = 76 + 256 + 512  # the demo's GPUs and its TPU chips (v5e 16x16, v5p 8x8x8)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def ledger(service_processes: ServiceProcesses, settings: Settings) -> AsyncIterator[Client]:
    await service_processes.start_demo_ledger(prefix="ledger_", sweep_ms=100)
    client = await nats.connect(settings.kit.nats_url or "")

    async def learnt() -> bool:
        snap = await call(client, settings, Rpc.LEDGER_SNAPSHOT, {})
        return len(snap["accelerators"]) >= DEMO_ACCELERATORS

    # Tests compare whole snapshots before and after: wait for every accelerator first.
    await wait_for(learnt, 60, interval_s=0.2, what="the ledger learnt the demo fleet's accelerators")
    yield client
    await client.close()
    for name in ("ledger_ledger", "ledger_topology"):
        service_processes.stop(name)


async def call(nc: Client, settings: Settings, rpc: Rpc, body: dict[str, Any]) -> dict[str, Any]:
    msg = await nc.request(
        Subjects(settings.kit.subject_prefix).rpc(rpc), json.dumps(body, default=str).encode(), timeout=10
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
        "shares": [{"accelerator_id": a, "weights_bytes": int(gb * GB)} for a in accs],
        **extra,
    }


async def reserved(nc: Client, settings: Settings, node: str) -> dict[str, int]:
    snap = await call(nc, settings, Rpc.LEDGER_SNAPSHOT, {"node": node})
    return {a["id"]: a["hbm_reserved_bytes"] for a in snap["accelerators"]}


async def ledger_events(nc: Client, settings: Settings, event: str = ">") -> list[dict[str, Any]]:
    return await read_all(
        nc.jetstream(),
        stream=stream_name(Context.LEDGER, stream_prefix=settings.kit.stream_prefix),
        subject=f"{settings.kit.subject_prefix}.events.ledger.{event}",
    )


async def publish(nc: Client, settings: Settings, context: Context, event: str, payload: dict[str, Any]) -> None:
    """An event as its producer (topology, an agent) would publish it."""
    env = new_event(
        type=f"{context.value}.{event}",
        source=EVENT_PUBLISHERS[context],
        occurred_at=datetime.now(UTC),
        payload=payload,
    )
    node = payload.get("node") if event in NODE_SCOPED_EVENTS.get(context, ()) else None
    await nc.jetstream().publish(
        Subjects(settings.kit.subject_prefix).event(context, event, node=node),
        env.model_dump_json().encode(),
        headers={"Nats-Msg-Id": str(env.event_id)},
    )


async def superuser(settings: Settings) -> asyncpg.Connection:
    return await asyncpg.connect(plain_url(settings.kit.database_url or ""))


async def test_capacity_comes_from_topology_with_the_ceiling(ledger: Client, settings: Settings) -> None:
    snap = await call(ledger, settings, Rpc.LEDGER_SNAPSHOT, {"node": "dgx-h100-01"})
    assert [a["id"] for a in snap["accelerators"]] == [f"dgx-h100-01/gpu{i}" for i in range(8)]
    assert all(a["hbm_usable_bytes"] == H100_USABLE and a["available"] for a in snap["accelerators"])
    assert all({"hbm_usable", "hbm_reserved"}.isdisjoint(a) for a in snap["accelerators"])  # each figure once


async def test_same_commit_twice_reserves_once(ledger: Client, settings: Settings) -> None:
    body = commit(["dgx-h100-01/gpu0", "dgx-h100-01/gpu1"], 20, rid="twice-1")
    first = await call(ledger, settings, Rpc.LEDGER_COMMIT, body)
    second = await call(ledger, settings, Rpc.LEDGER_COMMIT, body)
    assert first["status"] == second["status"] == "committed"
    assert second["allocation_id"] == first["allocation_id"] and second["duplicate"] and not first["duplicate"]
    now = await reserved(ledger, settings, "dgx-h100-01")
    assert now["dgx-h100-01/gpu0"] == now["dgx-h100-01/gpu1"] == 20 * GB
    other = await call(
        ledger,
        settings,
        Rpc.LEDGER_COMMIT,
        {**body, "shares": [{"accelerator_id": "dgx-h100-01/gpu0", "weights_bytes": 1}]},
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


async def test_share_fields_are_still_accepted_under_their_deprecated_names(ledger: Client, settings: Settings) -> None:
    body = {
        "request_id": f"r-{uuid.uuid4().hex[:8]}",
        "tenant": "acme",
        "shares": [{"accelerator_id": "dgx-h100-01/gpu2", "weights": 3 * GB, "kv": 1 * GB}],
    }
    reply = await call(ledger, settings, Rpc.LEDGER_COMMIT, body)
    assert reply["status"] == "committed"
    assert reply["view"][0]["reserved_bytes"] == 4 * GB and "reserved" not in reply["view"][0]  # sent once
    both = {**body, "request_id": f"r-{uuid.uuid4().hex[:8]}"}
    both["shares"] = [{"accelerator_id": "dgx-h100-01/gpu2", "weights": 3 * GB, "weights_bytes": 2 * GB}]
    refused = await call(ledger, settings, Rpc.LEDGER_COMMIT, both)
    assert refused["error"]["code"] == "invalid_request" and "weights_bytes" in refused["error"]["message"]
    await call(ledger, settings, Rpc.LEDGER_RELEASE, {"allocation_id": reply["allocation_id"], "tenant": "acme"})


async def test_bad_input_gets_typed_errors_and_changes_nothing(ledger: Client, settings: Settings) -> None:
    held = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit("dgx-h100-02/gpu0", 5, tenant="globex"))
    before = await call(ledger, settings, Rpc.LEDGER_SNAPSHOT, {})
    past = (datetime.now(UTC) - timedelta(minutes=5)).isoformat()
    cases = [
        (
            Rpc.LEDGER_COMMIT,
            {**commit("dgx-h100-02/gpu1", 1), "shares": [{"accelerator_id": "dgx-h100-02/gpu1", "weights_bytes": -5}]},
            "invalid_request",
        ),
        (Rpc.LEDGER_COMMIT, commit("no-such-node/gpu0", 1), "not_found"),
        (Rpc.LEDGER_COMMIT, commit(["dgx-h100-02/gpu1", "no-such-node/gpu0"], 1), "not_found"),  # all or nothing
        (Rpc.LEDGER_COMMIT, commit("dgx-h100-02/gpu1", 1, lease_expires_at=past), "invalid_request"),
        (Rpc.LEDGER_COMMIT, commit("dgx-h100-02/gpu1", 1, kind="request"), "invalid_request"),  # replicas only
        (
            Rpc.LEDGER_COMMIT,
            commit("dgx-h100-02/gpu0", 1, tenant="globex", kind="request", parent_id=held["allocation_id"]),
            "invalid_request",
        ),
        # Another tenant's allocation: answered as an unknown one (issue 23: an id says nothing of its existence).
        (Rpc.LEDGER_RELEASE, {"allocation_id": held["allocation_id"], "tenant": "acme"}, "not_found"),
        (Rpc.LEDGER_RENEW, {"allocation_id": held["allocation_id"], "tenant": "acme", "lease_s": 60}, "not_found"),
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
    first = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(acc, 60, expected={acc: seen}, sharing="shared"))
    assert first["status"] == "committed"
    late = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(acc, 30, expected={acc: seen}, sharing="shared"))
    assert late["status"] == "rejected" and late["error"]["code"] == "conflict"
    assert late["error"]["details"]["view"] == [
        {
            "id": acc,
            "usable_bytes": H100_USABLE,
            "reserved_bytes": 60 * GB,
            "available": True,
        }
    ]
    fresh = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(acc, 30, expected={acc: 60 * GB}, sharing="shared"))
    assert fresh["error"]["code"] == "no_capacity" and "short by" in fresh["error"]["message"]
    fits = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(acc, 19, expected={acc: 60 * GB}, sharing="shared"))
    assert fits["status"] == "committed"  # 60 + 19 = 79 GB <= 79.03 GB usable


async def test_commit_batch_answers_each_commit_in_request_order(ledger: Client, settings: Settings) -> None:
    acc = "dgx-h100-02/gpu5"
    commits = [
        commit(acc, 10, rid=f"batch-{uuid.uuid4().hex[:6]}-0", sharing="shared"),
        commit("no-such-node/gpu0", 1, rid=f"batch-{uuid.uuid4().hex[:6]}-1"),
        commit(acc, 70, rid=f"batch-{uuid.uuid4().hex[:6]}-2", sharing="shared"),  # 10 + 70 > 79.03 GB: refused
        commit(acc, 20, rid=f"batch-{uuid.uuid4().hex[:6]}-3", sharing="shared"),
        commit("dgx-h100-02/gpu6", 5, rid=f"batch-{uuid.uuid4().hex[:6]}-4"),
    ]
    reply = await call(ledger, settings, Rpc.LEDGER_COMMIT_BATCH, {"commits": commits})
    results = reply["results"]
    assert [r["request_id"] for r in results] == [c["request_id"] for c in commits]
    assert [r["status"] for r in results] == ["committed", "rejected", "rejected", "committed", "committed"]
    assert [(r.get("error") or {}).get("code") for r in results] == [None, "not_found", "no_capacity", None, None]
    # Each commit saw the ones before it: the refusal's view holds the first commit's 10 GB.
    assert results[2]["view"][0]["reserved_bytes"] == 10 * GB
    assert (await reserved(ledger, settings, "dgx-h100-02"))[acc] == 30 * GB


async def test_snapshot_pages_cover_every_accelerator_once(ledger: Client, settings: Settings) -> None:
    whole = [a["id"] for a in (await call(ledger, settings, Rpc.LEDGER_SNAPSHOT, {}))["accelerators"]]
    assert len(whole) >= DEMO_ACCELERATORS
    for request, size in (({}, 100), ({"node": "dgx-h100-02"}, 3)):
        seen: list[str] = []
        cursor: str | None = None
        for _page in range(len(whole) // size + 2):  # a cursor that is not followed would never end
            page = await call(ledger, settings, Rpc.LEDGER_SNAPSHOT, {**request, "limit": size, "cursor": cursor})
            ids = [a["id"] for a in page["accelerators"]]
            assert 0 < len(ids) <= size
            seen += ids
            cursor = page["next_cursor"]
            if cursor is None:
                break
        assert cursor is None, "the pages never ended"
        assert len(seen) == len(set(seen)), "a page repeated accelerators"
        expected = [i for i in whole if "node" not in request or i.startswith(f"{request['node']}/")]
        assert seen == expected
    # The typed client follows the cursor the same way.
    rpc = RpcClient(ledger, Subjects(settings.kit.subject_prefix))
    merged = await rpc.ledger_snapshot(limit=250)
    assert not isinstance(merged, Rejected)
    assert [a.id for a in merged.accelerators] == whole


async def test_an_unrenewed_lease_expires_with_an_event(ledger: Client, settings: Settings) -> None:
    acc = "dgx-h100-02/gpu4"
    short = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(acc, 10, lease_s=1, sharing="shared"))
    kept = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(acc, 10, lease_s=1, sharing="shared"))
    renewed = await call(
        ledger, settings, Rpc.LEDGER_RENEW, {"allocation_id": kept["allocation_id"], "tenant": "acme", "lease_s": 120}
    )
    assert renewed["status"] == "renewed"

    async def expired_events() -> list[dict[str, Any]]:
        return [
            e
            for e in await ledger_events(ledger, settings, "allocation_expired")
            if e["payload"]["allocation_id"] == short["allocation_id"]
        ]

    expired = await wait_for(expired_events, 15, interval_s=0.2, what="the short lease expired")
    assert len(expired) == 1 and expired[0]["payload"]["shares"][0]["total_bytes"] == 10 * GB
    assert (await reserved(ledger, settings, "dgx-h100-02"))[acc] == 10 * GB  # the renewed one stays
    assert not [
        e
        for e in await ledger_events(ledger, settings, "allocation_expired")
        if e["payload"]["allocation_id"] == kept["allocation_id"]
    ]


async def _node_available(ledger: Client, settings: Settings, node: str, available: bool) -> None:
    async def reached() -> bool:
        snap = await call(ledger, settings, Rpc.LEDGER_SNAPSHOT, {"node": node})
        return all(a["available"] == available for a in snap["accelerators"])

    await wait_for(reached, 15, interval_s=0.1, what=f"{node} available={available}")


async def _capacity_event(ledger: Client, settings: Settings, node: str, reason: str) -> dict[str, Any]:
    async def found() -> list[dict[str, Any]]:
        return [
            e
            for e in await ledger_events(ledger, settings, "capacity_changed")
            if e["payload"]["node"] == node and e["payload"]["reason"] == reason
        ]

    events: list[dict[str, Any]] = await wait_for(found, 15, interval_s=0.2, what=f"capacity_changed {node} {reason}")
    return events[-1]


async def test_lost_node_is_unavailable_and_its_allocations_flagged(ledger: Client, settings: Settings) -> None:
    node = "hgx-h200-01"
    # A GPU a shared replica may join, with the most room: other tests of the run may have placed
    # replicas on this node.
    snap = await call(ledger, settings, Rpc.LEDGER_SNAPSHOT, {"node": node})
    gpu = max(
        snap["accelerators"],
        key=lambda a: (a["hbm_reserved_bytes"] == 0 or a["shared"], a["hbm_usable_bytes"] - a["hbm_reserved_bytes"]),
    )["id"]
    held = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(gpu, 50, sharing="shared"))
    assert held["status"] == "committed", held
    state = {"node": node, "region": "us-east-1", "accelerators": []}
    await publish(ledger, settings, Context.TOPOLOGY, "node_lost", state)
    await _node_available(ledger, settings, node, False)
    refused = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(gpu, 1, sharing="shared"))
    assert refused["error"]["code"] == "no_capacity" and "unavailable" in refused["error"]["message"]

    async def flagged() -> bool:
        events = await ledger_events(ledger, settings, "allocations_flagged")
        return any(held["allocation_id"] in e["payload"]["allocation_ids"] for e in events)

    await wait_for(flagged, 15, interval_s=0.2, what="allocations_flagged for the lost node")
    lost = await _capacity_event(ledger, settings, node, "lost")
    assert len(lost["payload"]["accelerators"]) == 8
    assert not any(a["available"] for a in lost["payload"]["accelerators"])
    # What it held is still on the books (other tests of the run may have placed more on this GPU).
    assert next(a for a in lost["payload"]["accelerators"] if a["id"] == gpu)["reserved_bytes"] >= 50 * GB
    await publish(ledger, settings, Context.TOPOLOGY, "node_recovered", state)
    await _node_available(ledger, settings, node, True)
    recovered = await _capacity_event(ledger, settings, node, "recovered")
    assert all(a["available"] for a in recovered["payload"]["accelerators"])
    assert (await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(gpu, 1, sharing="shared")))["status"] == "committed"


async def test_removed_node_takes_nothing_more_and_its_allocations_are_flagged(
    ledger: Client, settings: Settings
) -> None:
    node = "hgx-h200-02"
    held = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(f"{node}/gpu3", 40))
    assert held["status"] == "committed"
    await publish(
        ledger, settings, Context.TOPOLOGY, "node_removed", {"node": node, "region": "us-east-1", "accelerators": []}
    )
    await _node_available(ledger, settings, node, False)
    refused = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(f"{node}/gpu4", 1))
    assert refused["error"]["code"] == "no_capacity" and "unavailable" in refused["error"]["message"]

    async def flagged() -> list[dict[str, Any]]:
        return [
            e
            for e in await ledger_events(ledger, settings, "allocations_flagged")
            if e["payload"]["node"] == node and held["allocation_id"] in e["payload"]["allocation_ids"]
        ]

    events = await wait_for(flagged, 15, interval_s=0.2, what="allocations_flagged for the removed node")
    assert events[0]["payload"]["reason"] == "node_removed"
    removed = await _capacity_event(ledger, settings, node, "removed")
    assert [a["available"] for a in removed["payload"]["accelerators"]] == [False] * 8


async def test_a_profiled_node_announces_its_capacity(ledger: Client, settings: Settings) -> None:
    event = await _capacity_event(ledger, settings, "dgx-h100-01", "profiled")
    assert [a["id"] for a in event["payload"]["accelerators"]] == [f"dgx-h100-01/gpu{i}" for i in range(8)]
    assert all(a["usable_bytes"] == H100_USABLE and a["available"] for a in event["payload"]["accelerators"])


async def test_drift_after_two_samples_over_ten_percent_once_per_episode(ledger: Client, settings: Settings) -> None:
    async def sample(index: int, used_gb: float) -> None:
        gpus = [{"index": index, "memory_used_bytes": int(used_gb * GB)}]
        await publish(ledger, settings, Context.TELEMETRY, "gpu", {"node": "l40s-01", "gpus": gpus})

    async def drifts(index: int) -> list[dict[str, Any]]:
        return [
            e
            for e in await ledger_events(ledger, settings, "drift_detected")
            if e["payload"]["accelerator_id"] == f"l40s-01/gpu{index}"
        ]

    async def barrier(index: int) -> None:
        """Drift on another GPU, through the same ordered consumer: once it shows, every sample sent
        before it has been applied (and its events published: the relay keeps their order)."""
        await sample(index, 30.0)
        await sample(index, 30.0)
        await wait_for(lambda: drifts(index), 15, interval_s=0.2, what=f"drift on l40s-01/gpu{index}")

    # l40s-01/gpu5 has nothing reserved; usable = 48 GiB x 0.92 = 47.4 GB, so 10% = 4.74 GB.
    await sample(5, 4.0)
    await sample(5, 30.0)
    await barrier(6)
    assert not await drifts(5)  # one sample over is not drift
    await sample(5, 30.0)
    drift = await wait_for(lambda: drifts(5), 15, interval_s=0.2, what="drift on l40s-01/gpu5")
    assert len(drift) == 1 and drift[0]["payload"]["difference_bytes"] == 30 * GB
    await sample(5, 31.0)  # the same episode goes on: no second report
    await barrier(7)
    assert len(await drifts(5)) == 1
    await sample(5, 1.0)  # back inside the band: the episode ends
    await sample(5, 25.0)
    await sample(5, 25.0)

    async def second() -> list[dict[str, Any]]:
        found = await drifts(5)
        return found if len(found) == 2 else []

    again = await wait_for(second, 15, interval_s=0.2, what="a second drift episode on l40s-01/gpu5")
    assert again[1]["payload"]["difference_bytes"] == 25 * GB


async def test_no_drift_on_a_gpu_whose_replica_was_just_committed(ledger: Client, settings: Settings) -> None:
    """HETSCHED_LEDGER_DRIFT_GRACE_S (600 s by default): a replica's engine still loading holds nothing of
    its reservation, and that is not drift; a GPU with nothing reserved beside it drifts as ever."""
    reply = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit("l40s-01/gpu2", 30))
    assert reply["status"] == "committed", reply

    async def drifts(index: int) -> list[dict[str, Any]]:
        return [
            e
            for e in await ledger_events(ledger, settings, "drift_detected")
            if e["payload"]["accelerator_id"] == f"l40s-01/gpu{index}"
        ]

    try:
        # gpu2: 30 GB reserved, 0 used (its engine loads); gpu3: nothing reserved, 30 GB used (drift).
        gpus = [{"index": 2, "memory_used_bytes": 0}, {"index": 3, "memory_used_bytes": 30 * GB}]
        for _ in range(3):
            await publish(ledger, settings, Context.TELEMETRY, "gpu", {"node": "l40s-01", "gpus": gpus})
        await wait_for(lambda: drifts(3), 15, interval_s=0.2, what="drift on l40s-01/gpu3")
        assert not await drifts(2)  # the same samples, judged together: gpu2 is within its grace
    finally:
        await call(ledger, settings, Rpc.LEDGER_RELEASE, {"allocation_id": reply["allocation_id"], "tenant": "acme"})


async def test_a_request_commit_is_refused_typed_and_changes_nothing(ledger: Client, settings: Settings) -> None:
    """The ledger holds replicas only: admissions are counted by placement in memory, so a `request`
    commit (a KV hold inside a replica, as the ledger once took) is refused and writes nothing."""
    acc = "dgx-a100-01/gpu0"
    replica = await call(
        ledger,
        settings,
        Rpc.LEDGER_COMMIT,
        {
            "request_id": f"rep-{uuid.uuid4().hex[:8]}",
            "tenant": "acme",
            "shares": [{"accelerator_id": acc, "weights_bytes": 20 * GB, "kv_bytes": 10 * GB}],
        },
    )
    assert replica["status"] == "committed"
    before = await call(ledger, settings, Rpc.LEDGER_SNAPSHOT, {})
    rid = f"q-{uuid.uuid4().hex[:8]}"
    hold = {
        "request_id": rid,
        "tenant": "acme",
        "kind": "request",
        "parent_id": replica["allocation_id"],
        "shares": [{"accelerator_id": acc, "kv_bytes": GB}],
    }
    refused = await call(ledger, settings, Rpc.LEDGER_COMMIT, hold)
    assert refused["status"] == "rejected" and refused["error"]["code"] == "invalid_request", refused
    assert "replicas only" in refused["error"]["message"] and "placement" in refused["error"]["message"]
    batch = await call(ledger, settings, Rpc.LEDGER_COMMIT_BATCH, {"commits": [hold]})
    assert [(r["status"], r["error"]["code"]) for r in batch["results"]] == [("rejected", "invalid_request")]
    assert await call(ledger, settings, Rpc.LEDGER_SNAPSHOT, {}) == before
    conn = await superuser(settings)
    try:
        assert await conn.fetchval("SELECT count(*) FROM ledger.allocations WHERE request_id = $1", rid) == 0
    finally:
        await conn.close()

    async def committed() -> list[str]:
        # Once the replica's own commit is on the stream, a commit of the hold would have been too.
        events = await ledger_events(ledger, settings, "allocation_committed")
        ids = [e["payload"]["request_id"] for e in events]
        return ids if replica["request_id"] in ids else []

    assert rid not in await wait_for(committed, 15, interval_s=0.2, what="the replica's commit on the stream")
    # The session's database is shared with later modules (the metrics test places on this node).
    released = await call(
        ledger, settings, Rpc.LEDGER_RELEASE, {"allocation_id": replica["allocation_id"], "tenant": "acme"}
    )
    assert released["status"] == "released", released


async def test_a_replica_s_end_still_ends_a_request_row_written_before_the_retirement(
    ledger: Client, settings: Settings
) -> None:
    """Rows of kind `request` from before admissions left the ledger (until migration 0017 ends them) go
    with their replica, as they always did."""
    acc = "dgx-a100-01/gpu1"
    replica = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(acc, 20))
    assert replica["status"] == "committed"
    legacy = f"al-legacy-{uuid.uuid4().hex[:8]}"
    conn = await superuser(settings)
    try:
        async with conn.transaction():
            await conn.execute(
                "INSERT INTO ledger.allocations (id, request_id, tenant, kind, parent_id, state, preemptible, "
                "priority, lease_expires_at) VALUES ($1, $1, 'acme', 'request', $2, 'active', false, 0, "
                "now() + interval '1 hour')",
                legacy,
                replica["allocation_id"],
            )
            await conn.execute(
                "INSERT INTO ledger.shares (allocation_id, accelerator_id, weights, kv, activation, workspace, "
                "total, counts, active) VALUES ($1, $2, 0, $3, 0, 0, $3, false, true)",
                legacy,
                acc,
                GB,
            )
        assert (await reserved(ledger, settings, "dgx-a100-01"))[acc] == 20 * GB  # the hold counts nothing
        released = await call(
            ledger, settings, Rpc.LEDGER_RELEASE, {"allocation_id": replica["allocation_id"], "tenant": "acme"}
        )
        assert released["status"] == "released", released
        row = await conn.fetchrow("SELECT state, ended_at FROM ledger.allocations WHERE id = $1", legacy)
        assert row["state"] == "released" and row["ended_at"] is not None
        assert not await conn.fetchval("SELECT active FROM ledger.shares WHERE allocation_id = $1", legacy)
    finally:
        await conn.close()

    async def request_released() -> bool:
        gone = [e["payload"]["allocation_id"] for e in await ledger_events(ledger, settings, "allocation_released")]
        return legacy in gone

    await wait_for(request_released, 15, interval_s=0.2, what="the legacy request went with its replica")


# -- exclusive and shared replicas; cross-domain traffic per cluster -----------------------------------

SHARING_NODE = "hgx-h100-4x4-01"  # used by no other test of this module


async def release(nc: Client, settings: Settings, reply: dict[str, Any], tenant: str = "acme") -> None:
    released = await call(nc, settings, Rpc.LEDGER_RELEASE, {"allocation_id": reply["allocation_id"], "tenant": tenant})
    assert released["status"] == "released", released


async def views(nc: Client, settings: Settings, node: str) -> dict[str, dict[str, Any]]:
    snap = await call(nc, settings, Rpc.LEDGER_SNAPSHOT, {"node": node})
    return {a["id"]: a for a in snap["accelerators"]}


async def test_an_exclusive_group_holds_its_gpus_alone_until_released(ledger: Client, settings: Settings) -> None:
    g = [f"{SHARING_NODE}/gpu{i}" for i in range(3)]
    group = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(g[:2], 20))  # TP=2, exclusive by default
    assert group["status"] == "committed", group
    overlapping = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(g[1:], 20))
    assert overlapping["error"]["code"] == "no_capacity", overlapping
    assert overlapping["error"]["message"] == f"{g[1]}: held by another replica (exclusive groups don't share a GPU)"
    beside = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(g[0], 1, sharing="shared"))
    assert beside["error"]["code"] == "no_capacity" and "held by another replica" in beside["error"]["message"]
    now = await views(ledger, settings, SHARING_NODE)
    assert [now[a]["hbm_reserved_bytes"] for a in g] == [20 * GB, 20 * GB, 0]  # the refusals reserved nothing
    assert not any(now[a]["shared"] for a in g)
    await release(ledger, settings, group)
    again = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(g[1:], 20))  # the freed GPU takes a new group
    assert again["status"] == "committed", again
    await release(ledger, settings, again)


async def test_shared_replicas_sit_together_and_keep_exclusive_groups_out(ledger: Client, settings: Settings) -> None:
    acc = f"{SHARING_NODE}/gpu4"
    a = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(acc, 10, sharing="shared"))
    b = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(acc, 10, sharing="shared"))
    assert a["status"] == b["status"] == "committed", (a, b)
    view = (await views(ledger, settings, SHARING_NODE))[acc]
    assert view["shared"] and view["hbm_reserved_bytes"] == 20 * GB
    assert sorted(view["allocations"]) == sorted([a["allocation_id"], b["allocation_id"]])
    group = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit([acc, f"{SHARING_NODE}/gpu5"], 1))
    assert group["error"]["code"] == "no_capacity", group
    assert group["error"]["message"] == (
        f"{acc}: held by another replica, a shared one (an exclusive group takes only idle GPUs)"
    )
    await release(ledger, settings, a)
    assert (await views(ledger, settings, SHARING_NODE))[acc]["shared"]  # b still holds it, shared
    await release(ledger, settings, b)
    view = (await views(ledger, settings, SHARING_NODE))[acc]
    assert not view["shared"] and view["hbm_reserved_bytes"] == 0
    alone = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(acc, 1))
    assert alone["status"] == "committed", alone
    joining = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(acc, 1, sharing="shared"))
    assert joining["error"]["message"] == (
        f"{acc}: held by another replica, an exclusive one (a shared replica joins only shared ones)"
    )
    await release(ledger, settings, alone)


async def test_racing_exclusive_groups_for_one_gpu_commit_exactly_one(ledger: Client, settings: Settings) -> None:
    """Two placements (or a placement and the reservation filler) deciding on the same idle GPU at once:
    whether their commits meet in one group-commit batch or in two transactions, one wins."""
    acc = f"{SHARING_NODE}/gpu6"
    for round_ in range(3):
        replies = await asyncio.gather(
            *(call(ledger, settings, Rpc.LEDGER_COMMIT, commit(acc, 5, expected={acc: 0})) for _ in range(8))
        )
        won = [r for r in replies if r["status"] == "committed"]
        assert len(won) == 1, (round_, replies)
        # Each loser decided when the GPU was idle: a conflict, with the fresh view to decide again.
        assert {r["error"]["code"] for r in replies if r["status"] != "committed"} == {"conflict"}
        assert (await views(ledger, settings, SHARING_NODE))[acc]["hbm_reserved_bytes"] == 5 * GB
        await release(ledger, settings, won[0])


async def test_cross_domain_traffic_is_summed_per_cluster_and_given_back(ledger: Client, settings: Settings) -> None:
    node = "l40s-02"  # us-west-1 / c1: its cluster key is "us-west-1/c1"
    accs = [f"{node}/gpu{i}" for i in range(4)]

    async def crossing() -> tuple[dict[str, int], dict[str, dict[str, Any]]]:
        # A page of one node, one accelerator: the cross-domain figures are still the whole fleet's.
        snap = await call(ledger, settings, Rpc.LEDGER_SNAPSHOT, {"node": node, "limit": 1})
        per_cluster: dict[str, int] = {}
        for c in snap["cross_domain"]:
            if c["cluster"] is not None:
                per_cluster[c["cluster"]] = per_cluster.get(c["cluster"], 0) + c["bytes_per_s"]
        assert snap["cross_domain_used"] == per_cluster  # the sum is of the allocations listed
        return snap["cross_domain_used"], {c["allocation_id"]: c for c in snap["cross_domain"]}

    before, _ = await crossing()
    kept = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(accs[:2], 5, cross_domain_bytes_per_s=40 * GB))
    short = await call(
        ledger, settings, Rpc.LEDGER_COMMIT, commit(accs[2:], 5, cross_domain_bytes_per_s=10 * GB, lease_s=1)
    )
    plain = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit("l40s-02/gpu7", 1, sharing="shared"))
    assert kept["status"] == short["status"] == plain["status"] == "committed"
    used, listed = await crossing()
    assert used.get("us-west-1/c1", 0) - before.get("us-west-1/c1", 0) in (
        50 * GB,
        40 * GB,
    )  # the short lease may be gone already
    assert listed[kept["allocation_id"]] == {
        "allocation_id": kept["allocation_id"],
        "cluster": "us-west-1/c1",
        "bytes_per_s": 40 * GB,
    }
    assert plain["allocation_id"] not in listed

    async def event_of(name: str, allocation_id: str) -> dict[str, Any] | None:
        found = [
            e for e in await ledger_events(ledger, settings, name) if e["payload"]["allocation_id"] == allocation_id
        ]
        return found[0]["payload"] if found else None

    committed = await wait_for(lambda: event_of("allocation_committed", kept["allocation_id"]), 15, interval_s=0.2)
    assert (committed["sharing"], committed["cross_domain_bytes_per_s"], committed["cluster"]) == (
        "exclusive",
        40 * GB,
        "us-west-1/c1",
    )
    shared = await wait_for(lambda: event_of("allocation_committed", plain["allocation_id"]), 15, interval_s=0.2)
    assert (shared["sharing"], shared["cross_domain_bytes_per_s"], shared["cluster"]) == ("shared", 0, "us-west-1/c1")
    expired = await wait_for(lambda: event_of("allocation_expired", short["allocation_id"]), 15, interval_s=0.2)
    assert (expired["cross_domain_bytes_per_s"], expired["cluster"]) == (
        10 * GB,
        "us-west-1/c1",
    )  # what a follower takes back
    used, listed = await crossing()
    assert (
        used.get("us-west-1/c1", 0) - before.get("us-west-1/c1", 0) == 40 * GB and short["allocation_id"] not in listed
    )
    await release(ledger, settings, kept)
    released = await wait_for(lambda: event_of("allocation_released", kept["allocation_id"]), 15, interval_s=0.2)
    assert (released["sharing"], released["cross_domain_bytes_per_s"], released["cluster"]) == (
        "exclusive",
        40 * GB,
        "us-west-1/c1",
    )
    used, listed = await crossing()
    assert used.get("us-west-1/c1", 0) == before.get("us-west-1/c1", 0) and kept["allocation_id"] not in listed
    await release(ledger, settings, plain)

    async def replay_matches() -> bool:
        # What a follower folds from the stream equals what the snapshot says.
        published = [e for e in await ledger_events(ledger, settings) if e["source"] == "capacity-ledger"]
        return replay_cross_domain(allocation_events(published)) == (await crossing())[0]

    await wait_for(replay_matches, 20, interval_s=0.2, what="replayed cross-domain use == snapshot")


async def test_the_database_refuses_a_replica_beside_an_exclusive_one_whatever_the_code_does(
    ledger: Client, settings: Settings
) -> None:
    acc = "a100-pcie-01/gpu5"
    allocation = (
        "INSERT INTO ledger.allocations (id, request_id, tenant, kind, state, preemptible, priority, "
        "lease_expires_at, sharing) VALUES ($1, $1, 'acme', 'replica', 'active', false, 0, "
        "now() + interval '1 hour', $2)"
    )
    share = (
        "INSERT INTO ledger.shares (allocation_id, accelerator_id, weights, kv, activation, workspace, total, "
        "counts, active) VALUES ($1, $2, $3, 0, 0, 0, $3, true, true)"
    )
    # The commit path's shape: the allocation and its share in one statement.
    together = (
        "WITH a AS (INSERT INTO ledger.allocations (id, request_id, tenant, kind, state, preemptible, priority, "
        "lease_expires_at, sharing) VALUES ($1, $1, 'acme', 'replica', 'active', false, 0, "
        "now() + interval '1 hour', $2) RETURNING id) "
        "INSERT INTO ledger.shares (allocation_id, accelerator_id, weights, kv, activation, workspace, total, "
        "counts, active) SELECT id, $3, $4, 0, 0, 0, $4, true, true FROM a"
    )
    conn = await superuser(settings)
    try:
        tx = conn.transaction()
        await tx.start()
        try:
            for allocation_id, sharing in (("al-sql-x1", "exclusive"), ("al-sql-x2", "exclusive"),
                                           ("al-sql-s1", "shared"), ("al-sql-s2", "shared")):  # fmt: skip
                await conn.execute(allocation, allocation_id, sharing)
            await conn.execute(share, "al-sql-x1", acc, GB)
            for intruder in ("al-sql-x2", "al-sql-s1"):
                with pytest.raises(asyncpg.CheckViolationError, match="held by another replica"):
                    async with conn.transaction():
                        await conn.execute(share, intruder, acc, GB)
            await conn.execute("UPDATE ledger.shares SET active = false WHERE allocation_id = 'al-sql-x1'")
            await conn.execute(share, "al-sql-s1", acc, GB)
            await conn.execute(share, "al-sql-s2", acc, GB)  # shared beside shared
            await conn.execute(together, "al-sql-s3", "shared", acc, GB)
            with pytest.raises(asyncpg.CheckViolationError, match="held by another replica"):
                async with conn.transaction():
                    await conn.execute(share, "al-sql-x2", acc, GB)
            with pytest.raises(asyncpg.CheckViolationError, match="held by another replica"):
                async with conn.transaction():
                    await conn.execute(together, "al-sql-x3", "exclusive", acc, GB)
            # A request (a KV hold inside its replica) counts nothing and is no replica: not checked.
            await conn.execute(
                "INSERT INTO ledger.shares (allocation_id, accelerator_id, weights, kv, activation, workspace, "
                "total, counts, active) VALUES ('al-sql-x2', $1, 0, 1, 0, 0, 1, false, true)",
                acc,
            )
            assert await conn.fetchval("SELECT reserved FROM ledger.accelerators WHERE id = $1", acc) == 3 * GB
        finally:
            await tx.rollback()
        assert await conn.fetchval("SELECT reserved FROM ledger.accelerators WHERE id = $1", acc) == 0
    finally:
        await conn.close()


async def test_the_database_refuses_an_over_commit_whatever_the_code_does(ledger: Client, settings: Settings) -> None:
    acc = "a100-pcie-01/gpu7"
    conn = await superuser(settings)
    try:
        tx = conn.transaction()
        await tx.start()
        try:
            await conn.execute(
                "INSERT INTO ledger.allocations (id, request_id, tenant, kind, state, preemptible, priority, "
                "lease_expires_at) VALUES ('al-sql-over', 'sql-over', 'acme', 'replica', 'active', false, 0, "
                "now() + interval '1 hour')"
            )
            with pytest.raises(asyncpg.CheckViolationError, match="over-commit"):
                await conn.execute(
                    "INSERT INTO ledger.shares (allocation_id, accelerator_id, weights, kv, activation, workspace, "
                    "total, counts, active) SELECT 'al-sql-over', id, hbm_usable + 1, 0, 0, 0, hbm_usable + 1, "
                    "true, true FROM ledger.accelerators WHERE id = $1",
                    acc,
                )
        finally:
            await tx.rollback()
        assert await conn.fetchval("SELECT reserved FROM ledger.accelerators WHERE id = $1", acc) == 0
    finally:
        await conn.close()


async def test_the_journal_is_append_only_even_for_the_superuser(ledger: Client, settings: Settings) -> None:
    held = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit("a100-pcie-01/gpu6", 1))
    assert held["status"] == "committed"  # so the journal has a row of this test's
    conn = await superuser(settings)
    try:
        seq = await conn.fetchval("SELECT max(seq) FROM ledger.journal WHERE allocation_id = $1", held["allocation_id"])
        assert seq is not None
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="append-only"):
            await conn.execute("UPDATE ledger.journal SET delta = 0 WHERE seq = $1", seq)
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="append-only"):
            await conn.execute("DELETE FROM ledger.journal WHERE seq = $1", seq)
        assert await conn.fetchval("SELECT count(*) FROM ledger.journal WHERE seq = $1", seq) == 1
    finally:
        await conn.close()


async def test_replaying_the_ledger_stream_rebuilds_the_tables(ledger: Client, settings: Settings) -> None:
    # Its own history, so the test means the same alone as after the others: commits on three
    # accelerators, one released, and a replica.
    accs = ["a100-pcie-01/gpu0", "a100-pcie-01/gpu1", "a100-pcie-01/gpu2"]
    kept = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(accs[:2], 7, sharing="shared"))
    gone = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(accs[1:], 3, sharing="shared"))
    replica = await call(
        ledger,
        settings,
        Rpc.LEDGER_COMMIT,
        {
            "request_id": f"r-{uuid.uuid4().hex[:8]}",
            "tenant": "acme",
            "sharing": "shared",
            "shares": [{"accelerator_id": accs[2], "kv_bytes": GB}],
        },
    )
    assert all(r["status"] == "committed" for r in (kept, gone, replica))
    released = await call(
        ledger, settings, Rpc.LEDGER_RELEASE, {"allocation_id": gone["allocation_id"], "tenant": "acme"}
    )
    assert released["status"] == "released"

    async def tables() -> tuple[dict[str, int], dict[str, int]]:
        conn = await superuser(settings)
        try:
            rows = await conn.fetch("SELECT id, reserved FROM ledger.accelerators")
            sums = await conn.fetch(
                "SELECT accelerator_id, sum(total) AS s FROM ledger.shares WHERE active AND counts GROUP BY 1"
            )
        finally:
            await conn.close()
        return {r["id"]: r["reserved"] for r in rows}, {r["accelerator_id"]: r["s"] for r in sums}

    async def replay_matches() -> tuple[dict[str, int], dict[str, int]] | None:
        known, sums = await tables()
        # What the ledger published: other tests of the run publish hand-made LEDGER events (source
        # "test") to exercise consumers, and they share the stream.
        published = [e for e in await ledger_events(ledger, settings) if e["source"] == "capacity-ledger"]
        rebuilt = replay_reserved(allocation_events(published))
        reserved_now = {a: b for a, b in known.items() if b != 0}
        return (reserved_now, sums) if rebuilt == reserved_now else None

    # Events leave through the outbox relay: poll until the stream has caught up with the tables.
    matched = await wait_for(replay_matches, 20, interval_s=0.2, what="replay == tables")
    assert matched is not None
    reserved_now, sums = matched
    assert reserved_now[accs[0]] >= 7 * GB and reserved_now[accs[2]] >= GB
    assert sums == reserved_now  # the trigger kept the totals exact


async def test_fleet_get_shows_what_the_ledger_reserved(ledger: Client, settings: Settings) -> None:
    held = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit("dgx-h100-01/gpu5", 30))
    assert held["status"] == "committed"
    rpc = RpcClient(ledger, Subjects(settings.kit.subject_prefix))

    async def fleet_with_it() -> dict[str, Any] | None:
        # Topology learns reservations from LEDGER events: asynchronous, so poll.
        reply = await rpc.fleet()
        assert not isinstance(reply, Rejected)
        fleet = reply.model_dump(mode="json")
        node = next(n for n in fleet["nodes"] if n["name"] == "dgx-h100-01")
        return fleet if next(a for a in node["accelerators"] if a["index"] == 5)["hbm_reserved_bytes"] else None

    fleet = await wait_for(fleet_with_it, 20, interval_s=0.2, what="fleet.get shows the reservation")
    node = next(n for n in fleet["nodes"] if n["name"] == "dgx-h100-01")
    assert next(a for a in node["accelerators"] if a["index"] == 5)["hbm_reserved_bytes"] == 30 * GB


async def test_tpu_chips_are_ledger_accelerators(ledger: Client, settings: Settings) -> None:
    async def pod_chips() -> dict[str, dict[str, Any]]:
        snap = await call(ledger, settings, Rpc.LEDGER_SNAPSHOT, {"node": "v5e-pod-1"})
        return {a["id"]: a for a in snap["accelerators"]} if len(snap["accelerators"]) == 256 else {}

    chips = await wait_for(pod_chips, 15, interval_s=0.1, what="the v5e pod's 256 chips")
    assert len(chips) == 256 and "v5e-pod-1/15.15" in chips
    assert chips["v5e-pod-1/0.0"]["hbm_usable_bytes"] == 16 * 2**30 * 23 // 25  # 16 GiB x 0.92
    v5p = await call(ledger, settings, Rpc.LEDGER_SNAPSHOT, {"node": "v5p-pod-1"})
    assert len(v5p["accelerators"]) == 512 and v5p["accelerators"][0]["id"] == "v5p-pod-1/0.0.0"


async def test_a_device_reported_smaller_under_an_allocation_keeps_it_and_takes_nothing_new(
    ledger: Client, settings: Settings, service_processes: ServiceProcesses
) -> None:
    """Issue 23 row 8: topology says a GPU holding a 60 GB replica has only 40 GiB (36.8 GiB usable). The
    ledger keeps the replica (usable held at what is reserved), lets nothing new in, says so once in its
    log, and lets usable down to the new figure when the replica goes; the real figures then come back."""
    node, gpu = "hgx-h100-4x4-01", "hgx-h100-4x4-01/gpu7"
    described = await call(ledger, settings, Rpc.FLEET_DESCRIBE, {"node": node})
    original = described["profile"]
    shrunk = {
        **original,
        "accelerators": [{**a, "hbm_bytes": 40 * 2**30} if a["index"] == 7 else a for a in original["accelerators"]],
    }

    def changed(profile: dict[str, Any], fingerprint: str) -> dict[str, Any]:
        return {
            "node": node,
            "region": profile["region"],
            "kind": "test",
            "fingerprint": fingerprint,
            "profile": profile,
        }

    async def usable_is(expected: int) -> bool:
        snap = await call(ledger, settings, Rpc.LEDGER_SNAPSHOT, {"node": node})
        return next(a for a in snap["accelerators"] if a["id"] == gpu)["hbm_usable_bytes"] == expected

    held = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(gpu, 60))
    assert held["status"] == "committed", held
    await publish(ledger, settings, Context.TOPOLOGY, "node_changed", changed(shrunk, "shrunk"))
    await wait_for(lambda: usable_is(60 * GB), 15, interval_s=0.1, what="usable held at the 60 GB reserved")
    refused = await call(ledger, settings, Rpc.LEDGER_COMMIT, commit(gpu, 0.001))
    assert refused["error"]["code"] == "no_capacity", refused
    others = await call(ledger, settings, Rpc.LEDGER_SNAPSHOT, {"node": node})
    assert all(a["hbm_usable_bytes"] == H100_USABLE for a in others["accelerators"] if a["id"] != gpu)
    assert "reports less HBM than is reserved on it" in service_processes.log("ledger_ledger")
    released = await call(
        ledger, settings, Rpc.LEDGER_RELEASE, {"allocation_id": held["allocation_id"], "tenant": "acme"}
    )
    assert released["status"] == "released"
    await wait_for(lambda: usable_is(40 * 2**30 * 23 // 25), 15, interval_s=0.1, what="usable down to the new figure")
    await publish(ledger, settings, Context.TOPOLOGY, "node_changed", changed(original, "restored"))
    await wait_for(lambda: usable_is(H100_USABLE), 15, interval_s=0.1, what="the real figure back")
