"""The router's store on real Postgres, as the router's own role: the routes a group commit writes in one
statement on the driver (``RoutingStore.save_routes`` through ``UnitOfWorkFactory.run_on_driver``), the
traffic counts of a flush, and what a restarted router loads back."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
import pytest_asyncio

from services.cross_region_router.store import Loaded, RoutingStore, StoredTenant
from services.cross_region_router.tables import SCHEMA
from shared.contracts.subjects import Subjects
from shared.domain.routing import day_of
from shared.infra.db import make_engine, make_sessions, service_database_url
from shared.infra.settings import Settings
from shared.infra.uow import DriverUnitOfWork, UnitOfWork, UnitOfWorkFactory

pytestmark = pytest.mark.asyncio(loop_scope="session")

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)


@pytest_asyncio.fixture(loop_scope="session")
async def uow(settings: Settings) -> AsyncIterator[UnitOfWorkFactory]:
    engine = make_engine(service_database_url(settings, SCHEMA))
    yield UnitOfWorkFactory(
        sessions=make_sessions(engine), schema=SCHEMA, source="cross-region-router", subjects=Subjects("t")
    )
    await engine.dispose()


async def test_routes_written_together_are_upserted_and_loaded_back(uow: UnitOfWorkFactory) -> None:
    store = RoutingStore()
    run = uuid.uuid4().hex[:8]  # the test database is shared: names of this test's own
    a, b, c = (f"{run}-{name}" for name in "abc")

    async def save(tenants: dict[str, StoredTenant], sessions: dict[tuple[str, str], str], now: datetime = NOW) -> None:
        async def work(unit: DriverUnitOfWork) -> None:
            await store.save_routes(connection=unit.connection, tenants=tenants, sessions=sessions, now=now)

        await uow.run_on_driver(work)

    # Two new tenants and three new sessions in one statement; then a switch and a moved session upserted
    # beside a new one; an empty write changes nothing.
    await save(
        {a: StoredTenant("us-east-1", NOW), b: StoredTenant("eu-west-1", NOW)},
        {(a, "s1"): "us-east-1", (a, "s2"): "us-east-1", (b, "s1"): "eu-west-1"},
    )
    later = NOW + timedelta(hours=1)
    await save({a: StoredTenant("us-west-1", later)}, {(a, "s2"): "us-west-1", (c, "s1"): "us-east-1"}, now=later)
    await save({}, {})

    async def add(counts: dict[tuple[str, str, int], int]) -> None:
        async def work(unit: UnitOfWork) -> None:
            await store.add_traffic(session=unit.session, counts=counts)

        await uow.run(work)

    today = day_of(NOW.timestamp())
    await add({(a, "us-east-1", today): 3, (b, "eu-west-1", today): 1})
    await add({(a, "us-east-1", today): 2, (a, "us-west-1", today): 1})

    async def load(unit: UnitOfWork) -> Loaded:
        return await store.load(session=unit.session, since_day=today - 7, sessions_since=NOW - timedelta(days=1))

    loaded = await uow.run(load)
    assert {t: s for t, s in loaded.tenants.items() if t.startswith(run)} == {
        a: StoredTenant("us-west-1", later),
        b: StoredTenant("eu-west-1", NOW),
    }
    assert {k: r for k, r in loaded.sessions.items() if k[0].startswith(run)} == {
        (a, "s1"): "us-east-1",
        (a, "s2"): "us-west-1",
        (b, "s1"): "eu-west-1",
        (c, "s1"): "us-east-1",
    }
    traffic = {t: counts for t, counts in loaded.traffic.items() if t.startswith(run)}
    assert traffic == {a: {("us-east-1", today): 5, ("us-west-1", today): 1}, b: {("eu-west-1", today): 1}}
