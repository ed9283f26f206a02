"""The supervisor's pure core: phases from observations, and the actions that bring what runs to what is
assigned (starts, restarts with backoff, failed after crashes in a row, stops by release or deadline)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.domain.supervision import (
    Forget,
    Kill,
    Phase,
    Policy,
    Run,
    Start,
    Stop,
    Wanted,
    exited,
    launch_failed,
    marked,
    plan,
    probed,
    started,
    stopping,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
POLICY = Policy(stop_grace_s=10, max_crashes=3, backoff_s=1, backoff_max_s=8, settle_s=60)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_an_assigned_part_with_no_engine_is_started_and_an_unassigned_one_is_not() -> None:
    assert plan({"al-1": Wanted("al-1")}, {}, T0, POLICY) == [Start("al-1")]
    assert plan({}, {}, T0, POLICY) == []


def test_the_phases_follow_the_process_and_its_health_probe() -> None:
    run = started("al-1", 42, T0)
    assert (run.phase, run.state) == (Phase.STARTING, "starting")
    assert probed(run, None, at(1), POLICY).phase is Phase.STARTING  # nothing listens yet
    loading = probed(run, 503, at(2), POLICY)
    assert (loading.phase, loading.state) == (Phase.LOADING, "loading")
    ready = probed(loading, 200, at(5), POLICY)
    assert (ready.phase, ready.state, ready.ready_since) == (Phase.READY, "ready", at(5))
    assert probed(ready, 200, at(6), POLICY).since == at(5)  # still ready since then
    assert probed(ready, 500, at(7), POLICY).phase is Phase.LOADING  # up, not serving
    assert plan({"al-1": Wanted("al-1")}, {"al-1": ready}, at(8), POLICY) == []


def test_a_crash_restarts_after_a_doubling_backoff_and_the_third_in_a_row_fails() -> None:
    run = probed(started("al-1", 1, T0), 200, at(1), POLICY)
    crashed = exited(run, -9, at(2), POLICY)
    assert (crashed.phase, crashed.state, crashed.crashes, crashed.restarts) == (Phase.WAITING, "starting", 1, 1)
    assert crashed.next_start_at == at(3) and "killed by signal 9" in (crashed.reason or "")
    wanted = {"al-1": Wanted("al-1")}
    assert plan(wanted, {"al-1": crashed}, at(2.5), POLICY) == []  # not yet
    assert plan(wanted, {"al-1": crashed}, at(3), POLICY) == [Start("al-1")]
    again = exited(started("al-1", 2, at(3), before=crashed), 1, at(4), POLICY)
    assert (again.crashes, again.next_start_at) == (2, at(6))  # 1 s, then 2 s
    failed = exited(started("al-1", 3, at(6), before=again), 1, at(7), POLICY)
    assert (failed.phase, failed.state, failed.crashes) == (Phase.FAILED, "failed", 3)
    assert failed.reason == "exited with code 1 (3 crashes in a row)"
    assert plan(wanted, {"al-1": failed}, at(100), POLICY) == []  # failed stays failed while assigned
    assert plan({}, {"al-1": failed}, at(100), POLICY) == [Forget("al-1")]


def test_a_crash_count_is_forgotten_once_the_engine_has_been_ready_a_while() -> None:
    run = exited(probed(started("al-1", 1, T0), 200, at(1), POLICY), 1, at(2), POLICY)
    run = probed(started("al-1", 2, at(3), before=run), 200, at(4), POLICY)
    assert run.crashes == 1
    assert probed(run, 200, at(4 + 59), POLICY).crashes == 1
    assert probed(run, 200, at(4 + 60), POLICY).crashes == 0


def test_a_released_part_is_stopped_then_killed_after_the_grace_then_forgotten() -> None:
    run = probed(started("al-1", 1, T0), 200, at(1), POLICY)
    [stop] = plan({}, {"al-1": run}, at(2), POLICY)
    assert stop == Stop("al-1", kill_at=at(12), reason="released")
    run = stopping(run, stop)
    assert run.state == "draining"
    assert plan({}, {"al-1": run}, at(11), POLICY) == []
    assert plan({}, {"al-1": run}, at(12), POLICY) == [Kill("al-1")]
    ended = exited(run, -15, at(12.5), POLICY)
    assert (ended.phase, ended.state, ended.crashes) == (Phase.STOPPED, "stopped", 0)  # asked to stop: no crash
    assert plan({}, {"al-1": ended}, at(13), POLICY) == [Forget("al-1")]


def test_a_preempted_part_is_gone_by_its_deadline_sigkill_at_the_latest() -> None:
    deadline = at(30)
    run = probed(started("al-1", 1, T0), 200, at(1), POLICY)
    wanted = {"al-1": Wanted("al-1", stop_by=deadline)}
    assert plan(wanted, {"al-1": run}, at(19), POLICY) == []  # more than the grace left: it serves on
    [stop] = plan(wanted, {"al-1": run}, at(25), POLICY)
    assert isinstance(stop, Stop) and stop.kill_at == deadline and "preempted" in stop.reason
    # Past the deadline already (the agent learnt late): SIGTERM and SIGKILL at once.
    [late] = plan(wanted, {"al-1": run}, at(31), POLICY)
    assert isinstance(late, Stop) and late.kill_at == at(31)
    # A part whose deadline has passed is not started at all.
    assert plan(wanted, {}, at(31), POLICY) == []


def test_draining_is_reported_while_the_engine_still_serves() -> None:
    run = probed(started("al-1", 1, T0), 200, at(1), POLICY)
    drained = marked(run, Wanted("al-1", draining=True))
    assert (drained.phase, drained.state) == (Phase.READY, "draining")
    assert marked(drained, Wanted("al-1")).state == "ready"
    assert marked(run, Wanted("al-1")) is run


def test_a_launch_that_cannot_spawn_fails_without_retries() -> None:
    run = launch_failed("al-1", "no such command: vllm", T0)
    assert (run.phase, run.reason) == (Phase.FAILED, "no such command: vllm")
    assert plan({"al-1": Wanted("al-1")}, {"al-1": run}, at(100), POLICY) == []


def test_a_policy_refuses_nonsense() -> None:
    with pytest.raises(ValueError):
        Policy(max_crashes=0)
    with pytest.raises(ValueError):
        Policy(backoff_s=10, backoff_max_s=1)
    assert [POLICY.backoff(n) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 8, 8]


PHASES = st.sampled_from(list(Phase))


@given(
    assigned=st.dictionaries(st.sampled_from(["a", "b", "c"]), st.booleans(), max_size=3),
    running=st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), PHASES, max_size=4),
    now_s=st.floats(0, 100),
)
def test_plan_never_starts_a_running_engine_nor_touches_one_it_should_leave(
    assigned: dict[str, bool], running: dict[str, Phase], now_s: float
) -> None:
    wanted = {r: Wanted(r, draining=d) for r, d in assigned.items()}
    runs = {
        r: Run(replica_id=r, phase=p, since=T0, pid=1, next_start_at=at(50), kill_at=at(50)) for r, p in running.items()
    }
    actions = plan(wanted, runs, at(now_s), POLICY)
    assert len({a.replica_id for a in actions}) == len(actions)  # one action per part at most
    for action in actions:
        run = runs.get(action.replica_id)
        if isinstance(action, Start):
            assert action.replica_id in wanted
            assert run is None or (run.phase is Phase.WAITING and now_s >= 50)
        elif isinstance(action, Stop):
            assert run is not None and run.phase in (Phase.STARTING, Phase.LOADING, Phase.READY)
            assert action.replica_id not in wanted
        elif isinstance(action, Kill):
            assert run is not None and run.phase is Phase.STOPPING and now_s >= 50
        else:
            assert run is not None and action.replica_id not in wanted
    for replica_id in wanted:  # every assigned part either runs or is started, waits, or failed
        run = runs.get(replica_id)
        assert run is not None or Start(replica_id) in actions
