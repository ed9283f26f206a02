"""The HBM ledger's pure rules: does a commit fit, planning a batch of commits, who may end or renew
an allocation, replay of ledger events, drift.

The database enforces the invariant (a trigger keeps per-accelerator reserved bytes and refuses a
commit that would exceed usable HBM); these functions decide *before* writing, explain refusals and
rebuild totals from the event stream.
"""

from shared.domain.ledger.commits import (
    MAX_LEASE_S,
    Accepted,
    AllocationKind,
    CommitIntent,
    CommitPlan,
    Duplicate,
    ExistingAllocation,
    Outcome,
    Refused,
    ReplicaPool,
    check_request,
    is_stale,
    lease_end,
    lease_too_long,
    plan_commits,
    refusal_code,
    same_shares,
    view_of,
)
from shared.domain.ledger.drift import Drift, DriftDetector
from shared.domain.ledger.fit import FitResult, Refusal, ShareRefusal, Shares, apply_shares, check_fit
from shared.domain.ledger.lifecycle import (
    Access,
    AllocationRecord,
    AllocationState,
    EndedAllocation,
    may_change,
    renewal_end,
)
from shared.domain.ledger.replay import (
    ALLOCATION_EVENTS,
    COMMITTED,
    EXPIRED,
    RELEASED,
    AllocationPayload,
    allocation_delta,
    apply_allocation_event,
    replay_reserved,
)

__all__ = [
    "ALLOCATION_EVENTS",
    "COMMITTED",
    "EXPIRED",
    "MAX_LEASE_S",
    "RELEASED",
    "Accepted",
    "Access",
    "AllocationKind",
    "AllocationPayload",
    "AllocationRecord",
    "AllocationState",
    "CommitIntent",
    "CommitPlan",
    "Drift",
    "DriftDetector",
    "Duplicate",
    "EndedAllocation",
    "ExistingAllocation",
    "FitResult",
    "Outcome",
    "Refusal",
    "Refused",
    "ReplicaPool",
    "ShareRefusal",
    "Shares",
    "allocation_delta",
    "apply_allocation_event",
    "apply_shares",
    "check_fit",
    "check_request",
    "is_stale",
    "lease_end",
    "lease_too_long",
    "may_change",
    "plan_commits",
    "refusal_code",
    "renewal_end",
    "replay_reserved",
    "same_shares",
    "view_of",
]
