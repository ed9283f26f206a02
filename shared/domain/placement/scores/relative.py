"""Scores that rank a per-(SKU, TP) figure where lower is better: the best feasible candidate's figure
over this one's (1 = the best). ``cost`` and ``energy`` are two figures of this one shape."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

from shared.domain.placement.framework import Candidate, CycleState, Scope, StateKey

Figure = Callable[[CycleState, Candidate], float]


class RelativeFigureScore:
    """A host-scope score over ``figure`` (it must depend on the SKU, the TP degree and the request only)."""

    scope: Final = Scope.HOST

    def __init__(self, name: str, figure: Figure) -> None:
        self.name = name
        self._figure = figure
        self._key: StateKey[tuple[float, dict[tuple[str, int], float]]] = StateKey(name)

    def prescore(self, state: CycleState, candidates: Sequence[Candidate]) -> None:
        # The figure depends on (SKU, TP) only: work it out once per pair, not per candidate.
        first = {(c.host.sku.name, c.tp): c for c in candidates}
        values = {key: self._figure(state, c) for key, c in first.items()}
        state.write(self._key, (min(values.values(), default=0.0), values))

    def score(self, state: CycleState, candidate: Candidate) -> float:
        best, values = state.read(self._key)
        own = values[(candidate.host.sku.name, candidate.tp)]
        return min(1.0, best / own) if own > 0 else 1.0
