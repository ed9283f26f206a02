"""The reservation filler's Prometheus metrics (``shared.infra.metrics`` CATALOGUE, owner reservation-filler):
fill rate per tenant and cluster and overall, and what idle reserved accelerators cost per tenant.

The figures are worked out from the filler's tables every ``METRICS_EVERY_S`` by its tick (``FillFigures``),
never from the HTTP thread that serves ``/metrics``. While nothing is reserved the overall fill rate is NaN
(no figure: an alert on ``< 0.7`` stays quiet), as are the per-scope series of reservations that ended.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from shared.infra.metrics import GaugeSeries, ServiceMetrics

METRICS_EVERY_S = 10.0
"""How often the figures are worked out again."""


@dataclass(frozen=True, slots=True)
class FillFigures:
    by_tenant_cluster: Mapping[tuple[str, str], float] = field(default_factory=dict)
    overall: float | None = None  # None: nothing reserved
    idle_cost_by_tenant: Mapping[str, float] = field(default_factory=dict)


class ReservationMetrics:
    def __init__(self, metrics: ServiceMetrics) -> None:
        self._fill = GaugeSeries(metrics.gauge("hetsched_reservation_fill_rate"))
        self._overall = metrics.gauge("hetsched_reservation_fill_rate_overall")
        self._idle_cost = GaugeSeries(metrics.gauge("hetsched_reservation_idle_cost_usd_per_hour"))
        self._overall.set(math.nan)  # no figure before the first one is worked out

    def show(self, figures: FillFigures) -> None:
        self._fill.show({(tenant, cluster): rate for (tenant, cluster), rate in figures.by_tenant_cluster.items()})
        self._overall.set(math.nan if figures.overall is None else figures.overall)
        self._idle_cost.show({(tenant,): cost for tenant, cost in figures.idle_cost_by_tenant.items()})
