"""The placement core's values: what the fleet looks like to one decision, what is asked, what is decided.

Everything here is immutable. ``FleetSnapshot`` is the scheduler's view of the fleet (the Kubernetes
scheduler's snapshot: plugins read it, never the ledger); ``apply`` returns the snapshot a placed
``Decision`` leaves behind, which is how batches and the simulator chain decisions without IO.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Literal

from shared.domain.capacity import AcceleratorCapacity
from shared.domain.errors import ErrorCode
from shared.domain.fleet import Fleet, NodeProfile, Rack, TpuPod, cluster_key, tpu_chip_id
from shared.domain.hardware import Sku
from shared.domain.memory import DEFAULT_CEILING, MemoryShare, usable_hbm
from shared.domain.models import ModelSpec
from shared.domain.topology.tpu import TpuGrid, TpuSlice, TpuType, allocate

RackKey = tuple[str, str, str]
"""(region, cluster, rack): rack names are only unique inside their cluster."""

Backend = Literal["gpu", "tpu", "any"]
DecisionStatus = Literal["placed", "rejected"]
"""What one decision came to (an intent's lifecycle is ``ownership.IntentState``)."""

__all__ = [
    "FALLBACKS",
    "AcceleratorCapacity",
    "Backend",
    "Decision",
    "DecisionStatus",
    "ErrorCode",
    "FleetSnapshot",
    "MemoryShare",
    "PlacementRequest",
    "RackKey",
    "RejectionClass",
    "Slo",
    "TpuPlacement",
    "TpuPodState",
    "apply",
    "chip_id",
    "tpu_sku_name",
]


@dataclass(frozen=True, slots=True)
class TpuPodState:
    """A TPU pod, which of its chips are taken, and each chip's HBM (before the utilisation ceiling)."""

    pod: TpuPod
    grid: TpuGrid
    hbm_per_chip: int

    @property
    def usable_per_chip(self) -> int:
        return _usable_per_chip(self.hbm_per_chip)


@lru_cache(maxsize=64)
def _usable_per_chip(hbm_per_chip: int) -> int:
    # Asked per pod by every decision's prefilter and a fleet has a few TPU types: memoised.
    return usable_hbm(hbm_per_chip)


def tpu_sku_name(tpu_type: TpuType) -> str:
    """The catalog SKU of a TPU generation (``TPU-V5E``, ``TPU-V5P``)."""
    return f"TPU-{tpu_type.value.upper()}"


def chip_id(pod: str, coord: Iterable[int]) -> str:
    """A TPU chip's id: ``"<pod>/<x>.<y>[.<z>]"`` (the ledger's id for it, see ``fleet.tpu_chip_id``)."""
    return tpu_chip_id(pod, tuple(coord))


class _Frame:
    """What the snapshots of one frame share (the same accelerators offering the same usable bytes and
    availability, the same racks and TPU pods): the same fleet with nothing reserved
    (``ladder.emptied``). One cell for all of them, so the empty fleet (with its index and verdicts)
    is built once per frame: by whichever snapshot refuses first, for every snapshot before and after
    it (e.g. the simulator's runs that all start from one snapshot)."""

    __slots__ = ("empty",)

    def __init__(self) -> None:
        self.empty: FleetSnapshot | None = None


class _Memo:
    """Derived data a snapshot computes once (the placement index); never part of equality."""

    __slots__ = ("frame", "index", "parent", "touched", "verdicts")

    def __init__(self) -> None:
        self.index: dict[bool, object] = {}
        # Verdicts already reached on this snapshot, by request less its id (the empty fleet's "would it
        # ever fit", asked by every refusal that may queue: one answer per request shape).
        self.verdicts: dict[object, object] = {}
        # Shared along a chain of snapshots while no accelerator's usable bytes or availability change.
        self.frame = _Frame()
        # (parent snapshot, accelerator ids, rack keys, pod names) changed by `apply`: lets the index
        # be updated for what changed instead of rebuilt for the whole fleet.
        self.parent: FleetSnapshot | None = None
        nothing: frozenset[str] = frozenset()
        self.touched: tuple[frozenset[str], frozenset[RackKey], frozenset[str]] = (nothing, frozenset(), nothing)


@dataclass(frozen=True, slots=True)
class FleetSnapshot:
    """The fleet as one decision sees it: static facts (nodes, racks, catalogs) and dynamic state
    (HBM reserved per accelerator, rack power drawn, TPU chips taken).

    ``capacity`` has one entry per GPU of every node, keyed by accelerator id. ``rack_power_used_w``
    holds the watts a rack draws now (racks absent draw 0). Two snapshots are equal when all of that
    is equal; derived indexes do not count.
    """

    nodes: Mapping[str, NodeProfile]
    capacity: Mapping[str, AcceleratorCapacity]
    racks: Mapping[RackKey, Rack]
    rack_power_used_w: Mapping[RackKey, float]
    tpu_pods: Mapping[str, TpuPodState]
    skus: Mapping[str, Sku]
    models: Mapping[str, ModelSpec]
    # PCIe utilisation per node (0..1, from GPU telemetry; absent: unknown, taken as idle) and the TP
    # traffic already crossing NVLink domains per cluster (bytes/s, from the allocations that do), keyed
    # by ``fleet.cluster_key`` (``<region>/<cluster>``).
    pcie_util: Mapping[str, float] = field(default_factory=dict)
    cross_domain_used: Mapping[str, float] = field(default_factory=dict)
    # Regions of nodes the snapshot leaves out (lost ones): a region whose nodes are all lost is still one
    # a request may name (it waits for capacity), not an unknown one. Not part of equality.
    known_regions: frozenset[str] = field(default_factory=frozenset, compare=False)
    _memo: _Memo = field(default_factory=_Memo, init=False, repr=False, compare=False)

    @classmethod
    def from_fleet(
        cls,
        fleet: Fleet,
        *,
        skus: Mapping[str, Sku],
        models: Mapping[str, ModelSpec],
        reserved: Mapping[str, int] | None = None,
        unavailable: Iterable[str] = (),
        rack_power_used_w: Mapping[RackKey, float] | None = None,
        ceiling: float = DEFAULT_CEILING,
        shared: Iterable[str] = (),
    ) -> FleetSnapshot:
        """A snapshot of ``fleet``: usable HBM is each GPU's HBM under ``ceiling``; ``reserved`` bytes
        per accelerator id (default none); rack power defaults to the TDP of every busy GPU. TPU pods
        start empty with their catalog SKU's HBM per chip (``ValueError`` when the SKU is missing).
        ``shared`` names the accelerators whose reservations belong to shared replicas."""
        reserved = reserved or {}
        down = set(unavailable)
        shared_ids = set(shared)  # accelerators whose reservations are shared replicas'

        capacity: dict[str, AcceleratorCapacity] = {}
        for node in fleet.nodes:
            for acc in node.accelerators:
                acc_id = node.accelerator_id(acc.index)
                capacity[acc_id] = AcceleratorCapacity(
                    id=acc_id,
                    node=node.name,
                    index=acc.index,
                    sku=acc.sku,
                    usable=usable_hbm(acc.hbm_bytes, ceiling),
                    reserved=reserved.get(acc_id, 0),
                    available=acc_id not in down,
                    shared=acc_id in shared_ids,
                )
        racks = {(rack.region, rack.cluster, rack.name): rack for rack in fleet.racks}
        if rack_power_used_w is None:
            power: dict[RackKey, float] = {}
            for node in fleet.nodes:
                busy = sum(1 for a in node.accelerators if not capacity[node.accelerator_id(a.index)].idle)
                if busy:
                    key = (node.region, node.cluster, node.rack)
                    power[key] = power.get(key, 0.0) + busy * skus[node.sku].tdp_w
            rack_power_used_w = power
        pods: dict[str, TpuPodState] = {}
        for pod in fleet.tpu_pods:
            sku_name = tpu_sku_name(pod.type)
            if sku_name not in skus:
                raise ValueError(f"TPU pod {pod.name}: no SKU {sku_name} in the catalog")
            pods[pod.name] = TpuPodState(pod, TpuGrid.empty(pod.type, pod.shape), skus[sku_name].hbm_bytes)
        return cls(
            nodes={node.name: node for node in fleet.nodes},
            capacity=capacity,
            racks=racks,
            rack_power_used_w=dict(rack_power_used_w),
            tpu_pods=pods,
            skus=dict(skus),
            models=dict(models),
        )

    def rack_key(self, node: str) -> RackKey:
        profile = self.nodes[node]
        return profile.region, profile.cluster, profile.rack

    def rack_headroom_w(self, key: RackKey) -> float | None:
        """Watts the rack may still draw (budget - used); None when the rack has no budget."""
        rack = self.racks.get(key)
        if rack is None or rack.power_kw is None:
            return None
        return rack.power_kw * 1000.0 - self.rack_power_used_w.get(key, 0.0)

    def evolve(
        self,
        *,
        capacity: Mapping[str, AcceleratorCapacity] | None = None,
        rack_power_used_w: Mapping[RackKey, float] | None = None,
        tpu_pods: Mapping[str, TpuPodState] | None = None,
        changed: tuple[frozenset[str], frozenset[RackKey], frozenset[str]] | None = None,
        pcie_util: Mapping[str, float] | None = None,
        cross_domain_used: Mapping[str, float] | None = None,
    ) -> FleetSnapshot:
        """The same fleet with new dynamic state (what is not given stays). When the accelerators,
        racks and pods are the same ones, the new snapshot remembers what changed, so its placement
        index is updated for that instead of rebuilt: the way for a read model that follows ledger
        events to hand decisions a fresh snapshot cheaply. ``changed`` (accelerator ids, rack keys, pod
        names) saves comparing the whole fleet when the caller knows it; it must name every change."""
        capacity = self.capacity if capacity is None else capacity
        power = self.rack_power_used_w if rack_power_used_w is None else rack_power_used_w
        pods = self.tpu_pods if tpu_pods is None else tpu_pods
        # A node whose PCIe utilisation moved changes its hosts' loads: its accelerators count as touched.
        pcie_moved: frozenset[str] = frozenset()
        if pcie_util is not None:
            nodes = {n for n in pcie_util.keys() | self.pcie_util.keys() if pcie_util.get(n) != self.pcie_util.get(n)}
            pcie_moved = frozenset(  # from the nodes' own GPUs: O(what moved), not O(fleet)
                self.nodes[n].accelerator_id(a.index)
                for n in nodes
                if n in self.nodes
                for a in self.nodes[n].accelerators
            )
        after = FleetSnapshot(
            self.nodes,
            capacity,
            self.racks,
            power,
            pods,
            self.skus,
            self.models,
            self.pcie_util if pcie_util is None else pcie_util,
            self.cross_domain_used if cross_domain_used is None else cross_domain_used,
            self.known_regions,
        )
        if changed is not None:
            _chain(self, after, (changed[0] | pcie_moved, changed[1], changed[2]))
        elif capacity.keys() == self.capacity.keys() and pods.keys() == self.tpu_pods.keys():
            accelerators = frozenset(a for a, cap in capacity.items() if self.capacity[a] != cap) | pcie_moved
            racks = frozenset(
                k for k in power.keys() | self.rack_power_used_w.keys() if power.get(k) != self.rack_power_used_w.get(k)
            )
            changed_pods = frozenset(p for p, state in pods.items() if self.tpu_pods[p] != state)
            _chain(self, after, (accelerators, racks, changed_pods))
        return after


def _same_frame(a: AcceleratorCapacity | None, b: AcceleratorCapacity | None) -> bool:
    """Whether an accelerator offers the same capacity to an empty fleet (usable bytes, availability)."""
    return a is not None and b is not None and (a.usable, a.available) == (b.usable, b.available)


def _same_pod(a: TpuPodState | None, b: TpuPodState | None) -> bool:
    """Whether a TPU pod offers the same chips to an empty fleet (the pod and its HBM per chip)."""
    return a is not None and b is not None and a.pod == b.pod and a.hbm_per_chip == b.hbm_per_chip


def _chain(
    before: FleetSnapshot, after: FleetSnapshot, touched: tuple[frozenset[str], frozenset[RackKey], frozenset[str]]
) -> None:
    """Let ``after``'s index be derived from ``before``'s (or its nearest ancestor's) plus ``touched``."""
    if all(_same_frame(before.capacity.get(a), after.capacity.get(a)) for a in touched[0]) and all(
        _same_pod(before.tpu_pods.get(p), after.tpu_pods.get(p)) for p in touched[2]
    ):
        after._memo.frame = before._memo.frame
    # Point at the nearest ancestor whose index exists (or will be built), merging what changed since:
    # a chain of snapshots without decisions in between then holds one ancestor, not all of them.
    memo = before._memo
    if memo.index or memo.parent is None:
        after._memo.parent = before
        after._memo.touched = touched
    else:
        accelerators, racks, pods = memo.touched
        after._memo.parent = memo.parent
        after._memo.touched = (accelerators | touched[0], racks | touched[1], pods | touched[2])


# -- the request -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency targets of the requests the replica will serve (milliseconds)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    p99_ms: float | None = None


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    """``placement.place`` as the domain sees it (API.md). Nothing is validated here: the demand
    prefilter turns bad values into a typed rejection, because bad input is an answer, not a crash."""

    request_id: str
    tenant: str
    model: str
    context_tokens: int
    concurrency: int = 1
    dtype: str | None = None
    kv_dtype: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    tp: int | None = None
    backend: str = "any"
    skus: tuple[str, ...] | None = None
    region: str | None = None
    preemptible: bool = False
    slo: Slo | None = None
    sharing: str = "exclusive"  # `exclusive` | `shared` (TP=1 only)
    fallbacks: tuple[str, ...] | None = None  # None: the default ladder (FALLBACKS); (): exact or nothing
    pp: int | None = None  # a fixed pipeline depth (GPU only)


FALLBACKS: tuple[str, ...] = ("kv_quantize", "pipeline", "cross_domain", "queue")
"""The brief's ladder, in order: quantise the KV cache, pipeline stages across NVLink domains, a TP
group across domains within the cluster's cross-domain budget, then wait in the queue."""


# -- the decision ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TpuPlacement:
    """The slice a TPU replica holds: ``chips`` are ``"<pod>/<x>.<y>[.<z>]"`` in row-major order."""

    pod: str
    origin: tuple[int, ...]
    shape: tuple[int, ...]
    chips: tuple[str, ...]

    @property
    def slice(self) -> TpuSlice:
        return TpuSlice(self.origin, self.shape)


@dataclass(frozen=True, slots=True)
class RejectionClass:
    """``count`` candidates (``unit``s: nodes, fabric domains, TPU pods) turned down for one reason.

    ``reason`` is the status code (``hbm_short``, ``no_nvlink_group``...), ``detail`` the figure in
    words ("HBM short by 3.2 GB per GPU at TP=4"); ``tp`` is None for reasons that hold at every TP.
    """

    count: int
    reason: str
    detail: str
    tp: int | None = None
    unit: str = "node"

    def describe(self) -> str:
        noun = self.unit if self.count == 1 else f"{self.unit}s"
        return f"{self.count} {noun}: {self.detail}"


@dataclass(frozen=True, slots=True)
class Decision:
    """A placement or a typed refusal (DESIGN §4 pipeline; API.md ``placement.place`` reply).

    Placed on GPUs: ``node`` (the first of ``nodes`` when a multi-node NVLink domain spans several),
    ``accelerators`` in TP rank order, ``domain`` the NVLink domain id. Placed on a TPU: ``tpu`` set,
    ``accelerators`` the chip ids, ``tp`` the chip count. ``share`` is what each accelerator holds.
    ``score`` maps each score plugin to its value in [0, 1], plus ``total`` (weighted mean).
    """

    request_id: str
    status: DecisionStatus
    error_code: ErrorCode | None = None
    message: str = ""
    backend: str | None = None
    region: str | None = None
    cluster: str | None = None
    rack: str | None = None
    node: str | None = None
    nodes: tuple[str, ...] = ()
    sku: str | None = None
    tp: int | None = None
    accelerators: tuple[str, ...] = ()
    domain: str | None = None
    share: MemoryShare | None = None
    tpu: TpuPlacement | None = None
    score: Mapping[str, float] = field(default_factory=dict)
    explanation: tuple[str, ...] = ()
    rejections: tuple[RejectionClass, ...] = ()
    sharing: str = "exclusive"
    pp: int = 1
    # With pp > 1: each stage's accelerators in TP rank order (``accelerators`` is their concatenation).
    stages: tuple[tuple[str, ...], ...] = ()
    fallback: str | None = None  # the ladder step that made it fit
    cross_domain_bytes_per_s: float = 0.0  # TP traffic this replica sends across NVLink domains
    queueable: bool = False  # refused for capacity with `queue` allowed: the service may queue it
    estimate: Mapping[str, float] = field(default_factory=dict)  # ttft_ms, tpot_ms, tokens_per_s, load_time_s

    @property
    def placed(self) -> bool:
        return self.status == "placed"


# -- applying a decision -----------------------------------------------------------------------


def apply(snapshot: FleetSnapshot, decision: Decision) -> FleetSnapshot:
    """The snapshot after ``decision``: its share reserved on each accelerator, the TDP of every GPU
    that turns from idle to busy added to its rack, its TPU slice taken. A rejected decision returns
    ``snapshot`` itself. Raises ``ValueError`` when the decision does not fit the snapshot (an
    unknown or unavailable accelerator, HBM over usable, a slice not free): callers apply decisions
    made on this snapshot, so that is a bug, not an outcome."""
    if not decision.placed:
        return snapshot
    if decision.share is None:
        raise ValueError(f"decision {decision.request_id} is placed but has no share")
    capacity = dict(snapshot.capacity)
    power = dict(snapshot.rack_power_used_w)
    pods = dict(snapshot.tpu_pods)
    touched_racks: set[RackKey] = set()
    if decision.tpu is not None:
        placement = decision.tpu
        pod = pods.get(placement.pod)
        if pod is None:
            raise ValueError(f"decision {decision.request_id}: unknown TPU pod {placement.pod}")
        pods[placement.pod] = TpuPodState(pod.pod, allocate(pod.grid, placement.slice), pod.hbm_per_chip)
        touched: frozenset[str] = frozenset()
        touched_pods = frozenset({placement.pod})
    else:
        need = decision.share.total
        for acc_id in decision.accelerators:
            cap = capacity.get(acc_id)
            if cap is None or not cap.available:
                raise ValueError(f"decision {decision.request_id}: accelerator {acc_id} is unknown or unavailable")
            if cap.reserved + need > cap.usable:
                raise ValueError(f"decision {decision.request_id}: {acc_id} would hold {cap.reserved + need} > usable")
            if cap.idle:
                key = snapshot.rack_key(cap.node)
                power[key] = power.get(key, 0.0) + snapshot.skus[cap.sku].tdp_w
                touched_racks.add(key)
            capacity[acc_id] = replace(cap, reserved=cap.reserved + need, shared=decision.sharing == "shared")
        touched = frozenset(decision.accelerators)
        touched_pods = frozenset()
    cross_domain = snapshot.cross_domain_used
    if decision.cross_domain_bytes_per_s and decision.cluster is not None and decision.region is not None:
        crossing = cluster_key(decision.region, decision.cluster)
        cross_domain = dict(cross_domain)
        cross_domain[crossing] = cross_domain.get(crossing, 0.0) + decision.cross_domain_bytes_per_s
    after = FleetSnapshot(
        nodes=snapshot.nodes,
        capacity=capacity,
        racks=snapshot.racks,
        rack_power_used_w=power,
        tpu_pods=pods,
        skus=snapshot.skus,
        models=snapshot.models,
        pcie_util=snapshot.pcie_util,
        cross_domain_used=cross_domain,
        known_regions=snapshot.known_regions,
    )
    _chain(snapshot, after, (touched, frozenset(touched_racks), touched_pods))
    return after
