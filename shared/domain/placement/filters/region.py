"""Filter ``region``: with a required region in the request, only hosts in it qualify."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from shared.domain.placement.framework import SUCCESS, Candidate, Code, CycleState, Scope, Status, demand_of, no_config

NAME: Final = "region"


class RegionFilter:
    name: Final = NAME
    scope: Final = Scope.HOST

    def filter(self, state: CycleState, candidate: Candidate) -> Status:
        wanted = demand_of(state).request.region
        if wanted is None or candidate.host.region == wanted:
            return SUCCESS
        return Status(Code.REGION_MISMATCH, plugin=NAME, message=f"in region {candidate.host.region}, not {wanted}")


def factory(config: Mapping[str, object] | None = None) -> RegionFilter:
    no_config(NAME, config)
    return RegionFilter()
