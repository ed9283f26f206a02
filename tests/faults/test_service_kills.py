"""SIGKILL of each service under load (placements at 30/s), the service started again at once; then the
ledger invariant holds, replay of the LEDGER stream equals the tables, every placed reply's allocation
exists, every request is answered (retried by id if its first try got no answer), and within the
reconciler's period no active allocation of placement's lacks a placed reply that owns it.

And placement killed exactly between the ledger's commit and its decision row
(``HETSCHED_PLACEMENT_FAULT_AFTER_COMMIT=exit``) while the callers of the requests it took went away:
the allocation it committed has no owner, and the reconciler releases it."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.faults.harness import (
    FaultStack,
    LoadDriver,
    check_after_fault,
    check_no_unowned_allocations,
    reconciled,
)
from tests.servers import RealServers
from tests.waiting import wait_for

pytestmark = [pytest.mark.faults, pytest.mark.asyncio(loop_scope="session")]

RATE = 30.0
DURATION_S = 10.0


@pytest.mark.parametrize("victim", ["capacity_ledger", "placement", "topology_discovery"])
async def test_sigkill_under_load_loses_nothing(servers: RealServers, tmp_path: Path, victim: str) -> None:
    async with FaultStack(servers, tmp_path) as stack:
        driver = LoadDriver(stack, rate=RATE, duration_s=DURATION_S)
        load = asyncio.create_task(driver.run())
        # A quarter of the way in, with requests in flight.
        await wait_for(lambda: driver.result.offered >= RATE * DURATION_S / 4, DURATION_S, what="load under way")
        stack.kill(victim)
        stack.start(victim)
        await stack.wait_healthy(victim)
        result = await load
        await driver.retry_unanswered()
        problems = await check_after_fault(stack, result)
        problems += await check_no_unowned_allocations(stack, result)
        print(f"\nSIGKILL {victim}: {result.summary()}; released by the reconciler: {await reconciled(stack, result)}")
    assert not result.unanswered, f"never answered, even when retried by id: {sorted(result.unanswered)[:5]}"
    assert result.placed, "nothing was placed: the load did not exercise the ledger"
    assert problems == []


async def test_placement_killed_mid_commit_leaves_no_orphan(servers: RealServers, tmp_path: Path) -> None:
    async with FaultStack(servers, tmp_path) as stack:
        driver = LoadDriver(stack, rate=RATE, duration_s=DURATION_S)
        load = asyncio.create_task(driver.run())
        await wait_for(lambda: driver.result.offered >= RATE * DURATION_S / 4, DURATION_S, what="load under way")
        # From here the callers whose request gets no answer go away: nobody retries what the dying
        # placement committed, so only its first lease running out can give its HBM back.
        driver.callers_leave = True
        stack.kill("placement")
        dying = stack.start("placement", HETSCHED_PLACEMENT_FAULT_AFTER_COMMIT="exit")
        await wait_for(lambda: dying.poll() is not None, 60, what="placement exits after a ledger commit")
        stack.start("placement")
        await stack.wait_healthy("placement")
        driver.callers_leave = False
        result = await load
        await driver.retry_unanswered()
        problems = await check_after_fault(stack, result)
        problems += await check_no_unowned_allocations(stack, result)
        expired = await reconciled(stack, result, state="expired")
        print(f"\nplacement killed mid-commit: {result.summary()}; ended with their first lease: {expired}")
    assert dying.returncode == 70, "placement did not exit at the fault point (after a ledger commit)"
    assert result.left, "no caller went away: the fault left nothing to free"
    assert not result.unanswered, f"never answered, even when retried by id: {sorted(result.unanswered)[:5]}"
    assert result.placed, "nothing was placed: the load did not exercise the ledger"
    assert problems == []
    assert expired >= 1, "the orphaned allocation did not end with its first lease"
