"""Filter ``slo``: with latency targets in the request, the replica's estimated TTFT, TPOT and
end-to-end time on the host's SKU at this TP must meet them (``placement.perf``: the calibrated
latency model, one prompt prefilled alone, decode steps over the whole KV pool). Where no calibration
exists for the SKU the estimate is a bandwidth proxy and is noted, not enforced."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from shared.domain.memory import MemoryShare
from shared.domain.placement.framework import SUCCESS, Candidate, Code, CycleState, Scope, Status, demand_of, no_config
from shared.domain.placement.hosts import Host, LoadClass
from shared.domain.placement.perf import perf

NAME: Final = "slo"


class SloFilter:
    name: Final = NAME
    scope: Final = Scope.PLACEMENT

    def filter(self, state: CycleState, candidate: Candidate) -> Status:
        demand = demand_of(state)
        slo = demand.request.slo
        if slo is None or (slo.ttft_ms is None and slo.tpot_ms is None and slo.p99_ms is None):
            return SUCCESS
        estimate = perf(state, demand, candidate.host.sku, candidate.tp)
        e2e = estimate.ttft_ms + (demand.output_tokens - 1) * estimate.tpot_ms
        misses = [
            f"{label} ~{value:.1f} ms > {limit:g} ms"
            for label, value, limit in (
                ("TTFT", estimate.ttft_ms, slo.ttft_ms),
                ("TPOT", estimate.tpot_ms, slo.tpot_ms),
                ("end-to-end", e2e, slo.p99_ms),
            )
            if limit is not None and value > limit
        ]
        if not misses:
            return SUCCESS
        if not estimate.calibrated:
            return Status(plugin=NAME, note=f"SLO not checked on {candidate.host.sku.name}: no latency calibration")
        return Status(Code.SLO_MISS, plugin=NAME, tp=candidate.tp, message=f"SLO missed: {', '.join(misses)}")

    def filter_bulk(
        self, state: CycleState, host: Host, tp: int, share: MemoryShare, classes: Sequence[LoadClass]
    ) -> tuple[list[LoadClass], list[tuple[Status, int]]]:
        # The estimate reads the SKU and the TP degree only: one verdict for the whole static class.
        if not classes:
            return [], []
        verdict = self.filter(state, Candidate(host, classes[0].load, tp, share))
        if verdict.ok:
            return list(classes), []
        return [], [(verdict, sum(len(c.hosts) for c in classes))]


def factory(config: Mapping[str, object] | None = None) -> SloFilter:
    no_config(NAME, config)
    return SloFilter()
