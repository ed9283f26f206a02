"""The engines the node agents run for placement's replicas, as their ``replica_state`` reports tell
(TELEMETRY, one per rank): the latest report of each rank, in memory, folded into each replica's lifecycle
state by the pure core (``shared.domain.placement.lifecycle``). Nothing here is durable: after a restart
the agents' next reports (every status interval) bring it back.

The trust check: a report counts only from one of the replica's own nodes (a replica placement knows,
``nodes_of``); another node's agent speaking for it is ignored, as for ``engine_status``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Set
from datetime import datetime

from shared.contracts.engines import ReplicaStateEvent
from shared.domain.placement.lifecycle import RankReport, alive, fold, fresh, head_endpoint, record
from shared.domain.placement.listing import ReplicaState, replica_state
from shared.infra.clock import Clock


def epoch_ms(at: datetime) -> float:
    return at.timestamp() * 1000


class EngineStates:
    """Each replica's ranks as their agents report them. ``nodes_of``: a replica's nodes (None: not one of
    placement's replicas); ``stale_s``: a report older than this counts as absent; ``clock``: wall time,
    the clock the reports' ``occurred_at`` is on."""

    def __init__(self, *, nodes_of: Callable[[str], Set[str] | None], stale_s: float, clock: Clock) -> None:
        self._nodes_of = nodes_of
        self._stale_ms = stale_s * 1000
        self._clock = clock
        self._ranks: dict[str, dict[int, RankReport]] = {}

    def report(self, event: ReplicaStateEvent, at: datetime) -> bool:
        """Keep one rank's report (if it is that rank's latest); False when it is ignored: not one of
        placement's replicas, or sent from a node the replica is not on."""
        nodes = self._nodes_of(event.replica_id)
        if nodes is None or event.node not in nodes:
            return False
        rank = RankReport(
            rank=event.rank,
            ranks=event.ranks,
            state=event.state,
            at_ms=epoch_ms(at),
            node=event.node,
            endpoint=event.endpoint,
        )
        self._ranks[event.replica_id] = record(self._ranks.get(event.replica_id, {}), rank)
        return True

    def _fresh(self, replica_id: str) -> dict[int, RankReport]:
        held = self._ranks.get(replica_id)
        if not held:
            return {}
        if self._nodes_of(replica_id) is None:  # the replica ended: its ranks go with it
            del self._ranks[replica_id]
            return {}
        return fresh(held, now_ms=epoch_ms(self._clock()), stale_ms=self._stale_ms)

    def folded(self, replica_id: str, *, draining: bool = False) -> ReplicaState | None:
        """The state the replica's fresh rank reports fold into; None when none is fresh."""
        return fold(self._fresh(replica_id), draining=draining)

    def reported(self, draining: Set[str]) -> dict[str, ReplicaState]:
        """Every replica with fresh rank reports, and the state they fold into."""
        out: dict[str, ReplicaState] = {}
        for replica_id in list(self._ranks):
            state = self.folded(replica_id, draining=replica_id in draining)
            if state is not None:
                out[replica_id] = state
        return out

    def state(self, replica_id: str, *, draining: bool, serving: bool) -> ReplicaState:
        """The replica's lifecycle state: its ranks' when they reported lately, else the engine rule."""
        return replica_state(draining=draining, serving=serving, reported=self.folded(replica_id, draining=draining))

    def admissible(self, replica_id: str) -> bool:
        """Whether admission may choose the replica as far as its agents say: ready, or not reported by one
        (an engine reporting only its status, e.g. ``hetsched engine-sim``, keeps the engine rule)."""
        state = self.folded(replica_id)
        return state is None or state is ReplicaState.READY

    def endpoint(self, replica_id: str, *, draining: bool = False) -> str | None:
        """The head rank's endpoint from ``ready`` on; None before, or with no fresh report."""
        ranks = self._fresh(replica_id)
        return head_endpoint(ranks, fold(ranks, draining=draining))

    def alive(self, replica_id: str) -> bool:
        """Whether a rank reports, fresh, an engine running or coming up (and none failed)."""
        return alive(self._fresh(replica_id))

    def forget(self, replica_ids: Iterable[str]) -> None:
        for replica_id in replica_ids:
            self._ranks.pop(replica_id, None)
