"""Hosts and classes of hosts: the units the placement plugins judge.

A *host* is what one replica can land on:

* a node's GPUs outside any multi-node NVLink domain (a TP group is a clique of the node's links);
* a multi-node NVLink domain (GH200 NVL / NVL72 fabric clique: every pair of its GPUs is NVLinked,
  so a TP group may take GPUs of several nodes);
* a TPU pod (a replica takes one whole legal slice).

Hosts that no plugin can tell apart are judged once: a *static class* groups hosts with equal fixed
facts (``static_key``: SKU, region, link matrix, GPU layout, PCIe generation, TPU type and dims), and
inside it a *load class* groups those whose dynamic state is equal too (``Load.key``: free and
reserved HBM per GPU, availability, how many more GPUs their racks' power lets turn busy, TPU chips
taken). A fresh fleet of 1,000 nodes is a few dozen classes, which is what keeps a decision in the
millisecond range. The contract that makes it sound: **a plugin reads only the request, the host's
static facts and its load** (never its name, node or rack); a plugin that needs more must add it to
the keys. ``Profile.group_classes=False`` judges every host on its own (a test checks both agree).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache
from typing import Final

from shared.domain.fleet import fleet_domains
from shared.domain.hardware import Sku
from shared.domain.placement.types import FleetSnapshot, RackKey, tpu_sku_name
from shared.domain.topology import LinkMatrix, largest_free_clique, multi_node_domains
from shared.domain.topology.domains import FabricGpu, GpuRef
from shared.domain.topology.tpu import TpuGrid, TpuType


class HostKind(StrEnum):
    NODE = "node"
    FABRIC = "fabric domain"
    TPU_POD = "TPU pod"


@dataclass(frozen=True, slots=True)
class GpuHost:
    """GPUs a TP group may be drawn from. Per-member tuples are aligned with ``members``.

    NODE hosts have the node's ``matrix`` (``indices`` index it); FABRIC hosts have none: every
    pair of their GPUs is NVLinked through the fabric.
    """

    id: str
    kind: HostKind
    sku: Sku
    region: str
    cluster: str
    members: tuple[str, ...]
    nodes: tuple[str, ...]
    indices: tuple[int, ...]
    domains: tuple[str, ...]
    racks: tuple[RackKey, ...]  # the distinct racks the members sit in
    member_rack: tuple[int, ...]  # per member: position in ``racks``
    matrix: LinkMatrix | None
    static_key: tuple[object, ...]
    domain_size: tuple[int, ...] = field(init=False, repr=False, compare=False)  # per member: its domain's size

    def __post_init__(self) -> None:
        sizes = {d: self.domains.count(d) for d in set(self.domains)}
        object.__setattr__(self, "domain_size", tuple(sizes[d] for d in self.domains))

    @property
    def size(self) -> int:
        return len(self.members)


@dataclass(frozen=True, slots=True)
class TpuHost:
    id: str
    kind: HostKind
    sku: Sku
    region: str
    cluster: str | None
    tpu_type: TpuType
    dims: tuple[int, ...]
    usable_per_chip: int
    static_key: tuple[object, ...]


Host = GpuHost | TpuHost


@dataclass(frozen=True, slots=True)
class GpuLoad:
    """A GPU host's dynamic state, per member: ``free`` bytes (0 when unavailable), ``available``,
    ``idle`` (nothing reserved); per rack of the host: ``power_gpus``, how many more GPUs the rack's
    power budget lets turn busy (capped at the host's members in that rack, so hosts compare equal).
    ``free_desc`` is the free bytes of the available GPUs, largest first: the HBM test at TP t is
    one look at ``free_desc[t - 1]``. ``group_cap[k - 1]`` is the most bytes per GPU a free NVLink
    group of k GPUs can take (see ``group_capacity``): the NVLink test at TP t is one look too."""

    free: tuple[int, ...]
    usable: tuple[int, ...]
    available: tuple[bool, ...]
    idle: tuple[bool, ...]
    power_gpus: tuple[int, ...]
    group_cap: tuple[int, ...] = field(repr=False, compare=False)
    shared: tuple[bool, ...] = ()  # per member: held by `shared` replicas only (empty: none is)
    pcie_util: float = 0.0  # the host's PCIe utilisation, rounded up to PCIE_STEP (filters/pcie_load.py)
    free_desc: tuple[int, ...] = field(init=False, repr=False, compare=False)
    idle_up: tuple[int, ...] = field(init=False, repr=False, compare=False)  # positions idle and available
    # What a `shared` (TP=1) replica may use: free bytes of GPUs idle or held by shared replicas only.
    shared_free: tuple[int, ...] = field(init=False, repr=False, compare=False)
    shared_desc: tuple[int, ...] = field(init=False, repr=False, compare=False)
    # What an exclusive group may use: free bytes of idle GPUs (0 elsewhere), and the available ones
    # largest first. Computed once: the bulk HBM screen reads them per load class and TP degree.
    exclusive_free: tuple[int, ...] = field(init=False, repr=False, compare=False)
    exclusive_desc: tuple[int, ...] = field(init=False, repr=False, compare=False)
    key: tuple[object, ...] = field(init=False, repr=False, compare=False)
    exclusive_key: tuple[object, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        up = (f for f, a in zip(self.free, self.available, strict=True) if a)
        object.__setattr__(self, "free_desc", tuple(sorted(up, reverse=True)))
        idle_up = tuple(p for p, (i, a) in enumerate(zip(self.idle, self.available, strict=True)) if i and a)
        object.__setattr__(self, "idle_up", idle_up)
        shared = self.shared or (False,) * len(self.free)
        shared_free = tuple(
            f if a and (i or s) else 0 for f, a, i, s in zip(self.free, self.available, self.idle, shared, strict=True)
        )
        object.__setattr__(self, "shared_free", shared_free)
        object.__setattr__(self, "shared_desc", tuple(sorted((f for f in shared_free if f > 0), reverse=True)))
        exclusive_free = tuple(f if i else 0 for f, i in zip(self.free, self.idle, strict=True))
        object.__setattr__(self, "exclusive_free", exclusive_free)
        object.__setattr__(self, "exclusive_desc", tuple(sorted((self.free[p] for p in idle_up), reverse=True)))
        key = (self.free, self.usable, self.available, self.idle, self.power_gpus, self.shared, self.pcie_util)
        object.__setattr__(self, "key", key)
        # An exclusive group sees idle GPUs only: hosts whose busy GPUs differ look alike to it.
        exclusive_key = (self.exclusive_free, self.available, self.idle, self.power_gpus, self.pcie_util)
        object.__setattr__(self, "exclusive_key", exclusive_key)

    def room(self, sharing: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(free bytes per member, the available ones largest first) as a replica of ``sharing`` sees
        them. An exclusive TP group takes idle GPUs only (another replica's GPU is never shared with
        it): their free bytes are their usable bytes. A shared replica may also join a GPU whose holders
        are all shared replicas."""
        if sharing == "shared":
            return self.shared_free, self.shared_desc
        return self.exclusive_free, self.exclusive_desc


@dataclass(frozen=True, slots=True)
class TpuLoad:
    grid: TpuGrid

    @property
    def key(self) -> tuple[object, ...]:
        return (self.grid.occupancy,)

    @property
    def exclusive_key(self) -> tuple[object, ...]:
        return (self.grid.occupancy,)


Load = GpuLoad | TpuLoad


@dataclass(frozen=True, slots=True)
class LoadClass:
    """Hosts of one static class with equal load; ``rep`` (the lowest id) speaks for all of them."""

    hosts: tuple[str, ...]
    rep: Host
    load: Load


@dataclass(frozen=True, slots=True)
class StaticClass:
    key: tuple[object, ...]
    hosts: tuple[str, ...]
    rep: Host


@dataclass(frozen=True, slots=True)
class SnapshotIndex:
    """Hosts, their loads and classes for one snapshot. Static parts are shared between snapshots."""

    hosts: Mapping[str, Host]
    host_of: Mapping[str, str]  # accelerator id -> host id
    rack_hosts: Mapping[RackKey, tuple[str, ...]]
    statics: tuple[StaticClass, ...]
    loads: Mapping[str, Load]
    classes: Mapping[tuple[object, ...], tuple[LoadClass, ...]]  # static key -> its load classes
    grouped: bool
    # static key -> its load classes as an exclusive group sees them (``GpuLoad.exclusive_key``): on a
    # loaded fleet a few dozen where ``classes`` holds hundreds, since busy GPUs' figures do not matter.
    exclusive: Mapping[tuple[object, ...], tuple[LoadClass, ...]] = field(default_factory=dict)
    # Capacity screens already judged on this index, keyed by (static key, ...) (``Framework.filter_bulk``):
    # requests of one shape ask the same screen again; an update keeps those of unchanged static classes.
    screens: dict[tuple[object, ...], dict[tuple[object, ...], object]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def classes_for(self, sharing: str) -> Mapping[tuple[object, ...], tuple[LoadClass, ...]]:
        """The load classes a replica of ``sharing`` is judged by (plugins read only what its key holds)."""
        return self.classes if sharing == "shared" else self.exclusive


def index_of(snapshot: FleetSnapshot, *, grouped: bool = True) -> SnapshotIndex:
    """The snapshot's index, built once and kept with it; after ``apply`` only what changed is redone."""
    memo = snapshot._memo
    cached = memo.index.get(grouped)
    if isinstance(cached, SnapshotIndex):
        return cached
    parent = memo.parent
    base = parent._memo.index.get(grouped) if parent is not None else None
    if isinstance(base, SnapshotIndex):
        index = _updated(base, snapshot, *memo.touched)
    else:
        index = _built(snapshot, grouped)
    memo.index[grouped] = index
    memo.parent = None  # the ancestor is no longer needed: let it go
    return index


# -- building ---------------------------------------------------------------------------------


def _gpu_hosts(snapshot: FleetSnapshot) -> list[GpuHost]:
    nodes = snapshot.nodes
    domain_of: dict[str, str] = {}
    for domain in fleet_domains(nodes.values()):
        for member in domain.members:
            domain_of[member] = domain.id
    hosts: list[GpuHost] = []
    in_fabric: set[tuple[str, int]] = set()
    fabrics = multi_node_domains(
        FabricGpu(GpuRef(node.name, acc.index), acc.fabric) for node in nodes.values() for acc in node.accelerators
    )
    for fabric in fabrics:
        refs = sorted(fabric.gpus)
        in_fabric.update((ref.node_id, ref.gpu_index) for ref in refs)
        first = nodes[refs[0].node_id]
        members = tuple(f"{ref.node_id}/gpu{ref.gpu_index}" for ref in refs)
        member_nodes = tuple(ref.node_id for ref in refs)
        racks = _distinct(snapshot.rack_key(n) for n in member_nodes)
        member_rack = tuple(racks.index(snapshot.rack_key(n)) for n in member_nodes)
        # Which members share a node (the group choice) and a rack (power) matters; their names do not.
        ordinals = {n: i for i, n in enumerate(dict.fromkeys(member_nodes))}
        layout = tuple(ordinals[n] for n in member_nodes)
        hosts.append(
            GpuHost(
                id=domain_of.get(members[0], f"fabric/{fabric.cluster_uuid}/{fabric.clique_id}"),
                kind=HostKind.FABRIC,
                sku=snapshot.skus[first.sku],
                region=first.region,
                cluster=first.cluster,
                members=members,
                nodes=member_nodes,
                indices=tuple(ref.gpu_index for ref in refs),
                domains=tuple(domain_of.get(m, "") for m in members),
                racks=racks,
                member_rack=member_rack,
                matrix=None,
                static_key=(HostKind.FABRIC, first.sku, first.region, layout, member_rack),
            )
        )
    for node in nodes.values():
        indices = tuple(a.index for a in node.accelerators if (node.name, a.index) not in in_fabric)
        if not indices:
            continue
        members = tuple(node.accelerator_id(i) for i in indices)
        sku = snapshot.skus[node.sku]
        rack = snapshot.rack_key(node.name)
        hosts.append(
            GpuHost(
                id=node.name,
                kind=HostKind.NODE,
                sku=sku,
                region=node.region,
                cluster=node.cluster,
                members=members,
                nodes=(node.name,) * len(members),
                indices=indices,
                domains=tuple(domain_of.get(m, "") for m in members),
                racks=(rack,),
                member_rack=(0,) * len(members),
                matrix=node.links,
                static_key=(HostKind.NODE, node.sku, node.region, node.links, indices, sku.pcie_gen),
            )
        )
    return hosts


def _distinct(keys: Iterable[RackKey]) -> tuple[RackKey, ...]:
    return tuple(dict.fromkeys(keys))


def _tpu_hosts(snapshot: FleetSnapshot) -> list[TpuHost]:
    hosts: list[TpuHost] = []
    for name, state in snapshot.tpu_pods.items():
        pod = state.pod
        sku = snapshot.skus[tpu_sku_name(pod.type)]
        hosts.append(
            TpuHost(
                id=name,
                kind=HostKind.TPU_POD,
                sku=sku,
                region=pod.region,
                cluster=pod.cluster,
                tpu_type=pod.type,
                dims=tuple(pod.shape),
                usable_per_chip=state.usable_per_chip,
                static_key=(HostKind.TPU_POD, sku.name, pod.region, pod.type, tuple(pod.shape), state.usable_per_chip),
            )
        )
    return hosts


def _load(snapshot: FleetSnapshot, host: Host) -> Load:
    if isinstance(host, TpuHost):
        return TpuLoad(snapshot.tpu_pods[host.id].grid)
    caps = [snapshot.capacity[m] for m in host.members]
    power: list[int] = []
    for position, rack in enumerate(host.racks):
        in_rack = sum(1 for r in host.member_rack if r == position)
        headroom = snapshot.rack_headroom_w(rack)
        if headroom is None or host.sku.tdp_w <= 0:
            power.append(in_rack)
        else:
            # Whole GPUs only: "n more busy GPUs fit" is exactly what the rack power filter asks.
            power.append(max(0, min(in_rack, math.floor(headroom / host.sku.tdp_w))))
    shared = tuple(c.shared and not c.idle for c in caps)
    return _gpu_load(
        host.matrix,
        host.indices,
        tuple(c.free for c in caps),
        tuple(c.usable for c in caps),
        tuple(c.available for c in caps),
        tuple(c.idle for c in caps),
        tuple(power),
        shared if any(shared) else (),
        pcie_step(max((snapshot.pcie_util.get(n, 0.0) for n in set(host.nodes)), default=0.0)),
    )


@lru_cache(maxsize=8192)
def _gpu_load(
    matrix: LinkMatrix | None,
    indices: tuple[int, ...],
    free: tuple[int, ...],
    usable: tuple[int, ...],
    available: tuple[bool, ...],
    idle: tuple[bool, ...],
    power_gpus: tuple[int, ...],
    shared: tuple[bool, ...],
    pcie_util: float,
) -> GpuLoad:
    # A load is a pure function of these figures, and hosts go back and forth between a few states
    # (idle, full, ...): the same load is reused, its derived tuples worked out once.
    # The NVLink screen is for exclusive TP groups (shared replicas are TP=1): idle GPUs only.
    idle_up = tuple(a and i for a, i in zip(available, idle, strict=True))
    return GpuLoad(
        free=free,
        usable=usable,
        available=available,
        idle=idle,
        power_gpus=power_gpus,
        group_cap=group_capacity(matrix, indices, free, idle_up),
        shared=shared,
        pcie_util=pcie_util,
    )


PCIE_STEP: Final = 0.05


def pcie_step(util: float) -> float:
    """``util`` rounded up to a multiple of ``PCIE_STEP`` (0 stays 0): few load classes, and a
    threshold that is a multiple of the step is decided exactly (0.72 -> 0.75 > 0.7; 0.70 stays)."""
    if util <= 0:
        return 0.0
    return round(math.ceil(round(util / PCIE_STEP, 6)) * PCIE_STEP, 2)


@lru_cache(maxsize=65536)
def group_capacity(
    matrix: LinkMatrix | None, indices: tuple[int, ...], free: tuple[int, ...], available: tuple[bool, ...]
) -> tuple[int, ...]:
    """Per group size k (position k - 1): the largest s such that k available GPUs, each with at
    least s bytes free, form a group in which every pair is NVLinked; 0 when there is no such group.
    ``matrix`` None is a multi-node fabric, where every pair is. Non-increasing in k.

    The index the placement runner screens load classes with: a TP group of t GPUs needing s bytes
    each exists exactly when ``group_cap[t - 1] >= s`` (the per-node free-clique sizes, by threshold).
    """
    up = [(f, i) for f, i, a in zip(free, indices, available, strict=True) if a]
    caps = [0] * len(indices)
    if matrix is None:
        for k, f in enumerate(sorted((f for f, _ in up), reverse=True)):
            caps[k] = f
        return tuple(caps)
    # Thresholds from the largest free figure down: the first that admits a group of k is its cap.
    for threshold in sorted({f for f, _ in up}, reverse=True):
        size = largest_free_clique(matrix, [i for f, i in up if f >= threshold])
        for k in range(size):
            if caps[k] == 0:
                caps[k] = threshold
    return tuple(caps)


def _static_key(host: Host, grouped: bool) -> tuple[object, ...]:
    return host.static_key if grouped else (host.id,)


def _full_key(load: Load) -> tuple[object, ...]:
    return load.key


def _exclusive_key(load: Load) -> tuple[object, ...]:
    return load.exclusive_key


def _classes_of(
    hosts: Iterable[Host],
    loads: Mapping[str, Load],
    grouped: bool,
    key_of: Callable[[Load], tuple[object, ...]] = _full_key,
) -> dict[tuple[object, ...], tuple[LoadClass, ...]]:
    by_key: dict[tuple[object, ...], dict[tuple[object, ...], list[Host]]] = {}
    for host in sorted(hosts, key=lambda h: h.id):
        by_key.setdefault(_static_key(host, grouped), {}).setdefault(key_of(loads[host.id]), []).append(host)
    return {
        key: tuple(
            LoadClass(hosts=tuple(h.id for h in members), rep=members[0], load=loads[members[0].id])
            for members in groups.values()
        )
        for key, groups in by_key.items()
    }


def _built(snapshot: FleetSnapshot, grouped: bool) -> SnapshotIndex:
    all_hosts: list[Host] = [*_gpu_hosts(snapshot), *_tpu_hosts(snapshot)]
    hosts = {h.id: h for h in all_hosts}
    if len(hosts) != len(all_hosts):
        raise ValueError("node, fabric domain and TPU pod names must be distinct: they name placement hosts")
    host_of: dict[str, str] = {}
    rack_hosts: dict[RackKey, list[str]] = {}
    for host in all_hosts:
        if isinstance(host, GpuHost):
            host_of.update((m, host.id) for m in host.members)
            for rack in host.racks:
                rack_hosts.setdefault(rack, []).append(host.id)
    loads = {h.id: _load(snapshot, h) for h in all_hosts}
    statics: dict[tuple[object, ...], list[Host]] = {}
    for host in sorted(all_hosts, key=lambda h: h.id):
        statics.setdefault(_static_key(host, grouped), []).append(host)
    return SnapshotIndex(
        hosts=hosts,
        host_of=host_of,
        rack_hosts={k: tuple(v) for k, v in rack_hosts.items()},
        statics=tuple(StaticClass(key, tuple(h.id for h in members), members[0]) for key, members in statics.items()),
        loads=loads,
        classes=_classes_of(all_hosts, loads, grouped),
        grouped=grouped,
        exclusive=_classes_of(all_hosts, loads, grouped, _exclusive_key),
    )


def _updated(
    base: SnapshotIndex,
    snapshot: FleetSnapshot,
    accelerators: frozenset[str],
    racks: frozenset[RackKey],
    pods: frozenset[str],
) -> SnapshotIndex:
    changed = {base.host_of[a] for a in accelerators} | set(pods)
    for rack in racks:
        changed.update(base.rack_hosts.get(rack, ()))
    loads = dict(base.loads)
    moved: dict[tuple[object, ...], list[str]] = {}
    for host_id in changed:
        load = _load(snapshot, base.hosts[host_id])
        if load.key != loads[host_id].key:
            loads[host_id] = load
            moved.setdefault(_static_key(base.hosts[host_id], base.grouped), []).append(host_id)
    classes = dict(base.classes)
    exclusive = dict(base.exclusive)
    for key, host_ids in moved.items():
        classes[key] = _regrouped(base, loads, base.classes[key], host_ids, _full_key)
        # Regrouped on any change (not only of the exclusive key) so each class holds its
        # representative's current load, as a fresh build would.
        exclusive[key] = _regrouped(base, loads, base.exclusive[key], host_ids, _exclusive_key)
    screens = dict(base.screens)  # per static class: those whose classes moved start afresh
    for key in moved:
        screens.pop(key, None)
    return SnapshotIndex(
        hosts=base.hosts,
        host_of=base.host_of,
        rack_hosts=base.rack_hosts,
        statics=base.statics,
        loads=loads,
        classes=classes,
        grouped=base.grouped,
        exclusive=exclusive,
        screens=screens,
    )


SCREENS_KEPT: Final = 256
"""Screens one static class keeps at most (request shapes; beyond, it starts afresh)."""


def _regrouped(
    base: SnapshotIndex,
    loads: Mapping[str, Load],
    before: tuple[LoadClass, ...],
    moved: list[str],
    key_of: Callable[[Load], tuple[object, ...]],
) -> tuple[LoadClass, ...]:
    """One static class's load classes after ``moved`` hosts changed load: only the classes they
    leave or join are rebuilt, so a big class of idle nodes costs a tuple copy, not a regroup.
    ``key_of`` is the grouping (the full load key, or what an exclusive group sees)."""
    leaving = set(moved)
    left = {key_of(base.loads[h]) for h in moved}  # the classes the moved hosts were in (by their old load)
    groups: dict[tuple[object, ...], LoadClass | list[str]] = {}
    for cls in before:
        key = key_of(cls.load)
        groups[key] = [h for h in cls.hosts if h not in leaving] if key in left else cls
    for host_id in moved:
        key = key_of(loads[host_id])
        group = groups.get(key)
        if group is None:
            groups[key] = [host_id]
        elif isinstance(group, LoadClass):
            groups[key] = [*group.hosts, host_id]
        else:
            group.append(host_id)
    rebuilt: list[LoadClass] = []
    for group in groups.values():
        if isinstance(group, LoadClass):
            rebuilt.append(group)
        elif group:
            ids = tuple(sorted(group))
            rebuilt.append(LoadClass(hosts=ids, rep=base.hosts[ids[0]], load=loads[ids[0]]))
    return tuple(sorted(rebuilt, key=lambda cls: cls.hosts[0]))
