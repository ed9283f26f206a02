"""Retention (issue 23 row 7, docs/RETENTION.md): every stream's limits from the settings, and the pruning
of the tables every service schema has, which otherwise only grow.

* Streams: ``stream_specs_for`` gives each its max age and size cap; ``ensure_streams`` creates or updates
  them in place at each start.
* Outbox: a row the relay marked sent is only history (it is never published again): deleted
  ``HETSCHED_OUTBOX_RETENTION_S`` after it was sent. A quarantined row is the outbox's dead letter, kept as
  long as dead letters (``HETSCHED_DEADLETTER_RETENTION_S``). Unsent rows are never touched.
* Inbox: a row says "this consumer applied this event id". It must outlive every copy of that event a
  consumer could still meet: a redelivery, a second publish by a relay that crashed before marking its
  row (JetStream drops that copy only inside the duplicate window), a dead letter replayed. The settings
  refuse ``HETSCHED_INBOX_RETENTION_S`` shorter than the longest stream max age and the dead-letter
  retention, so such a copy always still finds its row.

Each pass deletes in batches of ``HETSCHED_RETENTION_PRUNE_BATCH`` rows, each batch its own short
transaction, so pruning never holds locks long or bloats one transaction; BRIN indexes on the time
columns (migration 0015) keep finding the old rows cheap.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import datetime, timedelta
from functools import cache

from sqlalchemy import TextClause, text
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from shared.contracts.streams import StreamSpec, stream_specs
from shared.contracts.subjects import Subjects
from shared.infra.clock import Clock
from shared.infra.settings import Settings
from shared.infra.tables import inbox_table, outbox_table

log = logging.getLogger("hetsched.retention")


def stream_specs_for(settings: Settings, *, subjects: Subjects | None = None) -> tuple[StreamSpec, ...]:
    """Every stream with the limits ``settings`` give it (what services and ``hetsched up`` create)."""
    return stream_specs(
        subjects=subjects or Subjects(settings.kit.subject_prefix),
        stream_prefix=settings.kit.stream_prefix,
        duplicate_window_s=settings.kit.stream_duplicate_window_s,
        telemetry_max_age_s=settings.kit.telemetry_max_age_s,
        deadletter_max_age_s=settings.kit.deadletter_retention_s,
        max_age_s=settings.kit.stream_max_ages(),
        max_bytes=settings.kit.stream_max_bytes or None,
        replicas=settings.kit.stream_replicas,
    )


@dataclass(frozen=True, slots=True)
class Retention:
    """How long each kind of row is kept, in seconds."""

    outbox_s: float
    inbox_s: float
    deadletter_s: float

    @classmethod
    def of(cls, settings: Settings) -> Retention:
        return cls(
            outbox_s=settings.kit.outbox_retention_s,
            inbox_s=settings.kit.inbox_retention_s,
            deadletter_s=settings.kit.deadletter_retention_s,
        )


@dataclass(frozen=True, slots=True)
class Pruned:
    """Rows one pass deleted."""

    outbox_sent: int = 0
    outbox_quarantined: int = 0
    inbox: int = 0

    @property
    def total(self) -> int:
        return self.outbox_sent + self.outbox_quarantined + self.inbox


# `table` below is a schema-qualified name from code (``outbox_table``/``inbox_table``), never input. The
# `created_at < :before` beside `sent_at` / `quarantined_at` (both come after it) lets the BRIN index on
# created_at skip the recent part of the table.
@cache
def _outbox_sent(table: str) -> TextClause:
    return text(
        f"DELETE FROM {table} WHERE seq IN (SELECT seq FROM {table} "
        "WHERE created_at < :before AND sent_at < :before LIMIT :batch)"
    )


@cache
def _outbox_quarantined(table: str) -> TextClause:
    return text(
        f"DELETE FROM {table} WHERE seq IN (SELECT seq FROM {table} "
        "WHERE created_at < :before AND sent_at IS NULL AND quarantined_at < :before LIMIT :batch)"
    )


@cache
def _inbox(table: str) -> TextClause:
    return text(
        f"DELETE FROM {table} WHERE (consumer, event_id) IN "
        f"(SELECT consumer, event_id FROM {table} WHERE processed_at < :before LIMIT :batch)"
    )


async def _drain(
    sessions: async_sessionmaker[AsyncSession], statement: TextClause, before: datetime, batch: int
) -> int:
    """Run ``statement`` batch after batch, each in its own transaction, until a batch comes back short."""
    deleted = 0
    while True:
        async with sessions() as session, session.begin():
            result = await session.execute(statement, {"before": before, "batch": batch})
            count = int(result.rowcount or 0)  # type: ignore[attr-defined]  # a DML result: CursorResult
        deleted += count
        if count < batch:
            return deleted


async def prune_once(
    *, sessions: async_sessionmaker[AsyncSession], schema: str, now: datetime, retention: Retention, batch: int
) -> Pruned:
    """Delete ``schema``'s sent outbox rows, quarantined outbox rows and inbox rows older than ``retention``
    at ``now``; unsent rows and rows inside their retention stay."""
    outbox, inbox = outbox_table(schema).fullname, inbox_table(schema).fullname
    return Pruned(
        outbox_sent=await _drain(sessions, _outbox_sent(outbox), now - timedelta(seconds=retention.outbox_s), batch),
        outbox_quarantined=await _drain(
            sessions, _outbox_quarantined(outbox), now - timedelta(seconds=retention.deadletter_s), batch
        ),
        inbox=await _drain(sessions, _inbox(inbox), now - timedelta(seconds=retention.inbox_s), batch),
    )


class Pruner:
    """The loop every service with a database runs (``shared.infra.service.build_app``): a pass at start,
    then one every ``every_s``; a failed pass is logged and tried again at the next."""

    def __init__(
        self,
        *,
        sessions: async_sessionmaker[AsyncSession],
        schema: str,
        clock: Clock,
        retention: Retention,
        every_s: float,
        batch: int,
    ) -> None:
        self._sessions = sessions
        self._schema = schema
        self._clock = clock
        self._retention = retention
        self._every_s = every_s
        self._batch = batch
        self.pruned = Pruned()  # since start, for tests and logs

    async def run_once(self) -> Pruned:
        done = await prune_once(
            sessions=self._sessions,
            schema=self._schema,
            now=self._clock(),
            retention=self._retention,
            batch=self._batch,
        )
        self.pruned = Pruned(
            outbox_sent=self.pruned.outbox_sent + done.outbox_sent,
            outbox_quarantined=self.pruned.outbox_quarantined + done.outbox_quarantined,
            inbox=self.pruned.inbox + done.inbox,
        )
        if done.total:
            log.info(
                "pruned rows past their retention",
                extra={
                    "schema": self._schema,
                    "outbox_sent": done.outbox_sent,
                    "outbox_quarantined": done.outbox_quarantined,
                    "inbox": done.inbox,
                },
            )
        return done

    async def run(self) -> None:
        while True:
            try:
                await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("pruning failed; trying again at the next pass", extra={"schema": self._schema})
            await asyncio.sleep(self._every_s)
