"""ledger: a commit's record and body hash; placement: a replica's requested lease while its first lease runs

``ledger.allocations.record``: what the caller decided, kept with the allocation it committed (placement: the
request and the reply it gave), carried by ``allocation_committed`` and returned by a repeat of the commit, so
that the commit is the placement's only durable record on its critical path. ``ledger.allocations.body_hash``:
the caller's hash of its request; a repeat of a request id with the same hash is answered with the first
allocation whatever it holds, one with another hash is refused.

``placement.decisions.lease_s``: a replica placed with a short first lease keeps the lease its caller asked
for here until the caller's first renew or its engine's first report extends the allocation to it (null once
extended, and for every decision recorded before this column).

Altered as each table's owner (0009).

Revision ID: 0018_ledger_records
Revises: 0017_retire_request_holds
Create Date: 2027-01-19
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0018_ledger_records"
down_revision: str | None = "0017_retire_request_holds"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.execute("SET LOCAL ROLE hetsched_ledger_owner")
    op.add_column("allocations", sa.Column("record", JSONB, nullable=True), schema="ledger")
    op.add_column("allocations", sa.Column("body_hash", sa.Text, nullable=True), schema="ledger")
    op.execute("RESET ROLE")
    op.execute("SET LOCAL ROLE hetsched_placement_owner")
    op.add_column("decisions", sa.Column("lease_s", sa.Integer, nullable=True), schema="placement")
    op.execute("RESET ROLE")


def downgrade() -> None:
    op.execute("SET LOCAL ROLE hetsched_placement_owner")
    op.drop_column("decisions", "lease_s", schema="placement")
    op.execute("RESET ROLE")
    op.execute("SET LOCAL ROLE hetsched_ledger_owner")
    op.drop_column("allocations", "body_hash", schema="ledger")
    op.drop_column("allocations", "record", schema="ledger")
    op.execute("RESET ROLE")
