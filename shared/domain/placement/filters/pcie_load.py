"""Filter ``pcie_load``: PCIe as a budget (the brief: "pcie_bw_util > 0.7 for 1 minute -> cold loads may
congest"). Placing a replica is a cold load: its weights cross the host's PCIe links into HBM. A host
whose PCIe utilisation (from GPU telemetry: the minimum over the last window of the busiest GPU's
(TX + RX) / link bandwidth, see ``shared.domain.placement.view``) is over ``max_util`` takes no cold load
now, and says so. Hosts without telemetry count as idle.

The utilisation reaches the load rounded **up** to 0.05 (``hosts.PCIE_STEP``): load classes stay few,
and "over 0.7" is decided exactly for any threshold that is a multiple of the step."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from shared.domain.placement.framework import SUCCESS, Candidate, Code, CycleState, Scope, Status, typed_config
from shared.domain.placement.hosts import GpuLoad

NAME: Final = "pcie_load"


@dataclass(frozen=True, slots=True)
class PcieLoadConfig:
    max_util: float = 0.7


class PcieLoadFilter:
    name: Final = NAME
    scope: Final = Scope.PLACEMENT

    def __init__(self, config: PcieLoadConfig) -> None:
        self.config = config

    def filter(self, state: CycleState, candidate: Candidate) -> Status:
        load = candidate.load
        if not isinstance(load, GpuLoad) or load.pcie_util <= self.config.max_util:
            return SUCCESS
        return Status(
            Code.PCIE_BUSY,
            plugin=NAME,
            tp=candidate.tp or None,
            message=f"PCIe at {load.pcie_util:.0%} of its bandwidth (over {self.config.max_util:.0%}): "
            "no cold load of weights now",
        )


def factory(config: Mapping[str, object] | None = None) -> PcieLoadFilter:
    built = typed_config(PcieLoadConfig, NAME, config or {})
    if not 0 < built.max_util <= 1:
        raise ValueError(f"plugin {NAME}: max_util must be in (0, 1], got {built.max_util}")
    return PcieLoadFilter(built)
