"""Filter ``rack_power``: a rack's budget (power_kw x 1000 W) must cover what it draws now plus the
TDP of every GPU of the group that turns from idle to busy (GPUs already busy add nothing). Runs
after ``nvlink_group``, whose binding says which GPUs those are."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from shared.domain.placement.framework import (
    SUCCESS,
    Candidate,
    Code,
    CycleState,
    GpuGroup,
    Scope,
    Status,
    no_config,
)
from shared.domain.placement.hosts import GpuHost, GpuLoad

NAME: Final = "rack_power"


class RackPowerFilter:
    name: Final = NAME
    scope: Final = Scope.PLACEMENT

    def filter(self, state: CycleState, candidate: Candidate) -> Status:
        host, load, group = candidate.host, candidate.load, candidate.binding
        if not isinstance(host, GpuHost) or not isinstance(load, GpuLoad) or not isinstance(group, GpuGroup):
            return SUCCESS
        turning = [0] * len(host.racks)
        for p in group.positions:
            if load.idle[p]:
                turning[host.member_rack[p]] += 1
        for needed, allowed in zip(turning, load.power_gpus, strict=True):
            if needed > allowed:
                return Status(
                    Code.RACK_POWER_SHORT,
                    plugin=NAME,
                    tp=candidate.tp,
                    busy_gpus_allowed=allowed,
                    busy_gpus_needed=needed,
                )
        return SUCCESS


def factory(config: Mapping[str, object] | None = None) -> RackPowerFilter:
    no_config(NAME, config)
    return RackPowerFilter()
