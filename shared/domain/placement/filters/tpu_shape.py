"""Filter ``tpu_shape``: a TPU pod qualifies only when some legal slice of its type holds the replica
(or, with a pinned TP, a legal slice of exactly that many chips does)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from shared.domain.placement.framework import SUCCESS, Candidate, Code, CycleState, Scope, Status, demand_of, no_config
from shared.domain.placement.hosts import TpuHost

NAME: Final = "tpu_shape"


class TpuShapeFilter:
    name: Final = NAME
    scope: Final = Scope.HOST

    def filter(self, state: CycleState, candidate: Candidate) -> Status:
        host = candidate.host
        if not isinstance(host, TpuHost):
            return SUCCESS
        tpu = demand_of(state).tpu.get((host.tpu_type, host.usable_per_chip))
        if tpu is None or tpu.chips is not None:
            return SUCCESS  # None: the backend filter already said no TPU
        return Status(Code.NO_TPU_SHAPE, plugin=NAME, message=tpu.reason)


def factory(config: Mapping[str, object] | None = None) -> TpuShapeFilter:
    no_config(NAME, config)
    return TpuShapeFilter()
