"""placement on real NATS and Postgres with topology and the ledger: decisions reserved through the
ledger, idempotent by request id, dry runs that reserve nothing, TPU slices, typed refusals, events."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
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


async def call(nc: Client, settings: Settings, rpc: Rpc, body: dict[str, Any]) -> dict[str, Any]:
    msg = await nc.request(Subjects(settings.subject_prefix).rpc(rpc), json.dumps(body).encode(), timeout=15)
    reply: dict[str, Any] = json.loads(msg.data)
    return reply


async def reserved(nc: Client, settings: Settings, node: str) -> dict[str, int]:
    snap = await call(nc, settings, Rpc.LEDGER_SNAPSHOT, {"node": node})
    return {a["id"]: a["hbm_reserved"] for a in snap["accelerators"]}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(service_processes: ServiceProcesses, settings: Settings) -> AsyncIterator[Client]:
    service_processes.start(
        "topology_discovery", name="pl_topology", HETSCHED_TOPOLOGY_INVENTORY=str(demo_fleet_path())
    )
    service_processes.start("capacity_ledger", name="pl_ledger")
    service_processes.start("placement", name="pl_placement", HETSCHED_PLACEMENT_REFRESH_MS="200")
    health = await wait_healthy(
        nats_url=settings.nats_url or "",
        subjects=Subjects(settings.subject_prefix),
        deadline_s=60,
        only={"topology_discovery", "capacity_ledger", "placement"},
    )
    assert all(h["status"] == "ok" for h in health.values()), health
    nc = await nats.connect(settings.nats_url or "")
    deadline = time.monotonic() + 30
    probe = {"request_id": "probe", "tenant": "t", "model": "llama3-8b", "context_tokens": 4096, "backend": "tpu"}
    while (await call(nc, settings, Rpc.PLACEMENT_EXPLAIN, probe))["status"] != "placed":  # GPUs and TPU chips known
        assert time.monotonic() < deadline, "placement never saw the demo fleet"
        await asyncio.sleep(0.2)
    # Every accelerator registered (76 GPUs, 768 TPU chips): tests compare whole ledger snapshots.
    while len((await call(nc, settings, Rpc.LEDGER_SNAPSHOT, {}))["accelerators"]) < 76 + 256 + 512:
        assert time.monotonic() < deadline, "the ledger never learnt the whole demo fleet"
        await asyncio.sleep(0.2)
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
    per = first["hbm_per_accelerator"]["total"]
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
    assert other["status"] == "rejected" and other["error"]["code"] == "forbidden"
    done = await call(
        stack, settings, Rpc.PLACEMENT_RELEASE, {"allocation_id": placed["allocation_id"], "tenant": "acme"}
    )
    assert done["status"] == "released"
    assert (await reserved(stack, settings, node))[acc] == held - placed["hbm_per_accelerator"]["total"]


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
    chips = 1
    for axis in tpu["shape"]:
        chips *= axis
    snap = await call(stack, settings, Rpc.LEDGER_SNAPSHOT, {"node": tpu["pod"]})
    taken = [a for a in snap["accelerators"] if a["hbm_reserved"] > 0]
    assert len(taken) == chips and all(a["hbm_reserved"] == a["hbm_usable"] for a in taken)  # whole chips


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
        place_body("huge", model="llama3-405b", dtype="fp16", context_tokens=131072, concurrency=64),
    )
    assert reply["status"] == "rejected" and reply["error"]["code"] == "no_capacity"
    assert any("short" in line or "NVLink" in line or "KV" in line for line in reply["explanation"]), reply


async def test_every_decision_is_an_event(stack: Client, settings: Settings) -> None:
    await asyncio.sleep(0.5)
    found = await read_all(
        stack.jetstream(),
        stream=stream_name(Context.PLACEMENT, stream_prefix=settings.stream_prefix),
        subject=f"{settings.subject_prefix}.events.placement.>",
    )
    kinds = {e["type"] for e in found}
    assert {"placement.placement_decided", "placement.placement_rejected", "placement.placement_released"} <= kinds
    decided = [e for e in found if e["type"].endswith("decided") and e["payload"]["request_id"] == "p-1"]
    assert len(decided) == 1 and decided[0]["payload"]["reply"]["explanation"]
