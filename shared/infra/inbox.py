"""Idempotent consumers: each (consumer, event id) is processed once, in the handler's transaction."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from functools import cache

from sqlalchemy import TextClause, text
from sqlalchemy.ext.asyncio import AsyncSession

from shared.infra.tables import inbox_table


async def claim(*, session: AsyncSession, schema: str, consumer: str, event_id: uuid.UUID) -> bool:
    """Record the event as processed by ``consumer``; False when it already was.

    Call it first inside the transaction that applies the event: if the transaction rolls back, the
    claim goes with it and a redelivery is processed again; if it commits, a redelivery is skipped.
    """
    result = await session.execute(_claim_statement(schema), {"consumer": consumer, "event_id": event_id})
    return result.first() is not None


async def claim_many(
    *, session: AsyncSession, schema: str, consumer: str, event_ids: Sequence[uuid.UUID]
) -> set[uuid.UUID]:
    """``claim`` for several events in one statement (a batch applied together): the ids not processed
    before, each once however often it is given."""
    result = await session.execute(_claim_many_statement(schema), {"consumer": consumer, "event_ids": list(event_ids)})
    return set(result.scalars())


@cache
def _claim_many_statement(schema: str) -> TextClause:
    return text(
        f"INSERT INTO {inbox_table(schema).fullname} (consumer, event_id) "
        "SELECT :consumer, id FROM unnest(CAST(:event_ids AS uuid[])) AS id "
        "ON CONFLICT DO NOTHING RETURNING event_id"
    )


@cache
def _claim_statement(schema: str) -> TextClause:
    """Built once per schema: a statement built per event costs more than its round trip."""
    return text(
        f"INSERT INTO {inbox_table(schema).fullname} (consumer, event_id) VALUES (:consumer, :event_id) "
        "ON CONFLICT DO NOTHING RETURNING event_id"
    )
