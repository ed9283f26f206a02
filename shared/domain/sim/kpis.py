"""What a simulation run is judged by: per-request outcomes and replica lifetimes folded into KPIs.

* ``success_rate`` = admitted / requests; ``slo_attainment`` = requests meeting the SLO / requests
  (a failed request misses it); queue waits are over the requests that waited at all.
* ``nvlink_affinity`` = share of GPU TP>1 groups whose every GPU pair is NVLinked (the node's
  ``LinkMatrix``; across nodes, the same NVLink fabric clique); None when there was no such group.
* ``cost_per_million_tokens`` = sum over replicas of price x the accelerator-hours charged to it,
  divided by the tokens (prompt + output) of the requests served, x 1e6. ``energy_kwh`` = TDP x the
  same accelerator-hours. A replica alone on its GPUs is charged accelerators x lifetime; replicas
  that share a GPU split its time (``sim.sharing.Residency``). ``accelerator_hours`` is their sum.
* ``fill_rate`` (only with reservations, ``sim.reservations``; else None) = the time-weighted mean of
  (owner use + lent use) / reserved accelerators over the sample times: each sample's value weighs the
  time since the previous sample (the run's start for the first, a partial period for the last).
  ``preemptions`` counts borrower replicas the owners reclaimed; ``preempted_requests`` the requests
  that failed in flight on them.
* Sharing (``sim.sharing``): ``shared_replicas`` were placed ``sharing: shared``;
  ``contended_requests`` were admitted while their replica's GPU had other busy replicas (their
  times x k); ``mean_tpot_ms`` and ``replica_tokens_per_s`` (the decode tokens/s of the replica
  serving each request, batch x 1000 / TPOT, at admission) are means over admitted requests;
  ``gpu_hbm_fill`` is the mean share of usable HBM reserved on GPUs while they held a replica.
* ``tpu_fragmentation`` = mean of ``topology.tpu.fragmentation`` over pods at sample times, 0 when no
  replica ever used a TPU.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from shared.domain.fleet import NodeProfile


@dataclass(frozen=True, slots=True)
class RequestOutcome:
    row: int
    model: str
    admitted: bool
    queued: bool
    wait_ms: float
    ttft_ms: float | None
    tpot_ms: float | None
    done_ms: float | None
    slo_met: bool
    tokens: int
    co_tenants: int = 1  # busy replicas on the replica's busiest GPU at admission (itself included)
    replica_tokens_per_s: float | None = None  # the replica's decode tokens/s at admission
    preempted: bool = False  # failed in flight: its replica was evicted for a reservation's owner


@dataclass(frozen=True, slots=True)
class ReplicaLife:
    model: str
    sku: str
    accelerators: int
    price_usd_per_hour: float
    tdp_w: float
    tpu: bool
    nvlinked: bool | None  # None unless a GPU TP>1 group
    start_ms: float
    end_ms: float
    sharing: str = "exclusive"
    accelerator_hours: float | None = None  # charged to it (shared GPUs split); None: accelerators x hours

    @property
    def hours(self) -> float:
        return (self.end_ms - self.start_ms) / 3_600_000.0

    @property
    def charged_hours(self) -> float:
        """Accelerator-hours this replica pays for: its share of each GPU's time while it held it."""
        return self.accelerators * self.hours if self.accelerator_hours is None else self.accelerator_hours


@dataclass(frozen=True, slots=True)
class Sample:
    """The state at the end of one sample period (a minute by default)."""

    minute: float
    active_replicas: int
    queue_length: int
    slo_attainment: float | None  # of the requests completed in the period
    tpu_fragmentation: float
    fill_rate: float | None = None  # (owner use + lent use) / reserved now; None without reservations


@dataclass(frozen=True, slots=True)
class Kpis:
    requests: int
    placed: int
    failed: int
    queued: int
    success_rate: float
    mean_queue_wait_ms: float
    p99_queue_wait_ms: float
    slo_attainment: float
    replicas: int
    tp_groups: int
    nvlink_affinity: float | None
    tp_groups_not_nvlinked: int
    fill_rate: float | None
    tpu_fragmentation: float
    cost_per_million_tokens: float | None
    energy_kwh: float
    decisions: int
    decision_p50_ms: float
    decision_p99_ms: float
    shared_replicas: int = 0
    contended_requests: int = 0
    mean_tpot_ms: float | None = None
    replica_tokens_per_s: float | None = None
    accelerator_hours: float = 0.0
    gpu_hbm_fill: float | None = None
    preemptions: int = 0
    preempted_requests: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (0 for no values)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100.0 * len(ordered)))
    return ordered[rank - 1]


def time_weighted_fill(samples: Sequence[Sample]) -> float | None:
    """The mean of the samples' fill rates, each weighed by the minutes since the sample before it (the
    first: since minute 0); the plain mean when no time passed; None when no sample has one."""
    total = weighted = 0.0
    previous = 0.0
    fills: list[float] = []
    for sample in samples:
        span = max(0.0, sample.minute - previous)
        previous = sample.minute
        if sample.fill_rate is None:
            continue
        fills.append(sample.fill_rate)
        total += span
        weighted += span * sample.fill_rate
    if not fills:
        return None
    return weighted / total if total > 0 else sum(fills) / len(fills)


def _split(acc_id: str) -> tuple[str, int]:
    node, _, gpu = acc_id.rpartition("/")
    return node, int(gpu.removeprefix("gpu"))


def nvlinked_group(nodes: Mapping[str, NodeProfile], accelerators: Sequence[str]) -> bool:
    """Whether every pair of the GPUs ``accelerators`` (ids ``<node>/gpu<i>``) is NVLinked."""
    parts = [_split(a) for a in accelerators]
    names = {n for n, _ in parts}
    if len(names) == 1:
        links = nodes[parts[0][0]].links
        idx = [i for _, i in parts]
        return all(links.is_nvlinked(a, b) for k, a in enumerate(idx) for b in idx[k + 1 :])
    fabrics = set()
    for node, index in parts:
        fabric = next((acc.fabric for acc in nodes[node].accelerators if acc.index == index), None)
        if fabric is None or not fabric.cluster_uuid.strip("0-"):
            return False
        fabrics.add((fabric.cluster_uuid, fabric.clique_id))
    return len(fabrics) == 1


def compute_kpis(
    outcomes: Sequence[RequestOutcome],
    replicas: Sequence[ReplicaLife],
    samples: Sequence[Sample],
    decision_ms: Sequence[float],
    *,
    gpu_hbm_fill: float | None = None,
    preemptions: int = 0,
) -> Kpis:
    total = len(outcomes)
    placed = sum(o.admitted for o in outcomes)
    waits = [o.wait_ms for o in outcomes if o.queued]
    groups = [r for r in replicas if r.nvlinked is not None]
    linked = sum(1 for r in groups if r.nvlinked)
    tokens = sum(o.tokens for o in outcomes if o.admitted)
    dollars = sum(r.price_usd_per_hour * r.charged_hours for r in replicas)
    served = [o for o in outcomes if o.admitted and o.tpot_ms is not None]
    rates = [o.replica_tokens_per_s for o in served if o.replica_tokens_per_s is not None]
    return Kpis(
        requests=total,
        placed=placed,
        failed=total - placed,
        queued=len(waits),
        success_rate=placed / total if total else 0.0,
        mean_queue_wait_ms=sum(waits) / len(waits) if waits else 0.0,
        p99_queue_wait_ms=percentile(waits, 99),
        slo_attainment=sum(o.slo_met for o in outcomes) / total if total else 0.0,
        replicas=len(replicas),
        tp_groups=len(groups),
        nvlink_affinity=linked / len(groups) if groups else None,
        tp_groups_not_nvlinked=len(groups) - linked,
        fill_rate=time_weighted_fill(samples),
        tpu_fragmentation=sum(s.tpu_fragmentation for s in samples) / len(samples) if samples else 0.0,
        cost_per_million_tokens=dollars / tokens * 1e6 if tokens else None,
        energy_kwh=sum(r.tdp_w * r.charged_hours for r in replicas) / 1000.0,
        decisions=len(decision_ms),
        decision_p50_ms=percentile(decision_ms, 50),
        decision_p99_ms=percentile(decision_ms, 99),
        shared_replicas=sum(1 for r in replicas if r.sharing == "shared"),
        contended_requests=sum(1 for o in served if o.co_tenants > 1),
        mean_tpot_ms=sum(o.tpot_ms or 0.0 for o in served) / len(served) if served else None,
        replica_tokens_per_s=sum(rates) / len(rates) if rates else None,
        accelerator_hours=sum(r.charged_hours for r in replicas),
        gpu_hbm_fill=gpu_hbm_fill,
        preemptions=preemptions,
        preempted_requests=sum(o.preempted for o in outcomes),
    )
