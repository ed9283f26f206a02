"""Topology-discovery's Prometheus metrics (``shared.infra.metrics`` CATALOGUE, owner topology-discovery):
node profiles that changed, and when the topology map was last refreshed."""

from __future__ import annotations

from shared.infra.clock import Clock, system_clock
from shared.infra.metrics import ServiceMetrics


class TopologyMetrics:
    def __init__(self, metrics: ServiceMetrics, *, clock: Clock = system_clock) -> None:
        self._clock = clock
        self._drift = metrics.counter("hetsched_topology_drift_total")
        self._refreshed = metrics.gauge("hetsched_topology_last_profile_timestamp_seconds")

    def profiles_changed(self, nodes: int) -> None:
        """Nodes re-profiled with another fingerprint (an NVLink down, a GPU gone)."""
        if nodes:
            self._drift.inc(nodes)

    def refreshed(self) -> None:
        """The map was confirmed current now: a profile accepted, a heartbeat, the inventory loaded."""
        self._refreshed.set(self._clock().timestamp())
