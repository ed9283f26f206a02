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

from nats import errors as nats_errors
from nats.js import JetStreamContext
from nats.js import errors as js_errors
from sqlalchemy import TextClause, select, text, update
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.sql import func

from shared.contracts.envelope import EventEnvelope
from shared.domain.errors import ErrorCode
from shared.infra.tables import outbox_table
from shared.infra.tracing import TRACEPARENT

log = logging.getLogger("hetsched.outbox")

AfterPublish = Callable[[EventEnvelope], Awaitable[None] | None]

# Below NATS's default max_payload (1 MiB), leaving room for headers.
DEFAULT_EVENT_MAX_BYTES = 900_000

# Errors that say "not now" (NATS or JetStream unreachable, slow, electing a leader): the relay keeps
# the row and retries with backoff. Any other publish error is about the event itself: quarantine it.
TRANSIENT_PUBLISH_ERRORS: tuple[type[BaseException], ...] = (
    TimeoutError,
    asyncio.TimeoutError,
    nats_errors.TimeoutError,
    nats_errors.NoRespondersError,
    nats_errors.ConnectionClosedError,
    nats_errors.ConnectionReconnectingError,
    nats_errors.ConnectionDrainingError,
    nats_errors.StaleConnectionError,
    nats_errors.OutboundBufferLimitError,
    js_errors.ServiceUnavailableError,
    js_errors.ServerError,
    js_errors.NoStreamResponseError,  # a clustered stream electing a new leader
    OSError,
)

QUARANTINED_MESSAGE = "outbox event quarantined: it cannot be published"


class EventTooLarge(ValueError):
    """An event larger than the limit was emitted: the transaction fails, the caller gets ``code``."""

    code = ErrorCode.INVALID_REQUEST

    def __init__(self, *, event_type: str, size: int, limit: int) -> None:
        super().__init__(f"the {event_type} event this request causes is {size} bytes; the limit is {limit}")
        self.event_type = event_type
        self.size = size
        self.limit = limit


def event_body(payload: dict[str, Any]) -> bytes:
    """The bytes the relay publishes for an outbox row: compact UTF-8 JSON (no ASCII escaping, which
    can grow a non-ASCII string sixfold). ``emit`` measures an event with the same function."""
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()


def check_event_size(event: EventEnvelope, *, limit: int) -> None:
    """Raise ``EventTooLarge`` when the event's published body would exceed ``limit`` bytes."""
    size = len(event_body(event.model_dump(mode="json")))
    if size > limit:
        raise EventTooLarge(event_type=event.type, size=size, limit=limit)


async def enqueue(*, session: AsyncSession, schema: str, subject: str, event: EventEnvelope) -> None:
    """Add an event to the outbox inside the caller's transaction (it commits with the state change)."""
    await enqueue_many(session=session, schema=schema, events=[(subject, event)])


async def enqueue_many(*, session: AsyncSession, schema: str, events: Sequence[tuple[str, EventEnvelope]]) -> None:
    """Add several events in one statement, in order, inside the caller's transaction.

    The rows travel as one JSON array (one round trip and no per-row parameter processing, which
    an executemany costs on a hot path such as the ledger's group commit)."""
    if not events:
        return
    await session.execute(_insert_rows(outbox_table(schema).fullname), {"rows": _rows(events)})


async def enqueue_on_driver(*, connection: Any, schema: str, events: Sequence[tuple[str, EventEnvelope]]) -> None:
    """``enqueue_many`` on an asyncpg connection inside its open transaction (``UnitOfWorkFactory.run_on_driver``)."""
    if not events:
        return
    await connection.execute(_insert_sql(outbox_table(schema).fullname, "$1"), _rows(events))


def _rows(events: Sequence[tuple[str, EventEnvelope]]) -> str:
    return json.dumps(
        [
            {
                "event_id": str(event.event_id),
                "subject": subject,
                "event_type": event.type,
                "payload": event.model_dump(mode="json"),
            }
            for subject, event in events
        ]
    )


@cache
def _insert_rows(table: str) -> TextClause:
    return text(_insert_sql(table, ":rows"))


@cache
def _insert_sql(table: str, rows: str) -> str:
    # `table` is a schema-qualified name from code (``outbox_table``), never user input; `rows` the
    # placeholder of the JSON array (SQLAlchemy's ``:rows``, asyncpg's ``$1``).
    return (
        f"INSERT INTO {table} (event_id, subject, event_type, payload) "
        f"SELECT event_id, subject, event_type, payload FROM json_to_recordset(CAST({rows} AS json)) "
        "AS x(event_id uuid, subject text, event_type text, payload jsonb)"
    )


def msg_id_headers(event_id: str, *, traceparent: object = None) -> dict[str, str]:
    """An event's NATS headers: ``Nats-Msg-Id`` = its id, and the trace it continues (``traceparent``,
    as its envelope records it) for readers that take the trace from the headers."""
    headers = {"Nats-Msg-Id": event_id}
    if isinstance(traceparent, str) and traceparent:
        headers[TRACEPARENT] = traceparent
    return headers


class RelayStalled(Exception):
    """A pass stopped at a transient publish error; what it published before is marked sent."""


class OutboxRelay:
    """Publishes unsent outbox rows to JetStream in order and marks them sent.

    A pass locks a batch (``FOR UPDATE SKIP LOCKED``, so several relays can run), publishes each row
    with ``Nats-Msg-Id`` = event id and waits for JetStream's ack, then marks the batch in the same
    transaction. If the relay dies between publish and mark, the rows stay unsent and are published
    again on restart; JetStream's duplicate window drops the second copy.

    A row that cannot be published (larger than the server's max_payload, refused by JetStream, or written
    under another subject prefix than ``subject_prefix``, so no stream of this deployment takes it) is
    quarantined (``quarantined_at``, ``error``) with one ERROR log line and counted in
    ``quarantined``; the rows behind it go on. A transient error (NATS down, a timeout) ends the pass
    and the relay retries with backoff, quarantining nothing.
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
        subject_prefix: str | None = None,
    ) -> None:
        self._sessions = sessions
        # Rows written under another subject prefix (the deployment's prefix changed since, or another
        # deployment shares the database) can never reach this deployment's streams: quarantined, not retried.
        self._own = f"{subject_prefix}." if subject_prefix else None
        self._js = js
        self._table = outbox_table(schema)
        self._batch = batch
        self._poll_s = poll_ms / 1000
        self._after_publish = after_publish
        self._wake = asyncio.Event()
        self._stopping = False
        self.published = 0
        # Rows set aside since start: the alert counter the metrics endpoint exports.
        self.quarantined = 0

    def wake(self) -> None:
        """Ask for a pass now (call after committing a transaction that enqueued events)."""
        self._wake.set()

    async def run_once(self) -> int:
        """One pass; returns how many rows it settled (published or quarantined).

        Raises ``RelayStalled`` after committing what it published when a transient error stopped it.
        """
        table = self._table
        stalled: BaseException | None = None
        async with self._sessions() as session, session.begin():
            rows = (
                await session.execute(
                    select(table.c.seq, table.c.event_id, table.c.subject, table.c.event_type, table.c.payload)
                    .where(table.c.sent_at.is_(None), table.c.quarantined_at.is_(None))
                    .order_by(table.c.seq)
                    .limit(self._batch)
                    .with_for_update(skip_locked=True)
                )
            ).all()
            if not rows:
                return 0
            sent: list[int] = []
            quarantined: list[tuple[int, str]] = []
            for row in rows:
                payload: dict[str, Any] = row.payload
                if self._own is not None and not row.subject.startswith(self._own):
                    error = f"written under another subject prefix than this deployment's ({self._own[:-1]!r})"
                    quarantined.append((row.seq, error))
                    log.error(
                        QUARANTINED_MESSAGE,
                        extra={"event_id": str(row.event_id), "subject": row.subject, "error": error},
                    )
                    continue
                try:
                    await self._js.publish(
                        row.subject,
                        event_body(payload),
                        headers=msg_id_headers(str(row.event_id), traceparent=payload.get("traceparent")),
                    )
                except TRANSIENT_PUBLISH_ERRORS as exc:
                    stalled = exc
                    break
                except Exception as exc:
                    error = f"{type(exc).__name__}: {exc}"[:500]
                    quarantined.append((row.seq, error))
                    log.error(
                        QUARANTINED_MESSAGE,
                        extra={
                            "event_id": str(row.event_id),
                            "event_type": row.event_type,
                            "subject": row.subject,
                            "error": error,
                        },
                    )
                    continue
                sent.append(row.seq)
                if self._after_publish is not None:
                    maybe = self._after_publish(EventEnvelope.model_validate(payload))
                    if maybe is not None:
                        await maybe
            if sent:
                await session.execute(update(table).where(table.c.seq.in_(sent)).values(sent_at=func.now()))
            for seq, error in quarantined:
                await session.execute(
                    update(table).where(table.c.seq == seq).values(quarantined_at=func.now(), error=error)
                )
        self.published += len(sent)
        self.quarantined += len(quarantined)
        if stalled is not None:
            raise RelayStalled(f"{type(stalled).__name__}: {stalled}") from stalled
        return len(sent) + len(quarantined)

    async def run(self) -> None:
        """Loop until ``stop``; errors are logged and retried with backoff, never fatal."""
        backoff = self._poll_s
        while not self._stopping:
            try:
                sent = await self.run_once()
                backoff = self._poll_s
            except asyncio.CancelledError:
                raise
            except RelayStalled as exc:
                # NATS is away: one line per attempt, no stack (it says nothing new).
                log.warning(
                    "outbox relay cannot publish now; retrying", extra={"backoff_s": backoff, "error": str(exc)}
                )
                sent = 0
                backoff = min(backoff * 2, 5.0)
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
