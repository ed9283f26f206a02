"""An accelerator's capacity, one type for every context: the ledger's rows, placement's view, the
simulator. ``free`` has one meaning everywhere: usable - reserved, never below 0, and 0 while the
accelerator is unavailable (its node lost or removed)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class AcceleratorCapacity:
    """One GPU as the ledger sees it. ``id`` is ``"<node>/gpu<index>"``; bytes are HBM bytes."""

    id: str
    node: str
    index: int
    sku: str
    usable: int
    reserved: int
    available: bool = True
    # Its reservations belong to `shared` replicas (TP=1 replicas that may share a GPU): another shared
    # replica may join it; an exclusive TP group may not. False when idle or held exclusively.
    shared: bool = False

    @property
    def free(self) -> int:
        """Bytes still allocatable: usable - reserved, never below 0, and 0 when unavailable."""
        return max(0, self.usable - self.reserved) if self.available else 0

    @property
    def idle(self) -> bool:
        """Nothing reserved: placing on it turns it from idle to busy (it then draws its TDP)."""
        return self.reserved == 0
