"""Score ``cost``: price per served token, price_usd_per_hour x accelerators / the prompt and output
tokens per second the replica gets through (``Perf.served_tokens_per_s``: its KV slots full, one
prefill at a time), as the cheapest feasible candidate's over this one's (1 = cheapest). Prompt
tokens count as ``$/M tokens`` counts them: with long prompts the prefill, not the decode, sets the
price."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from shared.domain.placement.framework import Candidate, CycleState, demand_of, no_config
from shared.domain.placement.perf import perf
from shared.domain.placement.scores.relative import RelativeFigureScore

NAME: Final = "cost"


def usd_per_million_tokens(state: CycleState, candidate: Candidate) -> float:
    sku = candidate.host.sku
    estimate = perf(state, demand_of(state), sku, candidate.tp)
    return sku.price_usd_per_hour * candidate.tp / 3600 / estimate.served_tokens_per_s * 1e6


class CostScore(RelativeFigureScore):
    def __init__(self) -> None:
        super().__init__(NAME, usd_per_million_tokens)


def factory(config: Mapping[str, object] | None = None) -> CostScore:
    no_config(NAME, config)
    return CostScore()
