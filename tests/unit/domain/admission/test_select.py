"""select: who is a candidate, which rule picks the choice, and the failover order behind it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shared.domain.admission import (
    AdmitAsk,
    AdmitPolicy,
    Candidate,
    Engine,
    ReplicaStatus,
    failover_order,
    least_cost,
    request_kv_bytes,
    select,
)
from tests.unit.domain.admission.builders import GIB, NOW_MS, ask, ids, models, replica

E = Engine


def choose(a: AdmitAsk, *replicas: ReplicaStatus, policy: AdmitPolicy = AdmitPolicy()) -> list[str]:
    return ids(select(a, replicas, models(), now_ms=NOW_MS, policy=policy))


# 1200 tokens of llama3.1-8b at 128 KiB a token
NEED_1200 = 1200 * 131_072


@pytest.mark.parametrize(
    ("status", "why"),
    [
        (replica("r", healthy=False), "unhealthy"),
        (replica("r", age_ms=15_001), "stale"),  # more than stale_ms since the last report
        (replica("r", age_ms=None), "stale"),  # never reported
        (replica("r", queue=16), "queue_full"),  # queue_depth < 16 required
        (replica("r", model="llama3-70b"), "context"),  # 8000 + 200 > its 8192
        (replica("r", kv_total_bytes=NEED_1200 - 1), "kv_full"),  # a byte short
        (replica("r", kv_total_bytes=NEED_1200 + GIB, held_bytes=GIB + 1), "kv_full"),  # admission's holds count
        (replica("r", model="gpt-9"), "unknown_model"),
        (replica("r", healthy=False, age_ms=None, queue=99), "unhealthy"),  # the first reason that applies
    ],
)
def test_exclusions(status: ReplicaStatus, why: str) -> None:
    a = ask(8000, 200) if status.model == "llama3-70b" else ask(1000, 200)
    selection = select(a, [status], models(), now_ms=NOW_MS)
    assert selection.order == ()
    assert dict(selection.excluded) == {"r": why}
    assert selection.explanation.endswith(f"no candidate; excluded r ({why})")


@pytest.mark.parametrize(
    "status",
    [
        replica("r", age_ms=15_000),  # exactly stale_ms old is still fresh
        replica("r", age_ms=-50),  # a report stamped ahead of our clock is fresh
        replica("r", queue=15),
        replica("r", kv_total_bytes=NEED_1200),  # exactly full fits
        replica("r", model="llama3-70b"),  # 7992 + 200 = 8192 fits its context
    ],
)
def test_boundaries_that_still_admit(status: ReplicaStatus) -> None:
    a = ask(7992, 200) if status.model == "llama3-70b" else ask(1000, 200)
    selection = select(a, [status], models(), now_ms=NOW_MS)
    assert ids(selection) == ["r"] and not selection.excluded


def test_the_candidate_carries_its_need() -> None:
    (candidate,) = select(ask(1000, 200), [replica("r", tp=2)], models(), now_ms=NOW_MS).order
    assert candidate.need_bytes == NEED_1200 // 2  # 4 of 8 kv heads a rank
    assert candidate.need_bytes == request_kv_bytes(models()["llama3.1-8b"], input_tokens=1000, output_tokens=200, tp=2)


@pytest.mark.parametrize(
    ("status", "ttft_ms", "cost"),
    [
        (replica("r", p50_ms=50), None, 50.0),  # latency alone
        (replica("r", p50_ms=50, queue=3), None, 30 + 50.0),  # 10 a queued request
        (replica("r", p50_ms=50, kv_used_gib=34), None, 50.0),  # kv_use 0.85: at the threshold, no penalty
        (replica("r", p50_ms=50, kv_used_gib=36, held_gib=2), None, 200 * 0.1 + 50),  # (36+2)/40 = 0.95
        (replica("r", p50_ms=120, queue=3, kv_used_gib=38), 100, 30 + 20 + 120 + 5 * 20),  # all four terms: 270
        (replica("r", p50_ms=90), 100, 90.0),  # meets the SLO: no SLO term
    ],
)
def test_least_cost_arithmetic(status: ReplicaStatus, ttft_ms: float | None, cost: float) -> None:
    assert least_cost(status, need_bytes=GIB, ttft_ms=ttft_ms, policy=AdmitPolicy()) == pytest.approx(cost)


def test_least_cost_weights_are_policy() -> None:
    status = replica("r", p50_ms=120, queue=3, kv_used_gib=38)
    policy = AdmitPolicy(queue_weight=1, kv_weight=0, slo_weight=0, kv_pressure=0.5)
    assert least_cost(status, need_bytes=0, ttft_ms=100, policy=policy) == pytest.approx(3 + 120)


def test_least_cost_picks_the_cheapest_and_fails_over_by_engine_then_latency() -> None:
    replicas = [
        replica("t-slow", E.TRANSFORMER, p50_ms=40),
        replica("t-fast", E.TRANSFORMER, p50_ms=20),
        replica("m", E.MOE, p50_ms=70),
        replica("s", E.SSM, p50_ms=10),
        replica("h", E.HYBRID, p50_ms=5),
        replica("h-busy", E.HYBRID, p50_ms=1, queue=5),  # cost 51
    ]
    selection = select(ask(), replicas, models(), now_ms=NOW_MS)
    assert selection.rule == "least_cost"
    # h costs 5, the least; behind it MoE, transformer (fastest first), SSM, hybrid
    assert ids(selection) == ["h", "m", "t-fast", "t-slow", "s", "h-busy"]
    assert not any(c.preferred for c in selection.order)
    assert selection.explanation.startswith("least cost: chose h (hybrid, p50 5 ms, cost 5.0); failover m, t-fast")


def test_failover_order_alone() -> None:
    def c(rid: str, engine: Engine, p50: float) -> Candidate:
        return Candidate(replica=replica(rid, engine, p50_ms=p50), need_bytes=1, cost=0.0, preferred=False)

    order = failover_order([c("s", E.SSM, 1), c("h", E.HYBRID, 1), c("t", E.TRANSFORMER, 9), c("m2", E.MOE, 9)])
    assert [x.replica.replica_id for x in order] == ["m2", "t", "s", "h"]
    same = failover_order([c("b", E.MOE, 5), c("a", E.MOE, 5)])  # equal latency: by id
    assert [x.replica.replica_id for x in same] == ["a", "b"]


def test_long_context_prefers_ssm_then_hybrid_over_a_cheaper_transformer() -> None:
    long = ask(40_000, 500)
    t = replica("t", E.TRANSFORMER, p50_ms=20)
    s = replica("s", E.SSM, p50_ms=200, queue=4)
    h = replica("h", E.HYBRID, p50_ms=100)
    m = replica("m", E.MOE, p50_ms=10)  # mixtral-8x7b holds 32768: out on context
    selection = select(long, [t, s, h, m], models(), now_ms=NOW_MS)
    assert selection.rule == "long_context"
    assert ids(selection) == ["s", "t", "h"]
    assert dict(selection.excluded) == {"m": "context"}
    assert [c.preferred for c in selection.order] == [True, False, True]
    assert choose(long, t, h) == ["h", "t"]  # no ssm: the hybrid
    assert choose(long, t, replace(s, healthy=False)) == ["t"]  # nothing preferred: the cheapest of the rest


def test_exactly_at_the_long_context_threshold_is_not_long() -> None:
    t, s = replica("t", E.TRANSFORMER, p50_ms=20), replica("s", E.SSM, p50_ms=200)
    assert choose(ask(32_000, 500), t, s)[0] == "t"
    assert choose(ask(32_001, 500), t, s)[0] == "s"
    assert choose(ask(32_001, 500), t, s, policy=AdmitPolicy(long_context_tokens=64_000))[0] == "t"


def test_strict_slo_prefers_the_fastest_that_meets_it_even_when_it_costs_more() -> None:
    fast_busy = replica("fast", E.MOE, p50_ms=30, queue=10)  # cost 130
    medium = replica("medium", E.TRANSFORMER, p50_ms=60)  # cost 60
    slow = replica("slow", E.SSM, p50_ms=90)  # misses 80 ms
    selection = select(ask(ttft_ms=80), [slow, medium, fast_busy], models(), now_ms=NOW_MS)
    assert selection.rule == "strict_slo"
    assert ids(selection) == ["fast", "medium", "slow"]
    assert [c.preferred for c in selection.order] == [True, True, False]
    # None meets 20 ms: the fastest anyway
    none_meet = select(ask(ttft_ms=20), [slow, medium, fast_busy], models(), now_ms=NOW_MS)
    assert ids(none_meet)[0] == "fast" and not none_meet.order[0].preferred
    assert "none preferred" in none_meet.explanation
    # 100 ms is not strict (< 100 required): least cost, medium
    assert choose(ask(ttft_ms=100), slow, medium, fast_busy)[0] == "medium"


@pytest.mark.parametrize(
    ("hint", "first"),
    [
        ("moe", "m"),
        ("transformer", "t"),
        ("ssm", "s"),  # s (cost 80) before h (cost 90): both count as ssm
        ("auto", "t"),  # least cost: t at 20
    ],
)
def test_a_hint_prefers_its_engine(hint: str, first: str) -> None:
    replicas = [
        replica("t", E.TRANSFORMER, p50_ms=20),
        replica("m", E.MOE, p50_ms=70),
        replica("s", E.SSM, p50_ms=80),
        replica("h", E.HYBRID, p50_ms=90),
    ]
    selection = select(ask(hint=hint), replicas, models(), now_ms=NOW_MS)
    assert ids(selection)[0] == first
    assert selection.rule == ("least_cost" if hint == "auto" else "hint")


def test_the_ssm_hint_takes_a_hybrid_and_a_hint_beats_long_context() -> None:
    t, h = replica("t", E.TRANSFORMER, p50_ms=20), replica("h", E.HYBRID, p50_ms=90)
    ssm_hint = select(ask(hint="ssm"), [t, h], models(), now_ms=NOW_MS)
    assert ids(ssm_hint) == ["h", "t"] and ssm_hint.order[0].preferred
    s = replica("s", E.SSM, p50_ms=90)
    assert choose(ask(40_000, 10, hint="transformer"), t, s)[0] == "t"
    assert choose(ask(hint="moe"), t, h) == ["t", "h"]  # no MoE candidate: the cheapest


def test_ties_break_by_replica_id_and_the_input_order_does_not_matter() -> None:
    a, b, c = (replica(x, E.TRANSFORMER, p50_ms=50) for x in "abc")
    assert choose(ask(), c, a, b) == choose(ask(), b, c, a) == ["a", "b", "c"]


def test_no_replica_at_all() -> None:
    selection = select(ask(), [], models(), now_ms=NOW_MS)
    assert selection.order == () and selection.choice is None
    assert selection.explanation == "least cost: no candidate (no replica)"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hint": "gpu"}, "hint"),
        ({"input_tokens": -1}, "tokens"),
        ({"ttft_ms": 0}, "ttft_ms"),
    ],
)
def test_a_malformed_ask_is_refused(kwargs: dict[str, object], message: str) -> None:
    base: dict[str, object] = {"input_tokens": 10, "output_tokens": 10, "ttft_ms": None}
    with pytest.raises(ValueError, match=message):
        AdmitAsk(**{**base, **kwargs})  # type: ignore[arg-type]


def test_policy_validates() -> None:
    with pytest.raises(ValueError, match="kv_pressure"):
        AdmitPolicy(kv_pressure=1.5)
    with pytest.raises(ValueError):
        AdmitPolicy(max_queue_depth=0)
