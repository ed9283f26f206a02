"""Filter ``tenant_rights``: a slot for reservations and isolation; today it accepts every host.

The reservation issue fills it: capacity that one tenant has reserved may host another tenant's
replica only when that replica is ``preemptible`` (it runs on lent capacity and is preempted when
the owner reclaims it); non-preemptible work of other tenants gets ``Code.FORBIDDEN``. When it does,
whatever it reads about reservations must join the host class keys (``hosts.py``), because hosts
that differ in it are no longer interchangeable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from shared.domain.placement.framework import SUCCESS, Candidate, CycleState, Scope, Status, no_config

NAME: Final = "tenant_rights"


class TenantRightsFilter:
    name: Final = NAME
    scope: Final = Scope.HOST

    def filter(self, state: CycleState, candidate: Candidate) -> Status:
        return SUCCESS


def factory(config: Mapping[str, object] | None = None) -> TenantRightsFilter:
    no_config(NAME, config)
    return TenantRightsFilter()
