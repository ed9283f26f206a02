"""The six services and the gateway: module to run, health subject, schema. The launcher and the tests read
this."""

from __future__ import annotations

from services.capacity_ledger.app import SERVICE as LEDGER
from services.cross_region_router.app import SERVICE as ROUTER
from services.gateway.app import SERVICE as GATEWAY
from services.placement.app import SERVICE as PLACEMENT
from services.rebalancer.app import SERVICE as REBALANCER
from services.reservation_filler.app import SERVICE as RESERVATION
from services.topology_discovery.app import SERVICE as TOPOLOGY
from shared.infra.service import ServiceDefinition

SERVICES: dict[str, ServiceDefinition] = {
    "topology_discovery": TOPOLOGY,
    "capacity_ledger": LEDGER,
    "placement": PLACEMENT,
    "reservation_filler": RESERVATION,
    "cross_region_router": ROUTER,
    "rebalancer": REBALANCER,
    "gateway": GATEWAY,
}


def module_of(package: str) -> str:
    return f"services.{package}"
