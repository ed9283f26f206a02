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


def test_a_call_that_got_no_answer_is_failing_not_slow_and_ends_with_the_next_answer() -> None:
    # Issue 23 row 10: a reclaim that waited 9.75 s for a filler killed mid-reclaim. Once the filler
    # answers again (0.003 s), the dependency is neither failing nor slow: the median is of the answered
    # calls only (0.003 s), not of 9.75 s and 0.003 s (4.9 s, which read "slow" for a whole minute).
    stats = CallStats(horizon_s=60)
    stats.record(Rpc.RESERVATION_RECLAIM, seconds=9.75, ok=False, at=100.0)
    assert stats.failing(now=101.0) == {"reservation"}
    assert "reservation" in stats.slow(slow_s=1.0, now=101.0)
    stats.record(Rpc.RESERVATION_HEALTH, seconds=0.003, ok=True, at=110.0)  # a health probe answered
    assert stats.failing(now=111.0) == set()
    assert stats.slow(slow_s=1.0, now=111.0) == {}


def test_a_failure_older_than_the_horizon_is_not_failing_any_more() -> None:
    stats = CallStats(horizon_s=60)
    stats.record(Rpc.RESERVATION_RECLAIM, seconds=3.0, ok=False, at=100.0)
    assert stats.failing(now=159.0) == {"reservation"}
    assert stats.failing(now=161.0) == set()


async def test_health_probes_a_failing_dependency_and_says_ok_once_it_answers() -> None:
    """Health asks the health subject of a dependency whose latest call got no answer (one the service may
    call): one that answers is back, without waiting for the next real call or the horizon."""
    from dataclasses import dataclass
    from typing import Any

    from pydantic import BaseModel

    from shared.contracts.health import HealthReply, HealthRequest
    from shared.infra.health import health_handler as _health
    from shared.infra.health import health_probes
    from shared.infra.settings import Settings

    up = {"filler": False}
    asked: list[Rpc] = []

    class Rpcs:
        stats = CallStats()

        async def call(self, rpc: Rpc, request: BaseModel, *, timeout_s: float | None = None) -> BaseModel:
            asked.append(rpc)
            self.stats.record(rpc, seconds=0.001, ok=up["filler"])
            if not up["filler"]:
                raise RuntimeError("no service answers this subject")
            return HealthReply(status="ok", service="reservation-filler", version="1")

    @dataclass
    class Up:
        is_connected: bool = True

    rpc = Rpcs()
    runtime: Any = type(
        "R",
        (),
        {"uses_database": False, "nc": Up(), "settings": Settings(), "name": "placement", "rpc": rpc, "consumers": []},
    )()
    probes = health_probes((Rpc.LEDGER_COMMIT, Rpc.RESERVATION_RECLAIM, Rpc.RESERVATION_HEALTH))
    assert probes == {"reservation": Rpc.RESERVATION_HEALTH}
    health = _health(runtime, None, probes=probes)
    assert (await health(HealthRequest())).model_dump()["status"] == "ok"
    assert asked == []  # nothing failing: nothing probed
    rpc.stats.record(Rpc.RESERVATION_RECLAIM, seconds=3.0, ok=False)
    rpc.stats.record(Rpc.LEDGER_COMMIT, seconds=0.002, ok=True)
    down = (await health(HealthRequest())).model_dump()
    assert down["status"] == "degraded" and "reservation" in down["checks"]["dependencies"], down
    up["filler"] = True
    back = (await health(HealthRequest())).model_dump()
    assert back["status"] == "ok", back
    assert asked == [Rpc.RESERVATION_HEALTH, Rpc.RESERVATION_HEALTH]
    assert (await health(HealthRequest())).model_dump()["status"] == "ok"
    assert len(asked) == 2  # answered: no more probes
