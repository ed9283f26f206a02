"""Filter ``tpu_slice``: a TPU replica takes one whole free slice of the smallest legal shape that
holds it (any orientation), found by ``topology.find_free_slice`` (aligned first, then best fit).
The slice is the status's binding."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from shared.domain.placement.framework import SUCCESS, Candidate, Code, CycleState, Scope, Status, demand_of, no_config
from shared.domain.placement.hosts import TpuHost, TpuLoad
from shared.domain.topology.tpu import find_free_slice, largest_free_block

NAME: Final = "tpu_slice"


class TpuSliceFilter:
    name: Final = NAME
    scope: Final = Scope.PLACEMENT

    def filter(self, state: CycleState, candidate: Candidate) -> Status:
        host, load = candidate.host, candidate.load
        if not isinstance(host, TpuHost) or not isinstance(load, TpuLoad):
            return SUCCESS
        tpu = demand_of(state).tpu.get((host.tpu_type, host.usable_per_chip))
        if tpu is None or tpu.shape is None:
            return Status(Code.NO_TPU_SLICE, plugin=NAME, tp=candidate.tp, message="no legal slice holds the replica")
        found = find_free_slice(load.grid, tpu.shape)
        if found is None:
            block = largest_free_block(load.grid)
            largest = "x".join(map(str, block.shape)) if block is not None else "none"
            return Status(
                Code.NO_TPU_SLICE,
                plugin=NAME,
                tp=candidate.tp,
                message=f"no free {'x'.join(map(str, tpu.shape))} slice ({load.grid.free_chips} chips free, "
                f"largest free legal block {largest})",
            )
        return Status(plugin=NAME, binding=found)


def factory(config: Mapping[str, object] | None = None) -> TpuSliceFilter:
    no_config(NAME, config)
    return TpuSliceFilter()
