"""Score ``packing``: keep whole NVLink domains and large TPU blocks free (DESIGN §2).

GPUs, the mean of four fits in [0, 1]:

* bytes: mean over the group of share / free HBM before (best fit: for a shared replica, fill GPUs
  other shared replicas use first; an exclusive group sees only idle GPUs, so this is SKU fit);
* domain: 1 - idle GPUs left in the group's NVLink domain / the domain's size (use busy domains);
* node: 1 - idle GPUs left on the host / its size (use busy nodes; PCIe-only nodes have one-GPU domains);
* group (look-ahead): the largest TP degree the host's idle GPUs still hold after the placement / the
  largest they held before (TP degrees are powers of two; a group is an NVLink clique). A TP=2
  replica on an idle NVSwitch node of 8 leaves TP=4 at most there (0.5); in one quad of an idle 4+4
  node it leaves the other quad, TP=4 as before (1.0): the node that alone could take a TP=8 replica
  keeps it. A shared replica joining a GPU already shared takes no idle GPU (1.0).

TPU: the mean of 1 - fragmentation of the pod after taking the slice (``topology.fragmentation_after``) and
the slice's chips / the pod's free chips before (best fit: use the fullest pod).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from shared.domain.placement.framework import Candidate, CycleState, GpuGroup, no_config, sharing_of
from shared.domain.placement.hosts import GpuHost, GpuLoad, HostKind, TpuLoad
from shared.domain.topology import largest_free_clique
from shared.domain.topology.tpu import TpuSlice, fragmentation_after

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
    before = _largest_tp_before(load)
    if before == 0 or len(idle_left) == len(load.idle_up):
        group_fit = 1.0  # no idle GPU taken
    elif host.kind is HostKind.FABRIC or host.matrix is None:  # every pair NVLinked through the fabric
        group_fit = min(1.0, _power_of_two(len(idle_left)) / before)
    else:
        after = largest_free_clique(host.matrix, [host.indices[p] for p in idle_left])
        group_fit = min(1.0, _power_of_two(after) / before)
    return min(1.0, (byte_fit + domain_fit + node_fit + group_fit) / 4)


def _power_of_two(size: int) -> int:
    """The largest TP degree (a power of two) a group of ``size`` GPUs holds; 0 for none."""
    return 1 << (size.bit_length() - 1) if size > 0 else 0


def _largest_tp_before(load: GpuLoad) -> int:
    """The largest TP degree an NVLink clique of the host's idle GPUs holds (``group_cap`` has a
    positive entry per group size such a clique reaches)."""
    return _power_of_two(sum(1 for cap in load.group_cap if cap > 0))


def tpu_packing(load: TpuLoad, block: TpuSlice) -> float:
    free_before = load.grid.free_chips
    # The pod's grid after the placement is not built: its fragmentation is read off this one.
    return min(1.0, (1 - fragmentation_after(load.grid, block) + block.chips / free_before) / 2)


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
        node fit at most 1 - (idle GPUs - TP) / size, since the group takes at most TP idle GPUs; group
        fit at most the largest TP degree of (idle GPUs - TP) GPUs / the largest before, when the
        group takes TP idle GPUs (a shared replica may take none: 1)."""
        host, load = candidate.host, candidate.load
        if not isinstance(host, GpuHost) or not isinstance(load, GpuLoad) or candidate.share is None:
            return 1.0
        need, tp = candidate.share.total, candidate.tp
        _, free = load.room(sharing_of(state))  # largest first: the tightest GPU with room is the last >= need
        tightest = next((f for f in reversed(free) if f >= need), 0)
        byte_fit = need / tightest if tightest > 0 else 1.0
        idle = len(load.idle_up)
        node_fit = 1 - (idle - tp) / host.size if idle > tp else 1.0
        before = _largest_tp_before(load)
        exclusive = sharing_of(state) != "shared"
        group_fit = min(1.0, _power_of_two(idle - tp) / before) if exclusive and before else 1.0
        return min(1.0, (byte_fit + 1 + node_fit + group_fit) / 4)


def factory(config: Mapping[str, object] | None = None) -> PackingScore:
    no_config(NAME, config)
    return PackingScore()
