"""When a moved replica's old copy may be drained: its copy's engine ranks as the agents report them
(``replica_state``), whether an agent runs engines on the copy's nodes, the mode, and a timeout."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from shared.domain.rebalance.ready import EngineRanks, Readiness, WaitForReady, copy_readiness

PLACED = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)  # when the copy was placed
TIMEOUT_S = 900.0
STALE_S = 30.0  # 3 x the agents' 10 s status interval
AUTO, ALWAYS, NEVER = WaitForReady.AUTO, WaitForReady.ALWAYS, WaitForReady.NEVER


def at(seconds: float) -> datetime:
    return PLACED + timedelta(seconds=seconds)


def ranks(*states: str, ranks: int | None = None, reason: str | None = None) -> EngineRanks:
    """A copy whose rank i last reported ``states[i]`` (one second after its placement)."""
    engine = EngineRanks()
    for rank, state in enumerate(states):
        engine = engine.reported(rank=rank, ranks=ranks or len(states), state=state, at=at(1), reason=reason)
    return engine


def readiness(
    engine: EngineRanks | None,
    *,
    mode: WaitForReady = AUTO,
    agent_seen: bool = True,
    now_s: float = 5.0,
    watching_s: float = 3600.0,  # how long this process had followed the reports when the copy was placed
) -> Readiness:
    return copy_readiness(
        engine,
        mode=mode,
        agent_seen=agent_seen,
        since=PLACED,
        watching_since=PLACED - timedelta(seconds=watching_s),
        now=at(now_s),
        timeout_s=TIMEOUT_S,
        stale_s=STALE_S,
    )


@pytest.mark.parametrize(
    ("engine", "mode", "agent_seen", "now_s", "expected"),
    [
        # The copy's engine serves: the old replica is drained.
        (ranks("ready"), AUTO, True, 5.0, Readiness.READY),
        (ranks("ready", "ready"), ALWAYS, False, 5.0, Readiness.READY),
        # Starting or loading (a large model's cold load takes minutes): the old replica keeps serving.
        (ranks("starting"), AUTO, True, 5.0, Readiness.WAIT),
        (ranks("loading"), AUTO, True, TIMEOUT_S - 1, Readiness.WAIT),
        (ranks("ready", "loading"), AUTO, True, 5.0, Readiness.WAIT),  # every rank must serve
        (ranks("ready", ranks=2), AUTO, True, 5.0, Readiness.WAIT),  # rank 1 never reported yet
        # A rank failed, or stopped for good: the move rolls back at once.
        (ranks("failed"), AUTO, True, 5.0, Readiness.FAILED),
        (ranks("ready", "failed"), ALWAYS, True, 5.0, Readiness.FAILED),
        (ranks("stopped"), AUTO, True, 5.0, Readiness.FAILED),
        # Not ready within the timeout (900 s after its placement): the move rolls back.
        (ranks("loading"), AUTO, True, TIMEOUT_S, Readiness.TIMED_OUT),
        (None, AUTO, True, TIMEOUT_S, Readiness.TIMED_OUT),  # an agent runs engines there, none for the copy
        (None, ALWAYS, False, TIMEOUT_S, Readiness.TIMED_OUT),
        (None, ALWAYS, False, TIMEOUT_S - 1, Readiness.WAIT),
        # auto, no agent on the copy's nodes and no report of the copy: as before, drain now.
        (None, AUTO, False, 0.0, Readiness.UNWATCHED),
        (None, AUTO, False, TIMEOUT_S + 1, Readiness.UNWATCHED),
        # auto, but the copy itself reported: it is waited for.
        (ranks("loading"), AUTO, False, 5.0, Readiness.WAIT),
        # never: as before, whatever the reports say.
        (ranks("loading"), NEVER, True, 5.0, Readiness.UNWATCHED),
        (ranks("failed"), NEVER, True, 5.0, Readiness.UNWATCHED),
    ],
)
def test_copy_readiness(
    engine: EngineRanks | None, mode: WaitForReady, agent_seen: bool, now_s: float, expected: Readiness
) -> None:
    assert readiness(engine, mode=mode, agent_seen=agent_seen, now_s=now_s) is expected


def test_auto_just_started_waits_one_stale_window_before_it_takes_silence_for_no_agent() -> None:
    # This process started following the reports 10 s before the copy was placed: agents republish every
    # status interval, so no report yet means nothing until 30 s of following (at 20 s after placement).
    assert readiness(None, agent_seen=False, now_s=5.0, watching_s=10.0) is Readiness.WAIT
    assert readiness(None, agent_seen=False, now_s=19.9, watching_s=10.0) is Readiness.WAIT
    assert readiness(None, agent_seen=False, now_s=20.0, watching_s=10.0) is Readiness.UNWATCHED
    assert readiness(ranks("ready"), agent_seen=False, now_s=5.0, watching_s=10.0) is Readiness.READY


def test_a_rank_report_older_than_its_last_is_left_out() -> None:
    engine = EngineRanks().reported(rank=0, ranks=1, state="ready", at=at(10))
    assert engine.reported(rank=0, ranks=1, state="loading", at=at(5)) is engine
    assert engine.ready
    crashed = engine.reported(rank=0, ranks=1, state="failed", at=at(11), reason="exited with code 1")
    assert not crashed.ready and crashed.gone is not None
    assert crashed.describe() == "rank 0 failed: exited with code 1"
    assert ranks("ready", "loading").describe() == "ready, loading"
    assert ranks("ready", ranks=2).describe() == "ready, unreported"
