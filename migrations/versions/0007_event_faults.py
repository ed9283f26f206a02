"""Outbox quarantine: a row the relay cannot publish is marked and skipped instead of blocking the rest

Each schema's outbox gains ``quarantined_at`` and ``error``; the index of rows waiting for the relay
leaves quarantined rows out.

Revision ID: 0007_event_faults
Revises: 0006_topology_reserved
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007_event_faults"
down_revision: str | None = "0006_topology_reserved"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SCHEMAS = ("topology", "ledger", "placement", "reservation", "routing", "rebalance")


def upgrade() -> None:
    for schema in SCHEMAS:
        op.add_column("outbox", sa.Column("quarantined_at", sa.DateTime(timezone=True), nullable=True), schema=schema)
        op.add_column("outbox", sa.Column("error", sa.Text(), nullable=True), schema=schema)
        op.drop_index(f"ix_{schema}_outbox_unsent", table_name="outbox", schema=schema)
        op.create_index(
            f"ix_{schema}_outbox_unsent",
            "outbox",
            ["seq"],
            schema=schema,
            postgresql_where=sa.text("sent_at IS NULL AND quarantined_at IS NULL"),
        )


def downgrade() -> None:
    for schema in reversed(SCHEMAS):
        op.drop_index(f"ix_{schema}_outbox_unsent", table_name="outbox", schema=schema)
        op.create_index(
            f"ix_{schema}_outbox_unsent",
            "outbox",
            ["seq"],
            schema=schema,
            postgresql_where=sa.text("sent_at IS NULL"),
        )
        op.drop_column("outbox", "error", schema=schema)
        op.drop_column("outbox", "quarantined_at", schema=schema)
