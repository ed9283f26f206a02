"""Score ``packing``: keep whole NVLink domains and large TPU blocks free (DESIGN §2).

GPUs, the mean of three fits in [0, 1]:

* bytes: mean over the group of share / free HBM before (best fit: for a shared replica, fill GPUs
  other shared replicas use first; an exclusive group sees only idle GPUs, so this is SKU fit);
* domain: 1 - idle GPUs left in the group's NVLink domain / the domain's size (use busy domains);
* node: 1 - idle GPUs left on the host / its size (use busy nodes; PCIe-only nodes have one-GPU domains).

TPU: the mean of 1 - fragmentation of the pod after taking the slice (``topology.fragmentation``) and
the slice's chips / the pod's free chips before (best fit: use the fullest pod).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from shared.domain.placement.filters.hbm import sharing_of
from shared.domain.placement.framework import Candidate, CycleState, GpuGroup, no_config
from shared.domain.placement.hosts import GpuHost, GpuLoad, TpuLoad
from shared.domain.topology.tpu import TpuSlice, allocate, fragmentation

NAME: Final = "packing"


def gpu_packing(host: GpuHost, load: GpuLoad, positions: Sequence[int], need: int, sharing: str = "exclusive") -> float:
    free, _ = load.room(sharing)
    domains = host.domains
    byte_fit = sum(need / max(1, free[p]) for p in positions) / len(positions)
    # A TP group is an NVLink clique, so it lies in one domain.
    domain = domains[positions[0]]
    idle_left = [p for p in load.idle_up if p not in positions]
    domain_fit = 1 - sum(1 for p in idle_left if domains[p] == domain) / host.domain_size[positions[0]]
    node_fit = 1 - len(idle_left) / host.size
    return min(1.0, (byte_fit + domain_fit + node_fit) / 3)


def tpu_packing(load: TpuLoad, block: TpuSlice) -> float:
    free_before = load.grid.free_chips
    return min(1.0, (1 - fragmentation(allocate(load.grid, block)) + block.chips / free_before) / 2)


class PackingScore:
    name: Final = NAME

    def prescore(self, state: CycleState, candidates: Sequence[Candidate]) -> None:
        return None

    def score(self, state: CycleState, candidate: Candidate) -> float:
        host, load, binding = candidate.host, candidate.load, candidate.binding
        if isinstance(load, TpuLoad) and isinstance(binding, TpuSlice):
            return tpu_packing(load, binding)
        if isinstance(host, GpuHost) and isinstance(load, GpuLoad) and isinstance(binding, GpuGroup):
            need = candidate.share.total if candidate.share is not None else 0
            return gpu_packing(host, load, binding.positions, need, sharing_of(state))
        return 0.0

    def bound(self, state: CycleState, candidate: Candidate) -> float:
        """Before binding: bytes fit at most share / the tightest GPU with room; domain fit at most 1;
        node fit at most 1 - (idle GPUs - TP) / size, since the group takes at most TP idle GPUs."""
        host, load = candidate.host, candidate.load
        if not isinstance(host, GpuHost) or not isinstance(load, GpuLoad) or candidate.share is None:
            return 1.0
        need, tp = candidate.share.total, candidate.tp
        _, free = load.room(sharing_of(state))  # largest first: the tightest GPU with room is the last >= need
        tightest = next((f for f in reversed(free) if f >= need), 0)
        byte_fit = need / tightest if tightest > 0 else 1.0
        idle = len(load.idle_up)
        node_fit = 1 - (idle - tp) / host.size if idle > tp else 1.0
        return min(1.0, (byte_fit + 1 + node_fit) / 3)


def factory(config: Mapping[str, object] | None = None) -> PackingScore:
    no_config(NAME, config)
    return PackingScore()
