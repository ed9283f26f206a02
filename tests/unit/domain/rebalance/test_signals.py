"""What hot, cold and drift read of a replica (its engine's load, else HBM) and when they may read it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from shared.domain.rebalance.ready import EngineRanks
from shared.domain.rebalance.signals import CARRIED_KV, EngineLoad, carried, engine_load, judged, load_figure

T0 = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


def at(s: float) -> datetime:
    return T0 + timedelta(seconds=s)


def load(kv: float | None = 0.5, *, queue: int = 0, running: int | None = 3, t: float = 0) -> EngineLoad:
    return EngineLoad(kv=kv, queue_depth=queue, running=running, at=at(t))


def ranks(*states: tuple[str, float]) -> EngineRanks:
    """One rank's reports in order: (state, when)."""
    out = EngineRanks()
    for state, t in states:
        out = out.reported(rank=0, ranks=1, state=state, at=at(t))
    return out


# -- the load figure -------------------------------------------------------------------------------


def test_the_load_is_the_engines_own_kv_share_not_the_bytes_when_it_gives_one() -> None:
    report = engine_load(kv_usage=0.9, kv_used_bytes=1, kv_total_bytes=100, queue_depth=0, running=4, at=T0)
    assert load_figure(report) == 0.9


def test_without_a_share_the_load_is_used_over_total_kv_bytes() -> None:
    report = engine_load(kv_usage=None, kv_used_bytes=30, kv_total_bytes=40, queue_depth=0, running=None, at=T0)
    assert load_figure(report) == 0.75
    nothing = engine_load(kv_usage=None, kv_used_bytes=0, kv_total_bytes=0, queue_depth=0, running=None, at=T0)
    assert nothing.kv is None and load_figure(nothing) == 0.0


def test_an_idle_engine_reads_zero_whatever_its_cache_holds() -> None:
    # A preallocating engine with a warm prefix cache and nothing to do is not loaded.
    assert load_figure(load(0.95, running=0)) == 0.0


def test_requests_waiting_read_full() -> None:
    assert load_figure(load(0.2, queue=3, running=8)) == 1.0


def test_a_busy_engine_reads_its_kv_share() -> None:
    assert load_figure(load(0.87, running=12)) == 0.87
    assert load_figure(load(0.87, running=None)) == 0.87  # running not reported: the share alone


# -- when a replica is judged ----------------------------------------------------------------------


def test_no_lifecycle_anywhere_is_judged_from_placement_as_before() -> None:
    assert judged(None, agent_runs_engines=False, now=T0, grace_s=120)


def test_no_report_of_its_own_where_an_agent_runs_engines_is_not_judged() -> None:
    assert not judged(None, agent_runs_engines=True, now=T0, grace_s=120)


@pytest.mark.parametrize("state", ["starting", "loading", "draining", "failed", "stopped"])
def test_a_replica_not_ready_is_not_judged(state: str) -> None:
    assert not judged(ranks((state, 0)), agent_runs_engines=True, now=at(10_000), grace_s=120)


def test_a_ready_replica_is_judged_only_after_the_grace_from_its_last_change() -> None:
    r = ranks(("starting", 0), ("loading", 5), ("ready", 30), ("ready", 60), ("ready", 90))
    assert r.changed_at == at(30)  # the same state reported again is no change
    assert not judged(r, agent_runs_engines=True, now=at(149), grace_s=120)
    assert judged(r, agent_runs_engines=True, now=at(150), grace_s=120)


def test_a_restart_starts_the_grace_again() -> None:
    r = ranks(("ready", 0), ("loading", 500), ("ready", 530))
    assert not judged(r, agent_runs_engines=True, now=at(600), grace_s=120)
    assert judged(r, agent_runs_engines=True, now=at(650), grace_s=120)


def test_every_rank_must_be_ready_and_the_latest_change_counts() -> None:
    r = EngineRanks().reported(rank=0, ranks=2, state="ready", at=at(0))
    assert not judged(r, agent_runs_engines=True, now=at(1000), grace_s=120)
    r = r.reported(rank=1, ranks=2, state="ready", at=at(100))
    assert not judged(r, agent_runs_engines=True, now=at(219), grace_s=120)
    assert judged(r, agent_runs_engines=True, now=at(220), grace_s=120)


# -- a copy has carried load -----------------------------------------------------------------------


def test_a_copy_carries_load_with_a_request_running_or_waiting_or_kv_in_use_after_ready() -> None:
    ready = ranks(("loading", 0), ("ready", 30))
    assert carried(load(0.0, running=1, t=40), ready)
    assert carried(load(0.0, queue=1, running=0, t=40), ready)
    assert carried(load(CARRIED_KV, running=None, t=40), ready)
    assert not carried(load(CARRIED_KV / 2, running=0, t=40), ready)  # idle: a preallocated cache is no load


def test_a_report_before_ready_or_while_not_ready_carries_nothing() -> None:
    assert not carried(load(0.9, running=5, t=20), ranks(("loading", 0), ("ready", 30)))
    assert not carried(load(0.9, running=5, t=40), ranks(("loading", 0)))


def test_without_lifecycle_any_busy_report_counts() -> None:
    assert carried(load(0.9, running=5), None)
    assert not carried(load(0.0, running=0), None)
