"""Transactional outbox and idempotent consumers on real Postgres and JetStream."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import asyncpg
import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js import JetStreamContext
from pydantic import BaseModel
from sqlalchemy import select, text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from shared.contracts.envelope import EventEnvelope, new_event
from shared.contracts.permissions import EVENT_PUBLISHERS
from shared.contracts.streams import stream_name, stream_specs
from shared.contracts.subjects import Context, Subjects
from shared.infra.bus import consume, ensure_streams
from shared.infra.db import make_engine, make_sessions
from shared.infra.outbox import OutboxRelay, enqueue
from shared.infra.settings import Settings
from shared.infra.tables import outbox_table
from shared.infra.uow import DriverUnitOfWork, UnitOfWork, UnitOfWorkFactory

pytestmark = pytest.mark.asyncio(loop_scope="session")
SCHEMA = "ledger"


class _Probe(BaseModel):
    k: int


class RelayCrash(Exception):
    """Stands for the relay process dying: raised between JetStream's ack and the row update."""


@pytest_asyncio.fixture(loop_scope="session")
async def engine(settings: Settings) -> AsyncIterator[AsyncEngine]:
    eng = make_engine(settings.kit.database_url or "")
    async with eng.begin() as conn:
        await conn.execute(text("CREATE TABLE IF NOT EXISTS public.probe_state (id uuid PRIMARY KEY, n int)"))
    yield eng
    await eng.dispose()


@pytest.fixture
def sessions(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return make_sessions(engine)


@pytest_asyncio.fixture(loop_scope="session")
async def js(settings: Settings) -> AsyncIterator[JetStreamContext]:
    client: Client = await nats.connect(settings.kit.nats_url or "")
    ctx = client.jetstream()
    await ensure_streams(
        ctx, stream_specs(subjects=Subjects(settings.kit.subject_prefix), stream_prefix=settings.kit.stream_prefix)
    )
    yield ctx
    await client.close()


def _event(kind: str = "probe") -> EventEnvelope:
    return new_event(
        type=f"ledger.{kind}", source=EVENT_PUBLISHERS[Context.LEDGER], payload={"k": 1}, occurred_at=datetime.now(UTC)
    )


async def _count_in_stream(js: JetStreamContext, stream: str, subject: str, event_id: uuid.UUID) -> int:
    """How many messages on ``subject`` carry this event id (read back with an ephemeral consumer)."""
    sub = await js.pull_subscribe(subject, stream=stream)
    seen = 0
    try:
        while True:
            try:
                msgs = await sub.fetch(100, timeout=0.5)
            except TimeoutError:
                break
            for msg in msgs:
                if (msg.headers or {}).get("Nats-Msg-Id") == str(event_id):
                    seen += 1
                await msg.ack()
    finally:
        await sub.unsubscribe()
    return seen


async def test_state_change_and_event_commit_or_roll_back_together(
    sessions: async_sessionmaker[AsyncSession], settings: Settings
) -> None:
    subject = Subjects(settings.kit.subject_prefix).event(Context.LEDGER, "probe")
    kept, dropped = _event(), _event()
    async with sessions() as session, session.begin():
        await session.execute(text("INSERT INTO public.probe_state VALUES (:id, 1)"), {"id": kept.event_id})
        await enqueue(session=session, schema=SCHEMA, subject=subject, event=kept)
    with pytest.raises(RuntimeError):
        async with sessions() as session, session.begin():
            await session.execute(text("INSERT INTO public.probe_state VALUES (:id, 1)"), {"id": dropped.event_id})
            await enqueue(session=session, schema=SCHEMA, subject=subject, event=dropped)
            raise RuntimeError("the state change failed after the event was written")
    table = outbox_table(SCHEMA)
    async with sessions() as session:
        ids = set((await session.execute(select(table.c.event_id))).scalars())
        states = set((await session.execute(text("SELECT id FROM public.probe_state"))).scalars())
    assert kept.event_id in ids and kept.event_id in states
    assert dropped.event_id not in ids and dropped.event_id not in states


async def test_relay_crash_after_publish_before_mark_yields_exactly_one_event(
    sessions: async_sessionmaker[AsyncSession], js: JetStreamContext, settings: Settings
) -> None:
    subject = Subjects(settings.kit.subject_prefix).event(Context.LEDGER, "crash_probe")
    event = _event("crash_probe")
    async with sessions() as session, session.begin():
        await enqueue(session=session, schema=SCHEMA, subject=subject, event=event)

    def crash(_published: EventEnvelope) -> None:
        raise RelayCrash

    dying = OutboxRelay(sessions=sessions, js=js, schema=SCHEMA, after_publish=crash)
    with pytest.raises(RelayCrash):
        await dying.run_once()

    table = outbox_table(SCHEMA)
    async with sessions() as session:
        sent_at = (
            await session.execute(select(table.c.sent_at).where(table.c.event_id == event.event_id))
        ).scalar_one()
    assert sent_at is None, "the row must still be unsent: the relay died before marking it"

    restarted = OutboxRelay(sessions=sessions, js=js, schema=SCHEMA)
    while await restarted.run_once():
        pass
    async with sessions() as session:
        sent_at = (
            await session.execute(select(table.c.sent_at).where(table.c.event_id == event.event_id))
        ).scalar_one()
    assert sent_at is not None
    stream = stream_name(Context.LEDGER, stream_prefix=settings.kit.stream_prefix)
    assert await _count_in_stream(js, stream, subject, event.event_id) == 1


async def test_idempotent_consumer_applies_a_redelivered_event_once(
    sessions: async_sessionmaker[AsyncSession], js: JetStreamContext, settings: Settings
) -> None:
    subject = Subjects(settings.kit.subject_prefix).event(Context.LEDGER, "idem_probe")
    event = _event("idem_probe")
    body = event.model_dump_json().encode()
    # The same event twice under different message ids: JetStream keeps both, as after a
    # redelivery or a producer that retried past the duplicate window.
    await js.publish(subject, body, headers={"Nats-Msg-Id": f"{event.event_id}-a"})
    await js.publish(subject, body, headers={"Nats-Msg-Id": f"{event.event_id}-b"})

    async def apply(*, uow: UnitOfWork, event: EventEnvelope, payload: object) -> None:
        await uow.session.execute(
            text("INSERT INTO public.probe_state VALUES (:id, 1) ON CONFLICT (id) DO UPDATE SET n = probe_state.n + 1"),
            {"id": event.event_id},
        )

    handler = consume(
        uow=UnitOfWorkFactory(
            sessions=sessions, schema=SCHEMA, source="probe", subjects=Subjects(settings.kit.subject_prefix)
        ),
        schema=SCHEMA,
        consumer="probe-consumer",
        context=Context.LEDGER,
        handlers={"idem_probe": apply},
    )
    stream = stream_name(Context.LEDGER, stream_prefix=settings.kit.stream_prefix)
    sub = await js.pull_subscribe(subject, durable=f"probe-{uuid.uuid4().hex[:8]}", stream=stream)
    handled = 0
    for msg in await sub.fetch(2, timeout=5):
        await handler(msg.data)
        await msg.ack()
        handled += 1
    await sub.unsubscribe()
    assert handled == 2
    async with sessions() as session:
        n = (
            await session.execute(text("SELECT n FROM public.probe_state WHERE id = :id"), {"id": event.event_id})
        ).scalar_one()
    assert n == 1


RELAY_THAT_DIES = """
import asyncio, os, sys
import nats
from shared.infra.db import make_engine, make_sessions
from shared.infra.outbox import OutboxRelay

async def main():
    nc = await nats.connect(sys.argv[1])
    relay = OutboxRelay(sessions=make_sessions(make_engine(sys.argv[2])), js=nc.jetstream(), schema=sys.argv[3],
                        after_publish=lambda _e: os._exit(137))  # killed right after JetStream's ack
    await relay.run_once()

asyncio.run(main())
"""


async def test_relay_process_killed_after_publish_yields_exactly_one_event(
    sessions: async_sessionmaker[AsyncSession], js: JetStreamContext, settings: Settings
) -> None:
    import asyncio
    import sys

    subject = Subjects(settings.kit.subject_prefix).event(Context.LEDGER, "kill_probe")
    event = _event("kill_probe")
    async with sessions() as session, session.begin():
        await enqueue(session=session, schema=SCHEMA, subject=subject, event=event)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", RELAY_THAT_DIES, settings.kit.nats_url or "", settings.kit.database_url or "", SCHEMA
    )
    assert await proc.wait() == 137
    restarted = OutboxRelay(sessions=sessions, js=js, schema=SCHEMA)
    while await restarted.run_once():
        pass
    stream = stream_name(Context.LEDGER, stream_prefix=settings.kit.stream_prefix)
    assert await _count_in_stream(js, stream, subject, event.event_id) == 1


async def test_grouped_units_of_work_share_transactions_and_one_failure_fails_only_its_caller(
    sessions: async_sessionmaker[AsyncSession], settings: Settings
) -> None:
    # `run_grouped`: works submitted together run in one transaction; each caller gets its own result
    # (or its own exception); the others' state and events commit, the failing one's do not. Each work's
    # `after_commit` changes run once its transaction committed: the group's, or its own when a failed
    # group (whose changes are discarded) runs each work alone.
    factory = UnitOfWorkFactory(sessions=sessions, schema=SCHEMA, source="probe", subjects=Subjects("grp"))
    table = outbox_table(SCHEMA)

    async def round_of(count: int, doomed: int | None) -> tuple[list[object], set[int], set[uuid.UUID], set[uuid.UUID]]:
        ids = [uuid.uuid4() for _ in range(count)]
        events = [_event() for _ in ids]
        transactions: set[int] = set()
        changes.clear()

        def work_for(n: int) -> Any:
            async def work(uow: UnitOfWork) -> int:
                xid = (await uow.session.execute(text("SELECT txid_current()"))).scalar_one()
                transactions.add(int(xid))
                await uow.session.execute(
                    text("INSERT INTO public.probe_state (id, n) VALUES (:id, :n)"), {"id": ids[n], "n": n}
                )
                uow.events.append(("grp.probe", events[n]))
                uow.after_commit(lambda: changes.append(n))
                if n == doomed:
                    raise ValueError("this one fails")
                return n

            return work

        # Submitted in one go: the first lane to run takes them all as one group.
        outcomes = await asyncio.gather(
            *(factory.run_grouped(work_for(n)) for n in range(count)), return_exceptions=True
        )
        async with sessions() as session:
            found = text("SELECT id FROM public.probe_state WHERE id = ANY(:ids)")
            stored = set((await session.execute(found, {"ids": ids})).scalars())
            wanted = [e.event_id for e in events]
            queued = set(
                (await session.execute(select(table.c.event_id).where(table.c.event_id.in_(wanted)))).scalars()
            )
            # Gone again before any relay of this schema tries a subject no stream takes.
            await session.execute(table.delete().where(table.c.event_id.in_(wanted)))
            await session.commit()
        expected = {e.event_id for n, e in enumerate(events) if n != doomed}
        assert stored == {i for n, i in enumerate(ids) if n != doomed}
        assert queued == expected
        return list(outcomes), transactions, stored, queued

    changes: list[int] = []
    outcomes, transactions, _, _ = await round_of(12, None)
    assert outcomes == list(range(12))
    assert len(transactions) == 1, "twelve works, one transaction"
    assert changes == list(range(12)), "each work's change, once, after the group committed"

    outcomes, transactions, _, _ = await round_of(12, 5)
    assert [o for o in outcomes if not isinstance(o, BaseException)] == [n for n in range(12) if n != 5]
    assert isinstance(outcomes[5], ValueError)
    assert len(transactions) == 1 + 12, "the failed group, then each work alone"
    assert changes == [n for n in range(12) if n != 5], "the failed group's discarded, each alone's once"


async def test_a_group_wakes_the_relay_only_when_it_emitted_events(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    # A relay pass is a transaction of its own: a group commit with nothing to publish must not ask for one.
    wakes: list[int] = []
    factory = UnitOfWorkFactory(
        sessions=sessions, schema=SCHEMA, source="probe", subjects=Subjects("grp"), wake=lambda: wakes.append(1)
    )
    event = _event()

    def work_for(emit: bool) -> Any:
        async def work(uow: UnitOfWork) -> None:
            await uow.session.execute(text("SELECT 1"))
            if emit:
                uow.events.append(("grp.probe", event))

        return work

    await asyncio.gather(*(factory.run_grouped(work_for(False)) for _ in range(4)))
    assert wakes == []
    await asyncio.gather(*(factory.run_grouped(work_for(n == 2)) for n in range(4)))
    assert wakes == [1]
    async with sessions() as session, session.begin():
        await session.execute(outbox_table(SCHEMA).delete().where(outbox_table(SCHEMA).c.event_id == event.event_id))


async def test_a_unit_of_work_on_the_driver_commits_its_statements_and_events_together_or_neither(
    sessions: async_sessionmaker[AsyncSession],
) -> None:
    # `run_on_driver`: the statements go straight to asyncpg, in one transaction with the events the work
    # emitted; its `after_commit` changes run once it committed, never when it rolled back; a transaction
    # Postgres asks to retry runs again from scratch; the relay is woken only when there are events.
    wakes: list[int] = []
    factory = UnitOfWorkFactory(
        sessions=sessions, schema=SCHEMA, source="probe", subjects=Subjects("drv"), wake=lambda: wakes.append(1)
    )
    table = outbox_table(SCHEMA)
    changes: list[str] = []
    ids = [uuid.uuid4() for _ in range(5)]
    events = [_event() for _ in ids]
    attempts: list[int] = []

    def work_for(n: int, *, fail: BaseException | None = None, emit: bool = True, retry_once: bool = False) -> Any:
        async def work(uow: DriverUnitOfWork) -> int:
            attempts.append(n)
            await uow.connection.execute("INSERT INTO public.probe_state (id, n) VALUES ($1, $2)", ids[n], n)
            if emit:
                uow.events.append(("drv.probe", events[n]))
            uow.after_commit(lambda: changes.append(f"done {n}"))
            if retry_once and attempts.count(n) == 1:
                raise asyncpg.SerializationError("could not serialize access")
            if fail is not None:
                raise fail
            return n

        return work

    async def stored() -> tuple[set[uuid.UUID], set[uuid.UUID]]:
        async with sessions() as session:
            found = text("SELECT id FROM public.probe_state WHERE id = ANY(:ids)")
            rows = set((await session.execute(found, {"ids": ids})).scalars())
            wanted = [e.event_id for e in events]
            queued = set(
                (await session.execute(select(table.c.event_id).where(table.c.event_id.in_(wanted)))).scalars()
            )
        return rows, queued

    assert await factory.run_on_driver(work_for(0)) == 0
    assert await stored() == ({ids[0]}, {events[0].event_id})
    assert changes == ["done 0"] and wakes == [1]

    with pytest.raises(ValueError):
        await factory.run_on_driver(work_for(1, fail=ValueError("the work failed")))
    assert await stored() == ({ids[0]}, {events[0].event_id}), "neither the row nor the event"
    assert changes == ["done 0"] and wakes == [1]

    assert await factory.run_on_driver(work_for(2, retry_once=True)) == 2
    assert attempts.count(2) == 2, "run again from scratch"
    assert await stored() == ({ids[0], ids[2]}, {events[0].event_id, events[2].event_id})
    assert changes == ["done 0", "done 2"], "the retried work's change once"

    assert await factory.run_on_driver(work_for(3, emit=False)) == 3
    assert wakes == [1, 1], "no event: no wake"

    # Without a transaction: the one statement is its own, and an event (which needs one) is refused.
    assert await factory.run_on_driver(work_for(4, emit=False), transaction=False) == 4
    assert (await stored())[0] == {ids[0], ids[2], ids[3], ids[4]}
    assert changes[-1] == "done 4"

    async def announces(uow: DriverUnitOfWork) -> None:
        uow.emit(Context.LEDGER, "probe", _Probe(k=1))

    with pytest.raises(RuntimeError, match="needs the transaction"):
        await factory.run_on_driver(announces, transaction=False)
    async with sessions() as session, session.begin():
        await session.execute(table.delete().where(table.c.event_id.in_([e.event_id for e in events])))


async def test_a_row_written_under_another_subject_prefix_is_quarantined_and_the_rows_behind_it_go_on(
    sessions: async_sessionmaker[AsyncSession], js: JetStreamContext, settings: Settings
) -> None:
    """A deployment whose subject prefix changed (or another one sharing the database) left a row no stream
    of this deployment takes: JetStream answers "no responders" for it forever. It is quarantined (not
    retried as if NATS were away), so the events written after it are published."""
    prefix = settings.kit.subject_prefix
    foreign, own = _event("foreign_probe"), _event("own_probe")
    foreign_subject = Subjects(f"gone{uuid.uuid4().hex[:6]}").event(Context.LEDGER, "foreign_probe")
    own_subject = Subjects(prefix).event(Context.LEDGER, "own_probe")
    async with sessions() as session, session.begin():
        await enqueue(session=session, schema=SCHEMA, subject=foreign_subject, event=foreign)
        await enqueue(session=session, schema=SCHEMA, subject=own_subject, event=own)
    relay = OutboxRelay(sessions=sessions, js=js, schema=SCHEMA, subject_prefix=prefix)
    while await relay.run_once():
        pass
    table = outbox_table(SCHEMA)
    async with sessions() as session:
        rows = {
            r.event_id: r
            for r in (
                await session.execute(
                    select(table.c.event_id, table.c.sent_at, table.c.quarantined_at, table.c.error).where(
                        table.c.event_id.in_([foreign.event_id, own.event_id])
                    )
                )
            ).all()
        }
    assert rows[foreign.event_id].sent_at is None and rows[foreign.event_id].quarantined_at is not None
    assert "another subject prefix" in rows[foreign.event_id].error
    assert rows[own.event_id].sent_at is not None and relay.quarantined >= 1
    stream = stream_name(Context.LEDGER, stream_prefix=settings.kit.stream_prefix)
    assert await _count_in_stream(js, stream, own_subject, own.event_id) == 1
