"""ledger: exclusive and shared replicas, cross-domain traffic and clusters (issue 12)

* ``ledger.allocations.sharing`` (``exclusive`` | ``shared``, default ``exclusive``: what every allocation
  made before was taken to be), ``cross_domain_bytes_per_s`` (>= 0, default 0) and ``cluster`` (the
  cluster of its accelerators, where that traffic is charged); a partial index finds the active
  allocations with cross-domain traffic (``ledger.snapshot`` sums them per cluster on every page).
* ``ledger.accelerators.cluster``, from ``node_profiled`` / ``node_changed``; the ledger role may insert
  and update it (0009 grants the columns of ``accelerators`` one by one). Existing rows take their
  node's cluster from ``topology.nodes`` and active allocations their accelerators' (read as the
  migrating user: the owner role sees only its own schema).
* ``ledger.check_exclusive()`` behind the trigger ``shares_exclusive`` (after ``shares_apply``: triggers
  fire in name order, so an over-commit is reported as such first): a replica's share may not land on
  an accelerator held by a replica it may not sit with (an exclusive one; or any, when it is exclusive).
  The commit path refuses that before writing (``shared.domain.ledger.sharing``); this is the
  database's own guard, like the HBM invariant, for any caller. It runs after the statement, so it sees
  the allocation rows that the same statement inserted, and once the accelerator's row is locked (by
  the commit path, or by ``apply_share``'s update of ``reserved``), so it sees what was committed before.

Everything is created as ``hetsched_ledger_owner`` (0009: the default privileges then grant the service
its DML, and no object is owned by the migrating user); the trigger function is SECURITY DEFINER with a
fixed ``search_path`` and no EXECUTE for the ledger role, as ``apply_share``.

Revision ID: 0010_ledger_sharing
Revises: 0009_least_privilege
Create Date: 2026-12-05
"""

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010_ledger_sharing"
down_revision: str | None = "0009_least_privilege"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OWNER = "hetsched_ledger_owner"
ROLE = "hetsched_ledger"
CROSS_DOMAIN_ACTIVE = "state = 'active' AND cross_domain_bytes_per_s > 0"

CHECK_EXCLUSIVE = """
CREATE FUNCTION ledger.check_exclusive() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    mine text;
BEGIN
    -- Only a replica's share that starts counting: an exclusive one joins an accelerator no other
    -- replica holds, a shared one an accelerator that only shared replicas hold.
    IF NOT (NEW.active AND NEW.counts) OR (TG_OP = 'UPDATE' AND OLD.active AND OLD.counts) THEN
        RETURN NULL;
    END IF;
    SELECT sharing INTO mine FROM ledger.allocations WHERE id = NEW.allocation_id;
    IF EXISTS (
        SELECT 1 FROM ledger.shares s JOIN ledger.allocations a ON a.id = s.allocation_id
        WHERE s.accelerator_id = NEW.accelerator_id AND s.active AND s.counts
          AND s.allocation_id <> NEW.allocation_id
          AND (mine IS DISTINCT FROM 'shared' OR a.sharing <> 'shared')
    ) THEN
        RAISE EXCEPTION 'ledger invariant: accelerator % is held by another replica (exclusive groups do not share)',
            NEW.accelerator_id USING ERRCODE = 'check_violation';
    END IF;
    RETURN NULL;
END $$;
"""

BACKFILL = """
DO $$ BEGIN
  UPDATE ledger.accelerators a SET cluster = n.cluster FROM topology.nodes n
   WHERE a.node = n.name AND a.cluster IS NULL;
  UPDATE ledger.allocations al SET cluster = (
      SELECT min(acc.cluster) FROM ledger.shares s JOIN ledger.accelerators acc ON acc.id = s.accelerator_id
       WHERE s.allocation_id = al.id)
   WHERE al.state = 'active' AND al.cluster IS NULL;
EXCEPTION WHEN insufficient_privilege OR undefined_table THEN
  RAISE WARNING 'ledger clusters not backfilled (%): they follow the next node_profiled / node_changed', SQLERRM;
END $$;
"""


def upgrade() -> None:
    op.execute(f"SET LOCAL ROLE {OWNER}")
    op.add_column(
        "allocations",
        sa.Column("sharing", sa.Text(), server_default=sa.text("'exclusive'"), nullable=False),
        schema="ledger",
    )
    op.add_column(
        "allocations",
        sa.Column("cross_domain_bytes_per_s", sa.BigInteger(), server_default=sa.text("0"), nullable=False),
        schema="ledger",
    )
    op.add_column("allocations", sa.Column("cluster", sa.Text(), nullable=True), schema="ledger")
    op.create_check_constraint(
        "allocations_sharing", "allocations", "sharing IN ('exclusive', 'shared')", schema="ledger"
    )
    op.create_check_constraint(
        "allocations_cross_domain", "allocations", "cross_domain_bytes_per_s >= 0", schema="ledger"
    )
    op.create_index(
        "ix_ledger_allocations_cross_domain",
        "allocations",
        ["cluster"],
        unique=False,
        schema="ledger",
        postgresql_where=sa.text(CROSS_DOMAIN_ACTIVE),
    )
    op.add_column("accelerators", sa.Column("cluster", sa.Text(), nullable=True), schema="ledger")
    op.execute(f"GRANT INSERT (cluster), UPDATE (cluster) ON ledger.accelerators TO {ROLE}")
    op.execute(CHECK_EXCLUSIVE)
    op.execute("ALTER FUNCTION ledger.check_exclusive() SECURITY DEFINER SET search_path = pg_catalog, pg_temp")
    op.execute(f"REVOKE EXECUTE ON FUNCTION ledger.check_exclusive() FROM PUBLIC, {ROLE}")
    op.execute(
        "CREATE TRIGGER shares_exclusive AFTER INSERT OR UPDATE ON ledger.shares "
        "FOR EACH ROW EXECUTE FUNCTION ledger.check_exclusive()"
    )
    op.execute("RESET ROLE")
    op.execute(BACKFILL)


def downgrade() -> None:
    op.execute(f"SET LOCAL ROLE {OWNER}")
    op.execute("DROP TRIGGER IF EXISTS shares_exclusive ON ledger.shares")
    op.execute("DROP FUNCTION IF EXISTS ledger.check_exclusive()")
    op.drop_column("accelerators", "cluster", schema="ledger")  # its column grants go with it
    op.drop_index(
        "ix_ledger_allocations_cross_domain",
        table_name="allocations",
        schema="ledger",
        postgresql_where=sa.text(CROSS_DOMAIN_ACTIVE),
    )
    op.drop_constraint("allocations_cross_domain", "allocations", schema="ledger", type_="check")
    op.drop_constraint("allocations_sharing", "allocations", schema="ledger", type_="check")
    op.drop_column("allocations", "cluster", schema="ledger")
    op.drop_column("allocations", "cross_domain_bytes_per_s", schema="ledger")
    op.drop_column("allocations", "sharing", schema="ledger")
    op.execute("RESET ROLE")
