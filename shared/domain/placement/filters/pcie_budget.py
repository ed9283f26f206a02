"""Filter and score ``pcie_budget``: cold loads (weights from host memory or disk into HBM) cross
PCIe, so prefer GPUs on PCIe Gen4 or newer. Soft by design: the filter never rejects, it notes a slow
link in the explanation; the score is the link's speed relative to ``min_gen`` (1 at or above it)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from shared.domain.placement.framework import SUCCESS, Candidate, CycleState, Scope, Status, typed_config
from shared.domain.placement.hosts import GpuHost

NAME: Final = "pcie_budget"

# Usable GB/s per lane and direction after line coding (PCI-SIG: Gen3 8 GT/s 128b/130b, doubling since).
GB_PER_S_PER_LANE: Final = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


@dataclass(frozen=True, slots=True)
class PcieBudgetConfig:
    min_gen: int = 4


def _bandwidth(gen: int, lanes: int) -> float:
    return GB_PER_S_PER_LANE.get(gen, GB_PER_S_PER_LANE[max(GB_PER_S_PER_LANE)]) * lanes


class PcieBudgetFilter:
    name: Final = NAME
    scope: Final = Scope.HOST

    def __init__(self, config: PcieBudgetConfig) -> None:
        self.config = config

    def filter(self, state: CycleState, candidate: Candidate) -> Status:
        host = candidate.host
        gen = host.sku.pcie_gen if isinstance(host, GpuHost) else None
        if gen is None or gen >= self.config.min_gen:
            return SUCCESS
        lanes = host.sku.pcie_lanes or 16
        return Status(
            plugin=NAME,
            note=f"PCIe Gen{gen} x{lanes} ({_bandwidth(gen, lanes):.0f} GB/s) is below Gen{self.config.min_gen}: "
            "cold loads of the weights will be slow",
        )

    def prescore(self, state: CycleState, candidates: Sequence[Candidate]) -> None:
        return None

    def score(self, state: CycleState, candidate: Candidate) -> float:
        host = candidate.host
        gen = host.sku.pcie_gen if isinstance(host, GpuHost) else None
        if gen is None or gen >= self.config.min_gen:
            return 1.0  # TPUs load over their hosts' own links; unknown gens are not penalised
        return min(1.0, GB_PER_S_PER_LANE.get(gen, 0.0) / GB_PER_S_PER_LANE[self.config.min_gen])


def factory(config: Mapping[str, object] | None = None) -> PcieBudgetFilter:
    return PcieBudgetFilter(typed_config(PcieBudgetConfig, NAME, config or {}))
