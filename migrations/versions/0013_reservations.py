"""reservation: the reservation filler's tables (issue 15)

``reservation.reservations`` (each reservation's whole state), ``reservation.holds`` (one row per
reserved accelerator: no accelerator is in two reservations), ``reservation.inventory`` (the GPUs the
topology announced), ``reservation.uses`` (live allocations per the ledger's events, GIN-indexed by
accelerator).

Created as ``hetsched_reservation_owner`` (0009: the default privileges grant the service its DML).

Revision ID: 0013_reservations
Revises: 0012_routing
Create Date: 2026-11-30
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0013_reservations"
down_revision: str | None = "0012_routing"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OWNER = "hetsched_reservation_owner"
SCHEMA = "reservation"


def upgrade() -> None:
    op.execute(f"SET LOCAL ROLE {OWNER}")
    op.create_table(
        "reservations",
        sa.Column("reservation_id", sa.Text(), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("request_id", sa.Text(), nullable=True),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.Column("body", postgresql.JSONB(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("reservation_id"),
        schema=SCHEMA,
    )
    op.create_index("ix_reservation_reservations_tenant", "reservations", ["tenant"], schema=SCHEMA)
    op.create_index(
        "ux_reservation_reservations_request",
        "reservations",
        ["tenant", "request_id"],
        unique=True,
        schema=SCHEMA,
        postgresql_where=sa.text("request_id IS NOT NULL"),
    )
    op.create_table(
        "holds",
        sa.Column("accelerator", sa.Text(), nullable=False),
        sa.Column("reservation_id", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("accelerator"),
        schema=SCHEMA,
    )
    op.create_index("ix_reservation_holds_reservation_id", "holds", ["reservation_id"], schema=SCHEMA)
    op.create_table(
        "inventory",
        sa.Column("accelerator", sa.Text(), nullable=False),
        sa.Column("node", sa.Text(), nullable=False),
        sa.Column("sku", sa.Text(), nullable=False),
        sa.Column("region", sa.Text(), nullable=False),
        sa.Column("cluster", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("accelerator"),
        schema=SCHEMA,
    )
    op.create_index("ix_reservation_inventory_node", "inventory", ["node"], schema=SCHEMA)
    op.create_table(
        "uses",
        sa.Column("allocation_id", sa.Text(), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("preemptible", sa.Boolean(), nullable=False),
        sa.Column("bytes", postgresql.JSONB(), nullable=False),
        sa.Column("since", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("allocation_id"),
        schema=SCHEMA,
    )
    op.execute(f"CREATE INDEX ix_reservation_uses_accelerators ON {SCHEMA}.uses USING gin (bytes)")
    op.execute("RESET ROLE")


def downgrade() -> None:
    op.execute(f"SET LOCAL ROLE {OWNER}")
    for table in ("uses", "inventory", "holds", "reservations"):
        op.drop_table(table, schema=SCHEMA)
    op.execute("RESET ROLE")
