"""placement: the queue of requests waiting for capacity (issue 12)

``placement.queue`` holds each request that placement answered ``queued`` (its decision row says
``queued``), in arrival order (``seq``), with the request itself and when it gives up
(``deadline_at``, from ``queue_timeout_s``). Placement's queue loop serves it in ``seq`` order as
capacity frees; a row leaves once its request is placed, rejected or timed out. Nothing in it is
reserved.

Created as ``hetsched_placement_owner`` (0009: the default privileges then grant the service its DML
on the table and USAGE, SELECT on its identity sequence; nothing is owned by the migrating user).

Revision ID: 0011_placement_queue
Revises: 0010_ledger_sharing
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision: str = "0011_placement_queue"
down_revision: str | None = "0010_ledger_sharing"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OWNER = "hetsched_placement_owner"


def upgrade() -> None:
    op.execute(f"SET LOCAL ROLE {OWNER}")
    op.create_table(
        "queue",
        sa.Column("seq", sa.BigInteger(), sa.Identity(always=True), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("request_id", sa.Text(), nullable=False),
        sa.Column("request", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("enqueued_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("deadline_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("seq"),
        sa.UniqueConstraint("tenant", "request_id", name="queue_tenant_request_id_key"),
        schema="placement",
    )
    op.execute("RESET ROLE")


def downgrade() -> None:
    op.execute(f"SET LOCAL ROLE {OWNER}")
    op.drop_table("queue", schema="placement")
    op.execute("RESET ROLE")
