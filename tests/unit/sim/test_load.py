"""Load: what a workload asks of a fleet, worked out by hand on a one-GPU fleet, and arrivals scaled to a target."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from shared.domain.placement import FleetSnapshot
from shared.domain.placement.perf import model_shape
from shared.domain.sim import SimConfig
from shared.domain.sim.engine import request_latency
from shared.domain.sim.load import fleet_load, replica_rate, scale_arrivals
from shared.domain.traces import AssignedRequest
from shared.infra.catalog import load_inventory, load_models, load_skus
from tests.unit.sim.fleets import one_node_fleet

FLEET_ONE_H100 = one_node_fleet("solo", gpus=1, topology="pcie")


def _snapshot(tmp_path: Path, text: str = FLEET_ONE_H100) -> FleetSnapshot:
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    skus = load_skus()
    fleet, _ = load_inventory(path, skus=skus)
    return FleetSnapshot.from_fleet(fleet, skus=skus, models=load_models())


def _requests(n: int, gap_ms: float, model: str = "llama3-8b", prompt: int = 800) -> list[AssignedRequest]:
    return [
        AssignedRequest(
            arrival_ms=1000.0 + i * gap_ms, input_tokens=prompt, output_tokens=200, row=i + 1, model=model, tenant="t"
        )
        for i in range(n)
    ]


def test_load_is_arrival_rate_over_what_the_fleet_serves_with_every_slot_taken(tmp_path: Path) -> None:
    snapshot = _snapshot(tmp_path)
    config = SimConfig()
    requests = _requests(11, gap_ms=500.0)  # 11 arrivals over 5 s: 2.2 per second
    measured = fleet_load(snapshot, requests, config)

    spec = snapshot.models["llama3-8b"]
    shape = model_shape(spec, spec.dtype, spec.kv_dtype)
    sku = snapshot.skus["H100-SXM-80GB"]
    one = request_latency(shape, sku, 1, requests[0], config.slots)  # every request has the same shape
    by_hand = min(config.slots / (one.e2e_ms / 1000.0), 1000.0 / one.ttft_ms)  # one replica fits the one GPU

    (model,) = measured.models
    assert model.model == "llama3-8b" and model.replicas == 1
    assert model.arrivals_per_s == pytest.approx(2.2)
    assert model.capacity_per_s == pytest.approx(by_hand)
    assert measured.span_s == pytest.approx(5.0)
    assert measured.load == pytest.approx(2.2 / by_hand)


def test_long_prompts_bind_on_prefill_before_the_slots_do(tmp_path: Path) -> None:
    snapshot = _snapshot(tmp_path)
    spec = snapshot.models["llama3-8b"]
    shape = model_shape(spec, spec.dtype, spec.kv_dtype)
    sku = snapshot.skus["H100-SXM-80GB"]
    long = _requests(4, gap_ms=100.0, prompt=30_000)
    one = request_latency(shape, sku, 1, long[0], 16)
    assert replica_rate(shape, sku, 1, long, 16) == pytest.approx(1000.0 / one.ttft_ms)
    assert 1000.0 / one.ttft_ms < 16 / (one.e2e_ms / 1000.0)


def test_scaling_the_arrivals_reaches_the_target_load(tmp_path: Path) -> None:
    snapshot = _snapshot(tmp_path)
    requests = _requests(21, gap_ms=2000.0)
    native = fleet_load(snapshot, requests, SimConfig())
    factor = native.factor(0.8)
    scaled = scale_arrivals(requests, factor)
    assert fleet_load(snapshot, scaled, SimConfig()).load == pytest.approx(0.8)
    assert factor == pytest.approx(0.8 / native.load)


def test_scale_arrivals_divides_the_gaps_and_keeps_everything_else() -> None:
    requests = _requests(3, gap_ms=1000.0)
    scaled = scale_arrivals(requests, 4.0)
    assert [r.arrival_ms for r in scaled] == [1000.0, 1250.0, 1500.0]
    assert [(r.row, r.model, r.input_tokens, r.output_tokens) for r in scaled] == [
        (r.row, r.model, r.input_tokens, r.output_tokens) for r in requests
    ]
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="factor"):
            scale_arrivals(requests, bad)


def test_a_fleet_that_cannot_hold_a_model_has_no_load_to_scale_to(tmp_path: Path) -> None:
    snapshot = _snapshot(tmp_path)  # one 80 GB GPU: llama3-405b fits nowhere
    measured = fleet_load(snapshot, _requests(3, gap_ms=100.0, model="llama3-405b"), SimConfig())
    assert measured.models[0].replicas == 0 and math.isinf(measured.load)
    with pytest.raises(ValueError, match="llama3-405b"):
        measured.factor(0.5)
    with pytest.raises(ValueError, match="positive"):
        fleet_load(snapshot, _requests(3, gap_ms=100.0), SimConfig()).factor(0.0)


def test_a_trace_without_a_span_has_no_rate(tmp_path: Path) -> None:
    snapshot = _snapshot(tmp_path)
    with pytest.raises(ValueError, match="same instant"):
        fleet_load(snapshot, _requests(3, gap_ms=0.0), SimConfig())
    with pytest.raises(ValueError, match="no requests"):
        fleet_load(snapshot, [], SimConfig())
