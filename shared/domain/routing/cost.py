"""The route cost of a candidate region: w_rtt*RTT + w_price*price + w_power*power*PUE - w_affinity*affinity.

Each term is normalised over the candidates (divided by the largest value among them; 0 when all
are 0), so the weights trade terms of the same [0, 1] scale against each other.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from shared.domain.routing.regions import Region

# One accelerator at about its TDP (H100/H200 SXM: 700 W): turns USD/kWh into USD/hour.
DEFAULT_POWER_KW = 0.7


@dataclass(frozen=True, slots=True)
class Weights:
    """The product brief's alpha (RTT), beta (price), gamma (power), delta (affinity): finite, >= 0."""

    rtt: float = 0.4
    price: float = 0.3
    power: float = 0.1
    affinity: float = 0.2

    def __post_init__(self) -> None:
        for name in ("rtt", "price", "power", "affinity"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"weight {name} must be a finite number >= 0, got {value}")


@dataclass(frozen=True, slots=True)
class CostTerms:
    """One candidate's normalised terms (each in [0, 1]), its total, and the raw figures behind them."""

    rtt: float
    price: float
    power: float
    affinity: float
    total: float  # weights.rtt*rtt + weights.price*price + weights.power*power - weights.affinity*affinity
    rtt_ms: float
    price_usd_per_hour: float
    power_usd_per_hour: float


def price_of(region: Region, sku: str | None) -> float:
    """The SKU's accelerator-hour price in the region; the region's mean price when the SKU is unknown
    or not sold there."""
    if sku is not None and sku in region.price_usd_per_hour:
        return float(region.price_usd_per_hour[sku])
    return region.mean_price()


def serving_price(region: Region, skus: Collection[str]) -> float:
    """The accelerator-hour price of what serves the request in the region: the cheapest of ``skus`` (the
    SKUs of the replicas that would serve it there) that the region prices; the region's mean price when
    none of them is priced there (or none is known)."""
    known = [float(region.price_usd_per_hour[sku]) for sku in skus if sku in region.price_usd_per_hour]
    return min(known) if known else region.mean_price()


def power_usd_per_hour(region: Region, power_kw: float = DEFAULT_POWER_KW) -> float:
    """What one accelerator drawing ``power_kw`` costs per hour there, facility overhead (PUE) included."""
    return power_kw * region.pue * region.power_usd_per_kwh


def _normalised(values: Mapping[str, float]) -> dict[str, float]:
    top = max(values.values(), default=0.0)
    return {name: (value / top if top > 0 else 0.0) for name, value in values.items()}


def costs(
    candidates: Sequence[Region],
    *,
    origin: Region,
    sku: str | None,
    affinity: Mapping[str, float],
    weights: Weights,
    power_kw: float = DEFAULT_POWER_KW,
    skus: Mapping[str, Collection[str]] | None = None,
) -> dict[str, CostTerms]:
    """Cost terms of each candidate for a request from ``origin`` served on ``sku`` (None: unknown).

    ``skus``: per region, the SKUs that would serve the request there; a region listed prices at the
    cheapest of them (``serving_price``), a region not listed at ``sku``'s price (``price_of``).
    A region missing from ``affinity`` has affinity 0. Lower total is better.
    """
    per_region = skus or {}
    rtt_ms = {r.name: origin.rtt_to(r.name) for r in candidates}
    price = {
        r.name: serving_price(r, per_region[r.name]) if per_region.get(r.name) else price_of(r, sku) for r in candidates
    }
    power = {r.name: power_usd_per_hour(r, power_kw) for r in candidates}
    liking = {r.name: max(0.0, affinity.get(r.name, 0.0)) for r in candidates}
    n_rtt, n_price, n_power, n_affinity = (_normalised(t) for t in (rtt_ms, price, power, liking))
    return {
        name: CostTerms(
            rtt=n_rtt[name],
            price=n_price[name],
            power=n_power[name],
            affinity=n_affinity[name],
            total=(
                weights.rtt * n_rtt[name]
                + weights.price * n_price[name]
                + weights.power * n_power[name]
                - weights.affinity * n_affinity[name]
            ),
            rtt_ms=rtt_ms[name],
            price_usd_per_hour=price[name],
            power_usd_per_hour=power[name],
        )
        for name in rtt_ms
    }
