"""The engines a node's agent runs: what it wants running (its node's assignments), what runs, and what to
do next. Pure: the agent's supervisor observes processes and health probes, folds each observation in
here, and carries out the actions ``plan`` returns (docs/ENGINES.md, "The supervisor").

One ``Run`` per replica part on the node. Its phase moves

    starting -> loading -> ready                 (the process is up, then /health answers 503, then 200)
    any      -> waiting -> starting ...          (it crashed: restarted after a backoff that doubles)
    any      -> failed                           (it crashed ``max_crashes`` times in a row)
    any      -> stopping -> stopped              (released, expired, preempted: SIGTERM, SIGKILL after a grace)

and is reported as a rank's ``replica_state`` (``shared.contracts.engines``): ``waiting`` reads as
``starting`` (it will start again), ``stopping`` as ``draining``, and a ready engine the rebalancer drains
as ``draining``. A crash count goes back to zero once the engine has been ready for ``settle_s``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from enum import StrEnum


class Phase(StrEnum):
    STARTING = "starting"
    LOADING = "loading"
    READY = "ready"
    WAITING = "waiting"
    STOPPING = "stopping"
    STOPPED = "stopped"
    FAILED = "failed"


ALIVE = frozenset({Phase.STARTING, Phase.LOADING, Phase.READY})
"""Phases with a process that should be running."""


@dataclass(frozen=True, slots=True)
class Policy:
    """How the supervisor treats engines: the grace between SIGTERM and SIGKILL, crashes in a row before
    ``failed``, the first restart backoff (doubling per crash, up to ``backoff_max_s``), and how long a
    ready engine runs before its crash count is forgotten."""

    stop_grace_s: float = 10.0
    max_crashes: int = 3
    backoff_s: float = 1.0
    backoff_max_s: float = 60.0
    settle_s: float = 60.0

    def __post_init__(self) -> None:
        if self.stop_grace_s < 0 or self.backoff_s < 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError("grace and backoffs must be >= 0, the largest backoff >= the first")
        if self.max_crashes < 1:
            raise ValueError("max_crashes must be at least 1")

    def backoff(self, crashes: int) -> float:
        """Seconds before the restart that follows the ``crashes``-th crash in a row."""
        return float(min(self.backoff_max_s, self.backoff_s * 2.0 ** max(0, crashes - 1)))


@dataclass(frozen=True, slots=True)
class Wanted:
    """What the node's assignment says of one replica part: drain it, stop it by a deadline."""

    replica_id: str
    draining: bool = False
    stop_by: datetime | None = None


@dataclass(frozen=True, slots=True)
class Run:
    """One replica part's engine on this node, as the supervisor knows it."""

    replica_id: str
    phase: Phase
    since: datetime
    pid: int | None = None
    crashes: int = 0
    restarts: int = 0
    next_start_at: datetime | None = None
    kill_at: datetime | None = None
    ready_since: datetime | None = None
    draining: bool = False
    reason: str | None = None

    @property
    def state(self) -> str:
        """The rank's ``replica_state`` (shared.contracts.engines.EngineState)."""
        if self.phase is Phase.WAITING:
            return "starting"
        if self.phase is Phase.STOPPING or (self.draining and self.phase in ALIVE):
            return "draining"
        return self.phase.value


# -- observations ---------------------------------------------------------------------------------


def started(replica_id: str, pid: int, now: datetime, *, before: Run | None = None) -> Run:
    """The engine's process was spawned (again, after ``before`` crashed)."""
    if before is None:
        return Run(replica_id=replica_id, phase=Phase.STARTING, since=now, pid=pid)
    return replace(before, phase=Phase.STARTING, since=now, pid=pid, next_start_at=None, ready_since=None)


def launch_failed(replica_id: str, reason: str, now: datetime, *, before: Run | None = None) -> Run:
    """The engine could not even be spawned (no such command, a bad template): nothing to retry."""
    base = before or Run(replica_id=replica_id, phase=Phase.FAILED, since=now)
    return replace(base, phase=Phase.FAILED, since=now, pid=None, reason=reason, next_start_at=None)


def probed(run: Run, status: int | None, now: datetime, policy: Policy) -> Run:
    """A health probe's answer: None (nothing listens yet), 503 or another non-200 (loading), 200 (ready).
    Only a live run moves; a ready engine that stops answering goes back to ``loading`` (it is up but
    not serving) until its process exits."""
    if run.phase not in ALIVE:
        return run
    if status == 200:
        ready_since = run.ready_since if run.phase is Phase.READY and run.ready_since else now
        crashes = 0 if (now - ready_since).total_seconds() >= policy.settle_s else run.crashes
        phase_since = run.since if run.phase is Phase.READY else now
        return replace(run, phase=Phase.READY, since=phase_since, ready_since=ready_since, crashes=crashes)
    if status is None and run.phase is Phase.STARTING:
        return run
    if run.phase is Phase.LOADING:
        return run
    return replace(run, phase=Phase.LOADING, since=now, ready_since=None)


def exited(run: Run, code: int | None, now: datetime, policy: Policy) -> Run:
    """The engine's process ended with ``code`` (negative: killed by that signal). Asked to stop: stopped.
    Otherwise a crash: restarted after a backoff, or ``failed`` after ``max_crashes`` in a row."""
    how = _how(code)
    if run.phase is Phase.STOPPING:
        return replace(run, phase=Phase.STOPPED, since=now, pid=None, kill_at=None, reason=run.reason or how)
    if run.phase not in ALIVE:
        return run
    crashes = run.crashes + 1
    if crashes >= policy.max_crashes:
        reason = f"{how} ({crashes} crashes in a row)"
        return replace(run, phase=Phase.FAILED, since=now, pid=None, crashes=crashes, reason=reason)
    wait = timedelta(seconds=policy.backoff(crashes))
    return replace(
        run,
        phase=Phase.WAITING,
        since=now,
        pid=None,
        crashes=crashes,
        restarts=run.restarts + 1,
        next_start_at=now + wait,
        ready_since=None,
        reason=f"{how}; restarting in {wait.total_seconds():g}s",
    )


def _how(code: int | None) -> str:
    if code is None:
        return "exited"
    if code < 0:
        return f"killed by signal {-code}"
    return f"exited with code {code}"


# -- what to do ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Start:
    replica_id: str


@dataclass(frozen=True, slots=True)
class Stop:
    """SIGTERM now; ``kill_at``: SIGKILL then if it still runs."""

    replica_id: str
    kill_at: datetime
    reason: str


@dataclass(frozen=True, slots=True)
class Kill:
    replica_id: str


@dataclass(frozen=True, slots=True)
class Forget:
    """A part no longer assigned whose engine has ended: drop it (after its last report)."""

    replica_id: str


Action = Start | Stop | Kill | Forget


def plan(wanted: Mapping[str, Wanted], runs: Mapping[str, Run], now: datetime, policy: Policy) -> list[Action]:
    """The actions that bring what runs to what is wanted, in a stable order (by replica id): start what is
    assigned and not running (or due for its restart), stop what is no longer assigned or must be gone by
    a preemption deadline, kill what outlived its grace, forget what ended and is no longer assigned."""
    actions: list[Action] = []
    grace = timedelta(seconds=policy.stop_grace_s)
    for replica_id in sorted(set(wanted) | set(runs)):
        want, run = wanted.get(replica_id), runs.get(replica_id)
        if run is None:
            if want is not None and not _past(want, now):
                actions.append(Start(replica_id))
            continue
        if run.phase is Phase.STOPPING:
            if run.kill_at is not None and now >= run.kill_at:
                actions.append(Kill(replica_id))
            continue
        if want is None or _past(want, now) or _due(want, now, grace):
            if run.phase in ALIVE:
                why = "released" if want is None else "preempted: stopping by its deadline"
                actions.append(Stop(replica_id, kill_at=_kill_at(want, now, grace), reason=why))
            elif want is None:
                actions.append(Forget(replica_id))
            continue
        if run.phase is Phase.WAITING and run.next_start_at is not None and now >= run.next_start_at:
            actions.append(Start(replica_id))
    return actions


def _past(want: Wanted, now: datetime) -> bool:
    return want.stop_by is not None and now >= want.stop_by


def _due(want: Wanted, now: datetime, grace: timedelta) -> bool:
    """A preempted part is stopped early enough that SIGKILL, at the latest, lands by its deadline."""
    return want.stop_by is not None and now >= want.stop_by - grace


def _kill_at(want: Wanted | None, now: datetime, grace: timedelta) -> datetime:
    kill_at = now + grace
    if want is not None and want.stop_by is not None:
        kill_at = min(kill_at, max(now, want.stop_by))
    return kill_at


def stopping(run: Run, stop: Stop) -> Run:
    """SIGTERM was sent."""
    return replace(run, phase=Phase.STOPPING, kill_at=stop.kill_at, reason=stop.reason)


def marked(run: Run, want: Wanted | None) -> Run:
    """The assignment's drain flag carried onto the run (reported as ``draining``)."""
    draining = bool(want and want.draining)
    return run if run.draining == draining else replace(run, draining=draining)
