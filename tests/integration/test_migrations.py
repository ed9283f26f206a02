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
