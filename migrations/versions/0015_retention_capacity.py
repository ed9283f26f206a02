"""usable HBM is the database's; BRIN indexes for pruning (issue 23 rows 7 and 8)

Row 8, the ledger's usable HBM. Before this, the ledger's role could set ``ledger.accelerators.hbm_usable``
to any number: 100x the device's HBM (the over-commit trigger then let commits through past the real
memory), or 0 under live allocations. Now:

* ``hbm_usable`` is written by the ``capacity_apply`` trigger alone (BEFORE INSERT OR UPDATE, function
  ``ledger.apply_capacity()``, owned by ``hetsched_ledger_owner``): ``floor(hbm_total x ceiling)``, the
  ceiling's decimal as ``shared.domain.memory.usable_hbm`` takes it, whatever the statement said. The ledger
  role loses INSERT and UPDATE on the column, so a direct write is ``permission denied`` (and the trigger
  would overrule it anyway, for the owner and superusers too).
* It never drops below what is allocated: a device that topology reports smaller than what is already
  reserved on it keeps ``hbm_usable = reserved`` (nothing new fits) and follows each release down until
  the new figure is reached (docs/LEDGER.md "Capacity changes"). The trigger runs on every row change,
  the shares trigger's ``reserved`` updates included, which is how it follows the releases.
* ``ceiling`` must lie in (0, 1] and ``hbm_total`` be >= 0 (CHECK constraints): usable never exceeds the
  total topology recorded.

Row 7, retention: BRIN indexes on ``<schema>.outbox.created_at`` and ``<schema>.inbox.processed_at`` (tiny,
nearly free to keep up on append-mostly tables) let the pruning task (``shared.infra.retention``) find the
rows past their retention without scanning the recent ones.

Revision ID: 0015_retention_capacity
Revises: 0014_rebalance
Create Date: 2026-12-20
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0015_retention_capacity"
down_revision: str | None = "0014_rebalance"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

SCHEMAS = ("topology", "ledger", "placement", "reservation", "routing", "rebalance")
LEDGER_OWNER = "hetsched_ledger_owner"
LEDGER_ROLE = "hetsched_ledger"

APPLY_CAPACITY = """
CREATE FUNCTION ledger.apply_capacity() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    computed bigint;
BEGIN
    -- Usable HBM = floor(total x ceiling), whatever the statement wrote; the ceiling's decimal (6 places),
    -- as shared.domain.memory.usable_hbm reads 0.92 as 23/25.
    computed := floor(NEW.hbm_total * round(NEW.ceiling::numeric, 6));
    IF TG_OP = 'INSERT' THEN
        NEW.hbm_usable := GREATEST(computed, NEW.reserved);
    ELSE
        -- Never below what is allocated: a device reported smaller than its reservations keeps them (and
        -- takes nothing new) and shrinks with each release, down to the new figure. A commit raising
        -- `reserved` does not raise it: the shares trigger then sees reserved > usable and refuses.
        NEW.hbm_usable := GREATEST(computed, LEAST(OLD.hbm_usable, NEW.reserved));
    END IF;
    RETURN NEW;
END $$;
"""


def upgrade() -> None:
    op.execute(f"SET LOCAL ROLE {LEDGER_OWNER}")
    op.create_check_constraint("accelerators_ceiling", "accelerators", "ceiling > 0 AND ceiling <= 1", schema="ledger")
    op.create_check_constraint("accelerators_hbm_total", "accelerators", "hbm_total >= 0", schema="ledger")
    op.execute(APPLY_CAPACITY)
    op.execute(
        "CREATE TRIGGER capacity_apply BEFORE INSERT OR UPDATE ON ledger.accelerators "
        "FOR EACH ROW EXECUTE FUNCTION ledger.apply_capacity()"
    )
    # Rows written before this: recomputed once (the trigger does it).
    op.execute("UPDATE ledger.accelerators SET hbm_usable = hbm_usable")
    op.execute("RESET ROLE")
    op.execute(f"REVOKE INSERT (hbm_usable), UPDATE (hbm_usable) ON ledger.accelerators FROM {LEDGER_ROLE}")
    for schema in SCHEMAS:
        op.execute(f"SET LOCAL ROLE hetsched_{schema}_owner")
        op.create_index(f"ix_{schema}_outbox_created", "outbox", ["created_at"], schema=schema, postgresql_using="brin")
        op.create_index(
            f"ix_{schema}_inbox_processed", "inbox", ["processed_at"], schema=schema, postgresql_using="brin"
        )
        op.execute("RESET ROLE")


def downgrade() -> None:
    for schema in reversed(SCHEMAS):
        op.execute(f"SET LOCAL ROLE hetsched_{schema}_owner")
        op.drop_index(f"ix_{schema}_inbox_processed", table_name="inbox", schema=schema)
        op.drop_index(f"ix_{schema}_outbox_created", table_name="outbox", schema=schema)
        op.execute("RESET ROLE")
    op.execute(f"GRANT INSERT (hbm_usable), UPDATE (hbm_usable) ON ledger.accelerators TO {LEDGER_ROLE}")
    op.execute(f"SET LOCAL ROLE {LEDGER_OWNER}")
    op.execute("DROP TRIGGER capacity_apply ON ledger.accelerators")
    op.execute("DROP FUNCTION ledger.apply_capacity()")
    op.drop_constraint("accelerators_hbm_total", "accelerators", schema="ledger", type_="check")
    op.drop_constraint("accelerators_ceiling", "accelerators", schema="ledger", type_="check")
    op.execute("RESET ROLE")
