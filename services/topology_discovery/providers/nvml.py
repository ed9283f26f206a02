"""NVML provider (nvidia-ml-py): the node's GPUs, their links and NVLink fabric, straight from the driver.

Follows the notes in NVML.md: NVLink peers are counted per remote PCI bus id; on NVSwitch systems
the remote is a switch, so two GPUs that both reach the switch fabric get NV = min(active links);
PCIe levels come from the common-ancestor query; multi-node domains from the fabric info.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

from services.topology_discovery.providers import NodePlace, ProviderError
from shared.contracts.topology import GpuSample
from shared.domain.fleet import Accelerator, NodeProfile
from shared.domain.hardware import sku_from_device_name
from shared.domain.topology import FabricState, GpuFabricInfo, LinkMatrix
from shared.domain.topology.cpus import cpu_list

T = TypeVar("T")

# nvmlDeviceGetTopologyCommonAncestor levels -> `topo -m` codes (INTERNAL = same board: PIX).
_LEVEL_CODES = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
_FABRIC_STATES = {
    0: FabricState.NOT_SUPPORTED,
    1: FabricState.NOT_STARTED,
    2: FabricState.IN_PROGRESS,
    3: FabricState.COMPLETED,
}
_NVLINK_DEVICE_GPU, _NVLINK_DEVICE_SWITCH = 0, 2


def normalise_bus_id(bus_id: bytes | str) -> str:
    """``00000000:19:00.0`` for any of the spellings NVML returns (legacy 4-digit domains included)."""
    text = bus_id.decode() if isinstance(bus_id, bytes) else bus_id
    text = text.strip().rstrip("\x00")
    domain, _, rest = text.rpartition(":") if text.count(":") == 1 else text.partition(":")
    if text.count(":") == 1:  # "19:00.0": no domain
        domain, rest = "0", text
    bus, _, devfn = rest.partition(":")
    if not devfn:
        bus, devfn = rest.split(":", 1) if ":" in rest else (rest, "")
    try:
        return f"{int(domain, 16):08X}:{int(bus, 16):02X}:{devfn.upper()}"
    except ValueError:
        return text.upper()


def _cpu_list(words: Any, cpus_per_word: int = 64) -> str | None:
    """NVML's affinity bitmask words as a cpulist (``0-47,96-143``), None when empty (cgroup limits)."""
    cpus = [w * cpus_per_word + b for w, word in enumerate(words) for b in range(cpus_per_word) if int(word) >> b & 1]
    return cpu_list(cpus) or None


class NvmlProvider:
    """Profiles the local node through NVML. ``nvml`` is the ``pynvml`` module (tests hand in another)."""

    name = "nvml"

    def __init__(self, *, place: NodePlace, nvml: ModuleType | None = None, sku_override: str | None = None) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self._nvml = nvml
        self._place = place
        self._sku_override = sku_override
        self._initialised = False

    def _init(self) -> None:
        if not self._initialised:
            try:
                self._nvml.nvmlInit()
            except Exception as exc:
                raise ProviderError(f"NVML unavailable: {exc}") from exc
            self._initialised = True

    def _try(self, fn: Callable[..., T], *args: Any, default: T | None = None) -> T | None:
        try:
            return fn(*args)
        except Exception:  # NVMLError_NotSupported / InvalidArgument / NoPermission: a missing fact
            return default

    def _fabric(self, handle: Any) -> GpuFabricInfo | None:
        nvml = self._nvml
        if not hasattr(nvml, "c_nvmlGpuFabricInfoV_t"):
            return None
        info = nvml.c_nvmlGpuFabricInfoV_t()
        try:
            nvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
        except Exception:
            return None
        offset = type(info).clusterUuid.offset
        raw = ctypes.string_at(ctypes.addressof(info) + offset, nvml.NVML_GPU_FABRIC_UUID_LEN)
        return GpuFabricInfo(
            cluster_uuid=raw.hex(),
            clique_id=int(info.cliqueId),
            state=_FABRIC_STATES.get(int(info.state), FabricState.NOT_SUPPORTED),
            status_ok=int(info.status) == 0,
        )

    def _nvlinks(self, handle: Any) -> tuple[dict[str, int], int]:
        """Active links per remote GPU bus id, and active links to NVSwitches."""
        nvml = self._nvml
        per_peer: dict[str, int] = {}
        to_switch = 0
        for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
            state = self._try(nvml.nvmlDeviceGetNvLinkState, handle, link)
            if not state:
                continue
            remote_type = self._try(nvml.nvmlDeviceGetNvLinkRemoteDeviceType, handle, link, default=_NVLINK_DEVICE_GPU)
            if remote_type == _NVLINK_DEVICE_SWITCH:
                to_switch += 1
                continue
            remote = self._try(nvml.nvmlDeviceGetNvLinkRemotePciInfo, handle, link)
            if remote is None:
                to_switch += 1  # remote hidden (VMs): NCCL treats it as a switch too
                continue
            bus = normalise_bus_id(remote.busId)
            per_peer[bus] = per_peer.get(bus, 0) + 1
        return per_peer, to_switch

    def profile(self) -> NodeProfile:
        self._init()
        nvml = self._nvml
        count = int(nvml.nvmlDeviceGetCount())
        if count == 0:
            raise ProviderError("NVML reports no GPUs")
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        buses = [normalise_bus_id(nvml.nvmlDeviceGetPciInfo(h).busId) for h in handles]
        words = max(1, -(-(os.cpu_count() or 64) // 64))
        accelerators: list[Accelerator] = []
        numa: list[int | None] = []
        links_out: list[tuple[dict[str, int], int]] = []
        for i, handle in enumerate(handles):
            name = nvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else str(name)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            affinity = self._try(nvml.nvmlDeviceGetCpuAffinity, handle, words)
            numa_mask = self._try(nvml.nvmlDeviceGetMemoryAffinity, handle, 1, 0)
            numa_nodes = [b for b in range(64) if numa_mask is not None and int(numa_mask[0]) >> b & 1]
            numa.append(numa_nodes[0] if len(numa_nodes) == 1 else None)
            power_mw = self._try(nvml.nvmlDeviceGetPowerManagementLimit, handle)
            uuid = self._try(nvml.nvmlDeviceGetUUID, handle)
            accelerators.append(
                Accelerator(
                    index=i,
                    sku=self._sku_override or sku_from_device_name(name, int(memory.total)) or name,
                    hbm_bytes=int(memory.total),
                    uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
                    pci_bus_id=buses[i],
                    numa_node=numa[-1],
                    cpu_affinity=_cpu_list(affinity) if affinity is not None else None,
                    power_limit_w=power_mw / 1000 if power_mw else None,
                    pcie_gen_max=self._try(nvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
                    pcie_width_max=self._try(nvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
                    fabric=self._fabric(handle),
                )
            )
            links_out.append(self._nvlinks(handle))
        codes = [["X"] * count for _ in range(count)]
        for i in range(count):
            for j in range(i + 1, count):
                direct = links_out[i][0].get(buses[j], 0)
                switched = min(links_out[i][1], links_out[j][1])
                nv = direct or switched
                if nv:
                    code = f"NV{nv}"
                else:
                    level = self._try(nvml.nvmlDeviceGetTopologyCommonAncestor, handles[i], handles[j], default=50)
                    code = _LEVEL_CODES.get(int(level or 50), "SYS")
                codes[i][j] = codes[j][i] = code
        return self._place.profile(accelerators, LinkMatrix.from_codes(codes, numa=numa), source=self.name)

    def telemetry(self) -> list[GpuSample]:
        self._init()
        nvml = self._nvml
        samples = []
        for i in range(int(nvml.nvmlDeviceGetCount())):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            memory = self._try(nvml.nvmlDeviceGetMemoryInfo, handle)
            util = self._try(nvml.nvmlDeviceGetUtilizationRates, handle)
            power_mw = self._try(nvml.nvmlDeviceGetPowerUsage, handle)
            tx = self._try(nvml.nvmlDeviceGetPcieThroughput, handle, getattr(nvml, "NVML_PCIE_UTIL_TX_BYTES", 0))
            rx = self._try(nvml.nvmlDeviceGetPcieThroughput, handle, getattr(nvml, "NVML_PCIE_UTIL_RX_BYTES", 1))
            samples.append(
                GpuSample(
                    index=i,
                    memory_used_bytes=int(memory.used) if memory is not None else None,
                    memory_free_bytes=int(memory.free) if memory is not None else None,
                    utilization_pct=float(util.gpu) if util is not None else None,
                    power_w=power_mw / 1000 if power_mw is not None else None,
                    pcie_tx_bytes_per_s=tx * 1024.0 if tx is not None else None,  # NVML reports KB/s
                    pcie_rx_bytes_per_s=rx * 1024.0 if rx is not None else None,
                )
            )
        return samples
