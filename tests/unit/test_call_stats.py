"""Health's view of dependencies: recent failed or slow calls to another service make it degraded."""

from __future__ import annotations

from shared.contracts.subjects import Rpc
from shared.infra.rpc import CallStats


def test_a_dependency_whose_latest_call_got_no_answer_is_failing_until_it_answers_again() -> None:
    stats = CallStats(horizon_s=60)
    stats.record(Rpc.LEDGER_COMMIT, seconds=0.004, ok=True, at=100.0)
    stats.record(Rpc.LEDGER_COMMIT, seconds=0.2, ok=False, at=101.0)
    assert stats.slow(slow_s=1.0, now=102.0) == {"ledger": "1 of the last 2 calls got no answer, the latest among them"}
    stats.record(Rpc.LEDGER_COMMIT, seconds=0.004, ok=True, at=103.0)
    assert stats.slow(slow_s=1.0, now=104.0) == {}  # it answers again
    stats.record(Rpc.LEDGER_COMMIT, seconds=0.2, ok=False, at=105.0)
    assert stats.slow(slow_s=1.0, now=170.0) == {}  # every call is older than the 60 s horizon


def test_a_slow_median_is_reported_and_a_fast_one_is_not() -> None:
    stats = CallStats()
    for i, seconds in enumerate((1.5, 1.4, 0.2)):
        stats.record(Rpc.FLEET_GET, seconds=seconds, ok=True, at=float(i))
    # median of 1.5, 1.4, 0.2 s = 1.4 s > 1 s
    assert stats.slow(slow_s=1.0, now=3.0) == {"fleet": "median answer 1400 ms over the last 3 calls"}
    assert stats.slow(slow_s=2.0, now=3.0) == {}
