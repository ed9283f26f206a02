"""Score ``energy``: joules per generated token, TDP x accelerators / decode tokens per second
(``placement.perf``), as the most frugal feasible candidate's over this one's (1 = most frugal)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from shared.domain.placement.framework import Candidate, CycleState, Scope, StateKey, demand_of, no_config
from shared.domain.placement.perf import perf

NAME: Final = "energy"
_PER_SKU_TP: Final[StateKey[tuple[float, dict[tuple[str, int], float]]]] = StateKey(NAME)


def joules_per_token(state: CycleState, candidate: Candidate) -> float:
    sku = candidate.host.sku
    estimate = perf(state, demand_of(state), sku, candidate.tp)
    return sku.tdp_w * candidate.tp / estimate.tokens_per_s


class EnergyScore:
    name: Final = NAME
    scope: Final = Scope.HOST  # reads the SKU, the TP degree and the request only

    def prescore(self, state: CycleState, candidates: Sequence[Candidate]) -> None:
        # The figure depends on (SKU, TP) only: work it out once per pair, not per candidate.
        first = {(c.host.sku.name, c.tp): c for c in candidates}
        values = {key: joules_per_token(state, c) for key, c in first.items()}
        state.write(_PER_SKU_TP, (min(values.values(), default=0.0), values))

    def score(self, state: CycleState, candidate: Candidate) -> float:
        best, values = state.read(_PER_SKU_TP)
        own = values[(candidate.host.sku.name, candidate.tp)]
        return min(1.0, best / own) if own > 0 else 1.0


def factory(config: Mapping[str, object] | None = None) -> EnergyScore:
    no_config(NAME, config)
    return EnergyScore()
