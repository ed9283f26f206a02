"""The gateway's API keys and usage on a real Postgres: migration 0019's schema and role, the key store
(as the gateway's own role), and `hetsched credentials issue|list|revoke` for API keys.

One database for this module, migrated here and dropped at its end."""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import date
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import pytest
import pytest_asyncio
from pydantic import SecretStr
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine
from typer.testing import CliRunner, Result

from hetsched.cli import app
from services.gateway import keystore
from services.gateway.keystore import UsageDelta
from shared.domain.gateway.keys import hash_secret, parse_key, verify
from shared.infra.db import SCHEMAS, make_engine, owner_role_of, plain_url, role_of, service_database_url
from shared.infra.migrate import upgrade
from shared.infra.settings import Settings
from tests.servers import ROLE_PASSWORD, RealServers

pytestmark = pytest.mark.asyncio(loop_scope="session")

T = TypeVar("T")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def keys_db(servers: RealServers) -> AsyncIterator[str]:
    """A database of this module's own, migrated to head (the roles get the run's password)."""
    name = f"hetsched_gwkeys_{servers.run_id}"
    url = await servers.create_database(name)
    try:
        await asyncio.to_thread(upgrade, url, role_password=SecretStr(ROLE_PASSWORD))
        yield url
    finally:
        await servers.drop_database(name)


@pytest.fixture(scope="module")
def keys_settings(keys_db: str, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return Settings(
        kit={
            "database_url": keys_db,
            "database_role_password": SecretStr(ROLE_PASSWORD),
            "data_dir": tmp_path_factory.mktemp("gwkeys"),
        }
    )


@pytest_asyncio.fixture(loop_scope="session")
async def gateway_engine(keys_settings: Settings) -> AsyncIterator[AsyncEngine]:
    """An engine as the gateway connects: its own role, hetsched_gateway."""
    engine = make_engine(service_database_url(keys_settings, "gateway"), pool_size=2)
    yield engine
    await engine.dispose()


@pytest_asyncio.fixture(loop_scope="session")
async def admin(keys_db: str) -> AsyncIterator[asyncpg.Connection]:
    conn = await asyncpg.connect(plain_url(keys_db))
    yield conn
    await conn.close()


async def in_tx(engine: AsyncEngine, work: Callable[[AsyncConnection], Awaitable[T]]) -> T:
    async with engine.begin() as conn:
        return await work(conn)


# -- the schema and its role -------------------------------------------------------------------------------------


async def test_the_gateway_schema_and_everything_in_it_belong_to_its_owner_role(admin: asyncpg.Connection) -> None:
    assert "gateway" in SCHEMAS
    owners = await admin.fetch(
        "SELECT nspowner::regrole::text AS owner FROM pg_namespace WHERE nspname = 'gateway' "
        "UNION ALL SELECT relowner::regrole::text FROM pg_class WHERE relnamespace = 'gateway'::regnamespace"
    )
    assert {r["owner"] for r in owners} == {owner_role_of("gateway")}
    tables = {
        r["relname"]
        for r in await admin.fetch(
            "SELECT relname FROM pg_class WHERE relnamespace = 'gateway'::regnamespace AND relkind = 'r'"
        )
    }
    assert tables == {"outbox", "inbox", "api_keys", "usage"}


async def test_the_gateway_role_writes_its_tables_and_nothing_of_any_other_schema(keys_settings: Settings) -> None:
    conn = await asyncpg.connect(plain_url(service_database_url(keys_settings, "gateway")))
    try:
        assert await conn.fetchval("SELECT current_user") == role_of("gateway")
        tx = conn.transaction()
        await tx.start()
        try:
            await conn.execute(
                "INSERT INTO gateway.api_keys (key_id, tenant, secret_hash) VALUES ('key-role0000test', 'acme', 'h')"
            )
            await conn.execute("UPDATE gateway.api_keys SET revoked_at = now() WHERE key_id = 'key-role0000test'")
            await conn.execute(
                "INSERT INTO gateway.usage (tenant, day, model, key_id, requests, prompt_tokens, completion_tokens) "
                "VALUES ('acme', current_date, 'm', 'key-role0000test', 1, 2, 3)"
            )
            assert await conn.fetchval("SELECT count(*) FROM gateway.usage WHERE tenant = 'acme'") == 1
            await conn.execute("DELETE FROM gateway.usage WHERE key_id = 'key-role0000test'")
            await conn.execute("DELETE FROM gateway.api_keys WHERE key_id = 'key-role0000test'")
        finally:
            await tx.rollback()
        for sql in (
            "SELECT * FROM ledger.accelerators",
            "SELECT * FROM placement.decisions",
            "SELECT * FROM routing.tenants",
            "TRUNCATE gateway.api_keys",
            "ALTER TABLE gateway.api_keys DROP CONSTRAINT api_keys_rpm",
            "CREATE TABLE gateway.planted (x int)",
        ):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(sql)
    finally:
        await conn.close()
    for other in ("ledger", "placement"):
        conn = await asyncpg.connect(plain_url(service_database_url(keys_settings, other)))
        try:
            with pytest.raises(asyncpg.InsufficientPrivilegeError, match="permission denied"):
                await conn.fetch("SELECT key_id, secret_hash FROM gateway.api_keys")
        finally:
            await conn.close()


async def test_a_quota_of_zero_is_refused_by_the_table_itself(admin: asyncpg.Connection) -> None:
    for column in ("rpm", "tpm"):
        with pytest.raises(asyncpg.CheckViolationError):
            await admin.execute(
                f"INSERT INTO gateway.api_keys (key_id, tenant, secret_hash, {column}) "
                "VALUES ('key-zero', 'acme', 'h', 0)"
            )


# -- the key store, as the gateway's role --------------------------------------------------------------------------


async def test_issue_stores_only_the_hash_and_the_plaintext_verifies(
    gateway_engine: AsyncEngine, admin: asyncpg.Connection
) -> None:
    key, plaintext = await in_tx(
        gateway_engine,
        lambda c: keystore.issue(
            c, tenant="acme-issue", name="ci", priority=3, rpm=60, tpm=10_000, models=["llama3.1-8b", "chat-large"]
        ),
    )
    try:
        parsed = parse_key(plaintext)
        assert parsed is not None and parsed[0] == key.key_id
        row = await admin.fetchrow("SELECT * FROM gateway.api_keys WHERE key_id = $1", key.key_id)
        assert row is not None
        assert row["secret_hash"] == hash_secret(parsed[1]) and verify(parsed[1], row["secret_hash"])
        assert parsed[1] not in json.dumps({k: str(v) for k, v in dict(row).items()})
        assert (row["tenant"], row["name"], row["priority"], row["rpm"], row["tpm"]) == (
            "acme-issue",
            "ci",
            3,
            60,
            10_000,
        )
        assert json.loads(row["models"]) == ["chat-large", "llama3.1-8b"]
        assert row["created_at"] is not None and row["revoked_at"] is None

        active = {k.key_id: k for k in await in_tx(gateway_engine, keystore.active_keys)}
        assert active[key.key_id] == key
        assert key.models == frozenset({"llama3.1-8b", "chat-large"}) and not key.revoked
    finally:
        await admin.execute("DELETE FROM gateway.api_keys WHERE key_id = $1", key.key_id)


async def test_a_key_without_limits_keeps_them_unset(gateway_engine: AsyncEngine, admin: asyncpg.Connection) -> None:
    key, _ = await in_tx(gateway_engine, lambda c: keystore.issue(c, tenant="acme-open"))
    try:
        (stored,) = [k for k in await in_tx(gateway_engine, keystore.list_keys) if k.key_id == key.key_id]
        assert (stored.rpm, stored.tpm, stored.models, stored.priority, stored.name) == (None, None, None, 0, None)
        assert stored.allows("anything")
    finally:
        await admin.execute("DELETE FROM gateway.api_keys WHERE key_id = $1", key.key_id)


async def test_revoke_leaves_the_key_listed_but_not_active(
    gateway_engine: AsyncEngine, admin: asyncpg.Connection
) -> None:
    key, _ = await in_tx(gateway_engine, lambda c: keystore.issue(c, tenant="acme-revoke"))
    try:
        assert await in_tx(gateway_engine, lambda c: keystore.revoke(c, key.key_id)) is True
        first = await admin.fetchval("SELECT revoked_at FROM gateway.api_keys WHERE key_id = $1", key.key_id)
        assert first is not None
        assert await in_tx(gateway_engine, lambda c: keystore.revoke(c, key.key_id)) is True  # again: kept as it was
        assert await admin.fetchval("SELECT revoked_at FROM gateway.api_keys WHERE key_id = $1", key.key_id) == first
        assert key.key_id not in {k.key_id for k in await in_tx(gateway_engine, keystore.active_keys)}
        listed = {k.key_id: k for k in await in_tx(gateway_engine, keystore.list_keys)}
        assert listed[key.key_id].revoked and not listed[key.key_id].allows("llama3.1-8b")
        assert await in_tx(gateway_engine, lambda c: keystore.revoke(c, "key-000000000000")) is False
    finally:
        await admin.execute("DELETE FROM gateway.api_keys WHERE key_id = $1", key.key_id)


async def test_usage_adds_to_the_days_totals(gateway_engine: AsyncEngine, admin: asyncpg.Connection) -> None:
    day1, day2 = date(2027, 1, 1), date(2027, 1, 2)

    def delta(
        day: date, model: str, requests: int, prompt: int, completion: int, tenant: str = "acme-use"
    ) -> UsageDelta:
        return UsageDelta(tenant, day, model, "key-use000000001", requests, prompt, completion)

    try:
        await in_tx(gateway_engine, lambda c: keystore.add_usage(c, []))  # nothing to add: no statement, no error
        await in_tx(
            gateway_engine,
            lambda c: keystore.add_usage(
                c,
                [
                    delta(day1, "m-a", 1, 10, 5),
                    delta(day1, "m-a", 2, 20, 10),  # the same row twice in one batch
                    delta(day2, "m-b", 1, 7, 3),
                    delta(day2, "m-b", 1, 1, 1, tenant="other-use"),
                ],
            ),
        )
        await in_tx(gateway_engine, lambda c: keystore.add_usage(c, [delta(day2, "m-b", 4, 40, 30)]))
        rows = await in_tx(gateway_engine, lambda c: keystore.usage_of(c, "acme-use", day1))
        assert [
            (r["day"], r["model"], r["key_id"], r["requests"], r["prompt_tokens"], r["completion_tokens"]) for r in rows
        ] == [
            (day1, "m-a", "key-use000000001", 3, 30, 15),
            (day2, "m-b", "key-use000000001", 5, 47, 33),
        ]
        assert {r["tenant"] for r in rows} == {"acme-use"}
        later = await in_tx(gateway_engine, lambda c: keystore.usage_of(c, "acme-use", day2))
        assert [r["model"] for r in later] == ["m-b"]
        assert await in_tx(gateway_engine, lambda c: keystore.usage_of(c, "nobody", day1)) == []
    finally:
        await admin.execute("DELETE FROM gateway.usage WHERE key_id = 'key-use000000001'")


# -- the command line ----------------------------------------------------------------------------------------------


async def hetsched(settings: Settings, *args: str) -> Result:
    """`hetsched ARGS` in-process (a thread: it runs its own event loop), as the operator of this database."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSCHED_")}
    env.update(HETSCHED_DATABASE_URL=settings.kit.database_url or "", HETSCHED_DATA_DIR=str(settings.kit.data_dir))
    return await asyncio.to_thread(CliRunner().invoke, app, list(args), env=env)


def ok(result: Result) -> Result:
    assert result.exit_code == 0, (result.exit_code, result.stdout, result.stderr)
    return result


async def test_the_cli_issues_lists_and_revokes_an_api_key(keys_settings: Settings, admin: asyncpg.Connection) -> None:
    issued = ok(
        await hetsched(
            keys_settings,
            *"credentials issue --tenant acme-cli --api-key --name ci --priority 2 --rpm 120".split(),
            *"--model llama3.1-8b --model chat-large".split(),
        )
    )
    lines = dict(line.split("=", 1) for line in issued.stdout.splitlines() if "=" in line and " " not in line)
    plaintext, key_id = lines["api_key"], lines["key_id"]
    try:
        assert lines["tenant"] == "acme-cli"
        parsed = parse_key(plaintext)
        assert parsed is not None and parsed[0] == key_id
        stored = await admin.fetchrow("SELECT * FROM gateway.api_keys WHERE key_id = $1", key_id)
        assert stored is not None and verify(parsed[1], stored["secret_hash"])
        assert (stored["tenant"], stored["priority"], stored["rpm"], stored["tpm"]) == ("acme-cli", 2, 120, None)

        as_json = json.loads(ok(await hetsched(keys_settings, "credentials", "list", "--json")).stdout)
        (row,) = [r for r in as_json if r["id"] == key_id]
        assert row == {
            "id": key_id,
            "kind": "api_key",
            "tenant": "acme-cli",
            "name": "ci",
            "priority": 2,
            "rpm": 120,
            "tpm": None,
            "models": ["chat-large", "llama3.1-8b"],
            "revoked": False,
        }
        as_text = ok(await hetsched(keys_settings, "credentials", "list", "--wide")).stdout
        assert key_id in as_text and "acme-cli" in as_text
        for listing in (as_text, json.dumps(as_json)):
            assert parsed[1] not in listing and plaintext not in listing and stored["secret_hash"] not in listing

        revoked = ok(await hetsched(keys_settings, "credentials", "revoke", key_id))
        assert f"revoked API key {key_id}" in revoked.stdout
        assert await admin.fetchval("SELECT revoked_at IS NOT NULL FROM gateway.api_keys WHERE key_id = $1", key_id)
        after = json.loads(ok(await hetsched(keys_settings, "credentials", "list", "--json")).stdout)
        assert [r["revoked"] for r in after if r["id"] == key_id] == [True]

        unknown = await hetsched(keys_settings, "credentials", "revoke", "key-ffffffffffff")
        assert unknown.exit_code == 2 and "key-ffffffffffff: no such API key" in unknown.stderr
    finally:
        await admin.execute("DELETE FROM gateway.api_keys WHERE key_id = $1", key_id)


async def test_the_cli_prints_the_key_as_json(keys_settings: Settings, admin: asyncpg.Connection) -> None:
    reply = json.loads(
        ok(await hetsched(keys_settings, "credentials", "issue", "--tenant", "acme-json", "--api-key", "--json")).stdout
    )
    try:
        assert reply["tenant"] == "acme-json" and reply["models"] is None and reply["rpm"] is None
        assert parse_key(reply["api_key"]) is not None and parse_key(reply["api_key"])[0] == reply["key_id"]  # type: ignore[index]
    finally:
        await admin.execute("DELETE FROM gateway.api_keys WHERE key_id = $1", reply["key_id"])


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--tenant", "acme-bad", "--model", "no-such-model"], "--model no-such-model: not a model or model group"),
        (["--tenant", "acme-bad", "--rpm", "0"], "--rpm 0: a quota per minute is at least 1"),
        (["--tenant", "acme-bad", "--tpm", "-5"], "--tpm -5: a quota per minute is at least 1"),
        (["--tenant", "acme-bad", "--tenant", "other"], "--api-key takes exactly one --tenant"),
        (["--agent", "node-1"], "--api-key takes exactly one --tenant"),
        (["--tenant", "acme-bad", "--out", "x.nk"], "--api-key takes exactly one --tenant"),
    ],
)
async def test_the_cli_refuses_bad_input_and_writes_nothing(
    keys_settings: Settings, admin: asyncpg.Connection, args: list[str], says: str
) -> None:
    before = await admin.fetchval("SELECT count(*) FROM gateway.api_keys")
    result = await hetsched(keys_settings, "credentials", "issue", "--api-key", *args)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    assert says in result.stderr and "api_key=" not in result.stdout
    assert await admin.fetchval("SELECT count(*) FROM gateway.api_keys") == before


async def test_quota_options_without_api_key_are_refused(keys_settings: Settings) -> None:
    result = await hetsched(keys_settings, "credentials", "issue", "--tenant", "acme", "--rpm", "5")
    assert result.exit_code == 2 and "add --api-key" in result.stderr


async def test_a_model_group_is_a_valid_allow_list_entry(keys_settings: Settings, admin: asyncpg.Connection) -> None:
    reply: dict[str, Any] = json.loads(
        ok(
            await hetsched(
                keys_settings, *"credentials issue --tenant acme-grp --api-key --model chat-large --json".split()
            )
        ).stdout
    )
    try:
        assert reply["models"] == ["chat-large"]
    finally:
        await admin.execute("DELETE FROM gateway.api_keys WHERE key_id = $1", reply["key_id"])


async def test_without_a_database_the_cli_says_where_it_looked(tmp_path: Path) -> None:
    """No HETSCHED_DATABASE_URL and no `hetsched up` in the data dir (a stale state file does not count)."""
    (tmp_path / "stack.json").write_text(json.dumps({"database_url": "postgresql://postgres@127.0.0.1:1/gone"}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSCHED_")}
    env["HETSCHED_DATA_DIR"] = str(tmp_path)
    for args in (["issue", "--tenant", "acme", "--api-key"], ["revoke", "key-0123456789ab"]):
        result = await asyncio.to_thread(CliRunner().invoke, app, ["credentials", *args], env=env)
        assert result.exit_code == 2 and "no database: no `hetsched up` runs in" in result.stderr, result.stderr
