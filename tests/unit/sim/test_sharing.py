"""Sharing in the simulator: the contention arithmetic, who pays for a shared GPU, which models are
small, and `hetsched sim --sharing compare` showing what sharing costs."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from hetsched.cli import app
from shared.domain.latency import LatencyEstimate
from shared.domain.placement import FleetSnapshot, PlacementRequest, apply, decide
from shared.domain.sim import SimConfig, make_policy, simulate
from shared.domain.sim.engine import release
from shared.domain.sim.sharing import Residency, co_tenancy, contended, decode_tokens_per_s, small_models
from shared.domain.traces import AssignedRequest
from shared.infra.catalog import demo_fleet_path, load_inventory, load_models, load_skus
from tests.unit.sim.fleets import one_node_fleet

FLEET_TWO_H100 = one_node_fleet("n1", gpus=2, topology="nvswitch-8")

FLEET_ONE_NODE = one_node_fleet("n1", gpus=8, topology="nvswitch-8")


def _snapshot(path: Path) -> FleetSnapshot:
    skus = load_skus()
    fleet, _ = load_inventory(path, skus=skus)
    return FleetSnapshot.from_fleet(fleet, skus=skus, models=load_models())


def _fleet(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "fleet.yaml"
    path.write_text(text)
    return path


# -- the arithmetic ------------------------------------------------------------------------------


def test_two_replicas_busy_on_one_gpu_each_see_half_its_throughput() -> None:
    alone = LatencyEstimate(ttft_ms=40.0, tpot_ms=20.0, e2e_ms=40.0 + 99 * 20.0)
    shared = contended(alone, 2)
    assert shared.ttft_ms == pytest.approx(80.0)
    assert shared.tpot_ms == pytest.approx(40.0)
    assert shared.e2e_ms == pytest.approx(2 * alone.e2e_ms)
    assert decode_tokens_per_s(16, shared.tpot_ms) == pytest.approx(decode_tokens_per_s(16, alone.tpot_ms) / 2)


def test_a_replica_alone_is_unchanged() -> None:
    alone = LatencyEstimate(ttft_ms=40.0, tpot_ms=20.0, e2e_ms=2020.0)
    assert contended(alone, 1) == alone
    assert decode_tokens_per_s(16, 20.0) == pytest.approx(800.0)
    with pytest.raises(ValueError, match="co_tenants"):
        contended(alone, 0)


def test_co_tenancy_is_the_busiest_gpu_of_the_group() -> None:
    assert co_tenancy(["n/gpu0"], {}) == 1
    assert co_tenancy(["n/gpu0"], {"n/gpu0": 1}) == 1
    assert co_tenancy(["n/gpu0", "n/gpu1"], {"n/gpu0": 1, "n/gpu1": 3}) == 3


def test_small_models_are_those_whose_weights_fit_a_quarter_of_the_largest_gpu() -> None:
    snapshot = _snapshot(demo_fleet_path())
    small = small_models(snapshot)
    assert "llama3-8b" in small  # 16.1 GB of bf16 weights; H200 usable 139.3 GB / 4 = 34.8 GB
    assert "llama3-70b" not in small
    assert "mixtral-8x7b" not in small
    assert small_models(snapshot, 0.0) == frozenset()


def test_replicas_sharing_a_gpu_split_its_hours() -> None:
    hour = 3_600_000.0
    residency = Residency(usable={"n/gpu0": 100, "n/gpu1": 100})
    residency.join(1, ["n/gpu0"], 40, 0.0)
    residency.join(2, ["n/gpu0"], 40, hour)  # shares gpu0 for the second hour
    residency.join(3, ["n/gpu1"], 50, 0.0)
    assert residency.leave(1, ["n/gpu0"], 2 * hour) == pytest.approx(1.5)
    assert residency.leave(2, ["n/gpu0"], 2 * hour) == pytest.approx(0.5)
    assert residency.leave(3, ["n/gpu1"], 2 * hour) == pytest.approx(2.0)  # alone: accelerators x hours
    # gpu0: 0.4 for an hour, 0.8 for an hour; gpu1: 0.5 for two hours.
    assert residency.hbm_fill == pytest.approx((0.4 + 0.8 + 0.5 * 2) / 4)


def test_release_keeps_a_gpu_shared_while_a_shared_replica_holds_it(tmp_path: Path) -> None:
    snapshot = _snapshot(_fleet(tmp_path, FLEET_TWO_H100))
    decisions = []
    for i in range(2):
        request = PlacementRequest(
            request_id=f"r{i}", tenant="t", model="llama3-8b", context_tokens=8192, concurrency=16, sharing="shared"
        )
        decision = decide(snapshot, request)
        assert decision.placed, decision.message
        decisions.append(decision)
        snapshot = apply(snapshot, decision)
    assert decisions[0].accelerators == decisions[1].accelerators  # best fit: the second joins the first
    gpu = decisions[0].accelerators[0]
    snapshot = release(snapshot, decisions[0])
    assert snapshot.capacity[gpu].shared and snapshot.capacity[gpu].reserved > 0
    snapshot = release(snapshot, decisions[1])
    assert not snapshot.capacity[gpu].shared and snapshot.capacity[gpu].idle


# -- the engine ----------------------------------------------------------------------------------


def _burst(n: int, model: str = "llama3-8b") -> list[AssignedRequest]:
    """``n`` requests within ``n`` ms: all admitted before any completes (the same batches in both runs)."""
    return [
        AssignedRequest(arrival_ms=float(i), input_tokens=500, output_tokens=400, row=i + 1, model=model, tenant="t")
        for i in range(n)
    ]


def test_shared_replicas_on_one_gpu_run_at_half_speed_and_split_its_cost(tmp_path: Path) -> None:
    snapshot = _snapshot(_fleet(tmp_path, FLEET_TWO_H100))
    requests = _burst(32)  # 16 slots per replica: two replicas (slots, not the prefill backlog, bind)
    slots_only = SimConfig(scale_backlog_ms=math.inf)
    exclusive = simulate(snapshot, requests, make_policy("hetsched"), config=slots_only)
    shared = simulate(snapshot, requests, make_policy("hetsched"), config=replace(slots_only, share_small=True))

    assert exclusive.kpis.placed == shared.kpis.placed == 32
    assert exclusive.kpis.shared_replicas == 0 and exclusive.kpis.contended_requests == 0
    assert shared.kpis.shared_replicas == 2
    # The second replica's requests were admitted while the first was busy on the same GPU.
    assert shared.kpis.contended_requests == 16
    for alone, together in zip(exclusive.outcomes, shared.outcomes, strict=True):
        assert alone.row == together.row and alone.co_tenants == 1
        assert alone.tpot_ms is not None and together.tpot_ms is not None
        assert alone.replica_tokens_per_s is not None and together.replica_tokens_per_s is not None
        assert together.tpot_ms == pytest.approx(alone.tpot_ms * together.co_tenants)
        assert together.replica_tokens_per_s == pytest.approx(alone.replica_tokens_per_s / together.co_tenants)
    assert shared.kpis.replica_tokens_per_s is not None and exclusive.kpis.replica_tokens_per_s is not None
    assert shared.kpis.replica_tokens_per_s < exclusive.kpis.replica_tokens_per_s
    # One GPU held instead of two, at half speed: no more GPU-hours (both replicas busy until the run
    # ends, so exactly as many), a fuller GPU, each replica charged its share.
    assert shared.kpis.accelerator_hours == pytest.approx(exclusive.kpis.accelerator_hours)
    assert (shared.kpis.gpu_hbm_fill or 0) > (exclusive.kpis.gpu_hbm_fill or 0)
    assert all(life.charged_hours < life.hours for life in shared.replicas)
    assert all(life.charged_hours == pytest.approx(life.hours) for life in exclusive.replicas)


def test_exclusive_replicas_are_unaffected_by_share_small_for_big_models(tmp_path: Path) -> None:
    snapshot = _snapshot(_fleet(tmp_path, FLEET_ONE_NODE))
    requests = _burst(20, model="mixtral-8x7b")  # not small: asks exclusive either way
    plain = simulate(snapshot, requests, make_policy("hetsched"))
    flagged = simulate(snapshot, requests, make_policy("hetsched"), config=SimConfig(share_small=True))
    assert plain.outcomes == flagged.outcomes
    assert flagged.kpis.shared_replicas == 0


# -- the command ---------------------------------------------------------------------------------


def test_sim_sharing_compare_reports_both_kpi_sets_side_by_side(tmp_path: Path) -> None:
    fleet = _fleet(tmp_path, FLEET_ONE_NODE)
    trace = tmp_path / "burst.csv"
    # 60 requests in the first 0.6 s with long outputs: two llama3-8b replicas of 16 slots are needed.
    trace.write_text("arrival_ms,input_tokens,output_tokens\n" + "".join(f"{i * 10},600,400\n" for i in range(60)))
    runner = CliRunner()
    result = runner.invoke(app, ["sim", "--fleet", str(fleet), "--trace", str(trace), "--sharing", "compare", "--json"])
    assert result.exit_code == 0, result.output
    body = json.loads(result.stdout)
    assert set(body["sharing"]) == {"exclusive", "shared"}
    assert body["small_models"] == ["llama3-8b"]
    exclusive, shared = body["sharing"]["exclusive"], body["sharing"]["shared"]
    for kpis in (exclusive, shared):
        assert kpis["requests"] == 60
        for key in ("placed", "success_rate", "slo_attainment", "cost_per_million_tokens", "energy_kwh"):
            assert kpis[key] is not None
        assert "fill_rate" in kpis and "gpu_hbm_fill" in kpis
    assert exclusive["shared_replicas"] == 0 and exclusive["contended_requests"] == 0
    assert shared["shared_replicas"] >= 2 and shared["contended_requests"] > 0
    small = body["small_model_kpis"]
    assert small["shared"]["replica_tokens_per_s"] < small["exclusive"]["replica_tokens_per_s"]
    assert small["shared"]["mean_tpot_ms"] > small["exclusive"]["mean_tpot_ms"]

    table = runner.invoke(app, ["sim", "--fleet", str(fleet), "--trace", str(trace), "--sharing", "compare"])
    assert table.exit_code == 0, table.output
    assert "all exclusive" in table.stdout and "all shared" in table.stdout


def test_sim_sharing_rejects_bad_values_and_baselines(tmp_path: Path) -> None:
    fleet, trace = str(_fleet(tmp_path, FLEET_ONE_NODE)), str(tmp_path / "t.csv")
    (tmp_path / "t.csv").write_text("arrival_ms,input_tokens,output_tokens\n0,10,10\n")
    runner = CliRunner()
    bad = runner.invoke(app, ["sim", "--fleet", fleet, "--trace", trace, "--sharing", "sometimes"])
    assert bad.exit_code == 2 and "--sharing" in bad.output
    baseline = runner.invoke(
        app, ["sim", "--fleet", fleet, "--trace", trace, "--sharing", "compare", "--policy", "first-fit"]
    )
    assert baseline.exit_code == 2 and "hetsched only" in baseline.output
