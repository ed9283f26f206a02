"""placement: each replica's lease end, and an index for listing the placed ones (`placement.replicas`)

``placement.decisions.lease_expires_at``: when a placed replica's lease ends unless renewed, as the ledger
answered its commit and then each ``placement.renew`` (null for decisions recorded before this column, and for
every status but ``placed``). ``ix_placement_decisions_placed``: the placed decisions in listing order
(tenant, request id), so a page of ``placement.replicas`` reads only live replicas however many ended ones the
table keeps.

Altered as ``hetsched_placement_owner`` (0009: the table's owner; the service keeps its DML on it).

Revision ID: 0016_placement_replicas
Revises: 0015_retention_capacity
Create Date: 2027-01-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0016_placement_replicas"
down_revision: str | None = "0015_retention_capacity"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OWNER = "hetsched_placement_owner"


def upgrade() -> None:
    op.execute(f"SET LOCAL ROLE {OWNER}")
    op.add_column(
        "decisions", sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True), schema="placement"
    )
    op.create_index(
        "ix_placement_decisions_placed",
        "decisions",
        ["tenant", "request_id"],
        unique=False,
        schema="placement",
        postgresql_where=sa.text("status = 'placed'"),
    )
    op.execute("RESET ROLE")


def downgrade() -> None:
    op.execute(f"SET LOCAL ROLE {OWNER}")
    op.drop_index("ix_placement_decisions_placed", table_name="decisions", schema="placement")
    op.drop_column("decisions", "lease_expires_at", schema="placement")
    op.execute("RESET ROLE")
