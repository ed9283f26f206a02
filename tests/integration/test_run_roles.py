"""What a test run leaves on the Postgres it uses: its service roles get a password made for the run
(none published in the repository), and the roles it created are dropped at its end; roles that were
there before it are kept."""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg
from pydantic import SecretStr

from hetsched.embedded import EmbeddedPostgres
from shared.infra.db import role_of
from shared.infra.migrate import upgrade
from tests.servers import ROLE_PASSWORD, TEST_ROLES, RealServers


async def test_a_run_drops_the_roles_it_created_and_keeps_the_others(tmp_path: Path) -> None:
    pg = await asyncio.to_thread(EmbeddedPostgres(pgdata=tmp_path / "pg").start, log_file=tmp_path / "pg.log")
    try:
        admin = await asyncpg.connect(pg.url())
        try:
            await admin.execute(f'CREATE ROLE "{role_of("ledger")}" LOGIN')  # the user's, before the run
        finally:
            await admin.close()
        run = RealServers(nats_url="nats://unused", admin_url=pg.url())
        run.roles_before = await run.existing_roles()
        assert run.roles_before == {role_of("ledger")}

        url = await run.create_database(f"hetsched_test_{run.run_id}")
        await asyncio.to_thread(upgrade, url, role_password=SecretStr(ROLE_PASSWORD))
        assert await run.existing_roles() == set(TEST_ROLES)
        assert len(ROLE_PASSWORD) >= 40  # random for this run (``generate_password``)
        conn = await asyncpg.connect(url, user=role_of("placement"), password=ROLE_PASSWORD)  # SCRAM: it is set
        await conn.close()

        # While a database still uses them, nothing is dropped (another run's, at the same time).
        assert await run.drop_created_roles() == []
        await run.drop_database(f"hetsched_test_{run.run_id}")
        dropped = await run.drop_created_roles()
        assert set(dropped) == set(TEST_ROLES) - {role_of("ledger")}
        assert await run.existing_roles() == {role_of("ledger")}
    finally:
        pg.stop()
