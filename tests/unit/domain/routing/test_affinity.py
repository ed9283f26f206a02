"""Affinity from a 7-day window of the tenant's traffic: dominant region 1.0, none 0.1, smooth in
between, 0 everywhere without traffic; traffic older than the window stops counting."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.domain.routing import AffinityRule, Traffic, affinity, day_of
from tests.unit.domain.routing.builders import DAY, T0

REGIONS = ("east", "west", "eu")
RULE = AffinityRule()


def traffic(**per_region: int) -> Traffic:
    t = Traffic()
    for name, n in per_region.items():
        t.add(name, T0, n)
    return t


def test_the_dominant_region_scores_one_and_a_region_without_traffic_the_floor() -> None:
    scores = affinity(traffic(east=95, west=5), REGIONS, T0)
    assert scores["east"] == 1.0  # 95% >= dominant share
    assert scores["eu"] == 0.1  # none
    # west: 0.1 + 0.9 * (0.05 / 0.95)**2 = 0.1 + 0.9 * 0.00277 = 0.10249
    assert scores["west"] == pytest.approx(0.10249, abs=1e-5)


def test_a_split_tenant_scores_in_between() -> None:
    scores = affinity(traffic(east=60, west=40), REGIONS, T0)
    # east: 0.1 + 0.9 * (0.6 / 0.95)**2 = 0.45900; west: 0.1 + 0.9 * (0.4 / 0.95)**2 = 0.25956
    assert scores["east"] == pytest.approx(0.45900, abs=1e-5)
    assert scores["west"] == pytest.approx(0.25956, abs=1e-5)


def test_no_traffic_means_no_preference() -> None:
    assert affinity(Traffic(), REGIONS, T0) == {"east": 0.0, "west": 0.0, "eu": 0.0}


def test_traffic_to_a_region_not_asked_about_still_dilutes_the_shares() -> None:
    scores = affinity(traffic(east=50, gone=50), ("east",), T0)
    assert scores == {"east": pytest.approx(0.1 + 0.9 * (0.5 / 0.95) ** 2)}


@given(st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_the_score_is_monotone_and_continuous_in_the_share(a: float, b: float) -> None:
    low, high = sorted((a, b))
    assert RULE.floor <= RULE.score(low) <= RULE.score(high) <= 1.0
    # Lipschitz: the steepest slope is 2 * 0.9 / 0.95 = 1.895 (at the dominant share), so no jumps.
    assert RULE.score(high) - RULE.score(low) <= 1.895 * (high - low) + 1e-12


def test_the_score_reaches_one_exactly_at_the_dominant_share() -> None:
    assert RULE.score(0.95) == 1.0 and RULE.score(1.0) == 1.0
    assert RULE.score(0.9499) < 1.0 and RULE.score(0.0) == 0.1


def test_traffic_eight_days_old_no_longer_counts() -> None:
    t = traffic(east=1000)
    assert affinity(t, REGIONS, T0)["east"] == 1.0
    later = T0 + 8 * DAY
    assert affinity(t, REGIONS, later) == {"east": 0.0, "west": 0.0, "eu": 0.0}  # back to no preference
    t.add("eu", later, 1)
    scores = affinity(t, REGIONS, later)
    assert scores["eu"] == 1.0 and scores["east"] == 0.1  # a single new request outweighs the old thousand


def test_the_window_is_today_and_the_six_days_before() -> None:
    today = day_of(T0)
    t = Traffic({("east", today - 6): 10, ("west", today - 7): 90})
    assert t.shares(T0) == {"east": 1.0}  # day today-6 is inside; today-7 fell out at midnight
    next_midnight = (today + 1) * DAY
    assert t.shares(next_midnight - 0.001) == {"east": 1.0}
    assert t.shares(next_midnight) == {}  # from the next midnight, today-6 is 7 days back
    assert Traffic({("east", today - 2): 1}).shares(T0, AffinityRule(window_days=2)) == {}


def test_shares_and_prune() -> None:
    today = day_of(T0)
    t = Traffic({("east", today): 3, ("west", today - 1): 1, ("eu", today - 9): 50})
    assert t.shares(T0) == {"east": 0.75, "west": 0.25}
    t.prune(T0)
    assert list(t.items()) == [(("east", today), 3), (("west", today - 1), 1)]
    assert t == Traffic({("west", today - 1): 1, ("east", today): 3})


def test_add_counts_per_region_and_day() -> None:
    t = Traffic()
    t.add("east", T0)
    t.add("east", T0 + 60, 2)
    t.add("east", T0 + DAY)
    t.add("west", T0, 0)  # nothing to count: no empty bucket
    assert list(t.items()) == [(("east", day_of(T0)), 3), (("east", day_of(T0) + 1), 1)]
    with pytest.raises(ValueError):
        t.add("east", T0, -1)
    with pytest.raises(ValueError):
        Traffic({("east", 1): -5})


def test_day_of() -> None:
    assert (day_of(0), day_of(DAY - 0.001), day_of(DAY), day_of(-1)) == (0, 0, 1, -1)


@pytest.mark.parametrize(
    "kwargs", [{"window_days": 0}, {"dominant_share": 0.0}, {"dominant_share": 1.5}, {"floor": -0.1}, {"floor": 2}]
)
def test_a_nonsense_rule_is_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        AffinityRule(**kwargs)  # type: ignore[arg-type]
