"""The cross-region router's pure rules (issue 14): which region serves a tenant's request.

Regions and their figures (``regions``), the tenant's affinity from a 7-day window of its traffic
(``affinity``), the normalised route cost ``w_rtt*RTT + w_price*price + w_power*power*PUE -
w_affinity*affinity`` with each region priced by the SKU that serves the request there (``cost``), and
the decision itself: affinity, a cheaper acceptable region when the affinity region is full, draining or
down, fallback with a relaxed SLO; damped per tenant, sticky per in-flight session (``route``). No IO
and no clock: ``now_s`` is always a parameter.
"""

from shared.domain.routing.affinity import AffinityRule, Traffic, affinity, day_of
from shared.domain.routing.cost import CostTerms, Weights, costs, power_usd_per_hour, price_of, serving_price
from shared.domain.routing.regions import Region, parse_regions
from shared.domain.routing.route import (
    KEPT_BY_DAMPING,
    KEPT_BY_SESSION,
    RegionState,
    RouteAsk,
    RouteDecision,
    RoutePolicy,
    SessionRoute,
    TenantRoute,
    Tier,
    choose,
    next_tenant_route,
)

__all__ = [
    "KEPT_BY_DAMPING",
    "KEPT_BY_SESSION",
    "AffinityRule",
    "CostTerms",
    "Region",
    "RegionState",
    "RouteAsk",
    "RouteDecision",
    "RoutePolicy",
    "SessionRoute",
    "TenantRoute",
    "Tier",
    "Traffic",
    "Weights",
    "affinity",
    "choose",
    "costs",
    "day_of",
    "next_tenant_route",
    "parse_regions",
    "power_usd_per_hour",
    "price_of",
    "serving_price",
]
