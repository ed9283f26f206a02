"""A service's `Consumer` on real JetStream: durable, explicit ack, typed payloads, redelivery on error,
each event applied once; what cannot be applied (not an envelope, a payload off its contract) is
dead-lettered (tests/integration/test_event_faults.py looks at the dead letters), and events of names
the consumer does not handle are skipped, all of them acknowledged."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import nats
import pytest
from pydantic import BaseModel
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from shared.contracts.envelope import EventEnvelope, new_event
from shared.contracts.ledger import (
    AcceleratorBalance,
    AllocationsFlaggedEvent,
    CapacityChangedEvent,
    DriftEvent,
    LedgerEventName,
)
from shared.contracts.permissions import EVENT_PUBLISHERS
from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context, Rpc, Subjects
from shared.infra.db import async_url, role_of
from shared.infra.service import Consumer, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings
from shared.infra.uow import UnitOfWork
from tests.contract_examples import example_body
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROBE_TABLE = "rebalance.probe_events"


@dataclass
class Probe:
    """The handlers under test: each records the event in the service's own schema, in the event's transaction."""

    failures_left: dict[uuid.UUID, int] = field(default_factory=dict)
    calls: list[tuple[uuid.UUID, str]] = field(default_factory=list)

    async def _record(self, *, uow: UnitOfWork, event: EventEnvelope, payload: BaseModel) -> None:
        self.calls.append((event.event_id, type(payload).__name__))
        await uow.session.execute(
            text(
                f"INSERT INTO {PROBE_TABLE} (event_id, n, payload) VALUES (:id, 1, :payload) "
                "ON CONFLICT (event_id) DO UPDATE SET n = probe_events.n + 1"
            ),
            {"id": event.event_id, "payload": type(payload).__name__},
        )
        if self.failures_left.get(event.event_id, 0) > 0:
            self.failures_left[event.event_id] -= 1
            raise RuntimeError("transient failure: the transaction rolls back and the message is nacked")

    async def on_drift(self, *, uow: UnitOfWork, event: EventEnvelope, payload: DriftEvent) -> None:
        await self._record(uow=uow, event=event, payload=payload)

    async def on_flagged(self, *, uow: UnitOfWork, event: EventEnvelope, payload: AllocationsFlaggedEvent) -> None:
        await self._record(uow=uow, event=event, payload=payload)


def probe_service(probe: Probe, *, durable: str) -> ServiceDefinition:
    def wire(_runtime: Runtime) -> Probe:
        return probe

    return ServiceDefinition(
        name="probe",
        health=Rpc.REBALANCE_HEALTH,
        schema="rebalance",
        consumers=(
            Consumer(
                Context.LEDGER,
                durable,
                on={
                    LedgerEventName.DRIFT_DETECTED: lambda p: p.on_drift,
                    LedgerEventName.ALLOCATIONS_FLAGGED: lambda p: p.on_flagged,
                },
            ),
        ),
        wire=wire,
    )


async def create_probe_table(settings: Settings) -> None:
    # The service connects as its own role, which may not create tables: the migrating user does.
    admin = create_async_engine(async_url(settings.kit.database_url or ""))
    async with admin.begin() as conn:
        await conn.execute(
            text(f"CREATE TABLE IF NOT EXISTS {PROBE_TABLE} (event_id uuid PRIMARY KEY, n int, payload text)")
        )
        await conn.execute(text(f"GRANT ALL ON {PROBE_TABLE} TO {role_of('rebalance')}"))
    await admin.dispose()


def ledger_event(name: LedgerEventName, payload: dict[str, Any]) -> EventEnvelope:
    return new_event(
        type=f"{Context.LEDGER.value}.{name}",
        source=EVENT_PUBLISHERS[Context.LEDGER],
        payload=payload,
        occurred_at=datetime.now(UTC),
    )


async def test_consumer_applies_each_event_once_redelivers_on_error_and_parks_what_it_cannot_apply(
    settings: Settings,
) -> None:
    await create_probe_table(settings)
    durable = f"probe-{uuid.uuid4().hex[:8]}"
    drift = example_body(DriftEvent)
    plain = ledger_event(LedgerEventName.DRIFT_DETECTED, drift)
    flaky = ledger_event(LedgerEventName.DRIFT_DETECTED, drift)
    flagged = ledger_event(LedgerEventName.ALLOCATIONS_FLAGGED, example_body(AllocationsFlaggedEvent))
    off_contract = ledger_event(LedgerEventName.DRIFT_DETECTED, {"accelerator_id": "n1/gpu0", "observed_bytes": "many"})
    capacity = CapacityChangedEvent(
        node="n1", reason="lost", accelerators=[AcceleratorBalance.model_validate(example_body(AcceleratorBalance))]
    )
    not_handled = ledger_event(LedgerEventName.CAPACITY_CHANGED, capacity.model_dump(mode="json"))
    probe = Probe(failures_left={flaky.event_id: 1})
    app, runtime = build_app(probe_service(probe, durable=durable), settings)
    subjects = Subjects(settings.kit.subject_prefix)

    async with app:
        nc = await nats.connect(settings.kit.nats_url or "")
        js = nc.jetstream()

        async def publish(event: EventEnvelope, *, msg_id: str | None = None) -> None:
            subject = subjects.event(Context.LEDGER, event.type.rsplit(".", 1)[-1])
            await js.publish(
                subject, event.model_dump_json().encode(), headers={"Nats-Msg-Id": msg_id or str(event.event_id)}
            )

        for suffix in ("a", "b"):  # the same event under two message ids: a redelivery JetStream keeps
            await publish(plain, msg_id=f"{plain.event_id}{suffix}")
        await js.publish(
            subjects.event(Context.LEDGER, LedgerEventName.DRIFT_DETECTED),
            b"not an envelope",
            headers={"Nats-Msg-Id": str(uuid.uuid4())},
        )
        await publish(off_contract)
        await publish(not_handled)
        await publish(flaky)
        await publish(flagged)

        stream = stream_name(Context.LEDGER, stream_prefix=settings.kit.stream_prefix)
        consumer = f"{settings.kit.subject_prefix}-rebalance-{durable}"  # the durable build_app names
        applied = {plain.event_id, flaky.event_id, flagged.event_id}

        async def settled() -> bool:
            # The events applied and every message acknowledged: nothing is left to (re)deliver, so
            # the counts below are final.
            info = await js.consumer_info(stream, consumer)
            done = applied <= {event_id for event_id, _ in probe.calls}
            return done and info.num_pending == 0 and info.num_ack_pending == 0

        await wait_for(settled, 30, what="the events applied and every message acknowledged")
        await nc.close()
        async with runtime.engine.connect() as conn:
            rows = (await conn.execute(text(f"SELECT event_id, n, payload FROM {PROBE_TABLE}"))).all()
    seen = {r.event_id: (r.n, r.payload) for r in rows}

    assert seen[plain.event_id] == (1, "DriftEvent"), "published twice, applied once"
    assert seen[flaky.event_id] == (1, "DriftEvent"), "the failed attempt rolled back; the redelivery applied it once"
    assert probe.failures_left[flaky.event_id] == 0
    assert probe.calls.count((flaky.event_id, "DriftEvent")) == 2, "the handler failed once: redelivered"
    assert seen[flagged.event_id] == (1, "AllocationsFlaggedEvent"), "each name reaches its handler, typed"
    assert off_contract.event_id not in seen, "a payload off its contract is never applied (dead-lettered)"
    assert not_handled.event_id not in seen, "an event of a name not in `on` is skipped"
    called = {event_id for event_id, _ in probe.calls}
    assert called == {plain.event_id, flaky.event_id, flagged.event_id}
