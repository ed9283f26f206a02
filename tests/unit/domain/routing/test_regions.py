"""parse_regions: the shipped catalog parses and is usable; every malformed entry is a CatalogError."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from shared.domain.hardware import CatalogError
from shared.domain.routing import Region, RegionState, RouteAsk, Tier, parse_regions, price_of, serving_price
from tests.unit.domain.routing.builders import H100, ask, route, traffic_in

CATALOG = Path(__file__).resolve().parents[4] / "shared" / "catalog"


def shipped() -> dict[str, Region]:
    return parse_regions(yaml.safe_load((CATALOG / "regions.yaml").read_text()))


def test_the_shipped_catalog_parses_with_three_regions() -> None:
    regions = shipped()
    assert sorted(regions) == ["eu-west-1", "us-east-1", "us-west-1"]
    for region in regions.values():
        assert region.source, region.name


def test_the_shipped_catalog_prices_every_sku_in_every_region() -> None:
    skus = set(yaml.safe_load((CATALOG / "skus.yaml").read_text())["skus"])
    for region in shipped().values():
        assert set(region.price_usd_per_hour) == skus, region.name


def test_the_demo_fleet_regions_are_in_the_catalog() -> None:
    fleet = yaml.safe_load((CATALOG / "demo_fleet.yaml").read_text())
    assert {r["name"] for r in fleet["regions"]} <= set(shipped())


def test_the_shipped_figures_show_the_differences_the_router_works_with() -> None:
    regions = shipped()
    west, east, eu = regions["us-west-1"], regions["us-east-1"], regions["eu-west-1"]
    assert east.power_usd_per_kwh < west.power_usd_per_kwh
    assert eu.price_usd_per_hour[H100] <= 0.7 * east.price_usd_per_hour[H100]
    assert all(1.0 <= r.pue < 1.6 for r in regions.values())
    assert west.rtt_to("us-west-1") == 0.0
    assert west.rtt_to("eu-west-1") == eu.rtt_to("us-west-1")


def test_the_cost_tier_can_be_seen_with_the_shipped_figures() -> None:
    # A European user of a tenant whose traffic goes to us-east-1: while us-east-1 has room it serves
    # (affinity first); when it is full, eu-west-1 is near enough (0 ms) and >= 30% cheaper on H100.
    home = route(ask("eu-west-1"), regions=shipped(), traffic=traffic_in("us-east-1"))
    assert (home.region, home.tier) == ("us-east-1", Tier.AFFINITY)
    decision = route(ask("eu-west-1"), regions=shipped(), traffic=traffic_in("us-east-1"), full=("us-east-1",))
    assert (decision.region, decision.tier) == ("eu-west-1", Tier.COST)
    assert decision.cost is not None and decision.cost.price_usd_per_hour == 2.70
    # From us-east-1 itself eu-west-1 is 68 ms away, beyond 0 + 20 ms: a full or drained home falls back.
    full = route(ask("us-east-1"), regions=shipped(), traffic=traffic_in("us-east-1"), full=("us-east-1",))
    assert full.tier is Tier.FALLBACK
    drained = route(
        ask("us-east-1"), regions=shipped(), traffic=traffic_in("us-east-1"), states={"us-east-1": RegionState.DRAIN}
    )
    assert drained.tier is Tier.FALLBACK and drained.region in {"us-west-1", "eu-west-1"}


def test_with_the_shipped_figures_the_serving_sku_decides_not_the_regions_mean() -> None:
    # The regions' means over every SKU are only ~12% apart: without a known SKU the cost tier does not
    # fire; with the SKU each region serves the model on (H100 in both), it does, at H100's prices.
    regions = shipped()
    unknown = route(ask("eu-west-1", sku=None), regions=regions, traffic=traffic_in("us-east-1"), full=("us-east-1",))
    assert unknown.tier is Tier.FALLBACK
    assert unknown.cost is not None and unknown.cost.price_usd_per_hour == regions["eu-west-1"].mean_price()
    by_region = {"us-east-1": (H100,), "eu-west-1": (H100,), "us-west-1": (H100,)}
    served = route(
        RouteAsk(tenant="acme", origin="eu-west-1", sku=None, in_flight=False, skus=by_region),
        regions=regions,
        traffic=traffic_in("us-east-1"),
        full=("us-east-1",),
    )
    assert (served.region, served.tier) == ("eu-west-1", Tier.COST)
    assert served.cost is not None and served.cost.price_usd_per_hour == 2.70
    assert "(2.70 vs 4.00 USD/h)" in served.reason


def test_region_helpers() -> None:
    region = Region("r", pue=1.1, power_usd_per_kwh=0.1, price_usd_per_hour={"a": 1.0, "b": 3.0}, rtt_ms={"s": 12})
    assert region.rtt_to("r") == 0.0 and region.rtt_to("s") == 12.0
    assert region.mean_price() == 2.0  # (1 + 3) / 2
    assert price_of(region, "b") == 3.0 and price_of(region, None) == 2.0 and price_of(region, "zzz") == 2.0
    # What serves the request: the cheapest SKU priced there; the mean when none of them is.
    assert serving_price(region, ("b", "a")) == 1.0 and serving_price(region, ("b", "zzz")) == 3.0
    assert serving_price(region, ("zzz",)) == 2.0 and serving_price(region, ()) == 2.0
    with pytest.raises(KeyError):
        region.rtt_to("unknown")


def good() -> dict[str, Any]:
    return {
        "regions": {
            "a": {"pue": 1.1, "power_usd_per_kwh": 0.1, "price_usd_per_hour": {H100: 4.0}, "rtt_ms": {"b": 10}},
            "b": {"pue": 1.2, "power_usd_per_kwh": 0.2, "price_usd_per_hour": {H100: 3.0}, "rtt_ms": {"a": 10.5}},
        }
    }


def test_a_small_good_document_parses() -> None:
    regions = parse_regions(good())
    assert regions["a"].rtt_to("b") == 10.0 and regions["b"].rtt_to("a") == 10.5  # within 1 ms: accepted
    assert regions["b"].pue == 1.2 and regions["a"].source == ""


def _with(path: tuple[str, ...], value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(good())
    node = doc
    for key in path[:-1]:
        node = node[key]
    if value is _DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


_DELETE = object()


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([1, 2], "expected a mapping"),
        ({"skus": {}}, "under `regions`"),
        ({"regions": {}}, "under `regions`"),
        (_with(("regions", "a"), "fast"), "regions.a: expected a mapping"),
        (_with(("regions", "a", "pue"), _DELETE), "missing field `pue`"),
        (_with(("regions", "a", "rtt_ms"), _DELETE), "missing field `rtt_ms`"),
        (_with(("regions", "a", "pue"), 0.9), "regions.a.pue"),
        (_with(("regions", "a", "pue"), "1.1"), "regions.a.pue"),
        (_with(("regions", "a", "power_usd_per_kwh"), -0.1), "regions.a.power_usd_per_kwh"),
        (_with(("regions", "a", "power_usd_per_kwh"), float("nan")), "regions.a.power_usd_per_kwh"),
        (_with(("regions", "a", "price_usd_per_hour"), 4.0), "regions.a.price_usd_per_hour"),
        (_with(("regions", "a", "price_usd_per_hour"), {}), "no SKU prices"),
        (_with(("regions", "a", "price_usd_per_hour", H100), -1), f"price_usd_per_hour.{H100}"),
        (_with(("regions", "a", "price_usd_per_hour", H100), True), f"price_usd_per_hour.{H100}"),
        (_with(("regions", "a", "rtt_ms"), {}), "missing the round trip to b"),
        (_with(("regions", "a", "rtt_ms", "b"), 15), "must agree within 1 ms"),
        (_with(("regions", "a", "rtt_ms", "c"), 5), "unknown regions ['c']"),
        (_with(("regions", "a", "rtt_ms", "a"), 3), "round trip to itself must be 0"),
        (_with(("regions", "a", "rtt_ms", "b"), -10), "regions.a.rtt_ms.b"),
        (_with(("regions", "a", "source"), 7), "regions.a.source"),
    ],
)
def test_bad_documents_are_refused_naming_the_field(doc: Any, message: str) -> None:
    with pytest.raises(CatalogError) as error:
        parse_regions(doc)
    assert message in str(error.value)
