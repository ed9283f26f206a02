"""Fixture builders for placement tests: ``node("dgx1").sku("H100-SXM-80GB").nvswitch(8)`` and
``snapshot(node(...), ..., pods=[tpu_pod(...)])``. Catalogs come from shared/catalog via yaml."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Self

import yaml
from hypothesis import strategies as st

from shared.domain.fleet import Accelerator, Fleet, NodeProfile, Rack, TpuPod
from shared.domain.hardware import Sku, parse_sku_catalog
from shared.domain.models import ModelSpec, parse_model_catalog
from shared.domain.placement import FleetSnapshot, PlacementRequest
from shared.domain.topology import (
    FabricState,
    GpuFabricInfo,
    LinkMatrix,
    four_plus_four,
    nvlink_pairs,
    nvswitch,
    pcie_only,
)
from shared.domain.topology.tpu import TpuType

CATALOG = Path(__file__).resolve().parents[3] / "shared" / "catalog"
GB = 1e9

# A DGX-1 (V100) is not in the catalog; its datasheet figures are enough for topology tests
# (NVIDIA Tesla V100 SXM2 32GB: 900 GB/s, 300 W, PCIe Gen3, 6 NVLinks). Family "volta" has no
# latency calibration, which exercises the bandwidth proxy.
V100 = Sku(
    name="V100-SXM2-32GB",
    vendor="nvidia",
    family="volta",
    hbm_bytes=34_359_738_368,
    memory_bandwidth_bytes_per_s=900e9,
    tdp_w=300,
    pcie_gen=3,
    pcie_lanes=16,
    nvlink_links=6,
    bf16_tflops=125,
    price_usd_per_hour=1.0,
    source="test fixture: NVIDIA Tesla V100 datasheet",
)

# DGX-1 V100 hybrid cube mesh as `nvidia-smi topo -m` prints it: two quads (NV1/NV2 inside) and
# GPU i <-> i+4 across; every other pair crosses the sockets (SYS). Largest all-NVLinked group: 4.
CUBE_MESH_CODES = (
    ("X", "NV1", "NV1", "NV2", "NV2", "SYS", "SYS", "SYS"),
    ("NV1", "X", "NV2", "NV1", "SYS", "NV2", "SYS", "SYS"),
    ("NV1", "NV2", "X", "NV2", "SYS", "SYS", "NV1", "SYS"),
    ("NV2", "NV1", "NV2", "X", "SYS", "SYS", "SYS", "NV1"),
    ("NV2", "SYS", "SYS", "SYS", "X", "NV1", "NV1", "NV2"),
    ("SYS", "NV2", "SYS", "SYS", "NV1", "X", "NV2", "NV1"),
    ("SYS", "SYS", "NV1", "SYS", "NV1", "NV2", "X", "NV2"),
    ("SYS", "SYS", "SYS", "NV1", "NV2", "NV1", "NV2", "X"),
)


@cache
def skus() -> dict[str, Sku]:
    catalog = parse_sku_catalog(yaml.safe_load((CATALOG / "skus.yaml").read_text()))
    return {**catalog, V100.name: V100}


@cache
def models() -> dict[str, ModelSpec]:
    return parse_model_catalog(yaml.safe_load((CATALOG / "models.yaml").read_text()))


@dataclass
class NodeBuilder:
    name: str
    sku_name: str = "H100-SXM-80GB"
    matrix: LinkMatrix = field(default_factory=nvswitch)
    region_name: str = "us-west-1"
    cluster_name: str = "c1"
    rack_name: str = "r1"
    fabric_info: GpuFabricInfo | None = None
    reserved: dict[int, int] = field(default_factory=dict)
    down: set[int] = field(default_factory=set)
    shared: set[int] = field(default_factory=set)

    def sku(self, name: str) -> Self:
        self.sku_name = name
        return self

    def nvswitch(self, gpus: int = 8) -> Self:
        self.matrix = nvswitch(gpus)
        return self

    def four_plus_four(self) -> Self:
        self.matrix = four_plus_four(8)
        return self

    def pairs(self, gpus: int = 8) -> Self:
        self.matrix = nvlink_pairs(gpus)
        return self

    def pcie(self, gpus: int = 8) -> Self:
        self.matrix = pcie_only(gpus)
        return self

    def cube_mesh(self) -> Self:
        self.matrix = LinkMatrix.from_codes(CUBE_MESH_CODES, numa=[0, 0, 0, 0, 1, 1, 1, 1])
        return self

    def links(self, matrix: LinkMatrix) -> Self:
        self.matrix = matrix
        return self

    def fabric(self, cluster_uuid: str, clique: int = 1) -> Self:
        """A member of a multi-node NVLink domain (NVML fabric clique), e.g. GH200 NVL32."""
        self.fabric_info = GpuFabricInfo(cluster_uuid, clique, FabricState.COMPLETED)
        return self

    def region(self, name: str) -> Self:
        self.region_name = name
        return self

    def rack(self, name: str) -> Self:
        self.rack_name = name
        return self

    def reserve(self, index: int, nbytes: int, *, shared: bool = False) -> Self:
        """``nbytes`` held on GPU ``index`` by another replica (an exclusive one unless ``shared``)."""
        self.reserved[index] = nbytes
        if shared:
            self.shared.add(index)
        return self

    def unavailable(self, index: int) -> Self:
        self.down.add(index)
        return self

    def profile(self) -> NodeProfile:
        sku = skus()[self.sku_name]
        accelerators = tuple(
            Accelerator(
                index=i,
                sku=self.sku_name,
                hbm_bytes=sku.hbm_bytes,
                numa_node=self.matrix.numa[i],
                pcie_gen_max=sku.pcie_gen,
                fabric=self.fabric_info,
            )
            for i in range(self.matrix.gpu_count)
        )
        return NodeProfile(
            name=self.name,
            region=self.region_name,
            cluster=self.cluster_name,
            rack=self.rack_name,
            sku=self.sku_name,
            accelerators=accelerators,
            links=self.matrix,
        )


def node(name: str) -> NodeBuilder:
    return NodeBuilder(name)


def tpu_pod(name: str, tpu_type: str = "v5e", shape: tuple[int, ...] = (16, 16), region: str = "us-west-1") -> TpuPod:
    return TpuPod(name=name, region=region, type=TpuType(tpu_type), shape=shape)


def snapshot(
    *nodes: NodeBuilder,
    pods: Iterable[TpuPod] = (),
    power_kw: Mapping[str, float] | float | None = None,
) -> FleetSnapshot:
    """A snapshot of ``nodes`` and ``pods``; ``power_kw`` budgets every rack (a number) or racks by
    name (a mapping); rack power in use starts at the TDP of the GPUs with reservations."""
    profiles = [b.profile() for b in nodes]
    racks: dict[tuple[str, str, str], Rack] = {}
    for p in profiles:
        budget = power_kw.get(p.rack) if isinstance(power_kw, Mapping) else power_kw
        racks[(p.region, p.cluster, p.rack)] = Rack(p.rack, p.region, p.cluster, budget)
    fleet = Fleet(nodes=tuple(profiles), racks=tuple(racks.values()), tpu_pods=tuple(pods))
    reserved = {f"{b.name}/gpu{i}": n for b in nodes for i, n in b.reserved.items()}
    down = [f"{b.name}/gpu{i}" for b in nodes for i in b.down]
    shared = [f"{b.name}/gpu{i}" for b in nodes for i in b.shared]
    return FleetSnapshot.from_fleet(
        fleet, skus=skus(), models=models(), reserved=reserved, unavailable=down, shared=shared
    )


def request(model: str = "llama3-8b", **fields: object) -> PlacementRequest:
    """A request with sensible defaults (4k context, 4 sequences); ``fields`` override any field.
    Exact by default (``fallbacks=()``): tests of the fallback ladder ask for it (``fallbacks=None`` is
    the whole ladder, as the API's default)."""
    values: dict[str, object] = {
        "request_id": "req-1",
        "tenant": "acme",
        "model": model,
        "context_tokens": 4096,
        "concurrency": 4,
        "fallbacks": (),
    }
    values.update(fields)
    return PlacementRequest(**values)  # type: ignore[arg-type]


SMALL_MODELS = ["llama3-8b", "mistral-7b-v0.1", "gemma2-9b", "llama3-70b", "mixtral-8x7b"]
_NODE_KINDS = (
    lambda b: b.nvswitch(4),
    lambda b: b.sku("H200-SXM-141GB").nvswitch(2),
    lambda b: b.sku("L40S-48GB").pcie(2),
    lambda b: b.sku("A100-PCIE-80GB").pairs(4),
)


@st.composite
def small_instances(
    draw: st.DrawFn, *, held: bool = False, pods: bool = False
) -> tuple[FleetSnapshot, list[PlacementRequest]]:
    """1-3 nodes of mixed layouts and 1-6 requests (some ``shared``), as the greedy-vs-MILP tests use.
    ``held``: GPUs of the first node may already be held, by a shared replica (gpu0) or an exclusive
    one (gpu1); ``pods``: a 4x4 TPU pod may join the fleet."""
    builders = [draw(st.sampled_from(_NODE_KINDS))(node(f"n{i}")) for i in range(draw(st.integers(1, 3)))]
    reqs = [
        request(
            draw(st.sampled_from(SMALL_MODELS)),
            request_id=f"r{i}",
            context_tokens=draw(st.sampled_from([1024, 4096, 8192])),
            concurrency=draw(st.integers(1, 24)),
            dtype=draw(st.sampled_from([None, "fp8"])),
            **({"sharing": "shared", "tp": 1} if draw(st.booleans()) else {}),
        )
        for i in range(draw(st.integers(1, 6)))
    ]
    if held and draw(st.booleans()):
        builders[0].reserve(0, 10 * 10**9, shared=True)
    if held and draw(st.booleans()):
        builders[0].reserve(1, 10 * 10**9)
    tpu = [tpu_pod("pod", shape=(4, 4))] if pods and draw(st.booleans()) else []
    return snapshot(*builders, pods=tpu, power_kw=draw(st.sampled_from([None, 2.0, 8.0]))), reqs
