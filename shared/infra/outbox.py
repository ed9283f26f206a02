"""Transactional outbox (DESIGN §5): a state change and its event commit together; a relay publishes.

Why not the ``faststream-outbox`` package: it brings its own table layout and relay loop tied to
one FastStream broker, while hetsched needs one outbox per service schema managed by our Alembic
migrations, ``Nats-Msg-Id`` = the envelope's ``event_id`` (the de-duplication key downstream
consumers and JetStream share), and a relay whose crash window we test directly. The relay below is
small enough to own.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from functools import cache
from typing import Any

from nats.js import JetStreamContext
from sqlalchemy import TextClause, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.sql import func

from shared.contracts.envelope import EventEnvelope
from shared.infra.tables import outbox_table

log = logging.getLogger("hetsched.outbox")

AfterPublish = Callable[[EventEnvelope], Awaitable[None] | None]


async def enqueue(*, session: AsyncSession, schema: str, subject: str, event: EventEnvelope) -> None:
    """Add an event to the outbox inside the caller's transaction (it commits with the state change)."""
    await enqueue_many(session=session, schema=schema, events=[(subject, event)])


async def enqueue_many(*, session: AsyncSession, schema: str, events: Sequence[tuple[str, EventEnvelope]]) -> None:
    """Add several events in one statement, in order, inside the caller's transaction.

    The rows travel as one JSON array (one round trip and no per-row parameter processing, which
    an executemany costs on a hot path such as the ledger's group commit)."""
    if not events:
        return
    rows = [
        {
            "event_id": str(event.event_id),
            "subject": subject,
            "event_type": event.type,
            "payload": event.model_dump(mode="json"),
        }
        for subject, event in events
    ]
    await session.execute(_insert_rows(outbox_table(schema).fullname), {"rows": json.dumps(rows)})


@cache
def _insert_rows(table: str) -> TextClause:
    # `table` is a schema-qualified name from code (``outbox_table``), never user input.
    return text(
        f"INSERT INTO {table} (event_id, subject, event_type, payload) "
        "SELECT event_id, subject, event_type, payload FROM json_to_recordset(CAST(:rows AS json)) "
        "AS x(event_id uuid, subject text, event_type text, payload jsonb)"
    )


def msg_id_headers(event_id: str) -> dict[str, str]:
    return {"Nats-Msg-Id": event_id}


class OutboxRelay:
    """Publishes unsent outbox rows to JetStream in order and marks them sent.

    A pass locks a batch (``FOR UPDATE SKIP LOCKED``, so several relays can run), publishes each row
    with ``Nats-Msg-Id`` = event id and waits for JetStream's ack, then marks the batch in the same
    transaction. If the relay dies between publish and mark, the rows stay unsent and are published
    again on restart; JetStream's duplicate window drops the second copy.
    """

    def __init__(
        self,
        *,
        sessions: async_sessionmaker[AsyncSession],
        js: JetStreamContext,
        schema: str,
        batch: int = 256,
        poll_ms: int = 100,
        after_publish: AfterPublish | None = None,
    ) -> None:
        self._sessions = sessions
        self._js = js
        self._table = outbox_table(schema)
        self._batch = batch
        self._poll_s = poll_ms / 1000
        self._after_publish = after_publish
        self._wake = asyncio.Event()
        self._stopping = False
        self.published = 0

    def wake(self) -> None:
        """Ask for a pass now (call after committing a transaction that enqueued events)."""
        self._wake.set()

    async def run_once(self) -> int:
        """One pass; returns how many events were published."""
        table = self._table
        async with self._sessions() as session, session.begin():
            rows = (
                await session.execute(
                    select(table.c.seq, table.c.event_id, table.c.subject, table.c.payload)
                    .where(table.c.sent_at.is_(None))
                    .order_by(table.c.seq)
                    .limit(self._batch)
                    .with_for_update(skip_locked=True)
                )
            ).all()
            if not rows:
                return 0
            for row in rows:
                payload: dict[str, Any] = row.payload
                await self._js.publish(
                    row.subject,
                    json.dumps(payload, separators=(",", ":")).encode(),
                    headers=msg_id_headers(str(row.event_id)),
                )
                if self._after_publish is not None:
                    maybe = self._after_publish(EventEnvelope.model_validate(payload))
                    if maybe is not None:
                        await maybe
            await session.execute(
                update(table).where(table.c.seq.in_([r.seq for r in rows])).values(sent_at=func.now())
            )
        self.published += len(rows)
        return len(rows)

    async def run(self) -> None:
        """Loop until ``stop``; errors are logged and retried with backoff, never fatal."""
        backoff = self._poll_s
        while not self._stopping:
            try:
                sent = await self.run_once()
                backoff = self._poll_s
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("outbox relay pass failed; retrying", extra={"backoff_s": backoff})
                sent = 0
                backoff = min(backoff * 2, 5.0)
            if sent >= self._batch:
                continue
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout=backoff)
            except TimeoutError:
                pass

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
