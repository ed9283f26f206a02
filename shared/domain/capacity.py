"""An accelerator's capacity, one type for every context: the ledger's rows, placement's view and its
mirror of the ledger's figures, the simulator. ``free`` has one meaning everywhere: usable - reserved,
never below 0, and 0 while the accelerator is unavailable (its node lost or removed)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.domain.fleet import AcceleratorId


@dataclass(frozen=True, slots=True)
class AcceleratorCapacity:
    """One GPU (or TPU chip) as the ledger sees it. ``id`` is ``"<node>/gpu<index>"``; bytes are HBM bytes.
    Built from the ledger's wire figures alone (placement's mirror of them), ``index`` is what the id
    names (0 for a TPU chip) and ``sku`` is ``""``: those figures carry neither, and the mirror reads
    only the bytes, availability and holders."""

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
    # The allocations its reserved bytes belong to, when known (a ledger snapshot's row names them).
    allocations: tuple[str, ...] = ()

    @classmethod
    def of_ledger(
        cls,
        id: str,
        node: str,
        usable: int,
        reserved: int,
        *,
        available: bool = True,
        allocations: tuple[str, ...] = (),
        shared: bool = False,
    ) -> AcceleratorCapacity:
        """A row from the ledger's figures alone (no SKU, the index its id names; see the class)."""
        try:
            index = AcceleratorId.parse(id).gpu_index or 0
        except ValueError:
            index = 0
        return cls(id, node, index, "", usable, reserved, available, shared, allocations)

    @property
    def free(self) -> int:
        """Bytes still allocatable: usable - reserved, never below 0, and 0 when unavailable."""
        return max(0, self.usable - self.reserved) if self.available else 0

    @property
    def idle(self) -> bool:
        """Nothing reserved: placing on it turns it from idle to busy (it then draws its TDP)."""
        return self.reserved == 0
