"""topology.reserved and topology.reserved_shares: reserved HBM per accelerator, a read model fed by
LEDGER events

Topology answers `fleet.get`'s `hbm_reserved` from its own schema instead of reading the ledger's.

Revision ID: 0006_topology_reserved
Revises: 0005_service_roles
Create Date: 2026-12-01
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006_topology_reserved"
down_revision: str | None = "0005_service_roles"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "reserved",
        sa.Column("accelerator_id", sa.Text(), nullable=False),
        sa.Column("reserved_bytes", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("accelerator_id"),
        schema="topology",
    )
    op.create_table(
        "reserved_shares",
        sa.Column("allocation_id", sa.Text(), nullable=False),
        sa.Column("accelerator_id", sa.Text(), nullable=False),
        sa.Column("reserved_bytes", sa.BigInteger(), nullable=False),
        sa.Column("ended", sa.Boolean(), nullable=False),
        sa.PrimaryKeyConstraint("allocation_id", "accelerator_id"),
        schema="topology",
    )
    # 0005's default privileges cover them when the same user migrates; say it outright for any other.
    op.execute(
        "GRANT SELECT, INSERT, UPDATE, DELETE ON topology.reserved, topology.reserved_shares TO hetsched_topology"
    )


def downgrade() -> None:
    op.drop_table("reserved_shares", schema="topology")
    op.drop_table("reserved", schema="topology")
