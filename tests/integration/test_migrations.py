"""Alembic against a real, empty Postgres database: upgrade, check, downgrade."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from shared.infra.db import SCHEMAS, plain_url
from shared.infra.migrate import check, downgrade, upgrade
from tests.servers import RealServers

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def _schemas(url: str) -> set[str]:
    conn = await asyncpg.connect(plain_url(url))
    try:
        rows = await conn.fetch("SELECT schema_name FROM information_schema.schemata")
    finally:
        await conn.close()
    return {r["schema_name"] for r in rows} & set(SCHEMAS)


async def test_upgrade_check_downgrade_on_an_empty_database(servers: RealServers) -> None:
    name = f"hetsched_migr_{servers.run_id}"
    url = await servers.create_database(name)
    try:
        assert await _schemas(url) == set()
        await asyncio.to_thread(upgrade, url)
        assert await _schemas(url) == set(SCHEMAS)
        await asyncio.to_thread(check, url)  # raises if models and migrations differ
        await asyncio.to_thread(downgrade, url, "base")
        assert await _schemas(url) == set()
        await asyncio.to_thread(upgrade, url)  # and back up again: downgrade left nothing behind
        await asyncio.to_thread(check, url)
    finally:
        await servers.drop_database(name)


ALLOCATION = (
    "INSERT INTO ledger.allocations (id, request_id, tenant, kind, parent_id, state, preemptible, priority, "
    "lease_expires_at) VALUES ($1, $1, 'acme', $2, $3, $4, false, 0, now() + interval '1 hour')"
)
SHARE = (
    "INSERT INTO ledger.shares (allocation_id, accelerator_id, weights, kv, activation, workspace, total, counts, "
    "active) VALUES ($1, 'n/gpu0', $2::bigint, $3::bigint, 0, 0, $2::bigint + $3::bigint, $4, true)"
)
GB = 10**9


async def test_0017_ends_every_live_request_allocation_and_nothing_else(servers: RealServers) -> None:
    """Rows written while the ledger still took `request` commits: at 0016, a replica with a request's KV
    hold inside it, a request without a share and one already released; after 0017 the live requests are
    released (journaled with the reason, their shares inactive), the replica and the reserved bytes unchanged."""
    name = f"hetsched_migr17_{servers.run_id}"
    url = await servers.create_database(name)
    try:
        await asyncio.to_thread(upgrade, url, "0016_placement_replicas")
        conn = await asyncpg.connect(plain_url(url))
        try:
            await conn.execute(
                "INSERT INTO ledger.accelerators (id, node, sku, hbm_total, ceiling) "
                "VALUES ('n/gpu0', 'n', 'H100', $1, 0.9)",
                80 * GB,
            )
            await conn.execute(ALLOCATION, "al-rep", "replica", None, "active")
            await conn.execute(SHARE, "al-rep", 20 * GB, 10 * GB, True)
            await conn.execute(ALLOCATION, "al-q1", "request", "al-rep", "active")
            await conn.execute(SHARE, "al-q1", 0, 2 * GB, False)
            await conn.execute(ALLOCATION, "al-q2", "request", "al-rep", "active")  # no share
            await conn.execute(ALLOCATION, "al-q3", "request", "al-rep", "released")
            old_end = await conn.fetchval("SELECT ended_at FROM ledger.allocations WHERE id = 'al-q3'")
            journal_before = await conn.fetchval("SELECT count(*) FROM ledger.journal")
            assert await conn.fetchval("SELECT reserved FROM ledger.accelerators WHERE id = 'n/gpu0'") == 30 * GB
        finally:
            await conn.close()

        await asyncio.to_thread(upgrade, url)
        await asyncio.to_thread(check, url)
        conn = await asyncpg.connect(plain_url(url))
        try:
            states = {
                r["id"]: (r["state"], r["ended_at"] is not None)
                for r in await conn.fetch("SELECT id, state, ended_at FROM ledger.allocations")
            }
            assert states == {
                "al-rep": ("active", False),
                "al-q1": ("released", True),
                "al-q2": ("released", True),
                "al-q3": ("released", old_end is not None),
            }
            assert await conn.fetchval("SELECT ended_at FROM ledger.allocations WHERE id = 'al-q3'") == old_end
            shares = {r["allocation_id"]: r["active"] for r in await conn.fetch("SELECT * FROM ledger.shares")}
            assert shares == {"al-rep": True, "al-q1": False}
            assert await conn.fetchval("SELECT reserved FROM ledger.accelerators WHERE id = 'n/gpu0'") == 30 * GB
            journal = await conn.fetch(
                "SELECT op, allocation_id, accelerator_id, delta, details->>'reason' AS reason FROM ledger.journal "
                "ORDER BY seq OFFSET $1",
                journal_before,
            )
            reason = "retired: admissions are not ledger allocations"
            assert [tuple(r) for r in journal] == [
                ("released", "al-q1", "n/gpu0", 0, reason),
                ("released", "al-q2", None, 0, reason),
            ]
        finally:
            await conn.close()
        await asyncio.to_thread(downgrade, url, "0016_placement_replicas")  # a no-op: nothing is revived
        conn = await asyncpg.connect(plain_url(url))
        try:
            assert await conn.fetchval("SELECT count(*) FROM ledger.allocations WHERE state = 'active'") == 1
        finally:
            await conn.close()
    finally:
        await servers.drop_database(name)
