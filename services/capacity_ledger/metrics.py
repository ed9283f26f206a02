"""The ledger's Prometheus metrics (``shared.infra.metrics`` CATALOGUE, owner capacity-ledger).

Commits and drift are counted where they happen (the handlers); the HBM and TP-group gauges are
refreshed from the ledger's own tables every ``REFRESH_S`` by a background loop (``refresh_loop``),
never from the HTTP thread that serves ``/metrics``.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable

from services.capacity_ledger.store import MetricsFigures
from shared.domain.fleet import AcceleratorId
from shared.infra.metrics import GaugeSeries, Labels, ServiceMetrics

REFRESH_S = 5.0
"""How often the HBM and TP-group gauges are read again from the ledger's tables."""
NVLINKED = ("true", "cross_domain", "false")
"""The values of ``hetsched_tp_groups``'s ``nvlinked`` label."""


def _is_gpu(accelerator_id: str) -> bool:
    try:
        return AcceleratorId.parse(accelerator_id).gpu_index is not None
    except ValueError:
        return False


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole > 0 else 0.0


class LedgerMetrics:
    """The capacity ledger's catalogue metrics, registered on its ``ServiceMetrics``."""

    def __init__(self, metrics: ServiceMetrics, *, crossing_budget_bytes_per_s: int = 0) -> None:
        self._sku = GaugeSeries(metrics.gauge("hetsched_hbm_utilization_ratio"))
        self._accelerator = GaugeSeries(metrics.gauge("hetsched_accelerator_hbm_utilization_ratio"))
        self._free = GaugeSeries(metrics.gauge("hetsched_hbm_free_bytes"))
        self._groups = GaugeSeries(metrics.gauge("hetsched_tp_groups"))
        self._crossing = metrics.gauge("hetsched_nvlink_cross_island_bytes_per_second")
        self._commits = metrics.counter("hetsched_ledger_commits_total")
        self._drift = metrics.gauge("hetsched_hbm_drift_bytes")
        metrics.gauge("hetsched_cross_domain_budget_bytes_per_second").set(crossing_budget_bytes_per_s)
        # Each node's NVLink domains (member accelerator ids) as its latest profile event says; a node not
        # profiled since this process started is not known here.
        self._domains: dict[str, list[frozenset[str]]] = {}

    def profiled(self, node: str, domains: Iterable[Iterable[str]]) -> None:
        """A node's latest profile: its NVLink domains now (a link down splits or shrinks one)."""
        self._domains[node] = [frozenset(members) for members in domains]

    def forget(self, node: str) -> None:
        """The node left the fleet."""
        self._domains.pop(node, None)

    def _nvlinked(self, accelerators: tuple[str, ...], cross_domain_bytes_per_s: int) -> str:
        """``cross_domain``: placed by the ladder's budgeted cross-domain step (its traffic declared and
        counted against the cluster's budget). ``false``: placed inside one NVLink domain, but the current
        profiles of its nodes no longer have one domain holding all its accelerators (an NVLink down under
        it). ``true``: inside one domain, or its nodes not profiled since this process started (placement's
        declaration stands)."""
        if cross_domain_bytes_per_s > 0:
            return "cross_domain"
        nodes = {a.partition("/")[0] for a in accelerators}
        known = [d for node in sorted(nodes) for d in self._domains.get(node, ())]
        if not any(node in self._domains for node in nodes):
            return "true"
        members = set(accelerators)
        return "true" if any(members <= domain for domain in known) else "false"

    def committed(self, allocations: int) -> None:
        """Allocations the ledger just committed (their transaction is durable)."""
        if allocations:
            self._commits.inc(allocations)

    def drift(self, accelerator_id: str, difference_bytes: int) -> None:
        """Observed minus reserved bytes while the accelerator drifts; 0 once it is back in the band."""
        self._drift.labels(accelerator_id).set(difference_bytes)

    def show(self, figures: MetricsFigures) -> None:
        """Set the HBM and TP-group gauges to what the ledger's tables hold now.

        Per SKU: sum(reserved) / sum(usable) over its accelerators. A TP group is a live replica on more
        than one GPU (a TPU slice is not NVLink's business), counted by ``nvlinked`` (``_nvlinked``): true,
        cross_domain (the budgeted fallback) or false (its NVLink gone in its nodes' current profiles)."""
        usable: Counter[str] = Counter()
        reserved: Counter[str] = Counter()
        for a in figures.accelerators:
            usable[a.sku] += a.usable
            reserved[a.sku] += a.reserved
        self._sku.show({(sku,): _ratio(reserved[sku], usable[sku]) for sku in usable})
        self._accelerator.show({(a.id, a.node, a.sku): _ratio(a.reserved, a.usable) for a in figures.accelerators})
        self._free.show({(a.id,): max(0, a.usable - a.reserved) for a in figures.accelerators})
        groups: Counter[Labels] = Counter(
            (str(len(g.accelerators)), self._nvlinked(g.accelerators, g.cross_domain_bytes_per_s))
            for g in figures.groups
            if all(_is_gpu(a) for a in g.accelerators)
        )
        # Every nvlinked value of every degree seen, so a share over them never divides by a missing series.
        degrees = {degree for degree, _ in groups}
        self._groups.show({(d, nv): groups.get((d, nv), 0) for d in degrees for nv in NVLINKED})
        self._crossing.set(figures.cross_domain_bytes_per_s)


async def refresh_loop(
    metrics: LedgerMetrics,
    read: Callable[[], Awaitable[MetricsFigures]],
    *,
    period_s: float = REFRESH_S,
    log: logging.Logger | None = None,
) -> None:
    """Forever: read the figures and show them, every ``period_s`` (first at once)."""
    while True:
        try:
            metrics.show(await read())
        except Exception:
            (log or logging.getLogger("hetsched.capacity-ledger")).exception("metrics refresh failed; retrying")
        await asyncio.sleep(period_s)
