"""Tables every service schema has: the transactional outbox and the consumer inbox.

They are plain SQLAlchemy tables on ``SQLModel.metadata`` (one pair per schema), so Alembic sees
them beside the SQLModel tables of each service.
"""

from __future__ import annotations

from functools import cache

from sqlalchemy import BigInteger, Column, DateTime, Identity, Index, Table, Text, text
from sqlalchemy.dialects.postgresql import JSONB, UUID
from sqlmodel import SQLModel

from shared.infra.db import SCHEMAS


@cache
def outbox_table(schema: str) -> Table:
    """``<schema>.outbox``: events waiting for the relay; ``sent_at`` is set once JetStream acked.

    ``quarantined_at``/``error``: the relay could not publish the row (too large, refused by
    JetStream) and moved on; setting ``quarantined_at`` back to NULL queues it again."""
    return Table(
        "outbox",
        SQLModel.metadata,
        Column("seq", BigInteger, Identity(always=True), primary_key=True),
        Column("event_id", UUID(as_uuid=True), nullable=False, unique=True),
        Column("subject", Text, nullable=False),
        Column("event_type", Text, nullable=False),
        Column("payload", JSONB, nullable=False),
        Column("created_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
        Column("sent_at", DateTime(timezone=True), nullable=True),
        Column("quarantined_at", DateTime(timezone=True), nullable=True),
        Column("error", Text, nullable=True),
        Index(
            f"ix_{schema}_outbox_unsent",
            "seq",
            postgresql_where=text("sent_at IS NULL AND quarantined_at IS NULL"),
        ),
        # Pruning finds old rows by time (shared.infra.retention; migration 0015): BRIN, nearly free to keep.
        Index(f"ix_{schema}_outbox_created", "created_at", postgresql_using="brin"),
        schema=schema,
    )


@cache
def inbox_table(schema: str) -> Table:
    """``<schema>.inbox``: (consumer, event id) pairs already processed, for idempotent consumers."""
    return Table(
        "inbox",
        SQLModel.metadata,
        Column("consumer", Text, primary_key=True),
        Column("event_id", UUID(as_uuid=True), primary_key=True),
        Column("processed_at", DateTime(timezone=True), nullable=False, server_default=text("now()")),
        Index(f"ix_{schema}_inbox_processed", "processed_at", postgresql_using="brin"),
        schema=schema,
    )


def register_all() -> None:
    """Put every schema's outbox and inbox on the metadata (Alembic's env calls this)."""
    for schema in SCHEMAS:
        outbox_table(schema)
        inbox_table(schema)


register_all()
