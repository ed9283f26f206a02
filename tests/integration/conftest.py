"""Fixtures of the integration tests that more than one module uses."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import asyncpg
import pytest_asyncio

from shared.infra.db import plain_url, service_database_url
from shared.infra.settings import Settings

Connect = Callable[[str], Awaitable[asyncpg.Connection]]


@pytest_asyncio.fixture(loop_scope="session")
async def connect(settings: Settings) -> AsyncIterator[Connect]:
    """Connects as a service does: the test database, as the role of the schema given."""
    opened: list[asyncpg.Connection] = []

    async def open_as(schema: str) -> asyncpg.Connection:
        conn = await asyncpg.connect(plain_url(service_database_url(settings, schema)))
        opened.append(conn)
        return conn

    yield open_as
    for conn in opened:
        await conn.close()
