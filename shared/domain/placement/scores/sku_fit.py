"""Score ``sku_fit``: how well the SKU suits the request's shape (DESIGN §4). Long outputs favour
memory bandwidth (decode reads every weight per token), long inputs favour HBM capacity (the KV of
long prompts), short requests favour cheap accelerators. Each quality is relative to the best among
this TP degree's feasible candidates, and the shape sets the weights::

    long     = min(1, (input + output) / long_tokens)
    sku_fit  = long x (output / total x bandwidth + input / total x capacity) + (1 - long) x cheapness

Without a typical shape in the request the three weigh equally.

**With a TTFT target** (``slo.ttft_ms``) the fit is the latency headroom instead: how many times the
typical prompt could grow and still be prefilled within the target on this SKU at this TP
(``placement.perf``: TTFT grows with the prompt), over ``tail``, capped at 1::

    sku_fit = min(1, slo.ttft_ms / ttft(typical prompt) / tail)

A target states what the request needs; a shape alone only says what it looks like. The ``slo``
filter already drops the candidates that miss the target at the typical shape, but requests are not
all typical: ``tail`` (4) is how much longer than the mean the prompts the target must still cover
are (the 99th percentile prompt of both shipped traces, Azure conversation 2023 and Mooncake, is 3.6
and 4.3 times their mean). Every candidate that covers that tail scores 1, so cheapness is left to
``cost``; one that does not scores by how much of it it covers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from shared.domain.placement.framework import Candidate, CycleState, Scope, StateKey, demand_of, typed_config
from shared.domain.placement.perf import perf

NAME: Final = "sku_fit"


@dataclass(frozen=True, slots=True)
class SkuFitConfig:
    long_tokens: int = 8192
    tail: float = 4.0


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
        if not config.tail >= 1:
            raise ValueError(f"plugin {NAME}: tail must be >= 1")
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
        demand, sku = demand_of(state), candidate.host.sku
        slo = demand.request.slo
        if slo is not None and slo.ttft_ms is not None:
            ttft = perf(state, demand, sku, candidate.tp).ttft_ms
            return min(1.0, slo.ttft_ms / max(ttft, 1e-9) / self.config.tail)
        best = state.read(_BEST)
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
