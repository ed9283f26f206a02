"""The rebalancer's read model: what the TOPOLOGY, PLACEMENT and LEDGER events and the engines' reports
(TELEMETRY ``engine_status``, and each rank's lifecycle ``replica_state`` from its node's agent) told,
folded in memory.

Pure and synchronous: each fold takes a contract or domain value and changes the view; no IO, no clock.
Consumers call the folds only once their transaction has committed (``UnitOfWork.after_commit``), and
start-up folds the rows the tables hold, so the view follows what Postgres holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

from services.rebalancer.mapping import cliques_of, replica_of
from shared.contracts.engines import ReplicaStateEvent
from shared.contracts.placement import PlacementEvent, PlaceRequest
from shared.contracts.topology import EngineStatusEvent, NodeProfileEvent, TpuPodEvent
from shared.domain.fleet import AcceleratorId, NodeProfile
from shared.domain.rebalance.drain import EngineReport
from shared.domain.rebalance.plans import Replica
from shared.domain.rebalance.ready import EngineRanks
from shared.domain.rebalance.signals import EngineLoad, engine_load
from shared.domain.topology.tpu import TpuGrid, TpuSlice, TpuType, allocate
from shared.infra.profiles import profile_from_payload


@dataclass(frozen=True, slots=True)
class Allocation:
    """A live ledger allocation: bytes per accelerator (``parent_id`` is set only on legacy ``request`` rows)."""

    allocation_id: str
    kind: str
    parent_id: str | None
    bytes: dict[str, int]


@dataclass
class RebalanceView:
    """What the events told: replicas (with the request each was placed with), allocations, each replica's
    latest engine report (what it has in flight), the fleet's node profiles and NVLink cliques, TPU pods."""

    replicas: dict[str, Replica] = field(default_factory=dict)
    requests: dict[str, PlaceRequest] = field(default_factory=dict)
    allocations: dict[str, Allocation] = field(default_factory=dict)
    engines: dict[str, EngineReport] = field(default_factory=dict)  # replica -> its engine's latest report
    loads: dict[str, EngineLoad] = field(default_factory=dict)  # replica -> its engine's latest load
    unproven: set[str] = field(default_factory=set)  # copies made for hot replicas that carried no load yet
    ranks: dict[str, EngineRanks] = field(default_factory=dict)  # replica -> its ranks' lifecycle states
    agents: dict[str, datetime] = field(default_factory=dict)  # node -> its last replica_state (it runs engines)
    by_node: dict[str, set[str]] = field(default_factory=dict)  # node -> replica allocations on it
    profiles: dict[str, NodeProfile] = field(default_factory=dict)
    cliques: dict[str, list[frozenset[str]]] = field(default_factory=dict)
    pods: dict[str, TpuPodEvent] = field(default_factory=dict)
    nvlinked: set[str] = field(default_factory=set)  # TP groups placed to be NVLinked (no cross-domain, no pipeline)

    # -- folds ---------------------------------------------------------------------------------------

    def placed(self, event: PlacementEvent) -> None:
        """A ``placement_decided`` event: the replica it placed (none when not placed or from an older
        placement without its request)."""
        replica = replica_of(event)
        if replica is None or event.request is None:
            return
        self.replicas[replica.allocation_id] = replica
        self.requests[replica.allocation_id] = event.request
        reply = event.reply
        one_node = len({p.node for p in reply.placements}) == 1
        if replica.tp > 1 and one_node and reply.pp == 1 and reply.fallback != "cross_domain":
            self.nvlinked.add(replica.allocation_id)

    def released(self, allocation_id: str) -> None:
        """A ``placement_released`` event: the replica is gone."""
        self.replicas.pop(allocation_id, None)
        self.requests.pop(allocation_id, None)
        self.engines.pop(allocation_id, None)
        self.loads.pop(allocation_id, None)
        self.unproven.discard(allocation_id)
        self.ranks.pop(allocation_id, None)
        self.nvlinked.discard(allocation_id)

    def allocated(self, allocation: Allocation) -> None:
        """An ``allocation_committed`` event."""
        self.allocations[allocation.allocation_id] = allocation
        if allocation.kind == "replica":  # the drift check reads a node's replicas on each of its samples
            for node in _hosts(allocation):
                self.by_node.setdefault(node, set()).add(allocation.allocation_id)

    def allocation_ended(self, allocation_id: str) -> None:
        """An ``allocation_released`` or ``allocation_expired`` event."""
        gone = self.allocations.pop(allocation_id, None)
        if gone is None:
            return
        for node in _hosts(gone):
            self.by_node.get(node, set()).discard(gone.allocation_id)

    def engine_reported(self, event: EngineStatusEvent, at: datetime) -> None:
        """An ``engine_status`` report made at ``at``: the replica's latest. Kept for replicas placed only
        (one released or unknown is left out, so reports of engines gone hold no memory); an older report
        arriving late is left out."""
        if event.replica_id not in self.replicas:
            return
        known = self.engines.get(event.replica_id)
        if known is not None and known.at > at:
            return
        self.engines[event.replica_id] = EngineReport(event.queue_depth, event.kv_used_bytes, at)
        self.loads[event.replica_id] = engine_load(
            kv_usage=event.kv_usage,
            kv_used_bytes=event.kv_used_bytes,
            kv_total_bytes=event.kv_total_bytes,
            queue_depth=event.queue_depth,
            running=event.running_requests,
            at=at,
        )

    def engines_said(self, node: str, at: datetime) -> None:
        """``node``'s agent says (in its GPU samples) that it supervises the node's engines."""
        last = self.agents.get(node)
        if last is None or at > last:
            self.agents[node] = at

    def replica_state(self, event: ReplicaStateEvent, at: datetime) -> None:
        """A rank's ``replica_state`` made at ``at``: its node runs engines (whatever the replica), and the
        replica's ranks are folded for replicas placed only (as ``engine_reported``)."""
        last = self.agents.get(event.node)
        if last is None or at > last:
            self.agents[event.node] = at
        if event.replica_id not in self.replicas:
            return
        known = self.ranks.get(event.replica_id, EngineRanks())
        self.ranks[event.replica_id] = known.reported(
            rank=event.rank, ranks=event.ranks, state=event.state, at=at, reason=event.reason
        )

    def nodes_of(self, allocation_id: str) -> frozenset[str]:
        """The nodes a GPU replica runs on (its first node and its GPUs' hosts); none when unknown or TPU."""
        replica = self.replicas.get(allocation_id)
        if replica is None or replica.tpu_pod is not None:
            return frozenset()
        hosts = {AcceleratorId.parse(a).host for a in replica.accelerators}
        return frozenset(hosts | ({replica.node} if replica.node else set()))

    def profiled(self, event: NodeProfileEvent) -> bool:
        """A ``node_profiled`` / ``node_changed`` event; True when a node already known has other NVLink
        cliques now (its TP groups are to be checked). A profile that does not parse is left out."""
        before = self.cliques.get(event.node)
        try:
            profile = profile_from_payload(event.profile)
        except ValueError:
            return False
        self.profiles[event.node] = profile
        self.cliques[event.node] = sorted(cliques_of(profile), key=sorted)
        return before is not None and before != self.cliques[event.node]

    def node_removed(self, node: str) -> None:
        self.profiles.pop(node, None)
        self.cliques.pop(node, None)

    def pod_profiled(self, event: TpuPodEvent) -> None:
        self.pods[event.pod] = event

    # -- reads ---------------------------------------------------------------------------------------

    def agent_runs_engines(self, nodes: frozenset[str], now: datetime, *, stale_s: float) -> bool:
        """An agent on one of ``nodes`` reported some replica's lifecycle within ``stale_s`` of ``now``."""
        return any(
            (last := self.agents.get(node)) is not None and (now - last).total_seconds() < stale_s for node in nodes
        )

    def replicas_on(self, node: str) -> list[Replica]:
        return [r for r in self.replicas.values() if r.node == node]

    def allocations_on(self, node: str) -> list[Allocation]:
        return [self.allocations[a] for a in self.by_node.get(node, ()) if a in self.allocations]

    def pod_grid(self, name: str) -> tuple[TpuGrid | None, dict[str, TpuSlice]]:
        """The pod's grid with the slices of its replicas allocated, and those slices by replica; no grid
        when the pod is unknown or its shape is not one of its type's."""
        pod = self.pods.get(name)
        if pod is None:
            return None, {}
        try:
            grid = TpuGrid.empty(TpuType(pod.type), tuple(pod.shape))
        except ValueError:
            return None, {}
        slices: dict[str, TpuSlice] = {}
        for replica in self.replicas.values():
            if replica.tpu_pod == name and replica.tpu_slice is not None:
                try:
                    grid = allocate(grid, replica.tpu_slice)
                except ValueError:
                    continue
                slices[replica.allocation_id] = replica.tpu_slice
        return grid, slices


def _hosts(allocation: Allocation) -> set[str]:
    return {AcceleratorId.parse(a).host for a in allocation.bytes}
