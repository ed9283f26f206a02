"""Small builders for the routing rules' tests: regions, a three-region world, asks, traffic, a router
call with everything open by default. Times are plain seconds (a fake clock)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from itertools import combinations

from shared.domain.routing import (
    Region,
    RegionState,
    RouteAsk,
    RouteDecision,
    RoutePolicy,
    SessionRoute,
    TenantRoute,
    Traffic,
    choose,
)

H100 = "H100-SXM-80GB"
A100 = "A100-SXM-80GB"
DAY = 86_400.0
MINUTE = 60.0
T0 = 1_750_003_600.0  # 01:00 UTC on day 20254: far from a day boundary either way

# The test world: "east", "west" and "eu", with round trips shaped like the real ones.
WORLD_RTT_MS = {("east", "west"): 60.0, ("east", "eu"): 70.0, ("west", "eu"): 140.0}


def rtt_table(name: str, pairs: Mapping[tuple[str, str], float]) -> dict[str, float]:
    """``name``'s row of a symmetric RTT matrix given as unordered pairs."""
    row: dict[str, float] = {}
    for (a, b), ms in pairs.items():
        if name == a:
            row[b] = ms
        elif name == b:
            row[a] = ms
    return row


def region(
    name: str,
    *,
    rtt_ms: Mapping[str, float],
    h100: float = 4.0,
    a100: float = 2.5,
    pue: float = 1.0,
    power_usd_per_kwh: float = 0.1,
) -> Region:
    return Region(
        name=name,
        pue=pue,
        power_usd_per_kwh=power_usd_per_kwh,
        price_usd_per_hour={H100: h100, A100: a100},
        rtt_ms=dict(rtt_ms),
    )


def world(*, east: float = 4.0, west: float = 4.4, eu: float = 3.6) -> dict[str, Region]:
    """Three regions; the keyword arguments are H100 prices (USD per GPU-hour).

    Power per GPU-hour at 0.7 kW: east 0.7*1.0*0.10 = 0.070, west 0.7*1.2*0.20 = 0.168,
    eu 0.7*1.1*0.20 = 0.154.
    """
    return {
        "east": region("east", rtt_ms=rtt_table("east", WORLD_RTT_MS), h100=east),
        "west": region("west", rtt_ms=rtt_table("west", WORLD_RTT_MS), h100=west, pue=1.2, power_usd_per_kwh=0.2),
        "eu": region("eu", rtt_ms=rtt_table("eu", WORLD_RTT_MS), h100=eu, pue=1.1, power_usd_per_kwh=0.2),
    }


def mesh(
    prices: Mapping[str, float], rtt_ms: Mapping[tuple[str, str], float], default_rtt_ms: float = 50.0
) -> dict[str, Region]:
    """Regions with the given H100 prices; every pair not in ``rtt_ms`` is ``default_rtt_ms`` apart."""
    pairs = {pair: rtt_ms.get(pair, rtt_ms.get((pair[1], pair[0]), default_rtt_ms)) for pair in combinations(prices, 2)}
    return {name: region(name, rtt_ms=rtt_table(name, pairs), h100=price) for name, price in prices.items()}


def ask(origin: str = "eu", *, sku: str | None = H100, tenant: str = "acme", in_flight: bool = False) -> RouteAsk:
    return RouteAsk(tenant=tenant, origin=origin, sku=sku, in_flight=in_flight)


def traffic_in(region_name: str, n: int = 100, now_s: float = T0) -> Traffic:
    traffic = Traffic()
    traffic.add(region_name, now_s, n)
    return traffic


def route(
    the_ask: RouteAsk | None = None,
    *,
    regions: Mapping[str, Region] | None = None,
    states: Mapping[str, RegionState] | None = None,
    full: tuple[str, ...] = (),
    capacity: Callable[[str], bool] | Mapping[str, bool] | None = None,
    tenant: TenantRoute | None = None,
    session: SessionRoute | None = None,
    traffic: Traffic | None = None,
    now_s: float = T0,
    policy: RoutePolicy | None = None,
) -> RouteDecision:
    """``choose`` with every region up and with capacity unless told otherwise (``full``: regions without)."""
    return choose(
        the_ask or ask(),
        regions=regions if regions is not None else world(),
        states=states or {},
        capacity=capacity if capacity is not None else (lambda name: name not in full),
        tenant=tenant,
        session=session,
        traffic=traffic if traffic is not None else Traffic(),
        now_s=now_s,
        policy=policy or RoutePolicy(),
    )
