"""Token buckets and the fair queue: a flooding tenant does not starve another (the must-show test)."""

from __future__ import annotations

from collections import Counter

import pytest

from shared.domain.admission import FairQueue, TokenBucket

# -- token bucket


def test_a_bucket_starts_full_and_refills_at_its_rate() -> None:
    bucket = TokenBucket(rate_per_s=10, burst=2)  # a token every 100 ms
    assert bucket.take(0) and bucket.take(0)
    assert not bucket.take(0) and bucket.tokens == 0
    assert not bucket.take(99)  # 0.99 tokens
    assert bucket.take(100)
    assert bucket.peek(10_000) == 2  # capped at the burst


def test_a_bucket_adds_up_float_refills() -> None:
    bucket = TokenBucket(rate_per_s=1, burst=1, tokens=0, updated_ms=0)
    for t in range(100, 1000, 100):
        assert not bucket.take(t)  # 0.1 token at a time: 0.9 at 900 ms
    assert bucket.take(1000)  # ten float tenths make a token


def test_a_clock_going_back_refills_nothing_and_does_not_rewind() -> None:
    bucket = TokenBucket(rate_per_s=1, burst=5, tokens=0, updated_ms=1000)
    assert bucket.peek(500) == 0
    assert not bucket.take(500)
    assert bucket.updated_ms == 1000
    assert bucket.peek(2000) == pytest.approx(1)


def test_take_n() -> None:
    bucket = TokenBucket(rate_per_s=0, burst=3)
    assert not bucket.take(0, 4)
    assert bucket.take(0, 2.5) and bucket.peek(0) == pytest.approx(0.5)


# -- the fair queue


def q(rate_per_s: float = 1000, burst: float = 100, ttl_ms: float = 60_000, **kw: object) -> FairQueue[str]:
    return FairQueue(rate_per_s=rate_per_s, burst=burst, ttl_ms=ttl_ms, **kw)  # type: ignore[arg-type]


def drain(queue: FairQueue[str], now_ms: float = 0) -> list[str]:
    out = []
    while (popped := queue.pop(now_ms)) is not None:
        out.append(popped[0])
    return out


def test_two_backlogged_tenants_with_equal_weights_alternate() -> None:
    queue = q()
    for i in range(4):
        queue.offer(f"a{i}", "x", tenant="a", now_ms=0)
    for i in range(2):
        queue.offer(f"b{i}", "x", tenant="b", now_ms=1)
    assert drain(queue) == ["a0", "b0", "a1", "b1", "a2", "a3"]


def test_weights_share_in_proportion() -> None:
    queue = q(weights={"gold": 2})
    for i in range(6):
        queue.offer(f"g{i}", "x", tenant="gold", now_ms=0)
        queue.offer(f"s{i}", "x", tenant="silver", now_ms=0)
    first_six = Counter(k[0] for k in drain(queue)[:6])
    assert first_six == {"g": 4, "s": 2}


def test_cost_counts_against_the_tenant() -> None:
    queue = q()
    queue.offer("big", "x", tenant="a", now_ms=0, cost=3)  # finish tag 3
    for i in range(3):
        queue.offer(f"b{i}", "x", tenant="b", now_ms=0)  # finish tags 1, 2, 3
    assert drain(queue) == ["b0", "b1", "big", "b2"]  # ties go to the earlier arrival


def test_an_idle_tenant_banks_no_credit() -> None:
    queue = q()
    for i in range(10):
        queue.offer(f"a{i}", "x", tenant="a", now_ms=0)
    assert [queue.pop(0) for _ in range(6)]  # a is served alone for a while
    for i in range(3):
        queue.offer(f"b{i}", "x", tenant="b", now_ms=0)
    # b re-enters at the present (virtual time 5, a5's start): b0 finishes at 6, before a6 at 7; then
    # they alternate, b does not take six in a row
    assert drain(queue)[:5] == ["b0", "a6", "b1", "a7", "b2"]


def test_in_profile_tenants_go_first_and_the_rest_only_when_nobody_in_profile_can() -> None:
    queue = q(rate_per_s=0, burst=1)  # one token a tenant, never refilled
    for i in range(3):
        queue.offer(f"a{i}", "x", tenant="a", now_ms=0)
    queue.pop(0)  # a0 takes a's token
    queue.offer("b0", "x", tenant="b", now_ms=0)
    queue.offer("b1", "x", tenant="b", now_ms=0)
    # b0 (tag 1) is in profile and goes first; then b1 and a1 are both out of profile and tie at 2: the
    # earlier arrival, a1; then b1 (2) before a2 (3)
    assert drain(queue) == ["b0", "a1", "b1", "a2"]


def test_a_tenant_with_tokens_overtakes_one_with_a_smaller_tag() -> None:
    queue = q(rate_per_s=0, burst=1, weights={"a": 100})
    queue.offer("a0", "x", tenant="a", now_ms=0)
    queue.pop(0)  # a spent its token; its tags stay tiny (weight 100)
    queue.offer("a1", "x", tenant="a", now_ms=0)
    queue.offer("b0", "x", tenant="b", now_ms=0)
    assert drain(queue) == ["b0", "a1"]  # b in profile goes first; a is still served (work conserving)


def test_can_serve_skips_without_blocking() -> None:
    queue = q()
    queue.offer("a-big", "big", tenant="a", now_ms=0)
    queue.offer("a-small", "small", tenant="a", now_ms=0)
    queue.offer("b-big", "big", tenant="b", now_ms=0)

    def small_only(item: str) -> bool:
        return item == "small"

    assert queue.pop(0, small_only) == ("a-small", "small")  # a's head is skipped, its next item goes
    assert queue.pop(0, small_only) is None  # nothing servable: nothing popped
    assert len(queue) == 2 and "a-big" in queue and "b-big" in queue
    assert drain(queue) == ["b-big", "a-big"]  # a was just served: b's tag is smaller


def test_position_is_the_order_pop_gives() -> None:
    queue = q(rate_per_s=0, burst=2, weights={"c": 3})
    offers = [("a", 1.0), ("a", 1.0), ("b", 2.0), ("c", 1.0), ("a", 1.0), ("c", 1.0), ("b", 1.0), ("c", 1.0)]
    for i, (tenant, cost) in enumerate(offers):
        queue.offer(f"{tenant}{i}", "x", tenant=tenant, now_ms=0, cost=cost)
    expected = sorted(queue, key=lambda k: queue.position(k) or 0)
    assert drain(queue) == expected


def test_offer_returns_the_position_and_a_redelivered_offer_changes_nothing() -> None:
    queue = q()
    assert queue.offer("a0", "x", tenant="a", now_ms=0) == 1
    assert queue.offer("a1", "x", tenant="a", now_ms=0) == 2
    assert queue.offer("b0", "x", tenant="b", now_ms=0) == 2  # b's first is served before a's second
    assert queue.position("a1") == 3
    assert queue.offer("a0", "changed", tenant="b", now_ms=0) == 1
    assert len(queue) == 3 and queue.pop(0) == ("a0", "x")
    assert queue.position("a0") is None


def test_remove_and_expire() -> None:
    queue = q(ttl_ms=1000)
    queue.offer("old", "o", tenant="a", now_ms=0)
    queue.offer("gone", "g", tenant="a", now_ms=100)
    queue.offer("new", "n", tenant="b", now_ms=900)
    assert queue.remove("gone") == "g" and queue.remove("gone") is None
    assert queue.expire(1000) == []  # exactly ttl old stays
    assert queue.expire(1001) == [("old", "o")]
    assert list(queue) == ["new"] and queue.position("new") == 1
    assert queue.expire(5000) == [("new", "n")] and len(queue) == 0 and queue.pop(5000) is None


def test_set_weight_applies_to_new_tags() -> None:
    queue = q()
    queue.set_weight("a", 3)
    for i in range(4):
        queue.offer(f"a{i}", "x", tenant="a", now_ms=0)
        queue.offer(f"b{i}", "x", tenant="b", now_ms=0)
    # a's tags 1/3, 2/3, 1, 4/3; b's 1, 2, ...: a2 and b0 tie at 1 and b0 arrived first
    assert drain(queue)[:5] == ["a0", "a1", "b0", "a2", "a3"]
    with pytest.raises(ValueError, match="weight"):
        queue.set_weight("a", 0)


def test_idle_tenants_state_is_forgotten() -> None:
    queue = q(rate_per_s=1000, burst=1)
    for t in range(100):
        queue.offer(f"k{t}", "x", tenant=f"tenant-{t}", now_ms=t)
        queue.pop(t)
    assert len(queue._last_finish) <= 1 and len(queue._buckets) <= 1


# -- the must-show test: a tenant that floods does not starve another


TICK_MS = 100


@pytest.mark.parametrize(
    ("b_per_tick", "rate_per_s", "burst"),
    [
        (2, 50, 10),  # B under its half; buckets of C/2 a tick each
        (4, 50, 10),
        (8, 50, 10),  # B over its half: max-min fair share is C/2
        (2, 1e6, 1e6),  # buckets never bind: WFQ alone
        (8, 1e6, 1e6),
        (2, 1, 1),  # buckets always bind: everyone out of profile, WFQ decides
        (8, 1, 1),
        (3, 20, 5),  # B's demand above its rate: some of B out of profile
    ],
)
def test_a_flooding_tenant_does_not_starve_another(b_per_tick: int, rate_per_s: float, burst: float) -> None:
    capacity = 10  # items served a tick
    a_per_tick = 10 * b_per_tick  # A offers ten times what B does; total demand > capacity
    queue = q(rate_per_s=rate_per_s, burst=burst, ttl_ms=20 * TICK_MS)
    served: Counter[str] = Counter()
    for tick in range(300):
        now = tick * TICK_MS
        for i in range(a_per_tick):
            queue.offer(f"a-{tick}-{i}", "a", tenant="a", now_ms=now)
        for i in range(b_per_tick):
            queue.offer(f"b-{tick}-{i}", "b", tenant="b", now_ms=now)
        queue.expire(now)
        for _ in range(capacity):
            popped = queue.pop(now)
            assert popped is not None  # A's backlog never runs dry
            served[popped[1]] += 1
    fair = min(b_per_tick, capacity / 2) / capacity  # max-min fair share of B
    share = served["b"] / (served["a"] + served["b"])
    assert abs(share - fair) <= 0.05 * fair, (share, fair)
