"""Issue 12's scenarios: exclusive TP groups, shared replicas, the fallback ladder, the cross-domain
budget and PCIe as a budget, each on a hand-built fleet with the brief's numbers."""

from __future__ import annotations

import dataclasses

import pytest

from shared.domain.placement import apply, decide
from shared.domain.placement.filters.demand import DemandConfig, DemandPreFilter
from shared.domain.placement.framework import CycleState, demand_of
from shared.domain.placement.ladder import cross_fraction, stage_share
from shared.domain.placement.types import FleetSnapshot
from tests.unit.placement.builders import node, request, snapshot
from tests.unit.placement.test_decide import assert_nvlinked


def test_a_second_tp8_on_a_node_with_one_fully_connected_eight_is_refused_with_the_reason() -> None:
    snap = snapshot(node("dgx").nvswitch(8))
    first = decide(snap, request("llama3-70b", tp=8))
    assert first.placed and len(first.accelerators) == 8
    after = apply(snap, first)
    second = decide(after, request("llama3-70b", request_id="req-2", tp=8))
    assert not second.placed and second.error_code == "no_capacity"
    # Exclusive: the held GPUs are not offered at all, not even their free bytes.
    assert second.rejections[0].reason == "too_few_accelerators"
    assert "1 node: only 0 GPUs available at TP=8" in second.explanation
    # With the whole ladder the answer is "queue": nothing fits now, and nothing is reserved.
    queued = decide(after, request("llama3-70b", request_id="req-3", tp=8, fallbacks=None))
    assert not queued.placed and queued.queueable
    assert "fallback queue" in queued.explanation[-1]
    assert apply(after, queued) is after


def test_a_tp2_replica_never_lands_on_a_gpu_that_holds_a_shared_replica() -> None:
    # GPUs 0-5 hold shared replicas (with plenty of room); only 6 and 7 are idle.
    builder = node("a").nvswitch(8)
    for i in range(6):
        builder.reserve(i, 5 * 10**9, shared=True)
    snap = snapshot(builder)
    decision = decide(snap, request("llama3-8b", tp=2))
    assert decision.placed and decision.accelerators == ("a/gpu6", "a/gpu7")
    # A shared replica joins a GPU other shared replicas use (best fit) instead of taking an idle one.
    shared = decide(apply(snap, decision), request("llama3-8b", request_id="s", sharing="shared"))
    assert shared.placed and shared.accelerators[0] in {f"a/gpu{i}" for i in range(6)}
    # And the reverse: no shared replica joins an exclusive group's GPU.
    full = node("b").nvswitch(2).reserve(0, 10**9).reserve(1, 10**9)
    refused = decide(snapshot(full), request("llama3-8b", sharing="shared"))
    assert not refused.placed


def test_llama3_70b_at_tp8_on_a_four_plus_four_node_gets_tp4_by_pp2_with_the_fallback_named() -> None:
    snap = snapshot(node("hgx").four_plus_four())
    exact = decide(snap, request("llama3-70b", dtype="bf16", tp=8, context_tokens=8192))
    assert not exact.placed and {r.reason for r in exact.rejections} == {"no_nvlink_group"}
    staged = decide(snap, request("llama3-70b", dtype="bf16", tp=8, context_tokens=8192, fallbacks=None))
    assert staged.placed and staged.fallback == "pipeline"
    assert (staged.tp, staged.pp) == (4, 2) and len(staged.stages) == 2
    for stage in staged.stages:  # each stage one NVLink clique (one quad of the 4+4)
        assert_nvlinked(snap, dataclasses.replace(staged, accelerators=stage))
    assert {a for s in staged.stages for a in s} == {f"hgx/gpu{i}" for i in range(8)}
    line = next(x for x in staged.explanation if x.startswith("fallback pipeline"))
    assert "TP=4 x PP=2" in line and "ms per token" in line
    # Each GPU holds half the layers of a TP=4 group.
    state = CycleState()
    DemandPreFilter(DemandConfig()).prefilter(
        state, snap, request("llama3-70b", dtype="bf16", tp=4, context_tokens=8192)
    )
    half = stage_share(demand_of(state), 4, 2)
    assert staged.share == half
    # All stages are reserved by one apply (one ledger commit): all or nothing.
    after = apply(snap, staged)
    assert all(after.capacity[a].reserved == half.total for a in staged.accelerators)


def test_kv_quantisation_comes_first_and_is_named() -> None:
    # llama3-8b (128 KiB of bf16 KV per token) x 80 sequences of 8k on one H100: 86 GB of bf16 KV does
    # not fit; in fp8 it is 43 GB and does.
    snap = snapshot(node("a").nvswitch(1))
    asked = request("llama3-8b", context_tokens=8192, concurrency=80, fallbacks=None)
    exact = decide(snap, dataclasses.replace(asked, fallbacks=()))
    assert not exact.placed
    decision = decide(snap, asked)
    assert decision.placed and decision.fallback == "kv_quantize"
    assert decision.explanation[0].startswith("fallback kv_quantize: KV cache quantised bf16 -> fp8: fits at TP=1")


def _cross_domain_fleet(used: float) -> FleetSnapshot:
    # One 4+4 node: TP=8 is no clique; with pipelines ruled out, only a cross-domain group is left.
    return snapshot(node("hgx").four_plus_four()).evolve(cross_domain_used={"us-west-1/c1": used})


def test_a_cross_domain_placement_is_refused_once_the_budget_is_spent_and_allowed_after_release() -> None:
    asked = request("llama3-70b", dtype="fp8", tp=8, context_tokens=8192, fallbacks=("cross_domain",))
    fresh = _cross_domain_fleet(0.0)
    placed = decide(fresh, asked)
    assert placed.placed and placed.fallback == "cross_domain" and placed.cross_domain_bytes_per_s > 0
    assert any("GB/s crosses domains (14% of its TP traffic)" in line for line in placed.explanation)
    # The cluster's budget nearly spent (batch work may fill half of 256 GB/s): refused, saying why.
    others = 128e9 - placed.cross_domain_bytes_per_s / 2
    spent = _cross_domain_fleet(others)
    refused = decide(spent, asked)
    assert not refused.placed
    assert any("cross-domain budget is spent" in line for line in refused.explanation)
    # One of the replicas using it is released (its traffic leaves the cluster's sum): allowed again.
    released = spent.evolve(cross_domain_used={"us-west-1/c1": others - placed.cross_domain_bytes_per_s})
    assert decide(released, dataclasses.replace(asked, request_id="again")).placed
    # Placing it adds its traffic to the cluster's sum.
    after = apply(fresh, placed)
    assert after.cross_domain_used["us-west-1/c1"] == pytest.approx(placed.cross_domain_bytes_per_s)


def test_the_cross_domain_limit_is_twenty_percent_of_a_replicas_tp_traffic() -> None:
    assert cross_fraction(2, 4) == pytest.approx(1 / 7)  # TP=8 over 4+4: 14%
    assert cross_fraction(2, 2) == pytest.approx(1 / 3)  # TP=4 over 2+2: 33%, refused
    snap = snapshot(node("pairs").sku("A100-PCIE-80GB").pairs(8))
    decision = decide(snap, request("llama3-70b", dtype="fp8", tp=8, fallbacks=("cross_domain",)))
    assert not decision.placed
    assert any("limit 20%" in line for line in decision.explanation)


def test_a_node_at_pcie_0_8_takes_no_cold_load() -> None:
    snap = snapshot(node("busy").nvswitch(8), node("calm").nvswitch(8)).evolve(pcie_util={"busy": 0.8})
    decision = decide(snap, request("llama3-8b"))
    assert decision.placed and decision.node == "calm"
    only_busy = snapshot(node("busy").nvswitch(8)).evolve(pcie_util={"busy": 0.8})
    refused = decide(only_busy, request("llama3-8b"))
    assert not refused.placed and "pcie_busy" in {r.reason for r in refused.rejections}
    assert "1 node: PCIe at 80% of its bandwidth (over 70%): no cold load of weights now at TP=1" in refused.explanation
    # At 0.7 exactly it is not over the threshold.
    assert decide(snapshot(node("busy").nvswitch(8)).evolve(pcie_util={"busy": 0.7}), request("llama3-8b")).placed
    # The cold load is estimated from the link: weights over min(5 GB/s, PCIe).
    assert decision.share is not None
    assert decision.estimate["load_time_s"] == pytest.approx(decision.share.weights / 5e9)


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"sharing": "shared", "tp": 2}, "TP=1"),
        ({"sharing": "pooled"}, "sharing 'pooled'"),
        ({"fallbacks": ("kv_quantize", "teleport")}, "unknown fallback 'teleport'"),
        ({"pp": 2, "backend": "tpu"}, "pipeline stages"),
        ({"pp": 3}, "pp must be a power of two"),
    ],
)
def test_bad_input_gets_typed_errors(fields: dict[str, object], words: str) -> None:
    decision = decide(snapshot(node("a").nvswitch(8)), request("llama3-8b", **fields))
    assert decision.error_code == "invalid_request" and words in decision.message


def test_only_what_would_fit_once_capacity_frees_is_queued() -> None:
    """A request no empty fleet could hold is refused at once, not queued to wait out its timeout."""
    snap = snapshot(node("a").nvswitch(8).reserve(0, 10**9))
    hopeless = decide(snap, request("llama3-405b", dtype="fp16", context_tokens=8192, fallbacks=None))
    assert not hopeless.placed and not hopeless.queueable
    assert any("not even an empty fleet holds it" in line for line in hopeless.explanation)
    full = apply(snap, decide(snap, request("llama3-70b", tp=4, request_id="x")))
    full = apply(full, decide(full, request("llama3-70b", tp=2, request_id="y")))
    waits = decide(full, request("llama3-70b", tp=4, request_id="z", fallbacks=None))
    assert not waits.placed and waits.queueable


def test_the_empty_fleet_a_refusal_is_judged_against_is_built_once_per_frame() -> None:
    """Deciding whether to queue asks an empty copy of the fleet: it is kept while only reservations
    change, and made again when an accelerator's availability does."""
    from shared.domain.placement.ladder import emptied

    snap = snapshot(node("a").nvswitch(8), node("b").nvswitch(8))
    empty = emptied(snap)
    assert all(c.reserved == 0 for c in empty.capacity.values())
    placed = apply(snap, decide(snap, request("llama3-70b", tp=4)))
    assert emptied(placed) is empty
    lost = placed.capacity["b/gpu0"]
    down = placed.evolve(capacity={**placed.capacity, "b/gpu0": dataclasses.replace(lost, available=False)})
    assert emptied(down) is not empty and not emptied(down).capacity["b/gpu0"].available
