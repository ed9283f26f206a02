"""When a moved replica's old copy may be drained: once the engine of its new copy serves.

A plan places a copy, then drains and releases the old replica. Where the nodes' agents run the engines,
placing the copy only reserves its accelerators: the engine still has to start and load its weights, which
takes minutes for a large model. Each rank's agent reports the engine's lifecycle (TELEMETRY
``replica_state``); the copy serves once every rank reports ``ready``. These rules read those reports:
``EngineRanks`` folds a replica's ranks, ``copy_readiness`` says whether the old replica may go now, must
wait, or whether the move is to be rolled back. Pure: ``now`` is passed in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum


class WaitForReady(StrEnum):
    """Whether a move waits for its copy's engine before it drains the old replica."""

    AUTO = "auto"  # where an agent runs engines on the copy's nodes (or the copy itself reported)
    ALWAYS = "always"  # every move: a copy that never reports times out and the move rolls back
    NEVER = "never"  # no move: the old replica is drained as soon as every copy is placed


@dataclass(frozen=True, slots=True)
class RankReport:
    """One rank's latest lifecycle state, as its node's agent reported it at ``at``."""

    state: str  # shared.contracts.engines.EngineState
    at: datetime
    reason: str | None = None
    changed_at: datetime | None = None  # when the rank entered ``state`` (None: ``at``)

    @property
    def since(self) -> datetime:
        """When the rank entered its state."""
        return self.changed_at if self.changed_at is not None else self.at


GONE = frozenset({"failed", "stopped"})
"""States after which a rank never serves: ``failed`` (crashed too often, cannot start) and ``stopped``
(exited, not restarted)."""


@dataclass(frozen=True, slots=True)
class EngineRanks:
    """A replica's engine ranks as their agents last reported them: ``ranks`` nodes, each rank's report."""

    ranks: int = 1
    by_rank: Mapping[int, RankReport] = field(default_factory=dict)

    def reported(self, *, rank: int, ranks: int, state: str, at: datetime, reason: str | None = None) -> EngineRanks:
        """With one rank's report; a report older than the rank's last one is left out."""
        known = self.by_rank.get(rank)
        if known is not None and known.at > at:
            return self
        changed = known.since if known is not None and known.state == state and ranks == self.ranks else at
        report = RankReport(state, at, reason, changed_at=changed)
        return dataclasses.replace(self, ranks=ranks, by_rank={**self.by_rank, rank: report})

    @property
    def changed_at(self) -> datetime | None:
        """When a rank last changed state (the latest of the ranks' ``since``); None when none reported."""
        return max((report.since for report in self.by_rank.values()), default=None)

    @property
    def ready(self) -> bool:
        """Every rank (0 .. ranks-1) reports ``ready``."""
        return all(
            (report := self.by_rank.get(rank)) is not None and report.state == "ready" for rank in range(self.ranks)
        )

    @property
    def gone(self) -> RankReport | None:
        """A rank that will never serve (``failed`` or ``stopped``), if any: the lowest."""
        return next((self.by_rank[r] for r in sorted(self.by_rank) if self.by_rank[r].state in GONE), None)

    def describe(self) -> str:
        """``rank 1 failed: exited with code 1`` for a gone rank; else each rank's state (``loading, ready``)."""
        gone = next((r for r in sorted(self.by_rank) if self.by_rank[r].state in GONE), None)
        if gone is not None:
            report = self.by_rank[gone]
            return f"rank {gone} {report.state}" + (f": {report.reason}" if report.reason else "")
        return ", ".join(self.by_rank[r].state if r in self.by_rank else "unreported" for r in range(self.ranks))


class Readiness(StrEnum):
    """What a move does next with its copy's engine."""

    READY = "ready"  # every rank of the copy serves: drain and release the old replica
    UNWATCHED = "unwatched"  # nothing runs engines there (or ``never``): as without agents, drain now
    WAIT = "wait"  # the copy starts or loads (or it is too early to tell): the old replica keeps serving
    FAILED = "failed"  # a rank of the copy failed or stopped: roll the move back
    TIMED_OUT = "timed_out"  # not ready within the timeout: roll the move back


def copy_readiness(
    engine: EngineRanks | None,
    *,
    mode: WaitForReady,
    agent_seen: bool,
    since: datetime,
    watching_since: datetime,
    now: datetime,
    timeout_s: float,
    stale_s: float,
) -> Readiness:
    """May the old replica of a move be drained at ``now``?

    ``engine``: the copy's ranks as reported (None: no report seen). ``agent_seen``: a node of the copy
    reported any replica's ``replica_state`` within ``stale_s`` before ``since`` or after it (an agent runs
    engines there). ``since``: when the copy was placed, or, for a plan resumed after a restart, when this
    process first saw it. ``watching_since``: when this process started following the reports (agents
    republish every status interval, so silence means something only after ``stale_s`` of following).

    ``never`` -> UNWATCHED. A copy with a failed or stopped rank -> FAILED; every rank ready -> READY.
    ``auto`` with no report of the copy and no agent seen on its nodes -> UNWATCHED (the fleet runs its
    engines by other means), but WAIT while this process has followed the reports for less than
    ``stale_s`` (just started: the agents may not have reported yet). Otherwise WAIT until ``timeout_s``
    after ``since``, then TIMED_OUT.
    """
    if mode is WaitForReady.NEVER:
        return Readiness.UNWATCHED
    if engine is not None:
        if engine.gone is not None:
            return Readiness.FAILED
        if engine.ready:
            return Readiness.READY
    elif mode is WaitForReady.AUTO and not agent_seen:
        if (now - watching_since).total_seconds() >= stale_s:
            return Readiness.UNWATCHED
        return Readiness.WAIT
    if (now - since).total_seconds() >= timeout_s:
        return Readiness.TIMED_OUT
    return Readiness.WAIT
