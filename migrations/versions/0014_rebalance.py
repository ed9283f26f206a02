"""rebalance: the rebalancer's tables (issue 16)

``rebalance.replicas`` (placed replicas with their requests), ``rebalance.allocations`` (live ledger
allocations), ``rebalance.nodes`` / ``rebalance.pods`` (the fleet), ``rebalance.plans`` (plans and their
steps), ``rebalance.actions`` (what it did), ``rebalance.throttles`` (nodes it throttles).

Created as ``hetsched_rebalance_owner`` (0009: the default privileges grant the service its DML).

Revision ID: 0014_rebalance
Revises: 0013_reservations
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0014_rebalance"
down_revision: str | None = "0013_reservations"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OWNER = "hetsched_rebalance_owner"
SCHEMA = "rebalance"


def upgrade() -> None:
    op.execute(f"SET LOCAL ROLE {OWNER}")
    op.create_table(
        "replicas",
        sa.Column("allocation_id", sa.Text(), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("body", postgresql.JSONB(), nullable=False),
        sa.PrimaryKeyConstraint("allocation_id"),
        schema=SCHEMA,
    )
    op.create_table(
        "allocations",
        sa.Column("allocation_id", sa.Text(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("parent_id", sa.Text(), nullable=True),
        sa.Column("bytes", postgresql.JSONB(), nullable=False),
        sa.PrimaryKeyConstraint("allocation_id"),
        schema=SCHEMA,
    )
    op.create_index("ix_rebalance_allocations_parent_id", "allocations", ["parent_id"], schema=SCHEMA)
    for table in ("nodes", "pods"):
        op.create_table(
            table,
            sa.Column("name", sa.Text(), nullable=False),
            sa.Column("body", postgresql.JSONB(), nullable=False),
            sa.PrimaryKeyConstraint("name"),
            schema=SCHEMA,
        )
    op.create_table(
        "plans",
        sa.Column("plan_id", sa.Text(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("body", postgresql.JSONB(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("plan_id"),
        schema=SCHEMA,
    )
    op.create_index("ix_rebalance_plans_state", "plans", ["state"], schema=SCHEMA)
    op.create_table(
        "actions",
        sa.Column("id", sa.BigInteger(), sa.Identity(), nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("plan_id", sa.Text(), nullable=True),
        sa.Column("what", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
        schema=SCHEMA,
    )
    op.create_table(
        "throttles",
        sa.Column("node", sa.Text(), nullable=False),
        sa.Column("since", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("node"),
        schema=SCHEMA,
    )
    op.execute("RESET ROLE")


def downgrade() -> None:
    op.execute(f"SET LOCAL ROLE {OWNER}")
    for table in ("throttles", "actions", "plans", "pods", "nodes", "allocations", "replicas"):
        op.drop_table(table, schema=SCHEMA)
    op.execute("RESET ROLE")
