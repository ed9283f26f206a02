"""Regions the cross-region router chooses between: their GPU-hour prices, power price, PUE and the
round-trip times between them (``shared/catalog/regions.yaml``)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from shared.domain.hardware import CatalogError

# Published inter-region RTT tables are symmetric to within noise; more than this is a typo.
RTT_SYMMETRY_TOLERANCE_MS = 1.0


@dataclass(frozen=True, slots=True)
class Region:
    """One region's figures. ``rtt_ms`` holds every other region (the parser guarantees it)."""

    name: str
    pue: float
    power_usd_per_kwh: float
    price_usd_per_hour: Mapping[str, float]  # per accelerator-hour, by SKU name as in skus.yaml
    rtt_ms: Mapping[str, float]  # to every other region; to itself 0 when absent
    source: str = ""
    # Worked out once: every route decision asks for it, for every candidate region.
    _mean_price: float = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        prices = self.price_usd_per_hour
        object.__setattr__(self, "_mean_price", sum(prices.values()) / len(prices) if prices else 0.0)

    def rtt_to(self, other: str) -> float:
        """Round trip to ``other`` in ms: 0 to itself; KeyError for a region this one does not know."""
        if other == self.name:
            return float(self.rtt_ms.get(other, 0.0))
        return float(self.rtt_ms[other])

    def mean_price(self) -> float:
        """Mean accelerator-hour price over the SKUs sold here (when the serving SKU is unknown); 0 if none."""
        return self._mean_price


def _number(value: Any, where: str, *, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < minimum:
        raise CatalogError(f"{where}: expected a number >= {minimum:g}, got {value!r}")
    return float(value)


def _table(entry: Mapping[str, Any], key: str, where: str) -> dict[str, float]:
    table = entry.get(key)
    if not isinstance(table, Mapping):
        raise CatalogError(f"{where}.{key}: expected a mapping, got {table!r}")
    return {str(name): _number(value, f"{where}.{key}.{name}") for name, value in table.items()}


def _region(name: str, entry: Any) -> Region:
    where = f"regions.{name}"
    if not isinstance(entry, Mapping):
        raise CatalogError(f"{where}: expected a mapping, got {entry!r}")
    for key in ("pue", "power_usd_per_kwh", "price_usd_per_hour", "rtt_ms"):
        if key not in entry:
            raise CatalogError(f"{where}: missing field `{key}`")
    prices = _table(entry, "price_usd_per_hour", where)
    if not prices:
        raise CatalogError(f"{where}.price_usd_per_hour: no SKU prices")
    source = entry.get("source", "")
    if not isinstance(source, str):
        raise CatalogError(f"{where}.source: expected a string, got {source!r}")
    return Region(
        name=name,
        # PUE is total facility power over IT power: below 1 is physically impossible.
        pue=_number(entry["pue"], f"{where}.pue", minimum=1.0),
        power_usd_per_kwh=_number(entry["power_usd_per_kwh"], f"{where}.power_usd_per_kwh"),
        price_usd_per_hour=prices,
        rtt_ms=_table(entry, "rtt_ms", where),
        source=source,
    )


def _check_rtt_matrix(regions: Mapping[str, Region]) -> None:
    for name, region in regions.items():
        unknown = sorted(set(region.rtt_ms) - set(regions))
        if unknown:
            raise CatalogError(f"regions.{name}.rtt_ms: unknown regions {unknown}")
        if region.rtt_ms.get(name, 0.0) != 0.0:
            raise CatalogError(f"regions.{name}.rtt_ms.{name}: the round trip to itself must be 0")
        for other in regions:
            if other == name:
                continue
            if other not in region.rtt_ms:
                raise CatalogError(f"regions.{name}.rtt_ms: missing the round trip to {other}")
            back = regions[other].rtt_ms.get(name)
            there = region.rtt_ms[other]
            if back is not None and abs(there - back) > RTT_SYMMETRY_TOLERANCE_MS:
                raise CatalogError(
                    f"regions.{name}.rtt_ms.{other} = {there:g} but regions.{other}.rtt_ms.{name} = {back:g}: "
                    f"round trips must agree within {RTT_SYMMETRY_TOLERANCE_MS:g} ms"
                )


def parse_regions(doc: Any) -> dict[str, Region]:
    """Regions from a catalog document (``{"regions": {NAME: {...}}}``); raises CatalogError naming the field.

    Every region must give a PUE >= 1, a non-negative power price, at least one SKU price and a round
    trip to every other region that agrees with the other region's figure within 1 ms.
    """
    if not isinstance(doc, Mapping):
        raise CatalogError(f"regions catalog: expected a mapping, got {type(doc).__name__}")
    entries = doc.get("regions")
    if not isinstance(entries, Mapping) or not entries:
        raise CatalogError("regions catalog: expected a non-empty mapping under `regions`")
    regions: dict[str, Region] = {}
    for name, entry in entries.items():
        if not isinstance(name, str) or not name:
            raise CatalogError(f"regions: a region name must be a non-empty string, got {name!r}")
        regions[name] = _region(name, entry)
    _check_rtt_matrix(regions)
    return regions
