"""What sharing a GPU costs a replica in the simulator, and which models the simulator asks to share.

**Contention (first order).** A replica whose GPU ``k`` replicas are busy on at once gets ``1/k`` of
the GPU's compute and memory bandwidth, so its prefill and each of its decode steps take ``k`` times
as long: TTFT, TPOT and the end-to-end time x ``k``, and the replica's decode tokens/s / ``k``. Two
replicas busy on one GPU each see half its throughput; a replica alone (or an idle co-tenant, which
issues no kernels) is unaffected. For a TP group the busiest of its GPUs sets ``k``: every step waits
for its slowest rank. ``k`` counts replicas with at least one request in flight at the moment a request
is admitted, and holds for that request's life, the same static approximation the engine makes for
the batch.

Why ``k`` and not less: without MPS, CUDA contexts of different processes do not run kernels at the
same time; the GPU time-slices between them and swaps each one's scheduling resources in and out on a
switch (NVIDIA, "Multi-Process Service", docs.nvidia.com/deploy/mps, on the context switching MPS
removes). ``k`` busy replicas then get at most ``1/k`` of the time each, a little less with the switch
cost, which is ignored here. With MPS the kernels of several processes may overlap, which (the same
page) helps where one process leaves part of the GPU's compute or memory bandwidth unused; a decode
step of a serving engine at a useful batch streams the weights and KV at close to the memory
bandwidth, which overlapping cannot add to. So ``k`` is exact for
time-slicing and an ASSUMPTION (slightly pessimistic) under MPS; MIG is not sharing in this sense (a
MIG slice is its own smaller device). The fixed per-step overhead of the latency model is scaled with
the rest: a first-order choice, not a measurement.

**Cost and energy.** A GPU costs its price and draws its TDP while it holds any replica; the replicas
it holds split that time evenly (``Residency``), so two replicas sharing a GPU for an hour are each
charged half a GPU-hour, and a replica alone on its GPUs is charged ``accelerators x hours``, as before.

**Small models.** With ``SimConfig.share_small`` the simulator asks ``sharing: shared`` for the models
whose weights at TP=1, in their own dtype, are at most ``SMALL_WEIGHT_FRACTION`` (a quarter) of the
usable HBM of the fleet's largest GPU: a replica of one fits that GPU with room for others beside it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

from shared.domain.dtypes import dtype_bytes
from shared.domain.latency import LatencyEstimate
from shared.domain.placement import FleetSnapshot

SMALL_WEIGHT_FRACTION: Final = 0.25


def contended(estimate: LatencyEstimate, co_tenants: int) -> LatencyEstimate:
    """``estimate`` of a replica that gets ``1 / co_tenants`` of its GPU: every time x ``co_tenants``."""
    if co_tenants < 1:
        raise ValueError(f"co_tenants must be >= 1, got {co_tenants}")
    if co_tenants == 1:
        return estimate
    return LatencyEstimate(
        ttft_ms=estimate.ttft_ms * co_tenants,
        tpot_ms=estimate.tpot_ms * co_tenants,
        e2e_ms=estimate.e2e_ms * co_tenants,
    )


def decode_tokens_per_s(batch: int, tpot_ms: float) -> float:
    """Output tokens per second of a replica decoding ``batch`` sequences at ``tpot_ms`` per step."""
    return batch * 1000.0 / max(tpot_ms, 1e-9)


def co_tenancy(accelerators: Iterable[str], busy: Mapping[str, int]) -> int:
    """``k`` of a replica: the most busy replicas on any one of its ``accelerators`` (itself included,
    so at least 1); ``busy`` maps an accelerator id to its busy replicas."""
    return max((busy.get(acc, 0) for acc in accelerators), default=0) or 1


def weight_bytes(snapshot: FleetSnapshot, model: str) -> float:
    """The model's weights at TP=1 in its own dtype."""
    spec = snapshot.models[model]
    return spec.params * dtype_bytes(spec.dtype)


def small_models(snapshot: FleetSnapshot, fraction: float = SMALL_WEIGHT_FRACTION) -> frozenset[str]:
    """Models whose TP=1 weights are at most ``fraction`` of the usable HBM of the fleet's largest GPU
    (none when the fleet has no GPU)."""
    largest = max(
        (cap.usable for cap in snapshot.capacity.values() if not snapshot.skus[cap.sku].is_tpu),
        default=0,
    )
    if largest <= 0:
        return frozenset()
    return frozenset(name for name in snapshot.models if weight_bytes(snapshot, name) <= fraction * largest)


@dataclass
class Residency:
    """Which replicas each GPU holds over simulated time (ms), and what that time is charged to.

    A GPU's occupied time is split evenly among the replicas it holds while they hold it
    (``charged_ms``); ``occupied_ms`` sums the time GPUs held anything and ``filled_ms`` the same
    time weighted by the share of usable HBM reserved, so ``filled_ms / occupied_ms`` is the mean HBM
    fill of occupied GPUs."""

    usable: Mapping[str, int]
    residents: dict[str, dict[int, int]] = field(default_factory=dict)  # accelerator -> {replica: bytes}
    since: dict[str, float] = field(default_factory=dict)
    charged: dict[int, float] = field(default_factory=dict)  # replica -> accelerator-ms
    occupied_ms: float = 0.0
    filled_ms: float = 0.0

    def _settle(self, acc: str, now: float) -> None:
        held = self.residents.get(acc)
        if held:
            elapsed = now - self.since[acc]
            for replica in held:
                self.charged[replica] = self.charged.get(replica, 0.0) + elapsed / len(held)
            self.occupied_ms += elapsed
            usable = self.usable.get(acc, 0)
            if usable > 0:
                self.filled_ms += elapsed * min(1.0, sum(held.values()) / usable)
        self.since[acc] = now

    def join(self, replica: int, accelerators: Iterable[str], bytes_each: int, now: float) -> None:
        """``replica`` starts holding ``bytes_each`` on each of ``accelerators`` at ``now``."""
        self.charged.setdefault(replica, 0.0)
        for acc in accelerators:
            self._settle(acc, now)
            self.residents.setdefault(acc, {})[replica] = bytes_each

    def leave(self, replica: int, accelerators: Iterable[str], now: float) -> float:
        """``replica`` lets go of ``accelerators`` at ``now``; the accelerator-hours it was charged."""
        for acc in accelerators:
            self._settle(acc, now)
            held = self.residents.get(acc)
            if held is not None:
                held.pop(replica, None)
                if not held:
                    del self.residents[acc]
        return self.charged.pop(replica, 0.0) / 3_600_000.0

    def holders(self, acc: str) -> Iterable[int]:
        return self.residents.get(acc, {}).keys()

    @property
    def hbm_fill(self) -> float | None:
        """Mean share of usable HBM reserved on GPUs while they held a replica (None: none ever did)."""
        return self.filled_ms / self.occupied_ms if self.occupied_ms > 0 else None
