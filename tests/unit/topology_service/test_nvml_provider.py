"""The NVML provider against a stand-in for the pynvml module (no GPU here): NVSwitch systems, direct
NVLink pairs, PCIe levels, fabric cliques, affinity masks and telemetry units."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from services.topology_discovery.providers import NodePlace, ProviderError
from services.topology_discovery.providers.nvml import NvmlProvider, _cpu_list, normalise_bus_id
from shared.domain.topology import NodeKind

GIB = 1024**3
SWITCH, GPU = 2, 0


class NotSupported(Exception):
    """Stands for pynvml.NVMLError_NotSupported."""


class FabricInfo(ctypes.Structure):
    _fields_ = [
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_uint8 * 16),
        ("status", ctypes.c_uint),
        ("cliqueId", ctypes.c_uint32),
        ("state", ctypes.c_uint),
        ("healthMask", ctypes.c_uint32),
    ]


@dataclass
class FakeGpu:
    bus: str
    links: list[tuple[int, str | None]]  # per NVLink: (remote device type, remote bus id)
    name: str = "NVIDIA H100 80GB HBM3"
    total: int = 81559 * 2**20
    numa: int = 0
    cpus: tuple[int, ...] = (0, 1, 2, 3)
    fabric: tuple[bytes, int, int] | None = None  # (cluster uuid, clique, state)


@dataclass
class FakeNvml:
    gpus: list[FakeGpu]
    levels: dict[frozenset[int], int] = field(default_factory=dict)
    NVML_NVLINK_MAX_LINKS: int = 18
    NVML_GPU_FABRIC_UUID_LEN: int = 16
    NVML_PCIE_UTIL_TX_BYTES: int = 0
    NVML_PCIE_UTIL_RX_BYTES: int = 1
    c_nvmlGpuFabricInfoV_t: type = FabricInfo

    def nvmlInit(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> int:
        return i

    def nvmlDeviceGetName(self, h: int) -> str:
        return self.gpus[h].name

    def nvmlDeviceGetUUID(self, h: int) -> bytes:
        return f"GPU-{h:08d}".encode()

    def nvmlDeviceGetPciInfo(self, h: int) -> Any:
        return SimpleNamespace(busId=self.gpus[h].bus.encode())

    def nvmlDeviceGetMemoryInfo(self, h: int) -> Any:
        return SimpleNamespace(total=self.gpus[h].total, used=2**30, free=self.gpus[h].total - 2**30)

    def nvmlDeviceGetCpuAffinity(self, h: int, words: int) -> list[int]:
        mask = [0] * words
        for cpu in self.gpus[h].cpus:
            mask[cpu // 64] |= 1 << (cpu % 64)
        return mask

    def nvmlDeviceGetMemoryAffinity(self, h: int, size: int, scope: int) -> list[int]:
        return [1 << self.gpus[h].numa]

    def nvmlDeviceGetPowerManagementLimit(self, h: int) -> int:
        return 700_000

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h: int) -> int:
        return 5

    def nvmlDeviceGetMaxPcieLinkWidth(self, h: int) -> int:
        return 16

    def nvmlDeviceGetNvLinkState(self, h: int, link: int) -> int:
        if link >= len(self.gpus[h].links):
            raise NotSupported
        return 1

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: int, link: int) -> int:
        return self.gpus[h].links[link][0]

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: int, link: int) -> Any:
        bus = self.gpus[h].links[link][1]
        if bus is None:
            raise NotSupported
        return SimpleNamespace(busId=bus.encode())

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:
        return self.levels.get(frozenset((a, b)), 50)

    def nvmlDeviceGetGpuFabricInfoV(self, h: int, ref: Any) -> int:
        fabric = self.gpus[h].fabric
        if fabric is None:
            raise NotSupported
        info = ref._obj
        ctypes.memmove(ctypes.addressof(info) + FabricInfo.clusterUuid.offset, fabric[0], 16)
        info.cliqueId, info.state, info.status = fabric[1], fabric[2], 0
        return 0

    def nvmlDeviceGetUtilizationRates(self, h: int) -> Any:
        return SimpleNamespace(gpu=40)

    def nvmlDeviceGetPowerUsage(self, h: int) -> int:
        return 350_500

    def nvmlDeviceGetPcieThroughput(self, h: int, counter: int) -> int:
        return 1000  # KB/s


PLACE = NodePlace(name="n1", region="r", cluster="c", rack="k")


def bus(i: int) -> str:
    return f"00000000:{0x18 + i:02X}:00.0"


def test_nvswitch_node_reads_as_all_pairs_nv18() -> None:
    # Every GPU has 18 links to switches: direct matching finds no peer, so NV = min(18, 18).
    gpus = [FakeGpu(bus=bus(i), links=[(SWITCH, None)] * 18, numa=i // 4) for i in range(8)]
    profile = NvmlProvider(place=PLACE, nvml=FakeNvml(gpus)).profile()  # type: ignore[arg-type]
    assert profile.links.codes()[0][1:] == ("NV18",) * 7
    assert profile.topology.kind is NodeKind.FULLY_CONNECTED
    assert profile.sku == "H100-SXM-80GB" and profile.accelerators[3].hbm_bytes == 81559 * 2**20
    assert profile.accelerators[5].numa_node == 1 and profile.accelerators[0].power_limit_w == 700
    assert profile.accelerators[0].cpu_affinity == "0-3"


def test_bridged_pairs_count_links_per_peer_and_pcie_levels_fill_the_rest() -> None:
    # GPU0<->GPU1 and GPU2<->GPU3 bridged with 4 links each; PCIe: PIX within a pair, SYS across.
    gpus = [
        FakeGpu(bus=bus(i), links=[(GPU, bus(i ^ 1))] * 4, name="NVIDIA A100 80GB PCIe", total=80 * GIB)
        for i in range(4)
    ]
    levels = {frozenset((0, 2)): 50, frozenset((1, 3)): 50, frozenset((0, 3)): 40, frozenset((1, 2)): 20}
    profile = NvmlProvider(place=PLACE, nvml=FakeNvml(gpus, levels)).profile()  # type: ignore[arg-type]
    assert profile.links.codes() == (
        ("X", "NV4", "SYS", "NODE"),
        ("NV4", "X", "PXB", "SYS"),
        ("SYS", "PXB", "X", "NV4"),
        ("NODE", "SYS", "NV4", "X"),
    )
    assert profile.topology.kind is NodeKind.PAIRS
    assert profile.sku == "A100-PCIE-80GB"


def test_fabric_clique_marks_a_multi_node_domain() -> None:
    uuid = bytes(range(1, 17))
    gpus = [FakeGpu(bus=bus(0), links=[], name="NVIDIA GH200 480GB", total=97871 * 2**20, fabric=(uuid, 7, 3))]
    profile = NvmlProvider(place=PLACE, nvml=FakeNvml(gpus)).profile()  # type: ignore[arg-type]
    fabric = profile.accelerators[0].fabric
    assert fabric is not None and fabric.is_multi_node and fabric.clique_id == 7
    assert fabric.cluster_uuid == uuid.hex()
    assert profile.topology.kind is NodeKind.MULTI_NODE and profile.sku == "GH200-96GB"


def test_telemetry_units() -> None:
    gpus = [FakeGpu(bus=bus(0), links=[])]
    (sample,) = NvmlProvider(place=PLACE, nvml=FakeNvml(gpus)).telemetry()  # type: ignore[arg-type]
    assert sample.power_w == 350.5 and sample.utilization_pct == 40
    assert sample.pcie_tx_bytes_per_s == 1000 * 1024 and sample.memory_used_bytes == GIB


def test_no_gpus_is_a_provider_error() -> None:
    with pytest.raises(ProviderError):
        NvmlProvider(place=PLACE, nvml=FakeNvml([])).profile()  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raw", "want"),
    [("00000000:19:00.0", "00000000:19:00.0"), (b"0000:9a:00.0", "00000000:9A:00.0"), ("19:00.0", "00000000:19:00.0")],
)
def test_bus_ids_are_normalised(raw: str | bytes, want: str) -> None:
    assert normalise_bus_id(raw) == want


def test_cpu_masks_become_cpu_lists() -> None:
    assert _cpu_list([0b1111, 0b11]) == "0-3,64-65"
    assert _cpu_list([0, 0]) is None  # empty under a cgroup cpuset
