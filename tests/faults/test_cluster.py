"""A 3-node JetStream cluster on loopback (R3 streams): the LEDGER stream's leader node is SIGKILLed
while placements arrive at 100/s. No acknowledged event is lost (every committed allocation has its
allocation_committed event; the outbox drains) and every request is answered or, retried with its own
id, ends placed or rejected with exactly one ledger allocation per placed id; and once the reconciler
has had its period, no active allocation of placement's lacks a placed reply that owns it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context
from tests.faults.harness import FaultStack, LoadDriver, check_after_fault, check_no_unowned_allocations, reconciled
from tests.servers import NatsCluster, RealServers
from tests.waiting import wait_for

pytestmark = [pytest.mark.faults, pytest.mark.asyncio(loop_scope="session")]

RATE = 100.0
DURATION_S = 10.0


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    nodes = NatsCluster(tmp_path / "nats").start()
    try:
        yield nodes
    finally:
        nodes.stop()


async def test_node_loss_under_100_placements_per_s(servers: RealServers, cluster: NatsCluster, tmp_path: Path) -> None:
    await cluster.wait_jetstream()
    async with FaultStack(servers, tmp_path, nats_url=cluster.url, replicas=3) as stack:
        assert stack.nc is not None
        ledger = stream_name(Context.LEDGER, stream_prefix=stack.servers.stream_prefix)
        info = await stack.nc.jetstream().stream_info(ledger)
        assert info.config.num_replicas == 3
        assert info.cluster is not None and info.cluster.leader
        leader = int(info.cluster.leader.removeprefix("n")) - 1  # the node that acknowledges LEDGER writes

        driver = LoadDriver(stack, rate=RATE, duration_s=DURATION_S)
        load = asyncio.create_task(driver.run())
        await wait_for(lambda: driver.result.offered >= RATE * DURATION_S / 3, DURATION_S, what="load under way")
        cluster.kill(leader)
        result = await load
        await driver.retry_unanswered()
        problems = await check_after_fault(stack, result)
        problems += await check_no_unowned_allocations(stack, result)
        released = await reconciled(stack, result)
        print(f"\nkilled LEDGER leader n{leader + 1}: {result.summary()}; released by the reconciler: {released}")
        after = await stack.nc.jetstream().stream_info(ledger)
        assert after.cluster is not None and after.cluster.leader not in (None, f"n{leader + 1}")
    assert not result.unanswered, f"never answered, even when retried by id: {sorted(result.unanswered)[:5]}"
    assert result.placed, "nothing was placed"
    assert problems == []
