"""GPU readings of a node whose engines are simulated: what a preallocating engine's GPUs read."""

from __future__ import annotations

import pytest

from shared.domain.engines.simulated_gpus import (
    DEFAULT_MAX_NUM_SEQS,
    DEFAULT_MEMORY_FRACTION,
    EngineOnGpus,
    Gpu,
    device_indices,
    launch_figures,
    simulated_gpus,
)

GB = 1_000_000_000
H100 = 80 * GB
NODE = (Gpu(0, H100), Gpu(1, H100))


def engine(state: str, *, devices: tuple[int, ...] = (0,), running: int = 0) -> EngineOnGpus:
    return EngineOnGpus(devices=devices, memory_fraction=0.88, state=state, running_requests=running, max_num_seqs=8)


@pytest.mark.parametrize(
    ("state", "used"),
    [("starting", 0), ("loading", int(0.88 * H100 * 0.5)), ("ready", int(0.88 * H100)), ("draining", int(0.88 * H100))],
)
def test_a_gpu_holds_nothing_while_its_engine_starts_half_its_share_while_loading_and_all_of_it_once_ready(
    state: str, used: int
) -> None:
    first, second = simulated_gpus(NODE, [engine(state)])
    assert (first.index, first.memory_used_bytes, first.memory_free_bytes) == (0, used, H100 - used)
    assert (second.memory_used_bytes, second.memory_free_bytes) == (0, H100)  # the GPU beside it is empty


@pytest.mark.parametrize("state", ["stopped", "failed", "waiting"])
def test_an_engine_that_does_not_run_holds_nothing(state: str) -> None:
    assert simulated_gpus(NODE, [engine(state)])[0].memory_used_bytes == 0


def test_a_tp_engine_holds_its_share_of_each_of_its_gpus_and_engines_sharing_a_gpu_add_up_to_its_hbm() -> None:
    tp2 = EngineOnGpus(devices=(0, 1), memory_fraction=0.4, state="ready")
    readings = simulated_gpus(NODE, [tp2, EngineOnGpus(devices=(1,), memory_fraction=0.3, state="ready")])
    assert [r.memory_used_bytes for r in readings] == [int(0.4 * H100), int(0.4 * H100) + int(0.3 * H100)]
    crowded = simulated_gpus(NODE, [tp2, EngineOnGpus(devices=(1,), memory_fraction=0.9, state="ready")])
    assert (crowded[1].memory_used_bytes, crowded[1].memory_free_bytes) == (H100, 0)


def test_utilisation_is_the_running_requests_over_the_batch_once_the_engine_serves() -> None:
    assert simulated_gpus(NODE, [engine("ready")])[0].utilization_pct == 0.0
    assert simulated_gpus(NODE, [engine("ready", running=2)])[0].utilization_pct == 25.0
    assert simulated_gpus(NODE, [engine("ready", running=20)])[0].utilization_pct == 100.0
    assert simulated_gpus(NODE, [engine("loading", running=2)])[0].utilization_pct == 0.0


def test_readings_come_in_index_order_and_a_node_without_engines_reads_empty() -> None:
    readings = simulated_gpus((Gpu(1, H100), Gpu(0, H100)), [])
    assert [(r.index, r.memory_used_bytes, r.memory_free_bytes) for r in readings] == [(0, 0, H100), (1, 0, H100)]


def test_the_launch_gives_the_share_and_the_batch_with_vllm_defaults_where_absent() -> None:
    args = ["m", "--tensor-parallel-size", "1", "--gpu-memory-utilization", "0.881", "--max-num-seqs", "4"]
    assert launch_figures(args) == (0.881, 4)
    assert launch_figures(["m", "--gpu-memory-utilization=0.5"]) == (0.5, DEFAULT_MAX_NUM_SEQS)
    assert launch_figures(["m"]) == (DEFAULT_MEMORY_FRACTION, DEFAULT_MAX_NUM_SEQS)
    assert launch_figures(["m", "--gpu-memory-utilization", "lots", "--max-num-seqs", "0"]) == (
        DEFAULT_MEMORY_FRACTION,
        1,
    )


def test_devices_are_the_indices_of_cuda_visible_devices() -> None:
    assert device_indices("0,2, 3") == (0, 2, 3)
    assert device_indices("GPU-uuid,1") == (1,)
    assert device_indices("") == ()
