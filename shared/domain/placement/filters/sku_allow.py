"""Filter ``sku_allow``: with an allow-list in the request, only hosts of those SKUs qualify."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from shared.domain.placement.framework import SUCCESS, Candidate, Code, CycleState, Scope, Status, demand_of, no_config

NAME: Final = "sku_allow"


class SkuAllowFilter:
    name: Final = NAME
    scope: Final = Scope.HOST

    def filter(self, state: CycleState, candidate: Candidate) -> Status:
        allowed = demand_of(state).skus
        if allowed is None or candidate.host.sku.name in allowed:
            return SUCCESS
        return Status(Code.SKU_NOT_ALLOWED, plugin=NAME, message=f"SKU {candidate.host.sku.name} not in the allow-list")


def factory(config: Mapping[str, object] | None = None) -> SkuAllowFilter:
    no_config(NAME, config)
    return SkuAllowFilter()
