"""routing: the cross-region router's tables (issue 14)

``routing.tenants`` (each tenant's region and when it last switched: the damping), ``routing.sessions``
(each session's region: an in-flight session never moves), ``routing.traffic`` (requests routed per
tenant, region and day: the affinity window), ``routing.regions`` (the operators' up / drain / down).

Created as ``hetsched_routing_owner`` (0009: the default privileges grant the service its DML).

Revision ID: 0012_routing
Revises: 0011_placement_queue
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0012_routing"
down_revision: str | None = "0011_placement_queue"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OWNER = "hetsched_routing_owner"
SCHEMA = "routing"


def upgrade() -> None:
    op.execute(f"SET LOCAL ROLE {OWNER}")
    op.create_table(
        "tenants",
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("region", sa.Text(), nullable=False),
        sa.Column("switched_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("tenant"),
        schema=SCHEMA,
    )
    op.create_table(
        "sessions",
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("session_id", sa.Text(), nullable=False),
        sa.Column("region", sa.Text(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), server_default=sa.text("now()"), nullable=False),
        sa.PrimaryKeyConstraint("tenant", "session_id", name="sessions_pkey"),
        schema=SCHEMA,
    )
    op.create_index("ix_routing_sessions_updated_at", "sessions", ["updated_at"], schema=SCHEMA)
    op.create_table(
        "traffic",
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("region", sa.Text(), nullable=False),
        sa.Column("day", sa.Integer(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("tenant", "region", "day", name="traffic_pkey"),
        schema=SCHEMA,
    )
    op.create_table(
        "regions",
        sa.Column("region", sa.Text(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("changed_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("region"),
        schema=SCHEMA,
    )
    op.create_table(
        "replicas",
        sa.Column("allocation_id", sa.Text(), nullable=False),
        sa.Column("region", sa.Text(), nullable=False),
        sa.Column("model", sa.Text(), nullable=False),
        sa.Column("sku", sa.Text(), nullable=True),
        sa.PrimaryKeyConstraint("allocation_id"),
        schema=SCHEMA,
    )
    op.execute("RESET ROLE")


def downgrade() -> None:
    op.execute(f"SET LOCAL ROLE {OWNER}")
    for table in ("replicas", "regions", "traffic", "sessions", "tenants"):
        op.drop_table(table, schema=SCHEMA)
    op.execute("RESET ROLE")
