"""nvidia-smi provider: `topo -m` for the links, `--query-gpu` for the devices.

It runs the commands, or reads captured outputs from files (for hosts where only the text is
available, and for tests). Parsing is the pure core's; a parse failure becomes a ProviderError that
names the line, and the caller keeps the node's previous profile.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from services.topology_discovery.providers import NodePlace, ProviderError
from shared.contracts.topology import GpuSample
from shared.domain.fleet import Accelerator, NodeProfile
from shared.domain.hardware import sku_from_device_name
from shared.domain.topology import (
    QUERY_GPU_FIELDS,
    TopologyParseError,
    from_parsed,
    parse_query_gpu_csv,
    parse_topo_matrix,
)

TELEMETRY_FIELDS = "index,memory.used,memory.free,utilization.gpu,power.draw"


class NvidiaSmiProvider:
    name = "nvidia-smi"

    def __init__(
        self,
        *,
        place: NodePlace,
        topo_file: Path | None = None,
        query_file: Path | None = None,
        binary: str = "nvidia-smi",
        sku_override: str | None = None,
        timeout_s: float = 20.0,
    ) -> None:
        self._place = place
        self._topo_file = topo_file
        self._query_file = query_file
        self._binary = binary
        self._sku_override = sku_override
        self._timeout_s = timeout_s

    def _run(self, *args: str) -> str:
        try:
            done = subprocess.run(
                [self._binary, *args], capture_output=True, text=True, timeout=self._timeout_s, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ProviderError(f"{self._binary} {' '.join(args)}: {exc}") from exc
        if done.returncode != 0:
            raise ProviderError(
                f"{self._binary} {' '.join(args)} exited {done.returncode}: {done.stderr.strip()[:300]}"
            )
        return done.stdout

    def _read(self, path: Path) -> str:
        try:
            return path.read_text()
        except OSError as exc:
            raise ProviderError(f"{path}: {exc.strerror}") from exc

    def profile(self) -> NodeProfile:
        topo_text = self._read(self._topo_file) if self._topo_file else self._run("topo", "-m")
        try:
            parsed = parse_topo_matrix(topo_text)
        except TopologyParseError as exc:
            raise ProviderError(f"nvidia-smi topo -m: {exc}", line=exc.line) from exc
        if self._query_file:
            query_text: str | None = self._read(self._query_file)
        elif self._topo_file:
            query_text = None  # captured topology only: devices from the SKU override
        else:
            query_text = self._run(f"--query-gpu={','.join(QUERY_GPU_FIELDS)}", "--format=csv")
        devices = {}
        if query_text is not None:
            try:
                devices = {gpu.index: gpu for gpu in parse_query_gpu_csv(query_text)}
            except TopologyParseError as exc:
                raise ProviderError(f"nvidia-smi --query-gpu: {exc}", line=exc.line) from exc
        links = from_parsed(parsed)
        accelerators = []
        for gpu in parsed.gpus:
            device = devices.get(gpu.index)
            memory = device.memory_total_bytes if device else None
            name = device.name if device and device.name else None
            sku = self._sku_override or (sku_from_device_name(name, memory) if name else None) or name or "unknown"
            accelerators.append(
                Accelerator(
                    index=gpu.index,
                    sku=sku,
                    hbm_bytes=memory or 0,
                    uuid=device.uuid if device else None,
                    pci_bus_id=device.pci_bus_id if device else None,
                    numa_node=links.numa[gpu.index] if gpu.index < len(links.numa) else None,
                    cpu_affinity=gpu.cpu_affinity,
                    power_limit_w=device.power_limit_w if device else None,
                    pcie_gen_max=device.pcie_link_gen_max if device else None,
                    pcie_width_max=device.pcie_link_width_max if device else None,
                )
            )
        return self._place.profile(accelerators, links, source=self.name)

    def telemetry(self) -> list[GpuSample]:
        if self._topo_file:  # captured outputs only: nothing live to sample
            return []
        text = self._run(f"--query-gpu={TELEMETRY_FIELDS}", "--format=csv,noheader,nounits")
        samples = []
        for line in text.splitlines():
            cells = [c.strip() for c in line.split(",")]
            if len(cells) != 5 or not cells[0].isdigit():
                continue

            def num(cell: str) -> float | None:
                try:
                    return float(cell)
                except ValueError:
                    return None

            used, free = num(cells[1]), num(cells[2])
            samples.append(
                GpuSample(
                    index=int(cells[0]),
                    memory_used_bytes=int(used * 2**20) if used is not None else None,
                    memory_free_bytes=int(free * 2**20) if free is not None else None,
                    utilization_pct=num(cells[3]),
                    power_w=num(cells[4]),
                )
            )
        return samples
