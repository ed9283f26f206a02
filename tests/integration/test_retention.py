"""Retention (issue 23 row 7) on the real stack: every stream has a max age and a size cap, a service
updates its own streams' limits in place at start, and the tables that only grew are pruned.

The probe found streams without a max age (PLACEMENT alone ~18 GB a day at 100 placements/s) and outbox,
inbox and dead-letter rows never deleted. Here:

* an authenticated NATS server (the ``auth.conf`` `hetsched up` writes) holds every stream as an older
  hetsched made it, with no limits; the router starts as a process with its own NKey, gives the stream it
  owns (ROUTING) its limits in place and may not touch the others (it says so for DEADLETTER, which it
  may only create); the operator's pass (`hetsched up`) then gives every stream its limits, read back from
  JetStream;
* rows past their retention that the router's schema holds before it starts are gone once it runs (the
  pruning task every service runs), rows inside their retention and unsent rows stay;
* each service's own role prunes its own schema (it has DELETE there), batch after batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import asyncpg
import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client

from hetsched.embedded import EmbeddedNats
from hetsched.stack import service_permission_map, wait_healthy
from services.registry import SERVICES
from shared.contracts.permissions import inbox_prefix, service_identity
from shared.contracts.streams import deadletter_stream_name, stream_name, stream_specs
from shared.contracts.subjects import Context, Subjects
from shared.infra.bus import ensure_streams
from shared.infra.db import SCHEMAS, make_engine, make_sessions, plain_url, service_database_url
from shared.infra.identity import Registry, ensure_operator, ensure_seeded, write_auth_conf
from shared.infra.retention import Retention, prune_once, stream_specs_for
from shared.infra.settings import Settings
from tests.conftest import ServiceProcesses
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

ROUTER = "cross_region_router"
ROUTING_MAX_AGE_S = 2 * 86_400.0  # the router's own setting here: not the default, so an update shows


@dataclass
class Bus:
    url: str
    settings: Settings  # what the router runs with
    operator: Client
    procs: ServiceProcesses


@dataclass(frozen=True)
class Row:
    """One row this module planted: where, and whether pruning must take it."""

    table: str
    key: str
    goes: bool


async def _plant(conn: asyncpg.Connection, schema: str, *, now: datetime, unsent: bool) -> list[Row]:
    """Outbox and inbox rows on both sides of their retention (the defaults: outbox 1 day after sent,
    quarantined rows and inbox 14 days). ``unsent``: also an old row the relay has not sent (no relay may
    run meanwhile: it would try to publish it)."""
    day = timedelta(days=1)
    outbox = [
        ("old_sent", now - 3 * day, now - 2 * day, None, True),
        ("fresh_sent", now - 2 * day, now - timedelta(hours=1), None, False),
        ("old_quarantined", now - 20 * day, None, now - 15 * day, True),
        ("fresh_quarantined", now - 20 * day, None, now - 2 * day, False),
    ]
    if unsent:
        outbox.append(("old_unsent", now - 30 * day, None, None, False))
    rows: list[Row] = []
    for name, created, sent, quarantined, goes in outbox:
        event_id = uuid.uuid4()
        await conn.execute(
            f"INSERT INTO {schema}.outbox (event_id, subject, event_type, payload, created_at, sent_at, "
            "quarantined_at, error) VALUES ($1, 'retention.test', $2, '{}', $3, $4, $5, $6)",
            event_id,
            f"retention.{name}",
            created,
            sent,
            quarantined,
            "planted" if quarantined else None,
        )
        rows.append(Row(f"{schema}.outbox", str(event_id), goes))
    for name, processed, goes in (("old", now - 15 * day, True), ("fresh", now - 13 * day, False)):
        event_id = uuid.uuid4()
        await conn.execute(
            f"INSERT INTO {schema}.inbox (consumer, event_id, processed_at) VALUES ($1, $2, $3)",
            f"retention-{name}",
            event_id,
            processed,
        )
        rows.append(Row(f"{schema}.inbox", str(event_id), goes))
    return rows


async def _present(conn: asyncpg.Connection, rows: list[Row]) -> dict[Row, bool]:
    return {
        row: bool(await conn.fetchval(f"SELECT count(*) FROM {row.table} WHERE event_id = $1", uuid.UUID(row.key)))
        for row in rows
    }


async def _remove(conn: asyncpg.Connection, rows: list[Row]) -> None:
    for row in rows:
        await conn.execute(f"DELETE FROM {row.table} WHERE event_id = $1", uuid.UUID(row.key))


@pytest.mark.parametrize("schema", SCHEMAS)
async def test_each_service_role_prunes_its_own_schema_in_batches(settings: Settings, schema: str) -> None:
    """As the role the service connects with: DELETE on its outbox and inbox, in batches of 2 here. Runs
    before the router starts below (its relay would try to publish the old unsent row)."""
    now = datetime.now(UTC)
    engine = make_engine(service_database_url(settings, schema))
    conn = await asyncpg.connect(plain_url(service_database_url(settings, schema)))
    rows: list[Row] = []
    try:
        rows = [row for _ in range(3) for row in await _plant(conn, schema, now=now, unsent=True)]
        done = await prune_once(
            sessions=make_sessions(engine), schema=schema, now=now, retention=Retention.of(settings), batch=2
        )
        present = await _present(conn, rows)
        assert [row for row in rows if row.goes and present[row]] == []
        assert [row for row in rows if not row.goes and not present[row]] == []
        # Three of each old kind planted; rows of other tests are hours old at most, so nothing else went.
        assert (done.outbox_sent, done.outbox_quarantined, done.inbox) == (3, 3, 3)
    finally:
        await _remove(conn, rows)
        await conn.close()
        await engine.dispose()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def planted(settings: Settings) -> AsyncIterator[list[Row]]:
    """Rows in the router's schema, planted before the router starts (it prunes at start, then every
    ``HETSCHED_RETENTION_PRUNE_S``)."""
    conn = await asyncpg.connect(plain_url(service_database_url(settings, "routing")))
    try:
        rows = await _plant(conn, "routing", now=datetime.now(UTC), unsent=False)
        yield rows
        await _remove(conn, rows)
    finally:
        await conn.close()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def bus(settings: Settings, planted: list[Row], tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Bus]:
    tmp = tmp_path_factory.mktemp("retention")
    directory = tmp / "identities"
    run = uuid.uuid4().hex[:8]
    own = settings.updated(kit={"subject_prefix": f"r{run}", "stream_prefix": f"R{run.upper()}_"})
    registry = Registry(subject_prefix=own.kit.subject_prefix, stream_prefix=own.kit.stream_prefix)
    operator_seed = ensure_operator(directory, registry)
    identity = service_identity(SERVICES[ROUTER].schema)
    seed = ensure_seeded(directory, registry, id=identity, kind="service", name=SERVICES[ROUTER].name)
    registry.save(directory)
    server = EmbeddedNats(
        store_dir=tmp / "js", auth_conf=write_auth_conf(directory, registry, service_permission_map(own))
    )
    await asyncio.to_thread(server.start, log_file=tmp / "nats.log")
    own = own.updated(kit={"nats_url": server.url, "stream_routing_max_age_s": ROUTING_MAX_AGE_S})
    operator = await nats.connect(server.url, nkeys_seed=str(operator_seed), max_reconnect_attempts=0)
    # Every stream as an older hetsched made it: no max age but TELEMETRY's and DEADLETTER's, no size cap.
    old = tuple(
        dataclasses.replace(spec, max_bytes=None, max_age_s=spec.max_age_s if "TELEMETRY" in spec.name else None)
        for spec in stream_specs(subjects=Subjects(own.kit.subject_prefix), stream_prefix=own.kit.stream_prefix)
    )
    old = tuple(dataclasses.replace(s, max_age_s=30 * 86_400.0) if "DEADLETTER" in s.name else s for s in old)
    await ensure_streams(operator.jetstream(), old)
    procs = ServiceProcesses(own, tmp)
    try:
        procs.start(
            ROUTER,
            HETSCHED_NATS_NKEY_SEED_FILE=str(seed),
            HETSCHED_NATS_INBOX_PREFIX=inbox_prefix(identity),
            HETSCHED_STREAM_ROUTING_MAX_AGE_S=str(ROUTING_MAX_AGE_S),
        )
        health = await wait_healthy(
            nats_url=server.url,
            subjects=Subjects(own.kit.subject_prefix),
            deadline_s=60,
            only={ROUTER},
            nkeys_seed=str(operator_seed),
        )
        assert health[ROUTER]["status"] == "ok", (health, procs.log(ROUTER)[-3000:])
        yield Bus(url=server.url, settings=own, operator=operator, procs=procs)
    finally:
        procs.stop_all()
        with contextlib.suppress(Exception):
            await operator.close()
        server.stop()


async def _limits(bus: Bus, name: str) -> tuple[float, int]:
    info = await bus.operator.jetstream().stream_info(name)
    return (round(info.config.max_age or 0.0, 3), int(info.config.max_bytes or -1))


async def test_a_service_gives_its_own_stream_its_limits_in_place_and_leaves_the_rest(bus: Bus) -> None:
    prefix = bus.settings.kit.stream_prefix
    routing = stream_name(Context.ROUTING, stream_prefix=prefix)
    assert await _limits(bus, routing) == (ROUTING_MAX_AGE_S, bus.settings.kit.stream_max_bytes)
    # Streams the router does not own keep what they had (it may not update them) ...
    assert await _limits(bus, stream_name(Context.LEDGER, stream_prefix=prefix)) == (0.0, -1)
    assert await _limits(bus, stream_name(Context.PLACEMENT, stream_prefix=prefix)) == (0.0, -1)
    # ... and DEADLETTER, which it may only create, is left for the operator with one WARNING line.
    assert await _limits(bus, deadletter_stream_name(stream_prefix=prefix)) == (30 * 86_400.0, -1)
    assert "a stream's limits differ from the settings" in bus.procs.log(ROUTER)


async def test_the_operators_pass_gives_every_stream_its_limits(bus: Bus) -> None:
    """What `hetsched up` runs as the operator at each start: every stream, read back from JetStream."""
    specs = stream_specs_for(bus.settings)
    await ensure_streams(bus.operator.jetstream(), specs)
    wanted = {
        stream_name(Context.TOPOLOGY, stream_prefix=bus.settings.kit.stream_prefix): 7 * 86_400.0,
        stream_name(Context.LEDGER, stream_prefix=bus.settings.kit.stream_prefix): 7 * 86_400.0,
        stream_name(Context.PLACEMENT, stream_prefix=bus.settings.kit.stream_prefix): 7 * 86_400.0,
        stream_name(Context.RESERVATION, stream_prefix=bus.settings.kit.stream_prefix): 7 * 86_400.0,
        stream_name(Context.ROUTING, stream_prefix=bus.settings.kit.stream_prefix): ROUTING_MAX_AGE_S,
        stream_name(Context.REBALANCE, stream_prefix=bus.settings.kit.stream_prefix): 7 * 86_400.0,
        stream_name(Context.TELEMETRY, stream_prefix=bus.settings.kit.stream_prefix): 3600.0,
        stream_name(Context.GATEWAY, stream_prefix=bus.settings.kit.stream_prefix): 7 * 86_400.0,
        deadletter_stream_name(stream_prefix=bus.settings.kit.stream_prefix): 14 * 86_400.0,
    }
    assert {s.name for s in specs} == set(wanted)
    for name, max_age_s in wanted.items():
        info = await bus.operator.jetstream().stream_info(name)
        assert (round(info.config.max_age or 0.0, 3), info.config.max_bytes) == (max_age_s, 1024**3), name
        assert 0 < (info.config.duplicate_window or 0) <= max_age_s


async def test_the_running_service_prunes_what_is_past_its_retention(
    bus: Bus, settings: Settings, planted: list[Row]
) -> None:
    conn = await asyncpg.connect(plain_url(service_database_url(settings, "routing")))
    try:

        async def pruned() -> dict[Row, bool] | None:
            present = await _present(conn, planted)
            return present if not any(present[row] for row in planted if row.goes) else None

        present = await wait_for(pruned, 30, interval_s=0.2, what="the router pruned the old rows")
        assert all(present[row] for row in planted if not row.goes), present
    finally:
        await conn.close()


async def test_a_size_cap_the_servers_store_cannot_reserve_leaves_the_stream_uncapped_and_says_so(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """JetStream reserves a stream's ``max_bytes`` in its store at creation (error 10047 when it cannot):
    a cap larger than any disk here must not keep the stack from starting. The streams are made without
    it, with their max ages, and one ERROR line per stream names the setting."""
    nc = await nats.connect(settings.kit.nats_url or "")
    js = nc.jetstream()
    run = uuid.uuid4().hex[:8]
    specs = stream_specs(subjects=Subjects(f"cap{run}"), stream_prefix=f"CAP{run.upper()}_", max_bytes=1024**5)
    try:
        with caplog.at_level("ERROR", logger="hetsched.bus"):
            await ensure_streams(js, specs)
            await ensure_streams(js, specs)  # and again, as the next start updates them in place
        for spec in specs:
            info = await js.stream_info(spec.name)
            assert (info.config.max_bytes, info.config.max_age) == (-1, spec.max_age_s), spec.name
        said = [r for r in caplog.records if "HETSCHED_STREAM_MAX_BYTES" in r.getMessage()]
        assert {getattr(r, "stream", None) for r in said} == {spec.name for spec in specs}
    finally:
        for spec in specs:
            with contextlib.suppress(Exception):
                await js.delete_stream(spec.name)
        await nc.close()
