"""The router's Prometheus metrics (``shared.infra.metrics`` CATALOGUE, owner cross-region-router): the RTT
to the region each request was routed to, and how often a tenant or session moved to another region."""

from __future__ import annotations

from shared.infra.metrics import ServiceMetrics


class RouterMetrics:
    def __init__(self, metrics: ServiceMetrics) -> None:
        self._rtt = metrics.histogram("hetsched_route_rtt_seconds")
        self._switches = metrics.counter("hetsched_route_switches_total")

    def routed(self, *, rtt_ms: float | None, moved: bool) -> None:
        """One request routed: its origin -> region RTT (when the regions file knows it), and whether its
        tenant or session moved to another region with it."""
        if rtt_ms is not None:
            self._rtt.observe(rtt_ms / 1000)
        if moved:
            self._switches.inc()
