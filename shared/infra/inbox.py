"""Idempotent consumers: each (consumer, event id) is processed once, in the handler's transaction."""

from __future__ import annotations

import uuid

from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from shared.infra.tables import inbox_table


async def claim(*, session: AsyncSession, schema: str, consumer: str, event_id: uuid.UUID) -> bool:
    """Record the event as processed by ``consumer``; False when it already was.

    Call it first inside the transaction that applies the event: if the transaction rolls back, the
    claim goes with it and a redelivery is processed again; if it commits, a redelivery is skipped.
    """
    result = await session.execute(
        insert(inbox_table(schema))
        .values(consumer=consumer, event_id=event_id)
        .on_conflict_do_nothing()
        .returning(inbox_table(schema).c.event_id)
    )
    return result.first() is not None
