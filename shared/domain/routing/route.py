"""Choosing the region for one request: affinity, then a cheaper acceptable region when the affinity
region cannot take it, then any region with capacity (SLO relaxed); damped per tenant, sticky per
in-flight session.

Order of the rules in ``choose``:

1. An in-flight session stays in its region while that region is not down (drain and full included).
2. The fresh choice: the affinity region while it is up with capacity; else, when it is full, draining
   or down, the cost tier (an up region with capacity within ``cost_rtt_slack_ms`` of the affinity
   region's RTT and at least ``cost_saving`` cheaper than it, the lowest total cost among them); else the
   fallback tier (lowest total cost among up regions with capacity, TTFT SLO relaxed); else no region.
3. Damping: a tenant whose current region is up with capacity and who switched less than
   ``damping_s`` ago keeps that region instead of the fresh choice.

A region's price is the accelerator-hour price of the SKU that would serve the request there
(``RouteAsk.skus``; the cheapest when several do), else of ``RouteAsk.sku``, else the region's mean.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from shared.domain.routing.affinity import AffinityRule, Traffic, affinity
from shared.domain.routing.cost import CostTerms, Weights, costs, price_of, serving_price
from shared.domain.routing.regions import Region


class RegionState(StrEnum):
    UP = "up"
    DRAIN = "drain"  # no new tenants or sessions; in-flight sessions stay
    DOWN = "down"


class Tier(StrEnum):
    AFFINITY = "affinity"
    COST = "cost"
    FALLBACK = "fallback"


@dataclass(frozen=True, slots=True)
class RoutePolicy:
    weights: Weights = field(default_factory=Weights)
    damping_s: float = 1800.0
    cost_rtt_slack_ms: float = 20.0
    cost_saving: float = 0.30
    fallback_ttft_ms: float = 500.0
    affinity: AffinityRule = field(default_factory=AffinityRule)

    def __post_init__(self) -> None:
        if self.damping_s < 0 or self.cost_rtt_slack_ms < 0 or self.fallback_ttft_ms <= 0:
            raise ValueError("damping_s and cost_rtt_slack_ms must be >= 0, fallback_ttft_ms > 0")
        if not 0 <= self.cost_saving < 1:
            raise ValueError(f"cost_saving must be in [0, 1), got {self.cost_saving}")


@dataclass(frozen=True, slots=True)
class TenantRoute:
    """What the router remembers of a tenant: its region and when it last switched there."""

    region: str
    switched_at_s: float


@dataclass(frozen=True, slots=True)
class SessionRoute:
    """What the router remembers of a session: its region and whether a stream is open there."""

    region: str
    in_flight: bool


@dataclass(frozen=True, slots=True)
class RouteAsk:
    """One request to route: who sends it, from which region, served on which SKU (None: unknown);
    ``in_flight``: it continues a stream of its session. ``skus``: per region, the SKUs of the replicas
    that would serve it there; a region listed is priced at the cheapest of them, one not listed at
    ``sku``'s price (the region's mean when ``sku`` is None or not sold there)."""

    tenant: str
    origin: str
    sku: str | None
    in_flight: bool
    skus: Mapping[str, tuple[str, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RouteDecision:
    region: str | None  # None: rejected
    tier: Tier | None
    switched: bool  # the tenant's region changed (never on its first route, never for a held session)
    cost: CostTerms | None  # of the chosen region
    rtt_ms: float | None  # origin -> chosen region
    relaxed_ttft_ms: float | None  # set on the fallback tier: the TTFT p99 SLO the caller should apply
    reason: str  # one line: why this region, or why none
    kept_by: str | None  # "session" | "damping" | None: what held the region in place


KEPT_BY_SESSION = "session"
KEPT_BY_DAMPING = "damping"


@dataclass(frozen=True, slots=True)
class _Choice:
    region: str
    tier: Tier
    why: str


class _View:
    """The facts of one decision: region states, capacity, affinity, costs over the candidates."""

    def __init__(
        self,
        ask: RouteAsk,
        *,
        regions: Mapping[str, Region],
        states: Mapping[str, RegionState],
        capacity: Callable[[str], bool] | Mapping[str, bool],
        traffic: Traffic,
        now_s: float,
        policy: RoutePolicy,
    ) -> None:
        if ask.origin not in regions:
            raise ValueError(f"unknown origin region {ask.origin!r}; known: {sorted(regions)}")
        self.ask, self.regions, self.policy = ask, regions, policy
        self.origin = regions[ask.origin]
        self._states = states
        self._capacity = capacity
        self.affinity = affinity(traffic, regions, now_s, policy.affinity)
        self.has_history = any(score > 0 for score in self.affinity.values())
        self.eligible = [name for name in sorted(regions) if self.open(name)]
        self.affinity_region = self._affinity_region()
        self.costs = self.costs_over(self.eligible)

    def state(self, name: str) -> RegionState:
        if name not in self.regions:
            return RegionState.DOWN  # a region gone from the catalog is as good as down
        return RegionState(self._states.get(name, RegionState.UP))

    def has_capacity(self, name: str) -> bool:
        if isinstance(self._capacity, Mapping):
            return bool(self._capacity.get(name, False))
        return bool(self._capacity(name))

    def open(self, name: str) -> bool:
        """Up (not draining, not down) and able to take this request."""
        return self.state(name) is RegionState.UP and self.has_capacity(name)

    def condition(self, name: str) -> str:
        state = self.state(name)
        if state is RegionState.DOWN:
            return "down"
        if state is RegionState.DRAIN:
            return "draining"
        return "full" if not self.has_capacity(name) else "up"

    def rtt_ms(self, name: str) -> float:
        return self.origin.rtt_to(name)

    def price(self, name: str) -> float:
        serving = self.ask.skus.get(name)
        region = self.regions[name]
        return serving_price(region, serving) if serving else price_of(region, self.ask.sku)

    def costs_over(self, names: list[str]) -> dict[str, CostTerms]:
        return costs(
            [self.regions[name] for name in names],
            origin=self.origin,
            sku=self.ask.sku,
            affinity=self.affinity,
            weights=self.policy.weights,
            skus=self.ask.skus,
        )

    def _affinity_region(self) -> str:
        # Highest affinity. Without history: the nearest region to the origin that can take the request (a
        # new tenant entering where nothing serves its model is not a "full home region" to fall back from),
        # else the nearest. Ties: nearer, then by name.
        def key(name: str) -> tuple[float, float, str]:
            return (-self.affinity[name] if self.has_history else 0.0, self.rtt_ms(name), name)

        if not self.has_history and self.eligible:
            return min(self.eligible, key=key)
        return min(self.regions, key=key)

    def cheaper_acceptable(self, name: str) -> bool:
        """Near enough (RTT within the slack of the affinity region's) and cheap enough (the saving)."""
        home = self.affinity_region
        return (
            name != home
            and self.rtt_ms(name) <= self.rtt_ms(home) + self.policy.cost_rtt_slack_ms
            and self.price(name) <= (1.0 - self.policy.cost_saving) * self.price(home)
        )

    def tier_of(self, name: str) -> Tier:
        """The tier reported for a region held in place (by damping or a session): it was chosen before,
        by a tier this decision does not know; "affinity" when it is the affinity region, else "cost"
        (never "fallback": holding a region does not relax its SLO)."""
        return Tier.AFFINITY if name == self.affinity_region else Tier.COST


def _fresh_choice(view: _View) -> _Choice | None:
    home = view.affinity_region
    if home in view.costs:  # up with capacity
        why = (
            f"affinity region (affinity {view.affinity[home]:.2f})"
            if view.has_history
            else f"no traffic in the last {view.policy.affinity.window_days} days: nearest region to {view.ask.origin}"
        )
        return _Choice(home, Tier.AFFINITY, f"{why}, RTT {view.rtt_ms(home):g} ms, up with capacity")
    # The affinity region is full, draining or down: a cheaper region near enough, else any region.
    cheaper = [name for name in view.eligible if view.cheaper_acceptable(name)]
    if cheaper:
        best = min(cheaper, key=lambda name: (view.costs[name].total, name))
        saving = 1.0 - view.price(best) / view.price(home) if view.price(home) > 0 else 0.0
        return _Choice(
            best,
            Tier.COST,
            f"affinity region {home} is {view.condition(home)}; {saving:.0%} cheaper than it "
            f"({view.price(best):.2f} vs {view.price(home):.2f} USD/h), RTT {view.rtt_ms(best):g} ms within "
            f"{home}'s {view.rtt_ms(home):g} + {view.policy.cost_rtt_slack_ms:g} ms, "
            f"total cost {view.costs[best].total:.3f}",
        )
    if view.eligible:
        best = min(view.eligible, key=lambda name: (view.costs[name].total, name))
        return _Choice(
            best,
            Tier.FALLBACK,
            f"fallback: affinity region {home} is {view.condition(home)} and no cheaper region within reach; "
            f"lowest total cost {view.costs[best].total:.3f} among up regions with capacity, "
            f"TTFT SLO relaxed to {view.policy.fallback_ttft_ms:g} ms p99",
        )
    return None


def _decision(
    view: _View,
    region: str,
    tier: Tier,
    *,
    tenant: TenantRoute | None,
    reason: str,
    kept_by: str | None,
    cost: CostTerms | None = None,
) -> RouteDecision:
    return RouteDecision(
        region=region,
        tier=tier,
        # A held session is not the tenant moving: the tenant's own route is unchanged.
        switched=kept_by != KEPT_BY_SESSION and tenant is not None and tenant.region != region,
        cost=cost if cost is not None else view.costs.get(region),
        rtt_ms=view.rtt_ms(region),
        relaxed_ttft_ms=view.policy.fallback_ttft_ms if tier is Tier.FALLBACK else None,
        reason=f"{region}: {reason}",
        kept_by=kept_by,
    )


def choose(
    ask: RouteAsk,
    *,
    regions: Mapping[str, Region],
    states: Mapping[str, RegionState],
    capacity: Callable[[str], bool] | Mapping[str, bool],
    tenant: TenantRoute | None,
    session: SessionRoute | None,
    traffic: Traffic,
    now_s: float,
    policy: RoutePolicy = RoutePolicy(),
) -> RouteDecision:
    """The region for one request, the tier that chose it, and why.

    ``states``: regions missing are up. ``capacity``: whether a region can take this request (a mapping
    missing a region means no). ``tenant``/``session``: what the router remembers (None: first time).
    ``traffic``: the tenant's routed requests, for affinity. Raises ValueError for an unknown origin.
    A session is held in place when it or the ask is in flight.
    """
    view = _View(ask, regions=regions, states=states, capacity=capacity, traffic=traffic, now_s=now_s, policy=policy)

    if (
        session is not None
        and (session.in_flight or ask.in_flight)
        and view.state(session.region) is not RegionState.DOWN
    ):
        held = session.region
        tier = view.tier_of(held)
        cost = view.costs.get(held) or view.costs_over([*view.eligible, held])[held]
        return _decision(
            view,
            held,
            tier,
            tenant=tenant,
            reason=f"in-flight session stays in its region ({view.condition(held)}), {tier} tier",
            kept_by=KEPT_BY_SESSION,
            cost=cost,
        )

    fresh = _fresh_choice(view)
    if (
        tenant is not None
        and (fresh is None or fresh.region != tenant.region)
        and view.open(tenant.region)
        and now_s - tenant.switched_at_s < policy.damping_s
    ):
        instead = f"; {fresh.region} ({fresh.tier}) would be chosen" if fresh is not None else ""
        return _decision(
            view,
            tenant.region,
            view.tier_of(tenant.region),
            tenant=tenant,
            reason=(
                f"kept by damping: the tenant moved here {now_s - tenant.switched_at_s:g} s ago, "
                f"less than {policy.damping_s:g} s{instead}"
            ),
            kept_by=KEPT_BY_DAMPING,
        )

    if fresh is None:
        conditions = ", ".join(f"{name} {view.condition(name)}" for name in sorted(regions))
        return RouteDecision(
            region=None,
            tier=None,
            switched=False,
            cost=None,
            rtt_ms=None,
            relaxed_ttft_ms=None,
            reason=f"no region can take the request: {conditions}",
            kept_by=None,
        )
    return _decision(view, fresh.region, fresh.tier, tenant=tenant, reason=fresh.why, kept_by=None)


def next_tenant_route(previous: TenantRoute | None, decision: RouteDecision, now_s: float) -> TenantRoute | None:
    """What to remember of the tenant after ``decision``: unchanged when it stays in its region (the
    switch time kept), when the request was rejected, or when only a session was held; a new route
    stamped ``now_s`` on the first route or a switch."""
    if decision.region is None or decision.kept_by == KEPT_BY_SESSION:
        return previous
    if previous is not None and previous.region == decision.region:
        return previous
    return TenantRoute(region=decision.region, switched_at_s=now_s)
