"""The servers under the services fail under load (placements at 30/s): a SIGKILLed nats-server or
Postgres is started again on its port with its data, as `hetsched up` does, and Postgres freezes for
12 s. The services ride it out: every request answered (retried by id if its first try got no answer),
the ledger invariant holds, replay of the LEDGER stream equals the tables, every placed reply's
allocation exists, no active allocation of placement's lacks a placed reply that owns it once the
reconciler has had its period; and after the stall, no allocation was committed for a caller that had
given up."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import psutil
import pytest

from hetsched.embedded import EmbeddedNats, EmbeddedPostgres
from tests.faults.harness import (
    FaultStack,
    LoadDriver,
    check_after_fault,
    check_no_unowned_allocations,
    late_commits,
    reconciled,
)
from tests.servers import RealServers
from tests.waiting import wait_for

pytestmark = [pytest.mark.faults, pytest.mark.asyncio(loop_scope="session")]

RATE = 30.0
DURATION_S = 10.0
STALL_S = 12.0


@pytest.fixture
def own_nats(tmp_path: Path) -> Iterator[EmbeddedNats]:
    server = EmbeddedNats(store_dir=tmp_path / "nats-store").start(log_file=tmp_path / "nats.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def own_postgres(tmp_path: Path) -> Iterator[EmbeddedPostgres]:
    server = EmbeddedPostgres(pgdata=tmp_path / "pg").start(log_file=tmp_path / "postgres.log")
    try:
        yield server
    finally:
        server.stop()


async def _restart(server: EmbeddedNats | EmbeddedPostgres, log: Path) -> None:
    """Start it again on its port with its data; a killed Postgres's backends may take a moment to go."""

    async def started() -> bool:
        try:
            await asyncio.to_thread(server.start, log_file=log)
        except RuntimeError:
            return False
        return True

    await wait_for(started, 60, interval_s=0.5, what="the server starts again")


async def _under_load(stack: FaultStack, kill_and_restart: Callable[[], Awaitable[None]]) -> None:
    driver = LoadDriver(stack, rate=RATE, duration_s=DURATION_S)
    load = asyncio.create_task(driver.run())
    await wait_for(lambda: driver.result.offered >= RATE * DURATION_S / 4, DURATION_S, what="load under way")
    await kill_and_restart()
    result = await load
    await driver.retry_unanswered()
    problems = await check_after_fault(stack, result)
    problems += await check_no_unowned_allocations(stack, result)
    print(f"\n{result.summary()}; released by the reconciler: {await reconciled(stack, result)}")
    assert not result.unanswered, f"never answered, even when retried by id: {sorted(result.unanswered)[:5]}"
    assert result.placed, "nothing was placed"
    assert problems == []


async def test_nats_restart_under_load(servers: RealServers, own_nats: EmbeddedNats, tmp_path: Path) -> None:
    async with FaultStack(servers, tmp_path, nats_url=own_nats.url) as stack:

        async def kill_and_restart() -> None:
            assert own_nats.proc is not None
            own_nats.proc.kill()
            own_nats.proc.wait(timeout=10)
            await _restart(own_nats, tmp_path / "nats.log")

        await _under_load(stack, kill_and_restart)


async def test_postgres_restart_under_load(
    servers: RealServers, own_postgres: EmbeddedPostgres, tmp_path: Path
) -> None:
    on_own_postgres = dataclasses.replace(servers, admin_url=own_postgres.url())
    async with FaultStack(on_own_postgres, tmp_path) as stack:

        async def kill_and_restart() -> None:
            assert own_postgres.proc is not None
            own_postgres.proc.kill()
            own_postgres.proc.wait(timeout=10)
            await _restart(own_postgres, tmp_path / "postgres.log")

        await _under_load(stack, kill_and_restart)


async def _settled(stack: FaultStack) -> None:
    """Until the ledger's allocations stop changing for a second: the backlog a stall left is done."""
    seen: list[int] = []

    async def unchanged() -> bool:
        conn = await stack.db()
        try:
            seen.append(int(await conn.fetchval("SELECT count(*) FROM ledger.allocations")))
        finally:
            await conn.close()
        return len(seen) > 4 and len(set(seen[-5:])) == 1

    await wait_for(unchanged, 60, interval_s=0.25, what="the ledger settles after the stall")


async def test_postgres_stall_under_load(servers: RealServers, own_postgres: EmbeddedPostgres, tmp_path: Path) -> None:
    on_own_postgres = dataclasses.replace(servers, admin_url=own_postgres.url())
    async with FaultStack(on_own_postgres, tmp_path) as stack:
        driver = LoadDriver(stack, rate=RATE, duration_s=STALL_S + 6)
        load = asyncio.create_task(driver.run())
        await wait_for(lambda: driver.result.offered >= RATE * 2, 10, what="load under way")
        assert own_postgres.proc is not None
        postmaster = psutil.Process(own_postgres.proc.pid)
        frozen = [postmaster, *postmaster.children(recursive=True)]
        for proc in frozen:
            proc.suspend()  # SIGSTOP: connections stay open, nothing answers
        try:
            await asyncio.sleep(STALL_S)  # the fault itself: Postgres frozen this long
        finally:
            for proc in frozen:
                proc.resume()
        result = await load
        await _settled(stack)
        late = await late_commits(stack, result)
        await driver.retry_unanswered()
        problems = await check_after_fault(stack, result)
        problems += await check_no_unowned_allocations(stack, result)
        print(
            f"\nPostgres frozen {STALL_S:.0f}s: {result.summary()}; committed after the caller gave up: {len(late)}; "
            f"released by the reconciler: {await reconciled(stack, result)}"
        )
    assert not result.unanswered, f"never answered, even when retried by id: {sorted(result.unanswered)[:5]}"
    assert result.placed, "nothing was placed"
    assert problems == []
    # Issue 10 (deadlines): before, 244 of 246 timed-out requests were committed once Postgres woke up.
    assert late == [], f"{len(late)} allocations committed after their caller gave up: {late[:3]}"
