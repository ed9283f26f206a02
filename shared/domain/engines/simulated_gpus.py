"""GPU telemetry for a node whose engines are simulated (`HETSCHED_AGENT_ENGINE=sim` on an inventory node):
what its GPUs would read if the engines were real ones.

vLLM and SGLang preallocate: an engine holds its share of each of its GPUs (``--gpu-memory-utilization`` x
the GPU's HBM) once it serves, whatever its load. So a GPU reads 0 bytes used while its engine starts, half
its share while the weights load, and the whole share from ready on (draining too: the process still holds
it); an engine stopped or failed holds nothing. Utilisation is the engine's running requests over its
batch (``--max-num-seqs``). Pure: the agent hands in its GPUs and its engines' latest states.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

LOADING_SHARE = 0.5
"""The part of its share an engine holds while its weights load."""
DEFAULT_MEMORY_FRACTION = 0.9
"""vLLM's own default ``--gpu-memory-utilization``, for a launch that names none."""
DEFAULT_MAX_NUM_SEQS = 256
"""vLLM's default ``--max-num-seqs``."""
HOLDS = {"starting": 0.0, "loading": LOADING_SHARE, "ready": 1.0, "draining": 1.0}
"""The part of its share an engine holds in each ``replica_state``; any other state holds nothing."""


@dataclass(frozen=True, slots=True)
class Gpu:
    """One GPU of the node, as the inventory describes it."""

    index: int
    hbm_bytes: int


@dataclass(frozen=True, slots=True)
class EngineOnGpus:
    """One engine of the node: its GPUs, the share of each it preallocates, its state and its load."""

    devices: tuple[int, ...]
    memory_fraction: float
    state: str
    running_requests: int = 0
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS


@dataclass(frozen=True, slots=True)
class GpuReading:
    index: int
    memory_used_bytes: int
    memory_free_bytes: int
    utilization_pct: float


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value after ``flag`` in an engine's argument list (``--flag value`` or ``--flag=value``)."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(f"{flag}="):
            return arg.split("=", 1)[1]
    return None


def launch_figures(args: Sequence[str]) -> tuple[float, int]:
    """``(memory fraction, max running sequences)`` of a vLLM argument list, vLLM's defaults where absent."""
    fraction, seqs = flag_value(args, "--gpu-memory-utilization"), flag_value(args, "--max-num-seqs")
    try:
        memory = float(fraction) if fraction is not None else DEFAULT_MEMORY_FRACTION
    except ValueError:
        memory = DEFAULT_MEMORY_FRACTION
    try:
        batch = int(seqs) if seqs is not None else DEFAULT_MAX_NUM_SEQS
    except ValueError:
        batch = DEFAULT_MAX_NUM_SEQS
    return min(max(memory, 0.0), 1.0), max(batch, 1)


def device_indices(cuda_visible_devices: str) -> tuple[int, ...]:
    """The GPU indices of a ``CUDA_VISIBLE_DEVICES`` value (names that are not indices are skipped)."""
    return tuple(int(part) for part in cuda_visible_devices.split(",") if part.strip().isdigit())


def held_bytes(engine: EngineOnGpus, gpu: Gpu) -> int:
    """What ``engine`` holds of ``gpu`` now."""
    if gpu.index not in engine.devices:
        return 0
    return int(engine.memory_fraction * gpu.hbm_bytes * HOLDS.get(engine.state, 0.0))


def busy_pct(engine: EngineOnGpus) -> float:
    """The engine's GPUs' utilisation: its running requests over its batch, in percent (0 unless it serves)."""
    if HOLDS.get(engine.state, 0.0) < 1.0:
        return 0.0
    return min(100.0, 100.0 * max(engine.running_requests, 0) / max(engine.max_num_seqs, 1))


def simulated_gpus(gpus: Iterable[Gpu], engines: Iterable[EngineOnGpus]) -> tuple[GpuReading, ...]:
    """One reading per GPU: the bytes its engines hold (at most its HBM), the rest free, and the busiest
    of its engines' utilisation."""
    engines = tuple(engines)
    readings: list[GpuReading] = []
    for gpu in sorted(gpus, key=lambda g: g.index):
        on_it = [e for e in engines if gpu.index in e.devices]
        used = min(gpu.hbm_bytes, sum(held_bytes(e, gpu) for e in on_it))
        utilization = max((busy_pct(e) for e in on_it), default=0.0)
        readings.append(
            GpuReading(
                index=gpu.index,
                memory_used_bytes=used,
                memory_free_bytes=gpu.hbm_bytes - used,
                utilization_pct=utilization,
            )
        )
    return tuple(readings)
