"""The gateway's Prometheus metrics (names in ``shared.infra.metrics.CATALOGUE``): request-level SLOs."""

from __future__ import annotations

from collections.abc import Mapping

from shared.infra.metrics import ServiceMetrics

Outcome = str  # admitted | queued | rejected | failed_over | failed


class GatewayMetrics:
    def __init__(self, metrics: ServiceMetrics) -> None:
        self.registry = metrics.registry
        self._ttft = metrics.histogram("hetsched_gateway_ttft_seconds")
        self._tpot = metrics.histogram("hetsched_gateway_tpot_seconds")
        self._e2e = metrics.histogram("hetsched_gateway_e2e_seconds")
        self._requests = metrics.counter("hetsched_gateway_requests_total")
        self._targets = metrics.gauge("hetsched_gateway_slo_ttft_seconds")
        self.in_flight = metrics.gauge("hetsched_gateway_in_flight_requests")
        self._added = metrics.histogram("hetsched_gateway_added_seconds")

    def targets(self, ttft_s: Mapping[str, float]) -> None:
        for model, seconds in ttft_s.items():
            self._targets.labels(model).set(seconds)

    def outcome(self, model: str, outcome: Outcome, reason: str = "") -> None:
        self._requests.labels(model, outcome, reason).inc()

    def added(self, seconds: float) -> None:
        self._added.observe(seconds)

    def served(
        self,
        labels: tuple[str, str, str, str],
        *,
        ttft_s: float | None,
        e2e_s: float,
        completion_tokens: int,
    ) -> None:
        """One answered request: its TTFT, its time per output token after the first, its end to end."""
        if ttft_s is not None:
            self._ttft.labels(*labels).observe(ttft_s)
            if completion_tokens > 1 and e2e_s > ttft_s:
                self._tpot.labels(*labels).observe((e2e_s - ttft_s) / (completion_tokens - 1))
        self._e2e.labels(*labels).observe(e2e_s)
