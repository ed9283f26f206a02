"""The ledger's usable HBM belongs to the database (issue 23 row 8, migration 0015), on real Postgres.

The probe, as the ledger's own role, set ``ledger.accelerators.hbm_usable`` to 100x the device's HBM and to 0
under live allocations; both went through. Now the role may not write the column at all, and for anyone who
may (the owner, a superuser) the ``capacity_apply`` trigger recomputes it from ``hbm_total`` x ``ceiling``
and never lets it below what is reserved. What topology's path writes (``hbm_total``, ``ceiling``) still
takes effect, a smaller device under live allocations included (docs/LEDGER.md "Capacity changes").

Every test works inside a transaction it rolls back, on an accelerator of its own.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest
import pytest_asyncio

from shared.domain.memory import usable_hbm
from shared.infra.db import plain_url
from shared.infra.settings import Settings
from tests.integration.conftest import Connect

pytestmark = pytest.mark.asyncio(loop_scope="session")

GIB = 1024**3
ACC = "cap-node/gpu0"


async def _usable(conn: asyncpg.Connection) -> int:
    return int(await conn.fetchval("SELECT hbm_usable FROM ledger.accelerators WHERE id = $1", ACC))


async def _accelerator(conn: asyncpg.Connection, *, total: int, ceiling: float) -> None:
    """What the ledger's store does for a profiled node: no ``hbm_usable``, no ``reserved``."""
    await conn.execute(
        "INSERT INTO ledger.accelerators (id, node, sku, hbm_total, ceiling, available) "
        "VALUES ($1, 'cap-node', 'H100-SXM-80GB', $2, $3, true)",
        ACC,
        total,
        ceiling,
    )


async def _hold(conn: asyncpg.Connection, allocation: str, total: int) -> None:
    await conn.execute(
        # shared: several replicas on one GPU (an exclusive one holds it alone, migration 0010)
        "INSERT INTO ledger.allocations (id, request_id, tenant, kind, state, preemptible, priority, "
        "lease_expires_at, sharing) VALUES ($1, $1, 'acme', 'replica', 'active', false, 0, "
        "now() + interval '1 hour', 'shared')",
        allocation,
    )
    await conn.execute(
        "INSERT INTO ledger.shares (allocation_id, accelerator_id, weights, kv, activation, workspace, total, "
        "counts, active) VALUES ($1, $2, $3, 0, 0, 0, $3, true, true)",
        allocation,
        ACC,
        total,
    )


async def _release(conn: asyncpg.Connection, allocation: str) -> None:
    await conn.execute("UPDATE ledger.shares SET active = false WHERE allocation_id = $1", allocation)


@pytest_asyncio.fixture(loop_scope="session")
async def as_ledger(connect: Connect) -> AsyncIterator[asyncpg.Connection]:
    """The ledger's own role, in a transaction rolled back at the end."""
    conn = await connect("ledger")
    tx = conn.transaction()
    await tx.start()
    try:
        yield conn
    finally:
        await tx.rollback()


@pytest_asyncio.fixture(loop_scope="session")
async def as_superuser(settings: Settings) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(plain_url(settings.kit.database_url or ""))
    tx = conn.transaction()
    await tx.start()
    try:
        yield conn
    finally:
        await tx.rollback()
        await conn.close()


@pytest.mark.parametrize(
    ("name", "sql"),
    [
        ("100x", "UPDATE ledger.accelerators SET hbm_usable = hbm_total * 100 WHERE id = $1"),
        ("zero", "UPDATE ledger.accelerators SET hbm_usable = 0 WHERE id = $1"),
    ],
)
async def test_the_ledger_role_cannot_write_usable_hbm(as_ledger: asyncpg.Connection, name: str, sql: str) -> None:
    await _accelerator(as_ledger, total=80 * GIB, ceiling=0.92)
    await _hold(as_ledger, "al-cap-live", 40 * GIB)
    with pytest.raises(asyncpg.InsufficientPrivilegeError, match="permission denied for table accelerators"):
        async with as_ledger.transaction():  # a savepoint: the outer transaction goes on
            await as_ledger.execute(sql, ACC)
    assert await _usable(as_ledger) == usable_hbm(80 * GIB, 0.92)


async def test_the_ledger_role_gets_usable_hbm_from_total_and_ceiling(as_ledger: asyncpg.Connection) -> None:
    await _accelerator(as_ledger, total=80 * GIB, ceiling=0.92)
    assert await _usable(as_ledger) == usable_hbm(80 * GIB, 0.92) == 79_027_398_246  # 80 GiB x 23/25


async def test_whoever_writes_usable_hbm_the_trigger_recomputes_it(as_superuser: asyncpg.Connection) -> None:
    """The owner or a superuser keeps the column privilege the ledger role lost: the trigger overrules them."""
    await _accelerator(as_superuser, total=80 * GIB, ceiling=0.92)
    await _hold(as_superuser, "al-cap-su", 40 * GIB)
    computed = usable_hbm(80 * GIB, 0.92)
    await as_superuser.execute("UPDATE ledger.accelerators SET hbm_usable = hbm_total * 100 WHERE id = $1", ACC)
    assert await _usable(as_superuser) == computed
    await as_superuser.execute("UPDATE ledger.accelerators SET hbm_usable = 0 WHERE id = $1", ACC)
    assert await _usable(as_superuser) == computed
    await as_superuser.execute(
        "INSERT INTO ledger.accelerators (id, node, sku, hbm_total, ceiling, hbm_usable) "
        "VALUES ('cap-node/gpu1', 'cap-node', 'H100-SXM-80GB', $1, 0.92, $2)",
        80 * GIB,
        8000 * GIB,
    )
    assert await as_superuser.fetchval("SELECT hbm_usable FROM ledger.accelerators WHERE id = 'cap-node/gpu1'") == (
        computed
    )


@pytest.mark.parametrize("ceiling", [0.0, -0.5, 1.5, 100.0])
async def test_the_ceiling_stays_a_fraction(as_ledger: asyncpg.Connection, ceiling: float) -> None:
    await _accelerator(as_ledger, total=80 * GIB, ceiling=0.92)
    with pytest.raises(asyncpg.CheckViolationError, match="accelerators_ceiling"):
        async with as_ledger.transaction():
            await as_ledger.execute("UPDATE ledger.accelerators SET ceiling = $2 WHERE id = $1", ACC, ceiling)
    with pytest.raises(asyncpg.CheckViolationError, match="accelerators_hbm_total"):
        async with as_ledger.transaction():
            await as_ledger.execute("UPDATE ledger.accelerators SET hbm_total = -1 WHERE id = $1", ACC)
    assert await _usable(as_ledger) == usable_hbm(80 * GIB, 0.92)


async def test_topologys_figures_still_change_usable_hbm(as_ledger: asyncpg.Connection) -> None:
    """The path that applies topology's figures (the store writes ``hbm_total`` and ``ceiling``) works."""
    await _accelerator(as_ledger, total=80 * GIB, ceiling=0.92)
    await as_ledger.execute("UPDATE ledger.accelerators SET hbm_total = $2 WHERE id = $1", ACC, 141 * GIB)
    assert await _usable(as_ledger) == usable_hbm(141 * GIB, 0.92)
    await as_ledger.execute("UPDATE ledger.accelerators SET ceiling = 0.5 WHERE id = $1", ACC)
    assert await _usable(as_ledger) == 141 * GIB // 2
    await as_ledger.execute("UPDATE ledger.accelerators SET hbm_total = $2, ceiling = 1 WHERE id = $1", ACC, 40 * GIB)
    assert await _usable(as_ledger) == 40 * GIB


async def test_a_smaller_device_under_allocations_keeps_them_and_shrinks_as_they_go(
    as_ledger: asyncpg.Connection,
) -> None:
    """100 bytes at ceiling 1, 60 + 20 reserved; topology then says 50, and later 0 (the probe's 0 by the
    column it may write): usable stays at what is reserved (80), so nothing new fits; each release takes it
    down (to 60, then to the new 50), never below what is still reserved."""
    await _accelerator(as_ledger, total=100, ceiling=1.0)
    await _hold(as_ledger, "al-cap-60", 60)
    await _hold(as_ledger, "al-cap-20", 20)
    await as_ledger.execute("UPDATE ledger.accelerators SET hbm_total = 50 WHERE id = $1", ACC)
    assert await _usable(as_ledger) == 80  # not 50: 80 bytes are allocated
    await as_ledger.execute("UPDATE ledger.accelerators SET hbm_total = 0 WHERE id = $1", ACC)
    assert await _usable(as_ledger) == 80
    await as_ledger.execute("UPDATE ledger.accelerators SET hbm_total = 50 WHERE id = $1", ACC)
    with pytest.raises(asyncpg.CheckViolationError, match="over-commit"):
        async with as_ledger.transaction():  # one more byte does not fit
            await _hold(as_ledger, "al-cap-1", 1)
    await _release(as_ledger, "al-cap-20")
    assert await _usable(as_ledger) == 60  # 60 reserved: usable follows the release down
    with pytest.raises(asyncpg.CheckViolationError, match="over-commit"):
        async with as_ledger.transaction():
            await _hold(as_ledger, "al-cap-1b", 1)
    await _release(as_ledger, "al-cap-60")
    assert await _usable(as_ledger) == 50  # drained: the reported figure
    await _hold(as_ledger, "al-cap-50", 50)  # and all of it is usable again
    assert await as_ledger.fetchval("SELECT reserved FROM ledger.accelerators WHERE id = $1", ACC) == 50
