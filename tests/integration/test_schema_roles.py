"""Each service's Postgres role reads its own schema and is refused every other (migration 0005).

The roles are how "services own their data" fails loudly at run time; tests/unit/test_schema_ownership.py
is the same rule read off the code.
"""

from __future__ import annotations

import asyncpg
import pytest

from shared.infra.db import SCHEMAS, role_of
from shared.infra.settings import Settings
from tests.integration.conftest import Connect

pytestmark = pytest.mark.asyncio(loop_scope="session")

# The reads issue 9 removed: placement read topology's and the ledger's tables, topology the ledger's.
COUPLINGS = [
    ("placement", "topology.nodes"),
    ("placement", "topology.racks"),
    ("placement", "topology.tpu_pods"),
    ("placement", "ledger.accelerators"),
    ("topology", "ledger.accelerators"),
]


@pytest.mark.parametrize("schema", SCHEMAS)
async def test_a_service_role_reads_its_own_schema_and_no_other(
    settings: Settings, connect: Connect, schema: str
) -> None:
    assert settings.kit.database_roles, "the services connect as their own roles by default"
    conn = await connect(schema)
    assert await conn.fetchval("SELECT current_user") == role_of(schema)
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.outbox") >= 0
    assert await conn.fetchval(f"SELECT count(*) FROM {schema}.inbox") >= 0
    for other in SCHEMAS:
        if other == schema:
            continue
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="permission denied"):
            await conn.fetchval(f"SELECT count(*) FROM {other}.outbox")
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="permission denied"):
            await conn.execute(f"DELETE FROM {other}.inbox")


@pytest.mark.parametrize(("schema", "table"), COUPLINGS)
async def test_the_reads_issue_9_removed_are_refused(
    settings: Settings, connect: Connect, schema: str, table: str
) -> None:
    conn = await connect(schema)
    with pytest.raises(asyncpg.InsufficientPrivilegeError, match="permission denied"):
        await conn.fetch(f"SELECT * FROM {table} LIMIT 1")
    owner = table.split(".", 1)[0]
    assert isinstance(await (await connect(owner)).fetch(f"SELECT * FROM {table} LIMIT 1"), list)
