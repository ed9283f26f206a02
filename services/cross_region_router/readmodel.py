"""The router's read model of placement: which regions hold a replica of each model (capacity per region),
and on which SKUs (what serving a request there costs).

Seeded from ``routing.replicas`` at start, then folded from placement's events (``placement_decided`` adds,
``placement_released`` removes) once the transaction that records each event has committed: pure memory,
no IO, so a consumer batch that rolls back and replays never counts a replica twice or loses one.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable


class ReplicaRegions:
    """Replicas by allocation id, how many of each model every region holds, and on which SKUs."""

    def __init__(self, replicas: Iterable[tuple[str, str, str, str | None]] = ()) -> None:
        """Seeded with ``(allocation_id, region, model, sku)`` for each replica the table holds (sku None:
        not known)."""
        self._replicas: dict[str, tuple[str, str, str | None]] = {}  # allocation id -> (region, model, sku)
        self._serving: dict[str, Counter[str]] = {}  # model -> replicas per region
        self._skus: dict[tuple[str, str], Counter[str]] = {}  # (model, region) -> replicas per known SKU
        for allocation_id, region, model, sku in replicas:
            self.add(allocation_id, region, model, sku)

    def add(self, allocation_id: str, region: str, model: str, sku: str | None = None) -> None:
        """A replica placed in ``region`` on ``sku``; one already known (a redelivered event) changes nothing."""
        if allocation_id in self._replicas:
            return
        self._replicas[allocation_id] = (region, model, sku)
        self._serving.setdefault(model, Counter())[region] += 1
        if sku is not None:
            self._skus.setdefault((model, region), Counter())[sku] += 1

    def remove(self, allocation_id: str) -> None:
        """A replica released or expired; one not known changes nothing."""
        found = self._replicas.pop(allocation_id, None)
        if found is None:
            return
        region, model, sku = found
        self._serving[model][region] -= 1
        if self._serving[model][region] <= 0:
            del self._serving[model][region]
        if sku is not None:
            skus = self._skus[(model, region)]
            skus[sku] -= 1
            if skus[sku] <= 0:
                del skus[sku]
            if not skus:
                del self._skus[(model, region)]

    def serves(self, region: str, models: Iterable[str]) -> bool:
        """Whether ``region`` holds a replica of any of ``models`` (a model or a group's members)."""
        for model in models:
            serving = self._serving.get(model)
            if serving is not None and serving.get(region, 0) > 0:
                return True
        return False

    def skus(self, region: str, models: Iterable[str]) -> tuple[str, ...]:
        """The SKUs, sorted, of the replicas of any of ``models`` that ``region`` holds (those whose SKU
        is known); empty when none is known there."""
        found: set[str] = set()
        for model in models:
            found.update(self._skus.get((model, region), ()))
        return tuple(sorted(found))

    def __len__(self) -> int:
        return len(self._replicas)
