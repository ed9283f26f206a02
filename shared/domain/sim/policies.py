"""Where a replica goes: ``hetsched`` (ours, ``placement.decide``) and the baselines it is compared with.

Every policy answers a ``Decision`` that ``placement.apply`` accepts. Baselines place on GPUs only
(TPUs are reached only through ``hetsched``); each tries TP degrees 1, 2, 4, 8 that divide the model's
heads, smallest first, and sizes the per-GPU share with ``memory.per_accelerator_share``:

* ``gpu-index``: lowest node name, then the lowest window of *contiguous* GPU indices with room, as
  serving engines number devices; NVLink is ignored, so a TP group may not be an NVLink clique.
* ``random``: a seeded random node among those with room, then seeded random GPUs on it.
* ``first-fit``: first node in name order with ``tp`` GPUs that have room (lowest indices), NVLink-oblivious.
* ``cheapest-sku``: only the cheapest SKU that can hold the model (price_usd_per_hour x smallest TP that
  fits an empty GPU), first-fit inside it; when that SKU is full the request is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from shared.domain.errors import ErrorCode
from shared.domain.memory import MemoryShare, per_accelerator_share
from shared.domain.models import ModelSpec
from shared.domain.placement import Decision, FleetSnapshot, PlacementRequest, decide
from shared.domain.traces import seeded_uniform

TP_DEGREES = (1, 2, 4, 8)


class Policy(Protocol):
    """Chooses where one replica goes; may keep state across calls (e.g. a seeded draw counter)."""

    name: str

    def decide(self, snapshot: FleetSnapshot, request: PlacementRequest) -> Decision: ...


@runtime_checkable
class ReleasingPolicy(Protocol):
    """A policy that holds something outside the simulation (a live stack's allocation) and must be told
    when the simulation retires a replica it placed."""

    def released(self, decision: Decision) -> None: ...


@dataclass
class HetschedPolicy:
    """Ours: the placement framework's ``decide``."""

    name: str = "hetsched"

    def decide(self, snapshot: FleetSnapshot, request: PlacementRequest) -> Decision:
        return decide(snapshot, request)


# GPU choosers: given the snapshot, node name, tp and the share, the accelerator ids or None.
_Chooser = Callable[[FleetSnapshot, str, int, MemoryShare], tuple[str, ...] | None]


def _rejected(request: PlacementRequest, message: str) -> Decision:
    return Decision(request_id=request.request_id, status="rejected", error_code=ErrorCode.NO_CAPACITY, message=message)


def _placed(
    snapshot: FleetSnapshot, request: PlacementRequest, node: str, tp: int, accs: tuple[str, ...], share: MemoryShare
) -> Decision:
    profile = snapshot.nodes[node]
    return Decision(
        request_id=request.request_id,
        status="placed",
        backend="gpu",
        region=profile.region,
        cluster=profile.cluster,
        rack=profile.rack,
        node=node,
        nodes=(node,),
        sku=profile.sku,
        tp=tp,
        accelerators=accs,
        share=share,
    )


def _tps(spec: ModelSpec) -> list[int]:
    return [tp for tp in TP_DEGREES if not (spec.heads and spec.heads % tp) and not (spec.ssm and spec.ssm.heads % tp)]


def _share(spec: ModelSpec, request: PlacementRequest, tp: int) -> MemoryShare:
    return per_accelerator_share(
        spec,
        tp=tp,
        dtype=request.dtype or spec.dtype,
        kv_dtype=request.kv_dtype or spec.kv_dtype,
        context_tokens=request.context_tokens,
        concurrency=request.concurrency,
    )


def _roomy(snapshot: FleetSnapshot, node: str, need: int) -> list[tuple[int, str]]:
    """(index, id) of the node's GPUs with ``need`` bytes free, by index."""
    profile = snapshot.nodes[node]
    out = []
    for acc in profile.accelerators:
        acc_id = profile.accelerator_id(acc.index)
        if snapshot.capacity[acc_id].free >= need:
            out.append((acc.index, acc_id))
    return out


def contiguous_window(snapshot: FleetSnapshot, node: str, tp: int, share: MemoryShare) -> tuple[str, ...] | None:
    """The lowest window of ``tp`` consecutive GPU indices that all have room."""
    roomy = dict(_roomy(snapshot, node, share.total))
    count = len(snapshot.nodes[node].accelerators)
    for start in range(count - tp + 1):
        if all(i in roomy for i in range(start, start + tp)):
            return tuple(roomy[i] for i in range(start, start + tp))
    return None


def lowest_roomy(snapshot: FleetSnapshot, node: str, tp: int, share: MemoryShare) -> tuple[str, ...] | None:
    """The ``tp`` lowest-index GPUs with room, contiguous or not."""
    roomy = _roomy(snapshot, node, share.total)
    return tuple(acc_id for _, acc_id in roomy[:tp]) if len(roomy) >= tp else None


def _gpu_nodes(snapshot: FleetSnapshot, skus: Sequence[str] | None = None) -> list[str]:
    return sorted(
        name
        for name, node in snapshot.nodes.items()
        if not snapshot.skus[node.sku].is_tpu and (skus is None or node.sku in skus)
    )


def _node_major(
    snapshot: FleetSnapshot, request: PlacementRequest, chooser: _Chooser, skus: Sequence[str] | None = None
) -> Decision:
    spec = snapshot.models.get(request.model)
    if spec is None:
        return Decision(request_id=request.request_id, status="rejected", error_code=ErrorCode.UNKNOWN_MODEL)
    shares = {tp: _share(spec, request, tp) for tp in _tps(spec)}
    for node in _gpu_nodes(snapshot, skus):
        for tp, share in shares.items():
            accs = chooser(snapshot, node, tp, share)
            if accs is not None:
                return _placed(snapshot, request, node, tp, accs, share)
    return _rejected(request, "no node has room")


@dataclass
class GpuIndexPolicy:
    name: str = "gpu-index"

    def decide(self, snapshot: FleetSnapshot, request: PlacementRequest) -> Decision:
        return _node_major(snapshot, request, contiguous_window)


@dataclass
class FirstFitPolicy:
    name: str = "first-fit"

    def decide(self, snapshot: FleetSnapshot, request: PlacementRequest) -> Decision:
        return _node_major(snapshot, request, lowest_roomy)


@dataclass
class CheapestSkuPolicy:
    name: str = "cheapest-sku"

    def decide(self, snapshot: FleetSnapshot, request: PlacementRequest) -> Decision:
        spec = snapshot.models.get(request.model)
        if spec is None:
            return Decision(request_id=request.request_id, status="rejected", error_code=ErrorCode.UNKNOWN_MODEL)
        best: tuple[float, str] | None = None
        for sku_name in sorted({snapshot.nodes[n].sku for n in _gpu_nodes(snapshot)}):
            sku = snapshot.skus[sku_name]
            usable = next(c.usable for c in snapshot.capacity.values() if c.sku == sku_name)
            width = max(len(node.accelerators) for node in snapshot.nodes.values() if node.sku == sku_name)
            for tp in _tps(spec):
                if tp <= width and _share(spec, request, tp).total <= usable:
                    cost = sku.price_usd_per_hour * tp
                    if best is None or cost < best[0]:
                        best = (cost, sku_name)
                    break
        if best is None:
            return _rejected(request, "no SKU can hold the model")
        return _node_major(snapshot, request, lowest_roomy, skus=(best[1],))


@dataclass
class RandomPolicy:
    """Seeded: the n-th decision draws from ``seeded_uniform(seed, n, k)``."""

    seed: int = 0
    name: str = "random"
    _draws: int = field(default=0, repr=False)

    def _uniform(self, k: int) -> float:
        return seeded_uniform(self.seed, self._draws, k)

    def decide(self, snapshot: FleetSnapshot, request: PlacementRequest) -> Decision:
        self._draws += 1
        spec = snapshot.models.get(request.model)
        if spec is None:
            return Decision(request_id=request.request_id, status="rejected", error_code=ErrorCode.UNKNOWN_MODEL)
        for tp in _tps(spec):
            share = _share(spec, request, tp)
            feasible = [
                (node, roomy)
                for node in _gpu_nodes(snapshot)
                if len(roomy := _roomy(snapshot, node, share.total)) >= tp
            ]
            if not feasible:
                continue
            node, roomy = feasible[int(self._uniform(0) * len(feasible))]
            pool = [acc_id for _, acc_id in roomy]
            for i in range(tp):  # partial Fisher-Yates
                j = i + int(self._uniform(i + 1) * (len(pool) - i))
                pool[i], pool[j] = pool[j], pool[i]
            return _placed(snapshot, request, node, tp, tuple(pool[:tp]), share)
        return _rejected(request, "no node has room")


POLICIES: tuple[str, ...] = ("hetsched", "gpu-index", "random", "first-fit", "cheapest-sku")


def make_policy(name: str, *, seed: int = 0) -> Policy:
    """A fresh policy by name (``POLICIES``); ValueError for an unknown one."""
    factories: Mapping[str, Callable[[], Policy]] = {
        "hetsched": HetschedPolicy,
        "gpu-index": GpuIndexPolicy,
        "random": lambda: RandomPolicy(seed=seed),
        "first-fit": FirstFitPolicy,
        "cheapest-sku": CheapestSkuPolicy,
    }
    if name not in factories:
        raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}")
    return factories[name]()
