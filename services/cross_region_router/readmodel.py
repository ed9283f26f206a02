"""The router's read model of placement: which regions hold a replica of each model (capacity per region).

Seeded from ``routing.replicas`` at start, then folded from placement's events (``placement_decided`` adds,
``placement_released`` removes) once the transaction that records each event has committed: pure memory,
no IO, so a consumer batch that rolls back and replays never counts a replica twice or loses one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class ReplicaRegions:
    """Replicas by allocation id, and how many of each model every region holds."""

    def __init__(self, replicas: Iterable[tuple[str, str, str]] = ()) -> None:
        """Seeded with ``(allocation_id, region, model)`` for each replica the table holds."""
        self._replicas: dict[str, tuple[str, str]] = {}  # allocation id -> (region, model)
        self._serving: dict[str, Counter[str]] = {}  # model -> replicas per region
        for allocation_id, region, model in replicas:
            self.add(allocation_id, region, model)

    def add(self, allocation_id: str, region: str, model: str) -> None:
        """A replica placed in ``region``; one already known (a redelivered event) changes nothing."""
        if allocation_id in self._replicas:
            return
        self._replicas[allocation_id] = (region, model)
        self._serving.setdefault(model, Counter())[region] += 1

    def remove(self, allocation_id: str) -> None:
        """A replica released or expired; one not known changes nothing."""
        found = self._replicas.pop(allocation_id, None)
        if found is None:
            return
        region, model = found
        self._serving[model][region] -= 1
        if self._serving[model][region] <= 0:
            del self._serving[model][region]

    def serves(self, region: str, models: Iterable[str]) -> bool:
        """Whether ``region`` holds a replica of any of ``models`` (a model or a group's members)."""
        for model in models:
            serving = self._serving.get(model)
            if serving is not None and serving.get(region, 0) > 0:
                return True
        return False

    def __len__(self) -> int:
        return len(self._replicas)
