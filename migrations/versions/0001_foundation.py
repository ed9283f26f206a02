"""Foundation: one schema per service, each with its outbox and inbox.

Revision ID: 0001_foundation
Revises:
Create Date: 2026-11-29
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0001_foundation"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SCHEMAS = ("topology", "ledger", "placement", "reservation", "routing", "rebalance")


def upgrade() -> None:
    for schema in SCHEMAS:
        op.execute(f"CREATE SCHEMA IF NOT EXISTS {schema}")
        op.create_table(
            "outbox",
            sa.Column("seq", sa.BigInteger(), sa.Identity(always=True), nullable=False),
            sa.Column("event_id", postgresql.UUID(as_uuid=True), nullable=False),
            sa.Column("subject", sa.Text(), nullable=False),
            sa.Column("event_type", sa.Text(), nullable=False),
            sa.Column("payload", postgresql.JSONB(), nullable=False),
            sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
            sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
            sa.PrimaryKeyConstraint("seq"),
            sa.UniqueConstraint("event_id"),
            schema=schema,
        )
        op.create_index(
            f"ix_{schema}_outbox_unsent",
            "outbox",
            ["seq"],
            schema=schema,
            postgresql_where=sa.text("sent_at IS NULL"),
        )
        op.create_table(
            "inbox",
            sa.Column("consumer", sa.Text(), nullable=False),
            sa.Column("event_id", postgresql.UUID(as_uuid=True), nullable=False),
            sa.Column("processed_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
            sa.PrimaryKeyConstraint("consumer", "event_id"),
            schema=schema,
        )


def downgrade() -> None:
    for schema in reversed(SCHEMAS):
        op.drop_table("inbox", schema=schema)
        op.drop_index(f"ix_{schema}_outbox_unsent", table_name="outbox", schema=schema)
        op.drop_table("outbox", schema=schema)
        op.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
