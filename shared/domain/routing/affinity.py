"""Tenant-to-region affinity from the tenant's routed requests over a sliding window of days.

Traffic is counted per (region, day index) with ``day = floor(now_s / 86400)``; buckets older than
the window stop counting, which is the decay. Pure: ``now_s`` is always the caller's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

SECONDS_PER_DAY = 86_400


@dataclass(frozen=True, slots=True)
class AffinityRule:
    """A region that carried ``dominant_share`` of the window's traffic scores 1; one with none scores
    ``floor``; in between the score rises smoothly (quadratically) with the share."""

    window_days: int = 7
    dominant_share: float = 0.95
    floor: float = 0.1

    def __post_init__(self) -> None:
        if self.window_days < 1:
            raise ValueError(f"window_days must be >= 1, got {self.window_days}")
        if not 0 < self.dominant_share <= 1:
            raise ValueError(f"dominant_share must be in (0, 1], got {self.dominant_share}")
        if not 0 <= self.floor <= 1:
            raise ValueError(f"floor must be in [0, 1], got {self.floor}")

    def first_day(self, now_s: float) -> int:
        """The oldest day index still inside the window ending today."""
        return day_of(now_s) - self.window_days + 1

    def score(self, share: float) -> float:
        """Affinity for a share of traffic: continuous and non-decreasing in ``share``."""
        return self.floor + (1.0 - self.floor) * min(1.0, max(0.0, share) / self.dominant_share) ** 2


def day_of(now_s: float) -> int:
    """Day index of an instant in seconds since the epoch (UTC days)."""
    return math.floor(now_s / SECONDS_PER_DAY)


class Traffic:
    """A tenant's routed requests per (region, day): mutable and small (regions x window days)."""

    __slots__ = ("_counts",)

    def __init__(self, counts: Mapping[tuple[str, int], int] | None = None) -> None:
        self._counts: dict[tuple[str, int], int] = {}
        for (region, day), n in (counts or {}).items():
            if n < 0:
                raise ValueError(f"traffic count for {region} on day {day} is negative: {n}")
            if n:
                self._counts[(region, day)] = self._counts.get((region, day), 0) + n

    def add(self, region: str, now_s: float, n: int = 1) -> None:
        """Count ``n`` requests routed to ``region`` at ``now_s``."""
        if n < 0:
            raise ValueError(f"cannot add a negative number of requests: {n}")
        if n:
            key = (region, day_of(now_s))
            self._counts[key] = self._counts.get(key, 0) + n

    def shares(self, now_s: float, rule: AffinityRule = AffinityRule()) -> dict[str, float]:
        """Each region's share of the requests inside the window (regions with none are absent; empty
        when the window holds no request)."""
        first, today = rule.first_day(now_s), day_of(now_s)
        per_region: dict[str, int] = {}
        for (region, day), n in self._counts.items():
            if first <= day <= today:
                per_region[region] = per_region.get(region, 0) + n
        total = sum(per_region.values())
        if total == 0:
            return {}
        return {region: n / total for region, n in sorted(per_region.items())}

    def prune(self, now_s: float, rule: AffinityRule = AffinityRule()) -> None:
        """Drop the buckets that fell out of the window (they no longer count anyway)."""
        first = rule.first_day(now_s)
        for key in [key for key in self._counts if key[1] < first]:
            del self._counts[key]

    def items(self) -> Iterable[tuple[tuple[str, int], int]]:
        """The non-empty buckets, ordered by region then day (for storing and events)."""
        return sorted(self._counts.items())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Traffic) and self._counts == other._counts

    __hash__ = None  # type: ignore[assignment]  # mutable

    def __repr__(self) -> str:
        return f"Traffic({dict(self.items())!r})"


def affinity(
    traffic: Traffic, regions: Iterable[str], now_s: float, rule: AffinityRule = AffinityRule()
) -> dict[str, float]:
    """Affinity in [floor, 1] of the tenant for each region; 0 everywhere when the tenant sent nothing
    inside the window (no preference)."""
    shares = traffic.shares(now_s, rule)
    if not shares:
        return {region: 0.0 for region in regions}
    return {region: rule.score(shares.get(region, 0.0)) for region in regions}
