"""`hetsched sim --live`: the simulation places its replicas through a running stack and gives them back."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from hetsched.cli.sim.run import run_sim
from hetsched.sim_live import LivePolicy
from hetsched.stack import wait_healthy
from shared.contracts.base import Rejected
from shared.contracts.ledger import SnapshotReply
from shared.contracts.placement import PlaceReply, PlaceRequest
from shared.contracts.subjects import Rpc, Subjects
from shared.infra.catalog import demo_fleet_path
from shared.infra.rpc import RpcClient
from shared.infra.settings import Settings
from tests.conftest import ServiceProcesses
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")
TRACE = Path(__file__).resolve().parents[1] / "fixtures" / "traces" / "sim_small.csv"


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(service_processes: ServiceProcesses, settings: Settings) -> AsyncIterator[RpcClient]:
    service_processes.start(
        "topology_discovery", name="sl_topology", HETSCHED_TOPOLOGY_INVENTORY=str(demo_fleet_path())
    )
    service_processes.start("capacity_ledger", name="sl_ledger")
    service_processes.start("placement", name="sl_placement")
    health = await wait_healthy(
        nats_url=settings.kit.nats_url or "",
        subjects=Subjects(settings.kit.subject_prefix),
        deadline_s=60,
        only={"topology_discovery", "capacity_ledger", "placement"},
    )
    assert all(h["status"] == "ok" for h in health.values()), health
    rpc = await RpcClient.connect(
        settings.kit.nats_url or "",
        Subjects(settings.kit.subject_prefix),
        timeout_s=settings.kit.request_timeout_ms / 1000,
    )
    probe = PlaceRequest(request_id="probe", tenant="t", model="llama3-8b", context_tokens=4096, backend="gpu")

    async def placeable() -> bool:
        reply = await rpc.ask(Rpc.PLACEMENT_EXPLAIN, probe, PlaceReply)
        return isinstance(reply, PlaceReply) and reply.status == "placed"

    await wait_for(placeable, 30, interval_s=0.2, what="placement sees the demo fleet")
    yield rpc
    await rpc.close()
    for name in ("sl_placement", "sl_ledger", "sl_topology"):
        service_processes.stop(name)


def held(snapshot: SnapshotReply | Rejected) -> dict[str, int]:
    assert isinstance(snapshot, SnapshotReply), snapshot
    return {a.id: a.hbm_reserved_bytes for a in snapshot.accelerators if a.hbm_reserved_bytes}


async def test_live_simulation_places_through_the_stack_and_releases(stack: RpcClient, settings: Settings) -> None:
    before = held(await stack.ledger_snapshot())

    def run() -> dict[str, Any]:
        policy = LivePolicy(
            nats_url=settings.kit.nats_url or "",
            subjects=Subjects(settings.kit.subject_prefix),
            timeout_s=settings.kit.request_timeout_ms / 1000,
        )
        try:
            results, _trace = run_sim(demo_fleet_path(), TRACE, seed=3, live=policy)
        finally:
            policy.close()
        assert policy.refused_by_mismatch == 0
        return results["hetsched-live"].kpis.to_dict()

    kpis = await asyncio.to_thread(run)
    assert kpis["requests"] > 0 and kpis["placed"] > 0 and kpis["decisions"] > 0
    assert kpis["nvlink_affinity"] in (None, 1.0)  # the stack only ever makes NVLink groups

    async def released() -> bool:
        return held(await stack.ledger_snapshot()) == before

    await wait_for(released, 10, interval_s=0.1, what="every live replica released again")
