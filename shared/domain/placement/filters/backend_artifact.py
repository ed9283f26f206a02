"""Filter ``backend_artifact``: a host's backend (gpu / tpu) must be one the replica may run on: the
model has a built artifact for it and the request allows it. A model without a TPU artifact never
lands on a TPU (DESIGN §2)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from shared.domain.placement.framework import SUCCESS, Candidate, Code, CycleState, Scope, Status, demand_of, no_config
from shared.domain.placement.hosts import TpuHost

NAME: Final = "backend_artifact"


class BackendArtifactFilter:
    name: Final = NAME
    scope: Final = Scope.HOST

    def filter(self, state: CycleState, candidate: Candidate) -> Status:
        demand = demand_of(state)
        backend = "tpu" if isinstance(candidate.host, TpuHost) else "gpu"
        if backend in demand.backends:
            return SUCCESS
        if not demand.model.supports(backend):
            message = f"{demand.model.name} has no {backend.upper()} artifact"
        else:
            message = f"the request asks for backend {demand.request.backend}"
        return Status(Code.BACKEND_UNSUPPORTED, plugin=NAME, message=message)


def factory(config: Mapping[str, object] | None = None) -> BackendArtifactFilter:
    no_config(NAME, config)
    return BackendArtifactFilter()
