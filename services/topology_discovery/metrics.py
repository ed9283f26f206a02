"""Topology-discovery's Prometheus metrics (``shared.infra.metrics`` CATALOGUE, owner topology-discovery):
node profiles that changed, when the topology map was last refreshed, agent-reported nodes by liveness
state, and per node its re-profiles that failed and when its profile was last confirmed current.

A node's profile is confirmed current by a report that parsed (accepted or unchanged) and by each of its
heartbeats while its re-profiles succeed. Once its agent reports a re-profile that failed, heartbeats no
longer stamp it (the old profile stays in force, unconfirmed) until a profile parses again: the per-node
timestamp then ages, and ``TopologyMapStale`` fires for that node."""

from __future__ import annotations

from collections.abc import Mapping

from shared.domain.liveness import Liveness
from shared.infra.clock import Clock, system_clock
from shared.infra.metrics import ServiceMetrics


class TopologyMetrics:
    def __init__(self, metrics: ServiceMetrics, *, clock: Clock = system_clock) -> None:
        self._clock = clock
        self._drift = metrics.counter("hetsched_topology_drift_total")
        self._refreshed = metrics.gauge("hetsched_topology_last_profile_timestamp_seconds")
        self._nodes = metrics.gauge("hetsched_nodes")
        self._node_profiled = metrics.gauge("hetsched_node_last_profile_timestamp_seconds")
        self._failures = metrics.counter("hetsched_node_profile_failures_total")
        self._failing: set[str] = set()

    def profiles_changed(self, nodes: int) -> None:
        """Nodes re-profiled with another fingerprint (an NVLink down, a GPU gone)."""
        if nodes:
            self._drift.inc(nodes)

    def refreshed(self) -> None:
        """The map was confirmed current now: a profile accepted, a heartbeat, the inventory loaded."""
        self._refreshed.set(self._clock().timestamp())

    def nodes(self, counts: Mapping[Liveness, int]) -> None:
        """Agent-reported nodes by liveness state."""
        for state, count in counts.items():
            self._nodes.labels(state.value).set(count)

    def profiled(self, node: str) -> None:
        """The node's agent sent a profile that parsed: its profile is current now."""
        self._failing.discard(node)
        self._node_profiled.labels(node).set(self._clock().timestamp())

    def beat(self, node: str) -> None:
        """The node's agent beat: its profile is still current, unless its last re-profile failed."""
        if node not in self._failing:
            self._node_profiled.labels(node).set(self._clock().timestamp())

    def profile_failed(self, node: str) -> None:
        """The node's agent could not parse a re-profile: the old profile stays, no longer confirmed."""
        self._failing.add(node)
        self._failures.labels(node).inc()

    def forget(self, node: str) -> None:
        """The node left the fleet: its series go."""
        self._failing.discard(node)
        for metric in (self._node_profiled, self._failures):
            try:
                metric.remove(node)
            except KeyError:
                pass
