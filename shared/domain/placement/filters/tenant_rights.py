"""Filter ``tenant_rights``: reservations and isolation.

The rule (issue 15, docs/RESERVATIONS.md): a GPU another tenant has reserved may host a replica only
when the replica is ``preemptible`` and the reservation (``soft`` or ``spot``) offers that GPU now; the
owner may use its own. The rule is per accelerator and a filter sees hosts (a host class speaks for
identical hosts), so it is applied before the cycle, to the snapshot itself:
``shared.domain.placement.withhold`` marks the GPUs a tenant may not use unavailable (placement's
``services.placement.deciding.Decider.rights``, fed by the RESERVATION stream's fold, ``ReservationBook.withheld``; the
simulator does the same). Withheld GPUs then differ from the others in availability, which the host
class keys already hold, so classes never mix them. This filter therefore accepts every host it is
shown; it stays in the profile as the named place of the rule.
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
