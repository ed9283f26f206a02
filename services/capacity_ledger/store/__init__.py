"""The ledger's SQL over its own schema, by aggregate: ``accelerators`` (capacity, locks, availability),
``allocations`` (commits, ends, leases) and ``reads`` (snapshot pages, metrics figures). Every transaction
locks accelerator rows in id order before touching shares, so concurrent commits, releases, expiries and
capacity changes never deadlock; the database trigger refuses any over-commit even if the code above were
wrong.

No rules here: what to write is decided in ``shared.domain.ledger``. The commit path talks to the
asyncpg connection under the session's transaction (``rows.driver``) because it is the hot path.

Who holds an accelerator (``AcceleratorCapacity.shared``) is read in a statement of its own *after*
the rows are locked: under READ COMMITTED a statement that waited for a row lock re-reads only the
locked row, so a join in the locking statement could miss the shares of the transaction it waited for.

The handlers take this package as their ``Store`` (tests hand them a fake of the same shape).
"""

from services.capacity_ledger.store.accelerators import (
    AcceleratorSpec,
    NodeAvailability,
    accelerator_clusters,
    held_above_reported,
    lock_accelerators,
    lock_crossing,
    newest_replica_commits,
    node_accelerators,
    set_node_available,
    upsert_capacity,
)
from services.capacity_ledger.store.allocations import (
    NewAllocation,
    end_allocations,
    existing_allocations,
    expired_ids,
    insert_allocations,
    lock_allocation,
    lock_allocations,
    set_lease,
)
from services.capacity_ledger.store.reads import (
    AcceleratorFigures,
    GroupFigures,
    LedgerEntry,
    MetricsFigures,
    SnapshotPage,
    metrics_figures,
    snapshot,
)

__all__ = [
    "AcceleratorFigures",
    "AcceleratorSpec",
    "GroupFigures",
    "LedgerEntry",
    "MetricsFigures",
    "NewAllocation",
    "NodeAvailability",
    "SnapshotPage",
    "accelerator_clusters",
    "end_allocations",
    "existing_allocations",
    "expired_ids",
    "held_above_reported",
    "insert_allocations",
    "lock_accelerators",
    "lock_allocation",
    "lock_allocations",
    "lock_crossing",
    "metrics_figures",
    "newest_replica_commits",
    "node_accelerators",
    "set_lease",
    "set_node_available",
    "snapshot",
    "upsert_capacity",
]
