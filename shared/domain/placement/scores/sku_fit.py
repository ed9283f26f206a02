"""Score ``sku_fit``: how well the SKU suits the request's shape (DESIGN §4). Long outputs favour
memory bandwidth (decode reads every weight per token), long inputs favour HBM capacity (the KV of
long prompts), short requests favour cheap accelerators. Each quality is relative to the best among
this TP degree's feasible candidates, and the shape sets the weights::

    long     = min(1, (input + output) / long_tokens)
    sku_fit  = long x (output / total x bandwidth + input / total x capacity) + (1 - long) x cheapness

Without a typical shape in the request the three weigh equally.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from shared.domain.placement.framework import Candidate, CycleState, Scope, StateKey, demand_of, typed_config

NAME: Final = "sku_fit"


@dataclass(frozen=True, slots=True)
class SkuFitConfig:
    long_tokens: int = 8192


@dataclass(frozen=True, slots=True)
class _Best:
    bandwidth: float
    hbm: float
    price: float


_BEST: Final[StateKey[_Best]] = StateKey(NAME)


class SkuFitScore:
    name: Final = NAME
    scope: Final = Scope.HOST  # reads the SKU, the TP degree and the request only

    def __init__(self, config: SkuFitConfig) -> None:
        if config.long_tokens < 1:
            raise ValueError(f"plugin {NAME}: long_tokens must be >= 1")
        self.config = config

    def prescore(self, state: CycleState, candidates: Sequence[Candidate]) -> None:
        skus = {id(c.host.sku): c.host.sku for c in candidates}.values()
        state.write(
            _BEST,
            _Best(
                bandwidth=max((s.memory_bandwidth_bytes_per_s for s in skus), default=1.0),
                hbm=max((float(s.hbm_bytes) for s in skus), default=1.0),
                price=min((s.price_usd_per_hour for s in skus), default=0.0),
            ),
        )

    def score(self, state: CycleState, candidate: Candidate) -> float:
        best, demand, sku = state.read(_BEST), demand_of(state), candidate.host.sku
        bandwidth = sku.memory_bandwidth_bytes_per_s / best.bandwidth if best.bandwidth > 0 else 1.0
        capacity = sku.hbm_bytes / best.hbm if best.hbm > 0 else 1.0
        cheap = best.price / sku.price_usd_per_hour if sku.price_usd_per_hour > 0 else 1.0
        if not demand.shape_given:
            return min(1.0, (bandwidth + capacity + cheap) / 3)
        total = demand.input_tokens + demand.output_tokens
        long = min(1.0, total / self.config.long_tokens)
        value = long * (demand.output_tokens * bandwidth + demand.input_tokens * capacity) / total
        return min(1.0, value + (1 - long) * cheap)


def factory(config: Mapping[str, object] | None = None) -> SkuFitScore:
    return SkuFitScore(typed_config(SkuFitConfig, NAME, config or {}))
