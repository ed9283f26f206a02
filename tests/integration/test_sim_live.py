"""`hetsched sim --live`: the simulation places its replicas through a running stack and gives them back."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client

from services.sim_cli import run_sim
from services.sim_live import LivePolicy
from services.stack import wait_healthy
from shared.contracts.subjects import Rpc, Subjects
from shared.infra.catalog import demo_fleet_path
from shared.infra.settings import Settings
from tests.conftest import ServiceProcesses

pytestmark = pytest.mark.asyncio(loop_scope="session")
TRACE = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "sim_small.csv"


async def call(nc: Client, settings: Settings, rpc: Rpc, body: dict[str, Any]) -> dict[str, Any]:
    msg = await nc.request(Subjects(settings.subject_prefix).rpc(rpc), json.dumps(body).encode(), timeout=15)
    reply: dict[str, Any] = json.loads(msg.data)
    return reply


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(service_processes: ServiceProcesses, settings: Settings) -> AsyncIterator[Client]:
    service_processes.start(
        "topology_discovery", name="sl_topology", HETSCHED_TOPOLOGY_INVENTORY=str(demo_fleet_path())
    )
    service_processes.start("capacity_ledger", name="sl_ledger")
    service_processes.start("placement", name="sl_placement")
    health = await wait_healthy(
        nats_url=settings.nats_url or "",
        subjects=Subjects(settings.subject_prefix),
        deadline_s=60,
        only={"topology_discovery", "capacity_ledger", "placement"},
    )
    assert all(h["status"] == "ok" for h in health.values()), health
    nc = await nats.connect(settings.nats_url or "")
    probe = {"request_id": "probe", "tenant": "t", "model": "llama3-8b", "context_tokens": 4096, "backend": "gpu"}
    deadline = time.monotonic() + 30
    while (await call(nc, settings, Rpc.PLACEMENT_EXPLAIN, probe))["status"] != "placed":
        assert time.monotonic() < deadline
        await asyncio.sleep(0.2)
    yield nc
    await nc.close()
    for name in ("sl_placement", "sl_ledger", "sl_topology"):
        service_processes.stop(name)


async def test_live_simulation_places_through_the_stack_and_releases(stack: Client, settings: Settings) -> None:
    before = await call(stack, settings, Rpc.LEDGER_SNAPSHOT, {})

    def run() -> dict[str, Any]:
        policy = LivePolicy(nats_url=settings.nats_url or "", subjects=Subjects(settings.subject_prefix))
        try:
            results, _trace = run_sim(demo_fleet_path(), TRACE, seed=3, live=policy)
        finally:
            policy.close()
        assert policy.refused_by_mismatch == 0
        return results["hetsched-live"].kpis.to_dict()

    kpis = await asyncio.to_thread(run)
    assert kpis["requests"] > 0 and kpis["placed"] > 0 and kpis["decisions"] > 0
    assert kpis["nvlink_affinity"] in (None, 1.0)  # the stack only ever makes NVLink groups
    await asyncio.sleep(0.5)
    after = await call(stack, settings, Rpc.LEDGER_SNAPSHOT, {})

    def held(snapshot: dict[str, Any]) -> dict[str, int]:
        return {a["id"]: a["hbm_reserved"] for a in snapshot["accelerators"] if a["hbm_reserved"]}

    assert held(after) == held(before)  # every live replica was released again
