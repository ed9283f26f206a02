"""Score ``cost``: price per generated token, price_usd_per_hour x accelerators / decode tokens per
second (``placement.perf``), as the cheapest feasible candidate's over this one's (1 = cheapest)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from shared.domain.placement.framework import Candidate, CycleState, Scope, StateKey, demand_of, no_config
from shared.domain.placement.perf import perf

NAME: Final = "cost"
_PER_SKU_TP: Final[StateKey[tuple[float, dict[tuple[str, int], float]]]] = StateKey(NAME)


def usd_per_million_tokens(state: CycleState, candidate: Candidate) -> float:
    sku = candidate.host.sku
    estimate = perf(state, demand_of(state), sku, candidate.tp)
    return sku.price_usd_per_hour * candidate.tp / 3600 / estimate.tokens_per_s * 1e6


class CostScore:
    name: Final = NAME
    scope: Final = Scope.HOST  # reads the SKU, the TP degree and the request only

    def prescore(self, state: CycleState, candidates: Sequence[Candidate]) -> None:
        # The figure depends on (SKU, TP) only: work it out once per pair, not per candidate.
        first = {(c.host.sku.name, c.tp): c for c in candidates}
        values = {key: usd_per_million_tokens(state, c) for key, c in first.items()}
        state.write(_PER_SKU_TP, (min(values.values(), default=0.0), values))

    def score(self, state: CycleState, candidate: Candidate) -> float:
        best, values = state.read(_PER_SKU_TP)
        own = values[(candidate.host.sku.name, candidate.tp)]
        return min(1.0, best / own) if own > 0 else 1.0


def factory(config: Mapping[str, object] | None = None) -> CostScore:
    no_config(NAME, config)
    return CostScore()
