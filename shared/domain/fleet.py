"""The fleet as the domain sees it: regions > clusters > racks > nodes > accelerators, TPU pods.

A ``NodeProfile`` is what every topology provider produces (NVML, nvidia-smi text, inventory
presets): the node's place, its accelerators and its GPU link matrix. NVLink domains are derived
from the links (and from NVML fabric info for multi-node domains), never stored separately from them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shared.domain.topology import (
    DomainKind,
    FabricGpu,
    GpuFabricInfo,
    GpuRef,
    LinkMatrix,
    NodeTopology,
    describe_node,
    multi_node_domains,
)
from shared.domain.topology.tpu import TpuType


@dataclass(frozen=True, slots=True)
class AcceleratorId:
    """The one accelerator id every service uses: ``<node>/gpu<index>`` for a GPU, ``<pod>/<x>.<y>[.<z>]``
    for a TPU chip. Build ids with ``gpu``/``tpu`` and read them with ``parse``; nobody formats or
    splits the string by hand."""

    host: str
    gpu_index: int | None = None
    chip: tuple[int, ...] | None = None

    @staticmethod
    def gpu(node: str, index: int) -> str:
        return f"{node}/gpu{index}"

    @staticmethod
    def tpu(pod: str, coord: Sequence[int]) -> str:
        return f"{pod}/{'.'.join(str(c) for c in coord)}"

    @staticmethod
    def parse(value: str) -> AcceleratorId:
        """Split an id into its host (node or pod) and GPU index or chip coordinate."""
        host, sep, local = value.rpartition("/")
        if not sep or not host or not local:
            raise ValueError(f"not an accelerator id: {value!r}")
        if local.startswith("gpu") and local[3:].isdigit():
            return AcceleratorId(host=host, gpu_index=int(local[3:]))
        parts = local.split(".")
        if all(p.isdigit() for p in parts):
            return AcceleratorId(host=host, chip=tuple(int(p) for p in parts))
        raise ValueError(f"not an accelerator id: {value!r}")

    @staticmethod
    def on_host(value: str, host: str) -> bool:
        """Whether the accelerator ``value`` is on node (or pod) ``host``: its host compared exactly (a
        prefix test would put ``a/b/gpu0`` on node ``a``); an id that does not parse is on none."""
        try:
            return AcceleratorId.parse(value).host == host
        except ValueError:
            return False

    def __str__(self) -> str:
        if self.gpu_index is not None:
            return AcceleratorId.gpu(self.host, self.gpu_index)
        return AcceleratorId.tpu(self.host, self.chip or ())


@dataclass(frozen=True, slots=True)
class Accelerator:
    """One GPU of a node. ``index`` is the GPU's index on its node, as nvidia-smi numbers it."""

    index: int
    sku: str
    hbm_bytes: int
    uuid: str | None = None
    pci_bus_id: str | None = None
    numa_node: int | None = None
    cpu_affinity: str | None = None
    power_limit_w: float | None = None
    pcie_gen_max: int | None = None
    pcie_width_max: int | None = None
    fabric: GpuFabricInfo | None = None


@dataclass(frozen=True, slots=True)
class NodeProfile:
    """One node: where it sits, its GPUs and the links between them."""

    name: str
    region: str
    cluster: str
    rack: str
    sku: str
    accelerators: tuple[Accelerator, ...]
    links: LinkMatrix
    source: str = "inventory"  # inventory | nvml | nvidia-smi

    def __post_init__(self) -> None:
        if self.links.gpu_count != len(self.accelerators):
            raise ValueError(
                f"node {self.name}: {len(self.accelerators)} accelerators but a {self.links.gpu_count}-GPU matrix"
            )

    def accelerator_id(self, index: int) -> str:
        return AcceleratorId.gpu(self.name, index)

    @property
    def topology(self) -> NodeTopology:
        return describe_node(self.links, [a.fabric for a in self.accelerators])

    @property
    def hbm_bytes(self) -> int:
        return sum(a.hbm_bytes for a in self.accelerators)

    def fingerprint(self) -> str:
        """Stable digest of everything in the profile: equal digests mean nothing changed."""
        return hashlib.sha256(json.dumps(profile_to_dict(self), sort_keys=True).encode()).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Rack:
    name: str
    region: str
    cluster: str
    power_kw: float | None


@dataclass(frozen=True, slots=True)
class TpuPod:
    """A TPU pod: chips on a 2-D (v5e) or 3-D (v5p) grid."""

    name: str
    region: str
    type: TpuType
    shape: tuple[int, ...]
    cluster: str | None = None

    @property
    def chips(self) -> int:
        total = 1
        for axis in self.shape:
            total *= axis
        return total


def cluster_key(region: str, cluster: str) -> str:
    """A cluster's identity across the fleet: ``<region>/<cluster>`` (cluster names repeat across regions,
    as ``c1`` does in the demo fleet). What per-cluster budgets (cross-domain traffic) are keyed by."""
    return f"{region}/{cluster}"


def tpu_chip_id(pod: str, coord: Sequence[int]) -> str:
    """Ledger id of one TPU chip: ``<pod>/<x>.<y>`` (v5e) or ``<pod>/<x>.<y>.<z>`` (v5p)."""
    return AcceleratorId.tpu(pod, coord)


def tpu_chip_ids(pod: TpuPod) -> list[str]:
    """Every chip of a pod, in row-major order (last axis fastest)."""
    coords: list[tuple[int, ...]] = [()]
    for axis in pod.shape:
        coords = [(*c, i) for c in coords for i in range(axis)]
    return [tpu_chip_id(pod.name, c) for c in coords]


@dataclass(frozen=True, slots=True)
class Domain:
    """An NVLink domain with fleet-wide ids: ``<node>/nv<lowest gpu>`` or ``fabric/<uuid>/<clique>``."""

    id: str
    kind: str
    members: tuple[str, ...]  # accelerator ids
    cliques: tuple[tuple[str, ...], ...] = ()


@dataclass(frozen=True, slots=True)
class Fleet:
    nodes: tuple[NodeProfile, ...] = ()
    racks: tuple[Rack, ...] = ()
    tpu_pods: tuple[TpuPod, ...] = ()
    regions: tuple[str, ...] = field(default=())

    def node(self, name: str) -> NodeProfile:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)


def fleet_domains(nodes: Iterable[NodeProfile]) -> tuple[Domain, ...]:
    """Every NVLink domain of the fleet: multi-node fabric cliques first, then each node's own.

    A GPU in a multi-node fabric clique belongs to that domain only; the node-local domains are
    built from the remaining GPUs.
    """
    nodes = tuple(nodes)
    fabric = multi_node_domains(
        FabricGpu(gpu=GpuRef(node.name, acc.index), fabric=acc.fabric) for node in nodes for acc in node.accelerators
    )
    in_fabric: set[tuple[str, int]] = set()
    domains: list[Domain] = []
    for multi in fabric:
        members = tuple(AcceleratorId.gpu(g.node_id, g.gpu_index) for g in multi.gpus)
        in_fabric.update((g.node_id, g.gpu_index) for g in multi.gpus)
        domains.append(
            Domain(
                id=f"fabric/{multi.cluster_uuid}/{multi.clique_id}",
                kind=DomainKind.MULTI_NODE.value,
                members=members,
                cliques=(members,),
            )
        )
    for node in nodes:
        for domain in node.topology.domains:
            gpus = [g for g in domain.gpus if (node.name, g) not in in_fabric]
            if not gpus:
                continue
            domains.append(
                Domain(
                    id=f"{node.name}/nv{min(gpus)}",
                    kind=domain.kind.value,
                    members=tuple(node.accelerator_id(g) for g in gpus),
                    cliques=tuple(tuple(node.accelerator_id(g) for g in c) for c in domain.cliques),
                )
            )
    return tuple(domains)


# -- the profile as plain data: what its fingerprint digests (the wire mapping is shared/infra/profiles.py) --


def _fabric_to_dict(fabric: GpuFabricInfo | None) -> dict[str, Any] | None:
    if fabric is None:
        return None
    return {
        "cluster_uuid": fabric.cluster_uuid,
        "clique_id": fabric.clique_id,
        "state": fabric.state.value,
        "status_ok": fabric.status_ok,
    }


def profile_to_dict(node: NodeProfile) -> dict[str, Any]:
    return {
        "name": node.name,
        "region": node.region,
        "cluster": node.cluster,
        "rack": node.rack,
        "sku": node.sku,
        "source": node.source,
        "links": [list(row) for row in node.links.codes()],
        "numa": list(node.links.numa),
        "accelerators": [
            {
                "index": a.index,
                "sku": a.sku,
                "hbm_bytes": a.hbm_bytes,
                "uuid": a.uuid,
                "pci_bus_id": a.pci_bus_id,
                "numa_node": a.numa_node,
                "cpu_affinity": a.cpu_affinity,
                "power_limit_w": a.power_limit_w,
                "pcie_gen_max": a.pcie_gen_max,
                "pcie_width_max": a.pcie_width_max,
                "fabric": _fabric_to_dict(a.fabric),
            }
            for a in node.accelerators
        ],
    }


@dataclass(frozen=True, slots=True)
class FleetDiff:
    """How an incoming set of profiles differs from what is stored (by fingerprint)."""

    new: tuple[NodeProfile, ...]
    changed: tuple[NodeProfile, ...]
    unchanged: tuple[str, ...]
    removed: tuple[str, ...]


def diff_profiles(
    stored: Mapping[str, str], incoming: Sequence[NodeProfile], *, removable: Iterable[str] = ()
) -> FleetDiff:
    """Compare incoming profiles with stored fingerprints (node -> fingerprint).

    Only names in ``removable`` that are not incoming are reported removed: an inventory load removes
    inventory nodes it no longer lists, never nodes that agents reported.
    """
    names = {node.name for node in incoming}
    new, changed, unchanged = [], [], []
    for node in incoming:
        before = stored.get(node.name)
        if before is None:
            new.append(node)
        elif before != node.fingerprint():
            changed.append(node)
        else:
            unchanged.append(node.name)
    removed = tuple(sorted(name for name in removable if name not in names))
    return FleetDiff(new=tuple(new), changed=tuple(changed), unchanged=tuple(unchanged), removed=removed)
