"""A replica's lifecycle from its ranks (docs/PLACEMENT.md "Replica lifecycle"): each node's agent reports the
engine it runs for one rank of the replica (``replica_state``); placement keeps the latest report per rank
and folds the ranks into the replica's state. Pure: times are handed in (milliseconds on one clock, the
reports' own ``occurred_at``), nothing is read or written.

The fold, in order: ``failed`` when any rank failed; ``stopped`` when every rank stopped; ``draining`` when
the rebalancer drains the replica, a rank drains, or some ranks stopped while others run; ``ready`` when
every rank (``ranks``, as the reports count them) is ready; otherwise the least advanced of the ranks
(``starting`` before ``loading``; a rank not heard from yet counts as ``starting``). Reports older than the
stale window count as absent; a replica with none left is judged as before the agents reported
(``listing.replica_state``: draining, ready on its engine's fresh healthy status, else placed)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from shared.domain.placement.listing import ReplicaState

ORDER: tuple[str, ...] = ("starting", "loading", "ready", "draining", "stopped", "failed")
"""A rank's states in lifecycle order (the rank of a state breaks ties between two reports of one instant)."""

LIVE: frozenset[str] = frozenset({"starting", "loading", "ready", "draining"})
"""States of a rank whose engine runs or is coming up: its reports keep the replica's lease renewed."""


@dataclass(frozen=True, slots=True)
class RankReport:
    """One rank's latest word: its state, the ranks the replica spans, the head's endpoint, when (ms)."""

    rank: int
    ranks: int
    state: str
    at_ms: float
    node: str = ""
    endpoint: str | None = None

    def key(self) -> tuple[float, int, str, str]:
        """The order of two reports of one rank: the later wins; at one instant, the further state, then the
        node and endpoint (so the fold never depends on the order reports arrive in)."""
        return (self.at_ms, ORDER.index(self.state) if self.state in ORDER else -1, self.node, self.endpoint or "")


def record(reports: Mapping[int, RankReport], report: RankReport) -> dict[int, RankReport]:
    """``reports`` with ``report`` in it when it is the latest of its rank (a new dict; ``reports`` is kept)."""
    held = reports.get(report.rank)
    out = dict(reports)
    if held is None or report.key() > held.key():
        out[report.rank] = report
    return out


def latest(reports: Iterable[RankReport]) -> dict[int, RankReport]:
    """The latest report of each rank, whatever order they come in."""
    out: dict[int, RankReport] = {}
    for report in reports:
        out = record(out, report)
    return out


def fresh(reports: Mapping[int, RankReport], *, now_ms: float, stale_ms: float) -> dict[int, RankReport]:
    """The reports not older than ``stale_ms`` at ``now_ms`` (the others count as absent)."""
    return {rank: r for rank, r in reports.items() if now_ms - r.at_ms <= stale_ms}


def fold(reports: Mapping[int, RankReport], *, draining: bool) -> ReplicaState | None:
    """The replica's state from its ranks' fresh reports (``draining``: the rebalancer moves it off); None
    when no rank reported (the caller judges it as before the agents reported)."""
    if not reports:
        return None
    states = [r.state for r in reports.values()]
    ranks = max(r.ranks for r in reports.values())
    if "failed" in states:
        return ReplicaState.FAILED
    heard = {rank for rank in reports if rank < ranks}
    stopped = [s for s in states if s == "stopped"]
    if len(stopped) == len(states) and len(heard) >= ranks:
        return ReplicaState.STOPPED
    if draining or "draining" in states or stopped:
        return ReplicaState.DRAINING
    if len(heard) >= ranks and all(s == "ready" for s in states):
        return ReplicaState.READY
    if len(heard) < ranks or "starting" in states:
        return ReplicaState.STARTING  # a rank not heard from yet has not started as far as anyone knows
    return ReplicaState.LOADING


def head_endpoint(reports: Mapping[int, RankReport], state: ReplicaState | None) -> str | None:
    """The head rank's (rank 0) endpoint, from ``ready`` on (ready or draining); None before or without one."""
    if state not in (ReplicaState.READY, ReplicaState.DRAINING):
        return None
    head = reports.get(0)
    return head.endpoint if head is not None else None


def alive(reports: Mapping[int, RankReport]) -> bool:
    """Whether a rank's engine runs or is coming up (no rank failed): its lease is worth renewing."""
    states = {r.state for r in reports.values()}
    return bool(states & LIVE) and "failed" not in states


def renew_due(*, expires_at_ms: float | None, lease_ms: float, now_ms: float) -> bool:
    """Renew a lease of ``lease_ms`` when less than half of it is left (a lease end not known: renew)."""
    if expires_at_ms is None:
        return True
    return expires_at_ms - now_ms < lease_ms / 2


def rank_order(binding: Sequence[str], placed: Sequence[str]) -> list[str]:
    """A replica's nodes in rank order (rank 0, the head, first): the binding's nodes in its order, then
    any node placed but not bound (none, for a GPU replica placed with its binding), each once."""
    return list(dict.fromkeys([*binding, *placed]))
