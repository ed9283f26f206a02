"""GPU telemetry for an inventory node whose agent runs simulated engines (provider ``none``, engine ``sim``):
its GPUs read as real preallocating engines would make them read (``shared.domain.engines.simulated_gpus``),
so the ledger's drift check and the rebalancer's detectors see a fleet of engines without GPUs."""

from __future__ import annotations

import logging
from pathlib import Path

from services.topology_discovery.supervisor import Supervisor
from shared.contracts.topology import GpuSample
from shared.domain.engines.simulated_gpus import EngineOnGpus, Gpu, device_indices, launch_figures, simulated_gpus
from shared.infra.catalog import load_inventory


def inventory_gpus(path: Path | None, node: str, log: logging.Logger) -> tuple[Gpu, ...] | None:
    """The node's GPUs as the inventory file describes them; None (and a warning) when it cannot say."""
    if path is None:
        log.warning("no inventory: the simulated engines' node publishes no GPU telemetry")
        return None
    try:
        fleet, _fingerprint = load_inventory(path)
        profile = fleet.node(node)
    except (ValueError, OSError, KeyError) as exc:  # InventoryError is a ValueError
        log.warning("node not read from the inventory: no GPU telemetry", extra={"node": node, "error": str(exc)})
        return None
    return tuple(Gpu(index=acc.index, hbm_bytes=acc.hbm_bytes) for acc in profile.accelerators)


class SimulatedGpus:
    """The node's GPUs under the supervisor's engines, sampled on demand."""

    def __init__(self, *, gpus: tuple[Gpu, ...], supervisor: Supervisor) -> None:
        self._gpus = gpus
        self._supervisor = supervisor

    def engines(self) -> list[EngineOnGpus]:
        engines: list[EngineOnGpus] = []
        for engine in self._supervisor.engines.values():
            binding = engine.assignment.binding
            if binding is None:
                continue
            launch = engine.assignment.launch
            fraction, batch = launch_figures(launch.vllm if launch is not None else [])
            engines.append(
                EngineOnGpus(
                    devices=device_indices(binding.cuda_visible_devices),
                    memory_fraction=fraction,
                    state=engine.run.state,
                    running_requests=engine.running_requests,
                    max_num_seqs=batch,
                )
            )
        return engines

    def samples(self) -> list[GpuSample]:
        return [
            GpuSample(
                index=r.index,
                memory_used_bytes=r.memory_used_bytes,
                memory_free_bytes=r.memory_free_bytes,
                utilization_pct=r.utilization_pct,
            )
            for r in simulated_gpus(self._gpus, self.engines())
        ]
