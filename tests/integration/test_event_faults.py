"""Events never wedge or loop (issue 10, Deliver 2), on real Postgres and JetStream.

- An event is measured when emitted, as the UTF-8 bytes the relay publishes (not ASCII-escaped JSON,
  which grows a non-ASCII string sixfold); one over the limit fails its transaction with a typed error.
- Row 4: an event that escaping pushed past NATS max_payload is published (UTF-8); one that cannot be
  published at all is quarantined with an alert; the rows behind both still reach consumers.
- Row 5: an event whose handler keeps failing is redelivered with growing delays at most
  ``event_max_deliveries`` times, then dead-lettered (DEADLETTER stream, headers saying why and
  whence) and acknowledged; one off its contract is dead-lettered at once; the consumer goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import sys
import time
import uuid
from asyncio.subprocess import PIPE
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime

import nats
import pytest
import pytest_asyncio
from nats.js import JetStreamContext
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.contracts.base import ErrorCode
from shared.contracts.envelope import EventEnvelope, new_event
from shared.contracts.permissions import EVENT_PUBLISHERS
from shared.contracts.streams import deadletter_stream_name, stream_name
from shared.contracts.subjects import Context, Rpc, Subjects
from shared.contracts.topology import NodeStateEvent, TopologyEventName
from shared.infra import deadletter
from shared.infra.consumers import DEAD_LETTERED_MESSAGE
from shared.infra.db import make_engine, make_sessions
from shared.infra.outbox import QUARANTINED_MESSAGE, OutboxRelay, RelayStalled, enqueue, event_body
from shared.infra.service import Consumer, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings
from shared.infra.tables import inbox_table, outbox_table
from shared.infra.uow import EventTooLarge, UnitOfWork
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

SCHEMA = "routing"  # the probe service's schema: its outbox, relay and inbox
NATS_MAX_PAYLOAD = 1024 * 1024  # nats-server's default


@dataclass
class Probe:
    """Handlers under test: record each delivery; fail for the events named in ``poison``."""

    poison: set[uuid.UUID] = field(default_factory=set)
    calls: list[tuple[uuid.UUID, float]] = field(default_factory=list)

    async def on_node(self, *, uow: UnitOfWork, event: EventEnvelope, payload: NodeStateEvent) -> None:
        self.calls.append((event.event_id, time.monotonic()))
        if event.event_id in self.poison:
            raise ValueError(f"malformed node name {payload.node[:40]!r}")

    def applied(self, event_id: uuid.UUID) -> int:
        return sum(1 for seen, _ in self.calls if seen == event_id)


def probe_service(probe: Probe, *, durable: str, together: bool = False) -> ServiceDefinition:
    def wire(_runtime: Runtime) -> Probe:
        return probe

    return ServiceDefinition(
        name="event-faults-probe",
        health=Rpc.ROUTE_HEALTH,
        schema=SCHEMA,
        consumers=(
            Consumer(
                Context.TOPOLOGY,
                durable,
                on={
                    TopologyEventName.NODE_LOST: lambda p: p.on_node,
                    TopologyEventName.NODE_RECOVERED: lambda p: p.on_node,
                },
                together=together,
            ),
        ),
        wire=wire,
    )


def node_event(node: str, *, name: TopologyEventName = TopologyEventName.NODE_LOST) -> EventEnvelope:
    payload = NodeStateEvent(node=node, region="r1", accelerators=[f"{node[:20]}/gpu0"])
    return new_event(
        type=f"{Context.TOPOLOGY.value}.{name}",
        source=EVENT_PUBLISHERS[Context.TOPOLOGY],
        payload=payload.model_dump(mode="json"),
        occurred_at=datetime.now(UTC),
    )


async def letters_of(js: JetStreamContext, settings: Settings, consumer: str) -> dict[uuid.UUID, deadletter.DeadLetter]:
    """The dead letters ``consumer`` parked, by event id (other tests' consumers park theirs too)."""
    stream = deadletter_stream_name(stream_prefix=settings.kit.stream_prefix)
    found = {}
    for letter in await deadletter.list_dead_letters(js, stream=stream, limit=100_000):
        if letter.consumer == consumer:
            with contextlib.suppress(ValueError):
                found[EventEnvelope.model_validate_json(letter.body).event_id] = letter
    return found


async def cli(settings: Settings, *args: str) -> str:
    """Run `hetsched <args>` as an operator does, against this run's NATS and streams; returns stdout."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSCHED_")}
    env.update(
        HETSCHED_NATS_URL=settings.kit.nats_url or "",
        HETSCHED_STREAM_PREFIX=settings.kit.stream_prefix,
        HETSCHED_SUBJECT_PREFIX=settings.kit.subject_prefix,
        COLUMNS="200",
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "hetsched.cli", *args, env=env, stdout=PIPE, stderr=PIPE
    )
    out, errors = await proc.communicate()
    assert proc.returncode == 0, errors.decode()
    return out.decode()


@pytest_asyncio.fixture(loop_scope="session")
async def admin(settings: Settings) -> AsyncIterator[AsyncEngine]:
    engine = make_engine(settings.kit.database_url or "")
    yield engine
    await engine.dispose()


@pytest_asyncio.fixture(loop_scope="session")
async def js(settings: Settings) -> AsyncIterator[JetStreamContext]:
    client = await nats.connect(settings.kit.nats_url or "")
    yield client.jetstream()
    await client.close()


async def test_an_event_is_measured_as_published_utf8_and_refused_over_the_limit() -> None:
    uow = UnitOfWork(session=None, now=datetime.now(UTC), subjects=Subjects("t"), source="t", max_event_bytes=900_000)  # type: ignore[arg-type]
    # 150k two-byte characters: 300 KB as UTF-8, 900 KB as ASCII-escaped JSON. It fits.
    wide = "é" * 150_000
    emitted = uow.emit(
        Context.TOPOLOGY, TopologyEventName.NODE_LOST, NodeStateEvent(node=wide, region="r", accelerators=[])
    )
    body = event_body(emitted.model_dump(mode="json"))
    assert 300_000 < len(body) < 310_000, "measured as UTF-8, not escaped"
    assert wide.encode() in body

    with pytest.raises(EventTooLarge) as refused:
        uow.emit(
            Context.TOPOLOGY,
            TopologyEventName.NODE_LOST,
            NodeStateEvent(node="x" * 950_000, region="r", accelerators=[]),
        )
    assert refused.value.code is ErrorCode.INVALID_REQUEST
    assert refused.value.size > refused.value.limit == 900_000
    assert len(str(refused.value)) < 200, "the message names sizes, it does not echo the event"
    assert len(uow.events) == 1, "the refused event is not queued"


async def test_row4_an_unpublishable_event_is_quarantined_and_the_outbox_goes_on(
    settings: Settings, admin: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    subjects = Subjects(settings.kit.subject_prefix)
    lost = subjects.event(Context.TOPOLOGY, TopologyEventName.NODE_LOST)
    # 400k two-byte characters: 800 KB as UTF-8 (fits NATS), 2.4 MB as ASCII-escaped JSON (did not).
    escaped = node_event("ñ" * 400_000)
    # Over max_payload even as UTF-8 (written past `emit`'s check, e.g. by an older version).
    huge = node_event("n" * (NATS_MAX_PAYLOAD + 10_000))
    later = node_event(f"later-{uuid.uuid4().hex[:6]}")
    sessions = make_sessions(admin)
    async with sessions() as session, session.begin():
        for event in (escaped, huge, later):
            await enqueue(session=session, schema=SCHEMA, subject=lost, event=event)
    probe = Probe()
    app, runtime = build_app(probe_service(probe, durable=f"faults-{uuid.uuid4().hex[:8]}"), settings)
    table = outbox_table(SCHEMA)

    async def rows() -> dict[uuid.UUID, tuple[datetime | None, datetime | None, str | None]]:
        async with sessions() as session:
            found = await session.execute(
                select(table.c.event_id, table.c.sent_at, table.c.quarantined_at, table.c.error).where(
                    table.c.event_id.in_([escaped.event_id, huge.event_id, later.event_id])
                )
            )
            return {r.event_id: (r.sent_at, r.quarantined_at, r.error) for r in found}

    async def all_settled() -> dict[uuid.UUID, tuple[datetime | None, datetime | None, str | None]] | None:
        found = await rows()
        done = len(found) == 3 and all(sent or quarantined for sent, quarantined, _ in found.values())
        return found if done else None

    with caplog.at_level(logging.ERROR, logger="hetsched.outbox"):
        async with app:
            await wait_for(lambda: probe.applied(later.event_id), 20, what="the event behind them applied")
            settled = await wait_for(all_settled, 10, what="every row sent or quarantined")
            relay = runtime.relay
            assert relay is not None
            # The counter the metrics endpoint exports (rows an earlier module of the run left under its own
            # subject prefix in the shared database are quarantined too: at least this one).
            assert relay.quarantined >= 1, "the counter the metrics endpoint exports"

    assert settled is not None
    assert settled[escaped.event_id][0] is not None, "published as UTF-8: it fits"
    sent_at, quarantined_at, error = settled[huge.event_id]
    assert sent_at is None and quarantined_at is not None
    assert error and "MaxPayload" in error and len(error) <= 500
    assert settled[later.event_id][0] is not None
    alerts = [r for r in caplog.records if r.getMessage() == QUARANTINED_MESSAGE]
    assert len(alerts) == 1 and alerts[0].levelno == logging.ERROR and not alerts[0].exc_info
    assert getattr(alerts[0], "event_id", None) == str(huge.event_id)


async def test_row5_a_failing_event_is_redelivered_with_backoff_then_dead_lettered_and_the_consumer_goes_on(
    settings: Settings, js: JetStreamContext, caplog: pytest.LogCaptureFixture
) -> None:
    max_deliveries, backoff_s = 3, 0.2
    tuned = settings.updated(
        kit={
            "event_max_deliveries": max_deliveries,
            "event_redelivery_backoff_ms": int(backoff_s * 1000),
            "event_redelivery_backoff_max_ms": 2000,
        }
    )
    subjects = Subjects(settings.kit.subject_prefix)
    poisoned = node_event(f"bad-{uuid.uuid4().hex[:6]}")
    before = node_event(f"before-{uuid.uuid4().hex[:6]}")
    after = node_event(f"after-{uuid.uuid4().hex[:6]}", name=TopologyEventName.NODE_RECOVERED)
    off_contract = node_event(f"odd-{uuid.uuid4().hex[:6]}")
    off_contract = off_contract.model_copy(update={"payload": {"node": 42}})
    probe = Probe(poison={poisoned.event_id})
    durable = f"faults-{uuid.uuid4().hex[:8]}"
    app, runtime = build_app(probe_service(probe, durable=durable), tuned)
    server_durable = f"{settings.kit.subject_prefix}-{SCHEMA}-{durable}"
    stream = stream_name(Context.TOPOLOGY, stream_prefix=settings.kit.stream_prefix)

    async def publish(event: EventEnvelope) -> int:
        name = event.type.rsplit(".", 1)[-1]
        ack = await js.publish(
            subjects.event(Context.TOPOLOGY, name),
            event.model_dump_json().encode(),
            headers={"Nats-Msg-Id": str(event.event_id)},
        )
        return ack.seq

    with caplog.at_level(logging.INFO, logger="hetsched.event-faults-probe"):
        async with app:
            await publish(before)
            off_seq = await publish(off_contract)
            poisoned_seq = await publish(poisoned)
            await publish(after)

            async def settled() -> dict[uuid.UUID, deadletter.DeadLetter] | None:
                info = await js.consumer_info(stream, server_durable)
                letters = await letters_of(js, settings, server_durable)
                done = (
                    probe.applied(after.event_id) == 1
                    and {poisoned.event_id, off_contract.event_id} <= set(letters)
                    and info.num_ack_pending == 0
                    and info.num_pending == 0
                )
                return letters if done else None

            letters = await wait_for(settled, 30, what="the failing events dead-lettered and the later one applied")
            # A pass more for the consumer to show it does not come back to the dead letters.
            probe_after = node_event(f"after2-{uuid.uuid4().hex[:6]}", name=TopologyEventName.NODE_RECOVERED)
            await publish(probe_after)
            await wait_for(lambda: probe.applied(probe_after.event_id), 10, what="a later event applied")

    assert probe.applied(before.event_id) == 1
    assert probe.applied(poisoned.event_id) == max_deliveries, "redelivered up to the limit, then no more"
    times = [at for seen, at in probe.calls if seen == poisoned.event_id]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert gaps[0] >= backoff_s * 0.9 and gaps[1] >= 2 * backoff_s * 0.9, f"no hot loop: growing delays {gaps}"
    assert probe.applied(off_contract.event_id) == 0
    order = [seen for seen, _ in probe.calls if seen in {before.event_id, after.event_id}]
    assert order == [before.event_id, after.event_id]

    assert letters is not None and runtime.consumers[0].dead_lettered >= 2
    bad = letters[poisoned.event_id]
    assert bad.original_sequence == str(poisoned_seq)
    assert bad.subject == subjects.deadletter(Context.TOPOLOGY, server_durable)
    assert bad.original_subject == subjects.event(Context.TOPOLOGY, TopologyEventName.NODE_LOST)
    assert "ValueError" in bad.error and bad.deliveries == str(max_deliveries)
    assert EventEnvelope.model_validate_json(bad.body).event_id == poisoned.event_id, "the original body"
    odd = letters[off_contract.event_id]
    assert odd.original_sequence == str(off_seq)
    assert "does not match its contract" in odd.error and odd.deliveries == "1", "no redelivery can help it"

    # One log line per delivery: the first failure with its stack, later ones one line, then the alert.
    about = [r for r in caplog.records if getattr(r, "durable", None) == server_durable]
    failed = [r for r in about if getattr(r, "sequence", None) == poisoned_seq]
    assert len(failed) == max_deliveries
    assert [bool(r.exc_info) for r in failed] == [True] + [False] * (max_deliveries - 1)
    assert failed[-1].getMessage() == DEAD_LETTERED_MESSAGE and failed[-1].levelno == logging.ERROR


async def test_a_consumer_applying_batches_together_parks_a_failing_event_and_commits_the_others_once(
    settings: Settings, js: JetStreamContext, admin: AsyncEngine
) -> None:
    # Consumer(together=True): a batch in one transaction; a failing event in the middle rolls the batch
    # back, the events before it are applied again (together), the failing one is redelivered with
    # backoff and then dead-lettered, and the events after it follow. Each event is recorded once.
    tuned = settings.updated(
        kit={"event_max_deliveries": 2, "event_redelivery_backoff_ms": 100, "event_redelivery_backoff_max_ms": 200}
    )
    subjects = Subjects(settings.kit.subject_prefix)
    events = [node_event(f"batch{n}-{uuid.uuid4().hex[:6]}") for n in range(6)]
    poisoned = events[3]
    probe = Probe(poison={poisoned.event_id})
    durable = f"together-{uuid.uuid4().hex[:8]}"
    app, _runtime = build_app(probe_service(probe, durable=durable, together=True), tuned)
    server_durable = f"{settings.kit.subject_prefix}-{SCHEMA}-{durable}"
    for event in events:  # published before the consumer starts: its first fetch takes them as one batch
        await js.publish(
            subjects.event(Context.TOPOLOGY, TopologyEventName.NODE_LOST),
            event.model_dump_json().encode(),
            headers={"Nats-Msg-Id": str(event.event_id)},
        )
    async with app:

        async def settled() -> bool:
            letters = await letters_of(js, settings, server_durable)
            return poisoned.event_id in letters and all(probe.applied(e.event_id) for e in events)

        await wait_for(settled, 30, what="the batch applied around the dead-lettered event")
    inbox = inbox_table(SCHEMA)
    async with admin.connect() as conn:
        rows = (await conn.execute(select(inbox.c.event_id).where(inbox.c.consumer == durable))).scalars().all()
    recorded = Counter(rows)
    assert {e.event_id for e in events if e is not poisoned} <= set(recorded), "every good event is committed"
    assert poisoned.event_id not in recorded, "the failing event's rolled-back work is not"
    assert all(count == 1 for count in recorded.values())
    assert probe.applied(poisoned.event_id) == 2, "redelivered up to the limit, then dead-lettered"


async def test_a_dead_letter_can_be_replayed_onto_its_original_subject(
    settings: Settings, js: JetStreamContext
) -> None:
    subjects = Subjects(settings.kit.subject_prefix)
    event = node_event(f"replayed-{uuid.uuid4().hex[:6]}")
    probe = Probe(poison={event.event_id})
    durable = f"faults-{uuid.uuid4().hex[:8]}"
    tuned = settings.updated(kit={"event_max_deliveries": 1})
    app, runtime = build_app(probe_service(probe, durable=durable), tuned)
    stream = deadletter_stream_name(stream_prefix=settings.kit.stream_prefix)
    server_durable = f"{settings.kit.subject_prefix}-{SCHEMA}-{durable}"
    async with app:
        await js.publish(
            subjects.event(Context.TOPOLOGY, TopologyEventName.NODE_LOST),
            event.model_dump_json().encode(),
            headers={"Nats-Msg-Id": str(event.event_id)},
        )

        async def parked() -> deadletter.DeadLetter | None:
            return (await letters_of(js, settings, server_durable)).get(event.event_id)

        letter = await wait_for(parked, 20, what="the event dead-lettered")
        assert letter is not None
        assert runtime.consumers[0].dead_lettered >= 1
        listed = json.loads(await cli(settings, "deadletter", "list", "--json", "--limit", "100000"))
        (shown,) = [row for row in listed if row["sequence"] == letter.sequence]
        assert shown["consumer"] == server_durable and "ValueError" in shown["error"]
        probe.poison.clear()  # the operator fixed the cause
        await cli(settings, "deadletter", "replay", str(letter.sequence))
        await wait_for(lambda: probe.applied(event.event_id) == 2, 20, what="the replayed event applied")
        remaining = await deadletter.list_dead_letters(js, stream=stream, limit=10_000)
    assert letter.sequence not in {entry.sequence for entry in remaining}, "replayed letters leave the stream"


class FlakyJetStream:
    """The real JetStream, except that publishing one event id times out ``failures`` times (NATS away)."""

    def __init__(self, js: JetStreamContext, *, event_id: uuid.UUID, failures: int) -> None:
        self._js = js
        self._event_id = str(event_id)
        self.failures = failures

    async def publish(self, subject: str, payload: bytes, *, headers: dict[str, str]) -> object:
        if headers.get("Nats-Msg-Id") == self._event_id and self.failures > 0:
            self.failures -= 1
            raise nats.errors.TimeoutError
        return await self._js.publish(subject, payload, headers=headers)


async def test_a_transient_publish_error_stalls_the_relay_without_quarantining(
    settings: Settings, admin: AsyncEngine, js: JetStreamContext
) -> None:
    subject = Subjects(settings.kit.subject_prefix).event(Context.TOPOLOGY, TopologyEventName.NODE_LOST)
    first, stuck = node_event("first"), node_event("stuck")
    sessions = make_sessions(admin)
    schema = "reservation"
    async with sessions() as session, session.begin():
        for event in (first, stuck):
            await enqueue(session=session, schema=schema, subject=subject, event=event)
    flaky = FlakyJetStream(js, event_id=stuck.event_id, failures=1)
    relay = OutboxRelay(sessions=sessions, js=flaky, schema=schema)  # type: ignore[arg-type]
    table = outbox_table(schema)

    async def state(event: EventEnvelope) -> tuple[datetime | None, datetime | None]:
        async with sessions() as session:
            row = (
                await session.execute(
                    select(table.c.sent_at, table.c.quarantined_at).where(table.c.event_id == event.event_id)
                )
            ).one()
            return row.sent_at, row.quarantined_at

    with pytest.raises(RelayStalled):
        while await relay.run_once():
            pass
    assert (await state(first))[0] is not None, "what was published before the error is marked sent"
    assert await state(stuck) == (None, None), "not sent, not quarantined: retried"
    assert relay.quarantined == 0
    while await relay.run_once():
        pass
    sent_at, quarantined_at = await state(stuck)
    assert sent_at is not None and quarantined_at is None
