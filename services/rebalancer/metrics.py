"""The rebalancer's Prometheus metrics (``shared.infra.metrics`` CATALOGUE, owner rebalancer): copies placed
by plan kind, and how many targets each detector fires on."""

from __future__ import annotations

from collections.abc import Mapping

from shared.infra.metrics import ServiceMetrics


class RebalanceMetrics:
    def __init__(self, metrics: ServiceMetrics) -> None:
        self._migrations = metrics.counter("hetsched_migrations_total")
        self._firing = metrics.gauge("hetsched_rebalance_detectors_firing")

    def copy_placed(self, kind: str) -> None:
        """A plan of ``kind`` placed one replica's copy."""
        self._migrations.labels(kind).inc()

    def firing(self, targets: Mapping[str, int]) -> None:
        """Targets each detector fires on now, by detector name."""
        for name, count in targets.items():
            self._firing.labels(name).set(count)
