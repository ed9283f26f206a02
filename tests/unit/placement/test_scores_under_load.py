"""The scores that `hetsched sim --sweep` showed matter under load: ``reserve`` (leave GPUs to GPU-only
models), ``sku_fit`` with a TTFT target (headroom for long prompts) and ``cost`` per served token."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shared.domain.placement import DEFAULT_PROFILE, FleetSnapshot, PlacementRequest, Slo, decide
from shared.domain.placement.filters.demand import factory as demand_factory
from shared.domain.placement.framework import SNAPSHOT, Candidate, CycleState, Demand, Profile, demand_of
from shared.domain.placement.hosts import index_of
from shared.domain.placement.perf import perf_of
from shared.domain.placement.scores.reserve import breadth
from tests.unit.placement.builders import node, request, snapshot, tpu_pod


def _only(score: str) -> Profile:
    return replace(DEFAULT_PROFILE, name=score, scores=((score, 1.0),))


def test_a_model_that_also_runs_on_tpu_leaves_the_gpus_to_gpu_only_models() -> None:
    snap = snapshot(node("a-h100").nvswitch(8), pods=[tpu_pod("z-v5p", "v5p", (4, 4, 4))])
    both = request("llama3-70b", context_tokens=8192, concurrency=16)  # TP 4: an H100 group or a v5p slice
    ours = decide(snap, both)
    assert ours.tpu is not None and ours.score["reserve"] == 1.0
    by_reserve = decide(snap, both, _only("reserve"))
    assert by_reserve.tpu is not None
    first_fit = decide(snap, both, replace(DEFAULT_PROFILE, name="none", scores=()))
    assert first_fit.node == "a-h100"  # the same count; only the score moved it
    gpu_only = decide(snap, request("mixtral-8x7b", context_tokens=8192, concurrency=16))
    assert gpu_only.backend == "gpu" and gpu_only.score["reserve"] == 1.0  # no other backend: no preference


def test_breadth_is_the_share_of_catalog_models_a_backend_runs() -> None:
    snap = snapshot(node("a-h100").nvswitch(8), pods=[tpu_pod("z-v5p", "v5p", (4, 4, 4))])
    state = CycleState()
    state.write(SNAPSHOT, snap)
    index = index_of(snap)
    gpu, tpu = (Candidate(index.hosts[h], index.loads[h], 4, None) for h in ("a-h100", "z-v5p"))
    models = list(snap.models.values())
    assert breadth(state, gpu) == pytest.approx(sum(m.supports("gpu") for m in models) / len(models))
    assert breadth(state, tpu) == pytest.approx(sum(m.supports("tpu") for m in models) / len(models))
    assert breadth(state, tpu) < breadth(state, gpu) == 1.0


def test_with_a_ttft_target_long_prompts_go_where_the_prefill_has_headroom() -> None:
    snap = snapshot(node("a-l40s").sku("L40S-48GB").pcie(1), node("b-h200").sku("H200-SXM-141GB").nvswitch(1))
    slo = Slo(ttft_ms=2000.0, tpot_ms=100.0)
    long = request("llama3-8b", context_tokens=8192, concurrency=4, input_tokens=7000, output_tokens=100, slo=slo)
    short = request("llama3-8b", context_tokens=8192, concurrency=4, input_tokens=300, output_tokens=100, slo=slo)
    by_fit = decide(snap, long, _only("sku_fit"))
    assert by_fit.sku == "H200-SXM-141GB" and by_fit.score["sku_fit"] == 1.0
    # Both cover a prompt four times the typical one when it is short: a tie, cost decides.
    assert decide(snap, short, _only("sku_fit")).score["sku_fit"] == 1.0
    assert decide(snap, short).sku == "L40S-48GB"
    l40s_only = decide(snapshot(node("a-l40s").sku("L40S-48GB").pcie(1)), long, _only("sku_fit"))
    ttft = perf_of(_demand(snap, long), snap.skus["L40S-48GB"], 1).ttft_ms
    assert l40s_only.score["sku_fit"] == pytest.approx(min(1.0, 2000.0 / ttft / 4.0)) and ttft * 4.0 > 2000.0


def test_cost_counts_prompt_tokens_and_one_prefill_at_a_time() -> None:
    snap = snapshot(node("a").nvswitch(1))
    sku = snap.skus["H100-SXM-80GB"]
    prompt = request("llama3-8b", context_tokens=8192, input_tokens=8000, output_tokens=20)
    long = perf_of(_demand(snap, prompt), sku, 1)
    assert long.requests_per_s == pytest.approx(1000.0 / long.ttft_ms)  # prefill binds before the slots
    assert long.served_tokens_per_s == pytest.approx(long.requests_per_s * 8020)
    chat = perf_of(_demand(snap, request("llama3-8b", concurrency=16, input_tokens=500, output_tokens=500)), sku, 1)
    e2e = chat.ttft_ms + 499 * chat.tpot_ms
    assert chat.requests_per_s == pytest.approx(16 * 1000.0 / e2e)  # the slots bind for short prompts


def _demand(snap: FleetSnapshot, req: PlacementRequest) -> Demand:
    state = CycleState()
    state.write(SNAPSHOT, snap)
    status = demand_factory().prefilter(state, snap, req)
    assert status.ok, status.describe()
    return demand_of(state)
