"""Filter ``nvlink_group``: the hard TP rule (DESIGN §2). A TP group of ``tp`` GPUs must be a clique
of the NVLink graph: every pair NVLinked, directly or through one domain's NVSwitch or multi-node
fabric. On a node the group is ``topology.best_tp_group`` over the GPUs that are available, idle (an
exclusive group never shares a GPU with another replica) and have room for the share (most NV links,
same NUMA, keeps the largest group free, lowest indices); in a
multi-node NVLink domain every pair qualifies, and the group takes GPUs from as few nodes as it can.
The chosen group is the status's binding."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Final, cast

from shared.domain.memory import MemoryShare
from shared.domain.placement.filters.hbm import with_room
from shared.domain.placement.framework import (
    SUCCESS,
    Candidate,
    Code,
    CycleState,
    GpuGroup,
    Scope,
    Status,
    no_config,
    sharing_of,
)
from shared.domain.placement.hosts import GpuHost, GpuLoad, Host, HostKind, LoadClass
from shared.domain.topology import LinkMatrix, best_tp_group, largest_free_clique

NAME: Final = "nvlink_group"


@lru_cache(maxsize=16384)
def best_group(matrix: LinkMatrix, free: tuple[int, ...], size: int) -> tuple[int, ...] | None:
    """``topology.best_tp_group`` of ``size`` among the GPU indices ``free``, memoised."""
    # Pure and hot (a fleet repeats a few layouts and free sets): memoised like topology's clique search.
    return best_tp_group(matrix, free, size)


@lru_cache(maxsize=16384)
def _bound(positions: tuple[int, ...]) -> Status:
    # Statuses are immutable and a fleet binds the same few groups over and over: share them.
    return Status(plugin=NAME, binding=GpuGroup(positions))


def fabric_group(host: GpuHost, positions: list[int], tp: int) -> tuple[int, ...]:
    """``tp`` of ``positions`` drawn from the nodes with the most of them first (fewest nodes
    spanned), then lowest (node, index); returned in TP rank order (by node, then GPU index)."""
    per_node: dict[str, list[int]] = {}
    for p in positions:
        per_node.setdefault(host.nodes[p], []).append(p)
    chosen: list[int] = []
    for node in sorted(per_node, key=lambda n: (-len(per_node[n]), n)):
        chosen.extend(per_node[node][: tp - len(chosen)])
        if len(chosen) == tp:
            break
    return tuple(sorted(chosen, key=lambda p: (host.nodes[p], host.indices[p])))


class NvlinkGroupFilter:
    name: Final = NAME
    scope: Final = Scope.PLACEMENT
    capacity: Final = True  # bulk outcome: a function of TP, the share's total, sharing and the classes

    def filter(self, state: CycleState, candidate: Candidate) -> Status:
        host, load = candidate.host, candidate.load
        if not isinstance(host, GpuHost) or not isinstance(load, GpuLoad) or candidate.share is None:
            return SUCCESS
        tp = candidate.tp
        sharing = sharing_of(state)
        positions = with_room(load, candidate.share.total, sharing)
        if sharing == "shared" and positions:  # TP=1: best fit among GPUs already shared, then idle ones
            free, _ = load.room(sharing)
            return _bound((min(positions, key=lambda p: (load.idle[p], free[p], p)),))
        if len(positions) < tp:  # the hbm filter explains this one when it runs first
            return Status(Code.NO_NVLINK_GROUP, plugin=NAME, tp=tp, largest_group=_largest(host, positions))
        if host.kind is HostKind.FABRIC:
            return _bound(fabric_group(host, positions, tp))
        assert host.matrix is not None
        by_index = {host.indices[p]: p for p in positions}
        best = best_group(host.matrix, tuple(by_index), tp)
        if best is None:
            return Status(Code.NO_NVLINK_GROUP, plugin=NAME, tp=tp, largest_group=_largest(host, positions))
        return _bound(tuple(by_index[i] for i in best))

    def filter_bulk(
        self, state: CycleState, host: Host, tp: int, share: MemoryShare, classes: Sequence[LoadClass]
    ) -> tuple[list[LoadClass], list[tuple[Status, int]]]:
        if not isinstance(host, GpuHost):
            return list(classes), []
        need = share.total
        keep: list[LoadClass] = []
        largest: dict[int, int] = {}
        shared = sharing_of(state) == "shared"
        for cls in classes:
            load = cast(GpuLoad, cls.load)
            # Exclusive groups: cliques of idle GPUs (group_cap); a shared replica is one GPU.
            caps = load.shared_desc[:1] if shared else load.group_cap
            if tp <= len(caps) and caps[tp - 1] >= need:
                keep.append(cls)
                continue
            # group_cap is non-increasing: the groups that can take `need` are sizes 1..size.
            size = sum(1 for cap in caps if cap >= need)
            largest[size] = largest.get(size, 0) + len(cls.hosts)
        rejected = [(_no_group(tp, size), count) for size, count in largest.items()]
        return keep, rejected


@lru_cache(maxsize=1024)
def _no_group(tp: int, largest_group: int) -> Status:
    return Status(Code.NO_NVLINK_GROUP, plugin=NAME, tp=tp, largest_group=largest_group)


def _largest(host: GpuHost, positions: list[int]) -> int:
    if host.kind is HostKind.FABRIC or not positions:
        return len(positions)
    assert host.matrix is not None
    return largest_free_clique(host.matrix, [host.indices[p] for p in positions])


def factory(config: Mapping[str, object] | None = None) -> NvlinkGroupFilter:
    no_config(NAME, config)
    return NvlinkGroupFilter()
