"""ledger: end every live ``request`` allocation; the ledger holds replicas only

Admissions (``placement.admit``) are counted by placement in memory, per replica, and the ledger refuses a
commit of kind ``request`` (``invalid_request``). The rows of that kind written before (a request's KV hold
inside its replica's pool) would otherwise stay active until their lease ran out or their replica ended. This
ends them now, the way the ledger's own release does at SQL level, in one transaction:

* a journal row per active share (op ``released``, delta 0: a request's share never counted against the
  accelerator; ``-total`` for one that did, which none should), and one for an allocation without an active
  share, each with ``details.reason`` = "retired: admissions are not ledger allocations";
* its shares stop being active (the shares trigger keeps ``ledger.accelerators.reserved``; nothing moves);
* the allocation is ``released`` with ``ended_at`` = now.

No LEDGER event is published for them: their ``allocation_committed`` counted no accelerator bytes and no
cross-domain traffic, so a follower folding the stream reaches the same totals either way.

Runs as ``hetsched_ledger_owner`` (0009: the tables' owner; the journal stays append-only, an INSERT is all
it takes). The kind stays allowed in ``allocations_kind`` so the ended rows keep their history.

Downgrade: nothing (ended allocations are not revived; a row's history is append-only).

Revision ID: 0017_retire_request_holds
Revises: 0016_placement_replicas
Create Date: 2027-01-12
"""

from collections.abc import Sequence

from alembic import op

revision: str = "0017_retire_request_holds"
down_revision: str | None = "0016_placement_replicas"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

OWNER = "hetsched_ledger_owner"
REASON = "retired: admissions are not ledger allocations"

LIVE_REQUESTS = "SELECT id FROM ledger.allocations WHERE kind = 'request' AND state = 'active'"


def upgrade() -> None:
    op.execute(f"SET LOCAL ROLE {OWNER}")
    op.execute(f"{LIVE_REQUESTS} ORDER BY id FOR UPDATE")  # a ledger still running waits, then sees them ended
    op.execute(
        f"""
        INSERT INTO ledger.journal (op, allocation_id, accelerator_id, delta, details)
        SELECT 'released', s.allocation_id, s.accelerator_id, CASE WHEN s.counts THEN -s.total ELSE 0 END,
               jsonb_build_object('reason', '{REASON}')
          FROM ledger.shares s
         WHERE s.active AND s.allocation_id IN ({LIVE_REQUESTS})
         ORDER BY s.allocation_id, s.accelerator_id
        """
    )
    op.execute(
        f"""
        INSERT INTO ledger.journal (op, allocation_id, accelerator_id, delta, details)
        SELECT 'released', a.id, NULL, 0, jsonb_build_object('reason', '{REASON}')
          FROM ledger.allocations a
         WHERE a.id IN ({LIVE_REQUESTS})
           AND NOT EXISTS (SELECT 1 FROM ledger.shares s WHERE s.allocation_id = a.id AND s.active)
         ORDER BY a.id
        """
    )
    op.execute(f"UPDATE ledger.shares SET active = false WHERE active AND allocation_id IN ({LIVE_REQUESTS})")
    op.execute(f"UPDATE ledger.allocations SET state = 'released', ended_at = now() WHERE id IN ({LIVE_REQUESTS})")
    op.execute("RESET ROLE")


def downgrade() -> None:
    # Nothing to undo: ended allocations stay ended (their journal rows are append-only history).
    pass
