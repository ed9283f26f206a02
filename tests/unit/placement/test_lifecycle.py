"""A replica's lifecycle from its ranks (shared/domain/placement/lifecycle.py): the fold's rules, the latest
report per rank winning whatever order reports arrive in, staleness, the head's endpoint, renewal timing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.domain.placement.lifecycle import (
    ORDER,
    RankReport,
    alive,
    fold,
    fresh,
    head_endpoint,
    latest,
    record,
    renew_due,
)
from shared.domain.placement.listing import ReplicaState, StateFilter, state_filter


def ranks(*states: str, at_ms: float = 1000.0, endpoint: str | None = None) -> dict[int, RankReport]:
    n = len(states)
    return {
        i: RankReport(rank=i, ranks=n, state=s, at_ms=at_ms, endpoint=endpoint if i == 0 else None)
        for i, s in enumerate(states)
    }


@pytest.mark.parametrize(
    ("states", "draining", "expected"),
    [
        (("ready",), False, ReplicaState.READY),
        (("ready", "ready"), False, ReplicaState.READY),
        (("ready", "failed"), False, ReplicaState.FAILED),
        (("draining", "failed"), True, ReplicaState.FAILED),  # failed wins over everything
        (("stopped", "stopped"), False, ReplicaState.STOPPED),
        (("stopped", "ready"), False, ReplicaState.DRAINING),  # going away: some ranks stopped
        (("ready", "draining"), False, ReplicaState.DRAINING),
        (("ready", "ready"), True, ReplicaState.DRAINING),  # the rebalancer's word
        (("ready", "loading"), False, ReplicaState.LOADING),
        (("loading", "starting"), False, ReplicaState.STARTING),  # the least advanced
        (("starting",), False, ReplicaState.STARTING),
        (("loading",), False, ReplicaState.LOADING),
    ],
)
def test_the_fold(states: tuple[str, ...], draining: bool, expected: ReplicaState) -> None:
    assert fold(ranks(*states), draining=draining) is expected


def test_no_report_leaves_the_state_to_the_engine_rule() -> None:
    assert fold({}, draining=False) is None
    assert fold({}, draining=True) is None


def test_a_rank_not_heard_from_counts_as_starting() -> None:
    only_head = {0: RankReport(rank=0, ranks=2, state="ready", at_ms=1.0)}
    assert fold(only_head, draining=False) is ReplicaState.STARTING
    both = record(only_head, RankReport(rank=1, ranks=2, state="ready", at_ms=2.0))
    assert fold(both, draining=False) is ReplicaState.READY
    # one rank stopped of two, the other never heard: not every rank stopped
    half = {0: RankReport(rank=0, ranks=2, state="stopped", at_ms=1.0)}
    assert fold(half, draining=False) is ReplicaState.DRAINING


def test_the_latest_report_of_a_rank_wins() -> None:
    early = RankReport(rank=0, ranks=1, state="loading", at_ms=1.0)
    late = RankReport(rank=0, ranks=1, state="ready", at_ms=2.0, endpoint="http://n:8000")
    assert record(record({}, late), early) == {0: late}  # a late arrival of an older report changes nothing
    assert record(record({}, early), late) == {0: late}


def test_stale_reports_count_as_absent() -> None:
    reports = ranks("ready", "ready", at_ms=1000.0)
    assert fresh(reports, now_ms=3000.0, stale_ms=2000.0) == reports
    assert fresh(reports, now_ms=3001.0, stale_ms=2000.0) == {}
    assert fold(fresh(reports, now_ms=3001.0, stale_ms=2000.0), draining=False) is None


def test_the_endpoint_is_the_heads_from_ready_on() -> None:
    up = ranks("ready", "ready", endpoint="http://10.0.0.7:8100")
    assert head_endpoint(up, fold(up, draining=False)) == "http://10.0.0.7:8100"
    assert head_endpoint(up, ReplicaState.DRAINING) == "http://10.0.0.7:8100"
    loading = ranks("ready", "loading", endpoint="http://10.0.0.7:8100")
    assert head_endpoint(loading, fold(loading, draining=False)) is None
    assert head_endpoint({}, None) is None


def test_alive_ranks_keep_the_lease() -> None:
    assert alive(ranks("starting"))
    assert alive(ranks("ready", "draining"))
    assert not alive(ranks("stopped"))
    assert not alive(ranks("ready", "failed"))
    assert not alive({})


def test_renewal_when_less_than_half_the_lease_is_left() -> None:
    assert not renew_due(expires_at_ms=10_000, lease_ms=10_000, now_ms=4_999)
    assert renew_due(expires_at_ms=10_000, lease_ms=10_000, now_ms=5_001)
    assert renew_due(expires_at_ms=None, lease_ms=10_000, now_ms=0)


def test_the_state_filter_takes_the_reported_states() -> None:
    reported = {"a": ReplicaState.LOADING, "b": ReplicaState.FAILED, "c": ReplicaState.READY}
    kw = {"draining": {"d"}, "serving": {"e"}, "reported": reported}
    assert state_filter(ReplicaState.LOADING, **kw) == StateFilter(only=frozenset({"a"}))
    assert state_filter(ReplicaState.FAILED, **kw) == StateFilter(only=frozenset({"b"}))
    assert state_filter(ReplicaState.READY, **kw) == StateFilter(only=frozenset({"c", "e"}))
    assert state_filter(ReplicaState.DRAINING, **kw) == StateFilter(only=frozenset({"d"}))
    assert state_filter(ReplicaState.PLACED, **kw) == StateFilter(excluding=frozenset({"a", "b", "c", "d", "e"}))


report = st.builds(
    RankReport,
    rank=st.integers(0, 3),
    ranks=st.just(4),
    state=st.sampled_from(ORDER),
    at_ms=st.integers(0, 20).map(float),
    node=st.sampled_from(["n0", "n1"]),
    endpoint=st.sampled_from([None, "http://a:1", "http://b:2"]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(report, max_size=24), st.randoms(use_true_random=False))
def test_the_fold_is_order_independent_and_keeps_each_ranks_latest(reports: list[RankReport], rng: object) -> None:
    shuffled = list(reports)
    rng.shuffle(shuffled)  # type: ignore[attr-defined]
    kept = latest(reports)
    assert latest(shuffled) == kept
    for rank, held in kept.items():
        assert held.at_ms == max(r.at_ms for r in reports if r.rank == rank)
    assert fold(latest(shuffled), draining=False) is fold(kept, draining=False)
