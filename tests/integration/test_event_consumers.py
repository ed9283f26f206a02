"""A service's event consumer on real JetStream: durable, explicit ack, redelivery on error, once per event."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import nats
import pytest
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from shared.contracts.envelope import EventEnvelope, new_event
from shared.contracts.subjects import Context, Rpc, Subjects
from shared.infra.bus import EventHandler
from shared.infra.db import async_url, role_of
from shared.infra.service import EventRoute, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings

pytestmark = pytest.mark.asyncio(loop_scope="session")


async def test_consumer_redelivers_after_an_error_and_applies_each_event_once(settings: Settings) -> None:
    failures_left = {"n": 1}

    def factory(_runtime: Runtime) -> EventHandler:
        async def apply(session: AsyncSession, event: EventEnvelope) -> None:
            await session.execute(
                text(
                    "INSERT INTO rebalance.probe_events (event_id, n) VALUES (:id, 1) "
                    "ON CONFLICT (event_id) DO UPDATE SET n = probe_events.n + 1"
                ),
                {"id": event.event_id},
            )
            if event.payload.get("fail") and failures_left["n"] > 0:
                failures_left["n"] -= 1
                raise RuntimeError("transient failure: the transaction rolls back and the message is nacked")

        return apply

    definition = ServiceDefinition(
        name="probe",
        health=Rpc.REBALANCE_HEALTH,
        schema="rebalance",
        events=(EventRoute(Context.REBALANCE, "probe_x", "probe", factory),),
    )
    app, runtime = build_app(definition, settings)
    # The service connects as its own role, which may not create tables: the migrating user does.
    admin = create_async_engine(async_url(settings.database_url or ""))
    async with admin.begin() as conn:
        await conn.execute(text("CREATE TABLE IF NOT EXISTS rebalance.probe_events (event_id uuid PRIMARY KEY, n int)"))
        await conn.execute(text(f"GRANT ALL ON rebalance.probe_events TO {role_of('rebalance')}"))
    await admin.dispose()

    subject = Subjects(settings.subject_prefix).event(Context.REBALANCE, "probe_x")
    plain = new_event(type="rebalance.probe_x", source="t", payload={}, occurred_at=datetime.now(UTC))
    flaky = new_event(type="rebalance.probe_x", source="t", payload={"fail": True}, occurred_at=datetime.now(UTC))
    async with app:
        nc = await nats.connect(settings.nats_url or "")
        js = nc.jetstream()
        for suffix in ("a", "b"):  # the same event under two message ids: a redelivery JetStream keeps
            await js.publish(
                subject, plain.model_dump_json().encode(), headers={"Nats-Msg-Id": f"{plain.event_id}{suffix}"}
            )
        await js.publish(subject, b"not an envelope", headers={"Nats-Msg-Id": str(uuid.uuid4())})
        await js.publish(subject, flaky.model_dump_json().encode(), headers={"Nats-Msg-Id": str(flaky.event_id)})
        await nc.close()

        async def counts() -> dict[uuid.UUID, int]:
            async with runtime.engine.connect() as conn:
                rows = (await conn.execute(text("SELECT event_id, n FROM rebalance.probe_events"))).all()
            return {r.event_id: r.n for r in rows}

        for _ in range(100):
            seen = await counts()
            if seen.get(plain.event_id) and seen.get(flaky.event_id):
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # time for any (wrong) second application to show up
        seen = await counts()
    assert seen[plain.event_id] == 1
    assert seen[flaky.event_id] == 1, "the failed attempt rolled back; the redelivery applied it once"
    assert failures_left["n"] == 0, "the handler did fail once, so the message was redelivered"
