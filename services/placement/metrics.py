"""Placement's Prometheus metrics (``shared.infra.metrics`` CATALOGUE, owner placement).

Decisions are counted where they are made (``PlacementMetrics``, used by the handlers). What the view
and admission hold (PCIe utilisation per node, TPU fragmentation per pod, admission's queue per tenant)
is read into gauges every ``REFRESH_S`` by a background loop (``ViewMetrics.run``) on the event loop,
never from the HTTP thread that serves ``/metrics``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from prometheus_client import Counter, Histogram

from shared.domain.errors import ErrorCode
from shared.domain.placement.listing import ReplicaState
from shared.domain.placement.types import Decision, FleetSnapshot
from shared.domain.topology.tpu import fragmentation
from shared.infra.metrics import GaugeSeries, ServiceMetrics

REFRESH_S = 5.0
"""How often the view's gauges are read again."""


@dataclass(frozen=True)
class PlacementMetrics:
    """Each pure decision's time, and what it decided: a replica placed, or refused (by error code)."""

    decision_seconds: Histogram
    rejections: Counter
    placements: Counter

    @classmethod
    def create(cls, metrics: ServiceMetrics) -> PlacementMetrics:
        return cls(
            decision_seconds=metrics.histogram("hetsched_placement_decision_seconds"),
            rejections=metrics.counter("hetsched_placement_rejections_total"),
            placements=metrics.counter("hetsched_placements_total"),
        )

    def decided(self, elapsed_ms: float) -> None:
        self.decision_seconds.observe(elapsed_ms / 1000)

    def count(self, decision: Decision) -> None:
        """A decision's outcome, once it is final (placed in the ledger, or refused)."""
        if decision.placed:
            self.placements.inc()
        else:
            self.rejections.labels(decision.error_code or ErrorCode.NO_CAPACITY).inc()


class ViewMetrics:
    """PCIe utilisation per node and TPU fragmentation per pod (from the view's snapshot), the requests
    waiting in admission's fair queue per tenant, each engine's KV cache use and the preemptions engines
    reported per model (from ``engine_status``), and the replicas whose agents report by lifecycle state,
    with how many have been ``loading`` for longer than ``load_expected_s`` (seen loading since, on
    ``now_s``'s clock; a replica that leaves ``loading`` starts again from 0 if it comes back to it)."""

    def __init__(
        self,
        metrics: ServiceMetrics,
        *,
        snapshot: Callable[[], FleetSnapshot],
        queue_depths: Callable[[], Mapping[str, int]],
        replicas: Callable[[], Mapping[str, ReplicaState]] = dict,
        kv_usage: Callable[[], Mapping[str, tuple[str, float]]] = dict,
        preempted: Callable[[], Mapping[str, int]] = dict,
        load_expected_s: float = 600.0,
        now_s: Callable[[], float] = time.monotonic,
        log: logging.Logger | None = None,
    ) -> None:
        self._snapshot = snapshot
        self._queue_depths = queue_depths
        self._replicas = replicas
        self._kv_usage = kv_usage
        self._preempted = preempted
        self._preempted_shown: dict[str, int] = {}
        self._kv = GaugeSeries(metrics.gauge("hetsched_engine_kv_usage_ratio"))
        self._preemptions = metrics.counter("hetsched_engine_preemptions_total")
        self._load_expected_s = load_expected_s
        self._now_s = now_s
        self._loading_since: dict[str, float] = {}
        self._states = metrics.gauge("hetsched_replicas")
        self._overdue = metrics.gauge("hetsched_replicas_loading_overdue")
        self._log = log or logging.getLogger("hetsched.placement")
        self._pcie = GaugeSeries(metrics.gauge("hetsched_pcie_utilization_ratio"))
        self._fragmentation = GaugeSeries(metrics.gauge("hetsched_tpu_fragmentation_ratio"))
        self._queue = metrics.gauge("hetsched_admit_queue_depth")
        self._queued: set[str] = set()

    def refresh(self) -> None:
        snapshot = self._snapshot()
        self._pcie.show({(node,): util for node, util in snapshot.pcie_util.items()})
        # A grid keeps the answer of its own searches: a pod unchanged since the last refresh costs nothing.
        self._fragmentation.show({(pod,): fragmentation(state.grid) for pod, state in snapshot.tpu_pods.items()})
        depths = self._queue_depths()
        # A tenant whose requests all left the queue shows 0 (it was seen waiting), not nothing.
        for tenant in self._queued | depths.keys():
            self._queue.labels(tenant).set(depths.get(tenant, 0))
        self._queued |= depths.keys()
        self._refresh_replicas()
        self._refresh_engines()

    def _refresh_engines(self) -> None:
        self._kv.show({(replica, model): usage for replica, (model, usage) in self._kv_usage().items()})
        for model, total in self._preempted().items():
            added = total - self._preempted_shown.get(model, 0)
            if added > 0:
                self._preemptions.labels(model).inc(added)
            self._preempted_shown[model] = total

    def _refresh_replicas(self) -> None:
        states = self._replicas()
        now = self._now_s()
        counts = dict.fromkeys(ReplicaState, 0)
        for state in states.values():
            counts[state] += 1
        for state, count in counts.items():
            self._states.labels(state.value).set(count)
        loading = {replica for replica, state in states.items() if state is ReplicaState.LOADING}
        self._loading_since = {replica: self._loading_since.get(replica, now) for replica in loading}
        overdue = sum(1 for since in self._loading_since.values() if now - since > self._load_expected_s)
        self._overdue.set(overdue)

    async def run(self) -> None:
        """Forever: refresh the gauges every ``REFRESH_S`` (first at once)."""
        while True:
            try:
                self.refresh()
            except Exception:
                self._log.exception("placement metrics refresh failed; retrying")
            await asyncio.sleep(REFRESH_S)
