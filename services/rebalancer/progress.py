"""What the rebalancer itself has under way (not told by events): targets with a plan, replicas it told
draining, nodes it throttled, and what the next tick is to plan again."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from shared.domain.rebalance.detect import Transition


@dataclass(frozen=True)
class CopyPlaced:
    """A copy this process placed: when, and on which nodes (placement's answer)."""

    at: datetime
    nodes: frozenset[str]


@dataclass
class Progress:
    active: set[str] = field(default_factory=set)  # targets with a plan open or running
    draining: set[str] = field(default_factory=set)  # replicas told draining
    # When each drain started (in memory: after a restart, a drain counts as started when first seen again):
    drain_started: dict[str, datetime] = field(default_factory=dict)
    # Copies whose engines a move waits for: placed by this process (when, where), or first seen waiting
    # after a restart (when; resumed plans: their agents' reports are learnt again):
    copies: dict[str, CopyPlaced] = field(default_factory=dict)
    resumed: dict[str, datetime] = field(default_factory=dict)
    throttled: set[str] = field(default_factory=set)  # nodes whose cold starts are throttled
    replace_tried: dict[str, datetime] = field(default_factory=dict)  # TP group -> when its re-placement was tried
    replicated: dict[tuple[str, str], list[datetime]] = field(default_factory=dict)  # (tenant, model) -> copies planned
    # Planned on the next tick, outside any transaction (planning may read the fleet over RPC):
    changed_nodes: set[str] = field(default_factory=set)  # nodes whose NVLink graph changed
    retry: list[Transition] = field(default_factory=list)  # fired, announced, not planned yet

    def forget(self, allocation_id: str) -> None:
        """A replica released: nothing of it is under way any more."""
        self.replace_tried.pop(allocation_id, None)
        self.draining.discard(allocation_id)
        self.drain_started.pop(allocation_id, None)
        self.copies.pop(allocation_id, None)
        self.resumed.pop(allocation_id, None)

    def throttling(self, nodes: set[str]) -> None:
        """The nodes throttled now (a committed throttle change)."""
        self.throttled = set(nodes)
