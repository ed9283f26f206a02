"""Score ``energy``: joules per served token, TDP x accelerators / the prompt and output tokens per
second the replica gets through (``Perf.served_tokens_per_s``, as ``cost`` counts them), as the most
frugal feasible candidate's over this one's (1 = most frugal)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from shared.domain.placement.framework import Candidate, CycleState, demand_of, no_config
from shared.domain.placement.perf import perf
from shared.domain.placement.scores.relative import RelativeFigureScore

NAME: Final = "energy"


def joules_per_token(state: CycleState, candidate: Candidate) -> float:
    sku = candidate.host.sku
    estimate = perf(state, demand_of(state), sku, candidate.tp)
    return sku.tdp_w * candidate.tp / estimate.served_tokens_per_s


class EnergyScore(RelativeFigureScore):
    def __init__(self) -> None:
        super().__init__(NAME, joules_per_token)


def factory(config: Mapping[str, object] | None = None) -> EnergyScore:
    no_config(NAME, config)
    return EnergyScore()
