"""placement intents: a decision row is written (status `committing`) before the ledger commit, with the
request body's hash, the attempt that holds it and the commit it sent; placement.ledger_allocations
holds placement's ledger allocations as LEDGER events told them (for the reconciler).

Revision ID: 0008_placement_intents
Revises: 0007_event_faults
Create Date: 2026-12-02
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0008_placement_intents"
down_revision: str | None = "0007_event_faults"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.alter_column("decisions", "reply", existing_type=postgresql.JSONB(), nullable=True, schema="placement")
    op.add_column("decisions", sa.Column("body_hash", sa.Text(), nullable=True), schema="placement")
    op.add_column(
        "decisions",
        sa.Column("attempt", sa.Integer(), server_default=sa.text("0"), nullable=False),
        schema="placement",
    )
    op.add_column(
        "decisions", sa.Column("claimed_until", sa.DateTime(timezone=True), nullable=True), schema="placement"
    )
    op.add_column(
        "decisions",
        sa.Column("ledger_commit", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        schema="placement",
    )
    op.add_column(
        "decisions",
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        schema="placement",
    )
    op.create_table(
        "ledger_allocations",
        sa.Column("allocation_id", sa.Text(), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("request_id", sa.Text(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("seen_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("allocation_id"),
        schema="placement",
    )
    op.create_index(
        op.f("ix_placement_ledger_allocations_request_id"),
        "ledger_allocations",
        ["request_id"],
        unique=False,
        schema="placement",
    )


def downgrade() -> None:
    op.drop_index(
        op.f("ix_placement_ledger_allocations_request_id"), table_name="ledger_allocations", schema="placement"
    )
    op.drop_table("ledger_allocations", schema="placement")
    op.drop_column("decisions", "updated_at", schema="placement")
    op.drop_column("decisions", "ledger_commit", schema="placement")
    op.drop_column("decisions", "claimed_until", schema="placement")
    op.drop_column("decisions", "attempt", schema="placement")
    op.drop_column("decisions", "body_hash", schema="placement")
    op.execute("DELETE FROM placement.decisions WHERE reply IS NULL")  # intents that never decided
    op.alter_column("decisions", "reply", existing_type=postgresql.JSONB(), nullable=False, schema="placement")
