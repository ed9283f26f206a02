"""decide() on hand-built fleets: the TP rule, memory fit, long context, TPU slices, fabric domains,
power, SLOs, explanations, and bad input as typed errors (arithmetic next to each figure)."""

from __future__ import annotations

import dataclasses

import pytest

from shared.domain.placement import DEFAULT_PROFILE, Decision, FleetSnapshot, Slo, apply, decide, explain
from shared.domain.placement.types import PlacementRequest
from shared.domain.topology import link_rank
from shared.domain.topology.tpu import is_legal_shape
from tests.unit.placement.builders import GB, node, request, snapshot, tpu_pod


def assert_nvlinked(snap: FleetSnapshot, decision: Decision) -> None:
    """Every pair of the TP group is NVLinked (same node: the matrix says NV<n>; across nodes: one
    multi-node fabric domain)."""
    ids = decision.accelerators
    for k, a in enumerate(ids):
        for b in ids[k + 1 :]:
            ca, cb = snap.capacity[a], snap.capacity[b]
            if ca.node == cb.node:
                assert snap.nodes[ca.node].links.is_nvlinked(ca.index, cb.index), (a, b)
            else:
                fa = snap.nodes[ca.node].accelerators[ca.index].fabric
                fb = snap.nodes[cb.node].accelerators[cb.index].fabric
                assert fa is not None and fb is not None and fa.domain_key == fb.domain_key, (a, b)


# -- TP groups are NVLink cliques -------------------------------------------------------------

TOPOLOGIES = [
    # (builder, the largest all-pairs-NVLinked group it offers)
    (node("n").nvswitch(8), 8),
    (node("n").four_plus_four(), 4),  # two NV12 quads joined over SYS
    (node("n").sku("V100-SXM2-32GB").cube_mesh(), 4),  # DGX-1: quads, plus only i <-> i+4 across
    (node("n").sku("A100-PCIE-80GB").pairs(8), 2),  # bridged pairs
    (node("n").sku("L40S-48GB").pcie(8), 1),  # no NVLink at all
]


@pytest.mark.parametrize(("builder", "largest"), TOPOLOGIES, ids=["nvswitch", "4+4", "cube-mesh", "pairs", "pcie"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_a_tp_group_is_an_nvlink_clique(builder: object, largest: int, tp: int) -> None:
    snap = snapshot(builder)  # type: ignore[arg-type]
    # mistral-7b bf16 at TP 8 needs ~2.6 GB per GPU: memory never decides here, links do.
    decision = decide(snap, request("mistral-7b-v0.1", context_tokens=2048, concurrency=1, tp=tp))
    assert decision.placed == (tp <= largest), decision.explanation
    if decision.placed:
        assert decision.tp == tp and len(decision.accelerators) == tp
        assert_nvlinked(snap, decision)
    else:
        (rejection,) = decision.rejections
        assert rejection.reason == "no_nvlink_group" and rejection.tp == tp
        assert f"NVLinked group of GPUs with room: {largest})" in rejection.detail


def test_tp8_on_four_plus_four_nodes_is_refused_naming_the_nvlink_group() -> None:
    snap = snapshot(node("a").four_plus_four(), node("b").four_plus_four())
    decision = decide(snap, request("llama3-70b", tp=8))
    assert decision.status == "rejected" and decision.error_code == "no_capacity"
    assert [r.describe() for r in decision.rejections] == [
        "2 nodes: no free NVLink group of 8 GPUs with room (largest all-pairs-NVLinked group of GPUs with room: 4)"
        " at TP=8"
    ]
    assert any("2 nodes: no free NVLink group of 8 GPUs" in line for line in decision.explanation)


def test_the_cube_mesh_group_of_four_is_a_quad_with_the_most_links() -> None:
    snap = snapshot(node("dgx1").sku("V100-SXM2-32GB").cube_mesh())
    decision = decide(snap, request("mistral-7b-v0.1", context_tokens=2048, concurrency=1, tp=4))
    assert decision.accelerators == ("dgx1/gpu0", "dgx1/gpu1", "dgx1/gpu2", "dgx1/gpu3")
    # quad 0-3: 0-1, 0-2, 1-3 are NV1; 0-3, 1-2, 2-3 are NV2
    assert "group links: 3 pairs NV1, 3 pairs NV2" in decision.explanation


def test_tp2_prefers_nvlink_pairs_over_pcie_and_more_links() -> None:
    # Both nodes can host TP=2; NV18 (rank 23) beats a NV4 bridge (rank 9) in the link score. Two-GPU
    # nodes, so packing is equal (the TP=2 group takes either node whole; on an idle NVSwitch node of 8
    # packing's look-ahead would keep its TP=8 group whole and pick a pair of the bridged node).
    snap = snapshot(node("bridged").sku("H100-SXM-80GB").pairs(2), node("switched").nvswitch(2))
    decision = decide(snap, request("mistral-7b-v0.1", context_tokens=2048, concurrency=1, tp=2))
    assert decision.node == "switched"
    assert decision.score["link"] > 0.95  # NV18, its two GPUs on two NUMA nodes (the NV4 pair: about 0.4)


# -- memory ---------------------------------------------------------------------------------------


def test_llama3_70b_fp16_does_not_fit_one_h100_but_fp8_does() -> None:
    snap = snapshot(node("h100").nvswitch(1))
    # fp16: 70,553,706,496 params x 2 B = 141.1 GB of weights > 85,899,345,920 x 0.92 = 79.0 GB usable.
    fp16 = decide(snap, request("llama3-70b", tp=1, context_tokens=4096, concurrency=1))
    assert fp16.error_code == "no_capacity"
    (short,) = fp16.rejections
    assert short.reason == "hbm_short" and short.tp == 1
    # weights 141.11 + KV 2x80x8x128x4096x2 B = 1.34 + activation 4096 x (4x8192 + 2x28672) x 2 B = 0.74
    # + workspace 1.07 = 144.26 GB; short by 144.26 - 79.03 = 65.2 GB
    assert short.detail == "HBM short by 65.2 GB per GPU at TP=1"
    # fp8: weights 70.55 GB (1 B/param) + 1.34 + 0.74 + 1.07 = 73.7 GB <= 79.0 GB
    fp8 = decide(snap, request("llama3-70b", tp=1, dtype="fp8", context_tokens=4096, concurrency=1))
    assert fp8.placed and fp8.accelerators == ("h100/gpu0",)
    assert fp8.share is not None and fp8.share.total == pytest.approx(73.7 * GB, rel=1e-3)


def test_a_128k_context_lands_where_its_kv_fits() -> None:
    # llama3.1-8b, 131,072 tokens x 4 sequences: KV = 2 x 32 x 8 x 128 x 2 B = 131,072 B per token
    # x 524,288 tokens = 68.7 GB; + weights 16.1 + activation 0.7 + workspace 1.1 = 86.6 GB per GPU at TP=1.
    long = request("llama3.1-8b", context_tokens=131_072, concurrency=4)
    snap = snapshot(node("h100").nvswitch(8), node("h200").sku("H200-SXM-141GB"), node("l40s").sku("L40S-48GB").pcie(8))
    decision = decide(snap, long)
    # TP=1 fits only the H200 (usable 0.92 x 141 GiB = 139.3 GB); H100 (79.0 GB) and L40S (47.4 GB) are short.
    assert (decision.node, decision.tp, decision.sku) == ("h200", 1, "H200-SXM-141GB")
    assert decision.share is not None and decision.share.kv == 68_719_476_736
    assert {(r.count, r.detail) for r in decision.rejections} == {
        (1, "HBM short by 7.6 GB per GPU at TP=1"),
        (1, "HBM short by 39.2 GB per GPU at TP=1"),
    }


def test_a_128k_context_that_fits_nowhere_is_refused_with_the_kv_figure() -> None:
    snap = snapshot(node("l40s").sku("L40S-48GB").pcie(8))  # no NVLink: TP 1 only
    decision = decide(snap, request("llama3.1-8b", context_tokens=131_072, concurrency=4))
    assert decision.error_code == "no_capacity"
    assert "needs per GPU at TP=1: weights 16.1 GB + KV 68.7 GB" in " ".join(decision.explanation)
    # 86,591,938,560 B needed - floor(51,539,607,552 x 0.92) = 47,416,438,947 B usable = 39.18 GB
    assert ("HBM short by 39.2 GB per GPU at TP=1", 1) in {(r.detail, r.tp) for r in decision.rejections}
    assert {r.reason for r in decision.rejections} == {"hbm_short", "no_nvlink_group", "too_few_accelerators"}


def test_reserved_bytes_and_unavailable_gpus_are_not_capacity() -> None:
    # 79.0 GB usable - 70 GB reserved leaves 9.0 GB: llama3-8b bf16 (16.1 GB weights) fits on no GPU but gpu7,
    # and gpu7 is down.
    builder = node("a").nvswitch(8).unavailable(7)
    for i in range(7):
        builder.reserve(i, 70 * 10**9)
    decision = decide(snapshot(builder), request("llama3-8b", tp=1))
    assert decision.error_code == "no_capacity"
    # Held by other replicas (exclusively): not even their free bytes are offered.
    assert decision.rejections[0].reason == "too_few_accelerators"
    # Held by shared replicas, a shared replica sees their 9.0 GB free: too little for 16.1 GB of weights.
    shared = node("a").nvswitch(8).unavailable(7)
    for i in range(7):
        shared.reserve(i, 70 * 10**9, shared=True)
    decision = decide(snapshot(shared), request("llama3-8b", tp=1, sharing="shared"))
    assert decision.error_code == "no_capacity"
    assert decision.rejections[0].reason == "hbm_short"


def test_classes_count_every_node_once_per_reason() -> None:
    snap = snapshot(*(node(f"l{i}").sku("L40S-48GB").pcie(8) for i in range(3)), node("h").nvswitch(8))
    decision = decide(snap, request("llama3-70b", tp=4, context_tokens=2048, concurrency=2))
    assert decision.node == "h"
    assert [(r.count, r.reason, r.tp) for r in decision.rejections] == [(3, "no_nvlink_group", 4)]


# -- the TP rule and the scores ---------------------------------------------------------------------


def test_the_smallest_tp_that_fits_wins() -> None:
    snap = snapshot(node("a").nvswitch(8))
    # llama3-70b bf16, 8k x 16: TP=1 needs 141 GB + ..., TP=2 ~ 70.6 + 10.7 + ... > 79 GB, TP=4 fits.
    decision = decide(snap, request("llama3-70b", context_tokens=8192, concurrency=16))
    assert decision.tp == 4
    assert [r.tp for r in decision.rejections] == [1, 2]
    assert decision.explanation[2].startswith("TP=4: the fewest accelerators")


def test_an_slo_climbs_the_tp_ladder() -> None:
    snap = snapshot(node("a").nvswitch(8))
    shape = {"dtype": "fp8", "context_tokens": 4096, "concurrency": 16, "input_tokens": 2048, "output_tokens": 512}
    assert decide(snap, request("llama3-70b", **shape)).tp == 2  # the smallest TP that fits
    strict = decide(snap, request("llama3-70b", slo=Slo(tpot_ms=30), **shape))
    assert strict.tp == 8
    assert any(r.reason == "slo_miss" and r.tp == 2 for r in strict.rejections)
    impossible = decide(snap, request("llama3-70b", slo=Slo(tpot_ms=1), **shape))
    assert impossible.error_code == "no_capacity"


def test_ties_go_to_the_lowest_host_id_and_packing_fills_used_nodes_first() -> None:
    snap = snapshot(node("b").nvswitch(8), node("a").nvswitch(8))
    first = decide(snap, request("llama3-8b", tp=1))
    assert first.accelerators == ("a/gpu0",)
    snap = apply(snap, first)
    second = decide(snap, request("llama3-8b", request_id="req-2", tp=1))
    assert second.node == "a"  # node a is already busy: b stays whole for a TP=8 replica


def test_decisions_are_deterministic_and_explain_is_decide() -> None:
    snap = snapshot(node("a").nvswitch(8), node("b").four_plus_four(), pods=[tpu_pod("p", shape=(4, 4))])
    req = request("llama3-70b", context_tokens=8192, concurrency=8)
    assert decide(snap, req) == decide(snap, req) == explain(snap, req)


def test_scores_are_in_range_and_total_is_their_weighted_mean() -> None:
    snap = snapshot(node("a").nvswitch(8), node("b").sku("L40S-48GB").pcie(8))
    decision = decide(snap, request("llama3-8b", input_tokens=512, output_tokens=512))
    weights = dict(DEFAULT_PROFILE.scores)
    assert set(decision.score) == {*weights, "total"}
    assert all(0.0 <= v <= 1.0 for v in decision.score.values())
    expected = sum(decision.score[k] * w for k, w in weights.items()) / sum(weights.values())
    assert decision.score["total"] == pytest.approx(expected)


def test_short_requests_favour_cheap_cards_and_long_outputs_bandwidth() -> None:
    snap = snapshot(node("h200").sku("H200-SXM-141GB").nvswitch(1), node("l40s").sku("L40S-48GB").pcie(1))
    short = decide(snap, request("llama3-8b", context_tokens=256, concurrency=1, input_tokens=64, output_tokens=64))
    long = decide(snap, request("llama3-8b", context_tokens=8192, concurrency=1, input_tokens=512, output_tokens=7000))
    # sku_fit: short = 1 - 128/8192 of cheapness (L40S $1.50 vs H200 $5.00); long: bandwidth 4.8 vs 0.864 TB/s.
    assert short.score["sku_fit"] > 0.9 and short.sku == "L40S-48GB"
    assert long.sku == "H200-SXM-141GB" and long.score["sku_fit"] > 0.9


def test_a_slow_pcie_link_is_noted_and_scored_not_rejected() -> None:
    snap = snapshot(node("dgx1").sku("V100-SXM2-32GB").cube_mesh())
    decision = decide(snap, request("mistral-7b-v0.1", context_tokens=2048, concurrency=1))
    assert decision.placed
    assert decision.score["pcie_budget"] == pytest.approx(0.985 / 1.969)  # Gen3 over Gen4 per lane
    assert any("PCIe Gen3 x16" in line for line in decision.explanation)


# -- rack power ---------------------------------------------------------------------------------------


def test_rack_power_counts_only_gpus_that_turn_busy() -> None:
    # Budget 1.5 kW, H100 TDP 700 W: two idle GPUs may turn busy (1,400 W), not three.
    snap = snapshot(node("a").nvswitch(8), power_kw=1.5)
    assert decide(snap, request("mistral-7b-v0.1", context_tokens=2048, concurrency=1, tp=2)).placed
    refused = decide(snap, request("mistral-7b-v0.1", context_tokens=2048, concurrency=1, tp=4))
    (rejection,) = refused.rejections
    assert rejection.reason == "rack_power_short"
    assert rejection.detail == "rack power budget lets 2 more GPUs turn busy, the group turns 4 at TP=4"
    # GPU 0 and 1 already busy (and already drawing, counted in used power). An exclusive group may not
    # reuse them and no more GPUs may turn busy; a shared replica may join one held by shared replicas,
    # turning nothing busy.
    busy = snapshot(node("a").nvswitch(8).reserve(0, 10**9).reserve(1, 10**9), power_kw=1.5)
    again = decide(busy, request("mistral-7b-v0.1", context_tokens=2048, concurrency=1, tp=2))
    assert not again.placed and again.rejections[0].reason == "rack_power_short"
    shared = snapshot(node("a").nvswitch(8).reserve(0, 10**9, shared=True).reserve(1, 10**9), power_kw=1.5)
    joined = decide(shared, request("mistral-7b-v0.1", context_tokens=2048, concurrency=1, sharing="shared"))
    assert joined.accelerators == ("a/gpu0",)
    after = apply(shared, joined)
    assert after.rack_power_used_w == shared.rack_power_used_w == {("us-west-1", "c1", "r1"): 1400.0}
    assert after.capacity["a/gpu0"].shared


# -- multi-node NVLink domains --------------------------------------------------------------------------


def test_a_multi_node_nvlink_domain_hosts_a_tp_group_across_nodes() -> None:
    gh = [node(f"gh{i}").sku("GH200-96GB").nvswitch(1).fabric("cafe-0001") for i in range(4)]
    snap = snapshot(*gh)
    decision = decide(snap, request("llama3-70b", tp=4, context_tokens=4096, concurrency=4))
    assert decision.placed, decision.explanation
    assert decision.accelerators == ("gh0/gpu0", "gh1/gpu0", "gh2/gpu0", "gh3/gpu0")
    assert decision.nodes == ("gh0", "gh1", "gh2", "gh3") and decision.node == "gh0"
    assert decision.domain == "fabric/cafe0001/1"
    assert_nvlinked(snap, decision)
    # The same GH200s without a fabric are four lone GPUs: TP=2 has no NVLink group.
    loose = snapshot(*(node(f"gh{i}").sku("GH200-96GB").nvswitch(1) for i in range(4)))
    assert decide(loose, request("llama3-8b", tp=2)).error_code == "no_capacity"


# -- TPUs -----------------------------------------------------------------------------------------------


def test_a_v5e_request_gets_a_whole_legal_slice() -> None:
    snap = snapshot(pods=[tpu_pod("v5e-1", "v5e", (16, 16))])
    decision = decide(snap, request("llama3-8b", backend="tpu"))
    assert decision.placed and decision.backend == "tpu" and decision.tpu is not None
    # llama3-8b bf16: 16.1 GB of weights > 0.92 x 16 GiB = 15.8 GB per chip, so more than one chip;
    # the smallest legal v5e shape above one chip is 2x2.
    assert decision.tpu.shape == (2, 2) and is_legal_shape(snap.tpu_pods["v5e-1"].grid.tpu_type, decision.tpu.shape)
    assert decision.tp == 4 == len(decision.accelerators) == len(set(decision.accelerators))
    assert decision.accelerators == ("v5e-1/0.0", "v5e-1/0.1", "v5e-1/1.0", "v5e-1/1.1")
    assert decision.share is not None and decision.share.total <= snap.tpu_pods["v5e-1"].usable_per_chip
    after = apply(snap, decision)
    assert after.tpu_pods["v5e-1"].grid.used_chips == 4


def test_a_model_without_a_tpu_artifact_never_lands_on_a_tpu() -> None:
    snap = snapshot(pods=[tpu_pod("v5e-1"), tpu_pod("v5p-1", "v5p", (4, 4, 4))])
    anywhere = decide(snap, request("llama3-405b", context_tokens=2048, concurrency=1))
    assert anywhere.error_code == "no_capacity"
    assert [r.describe() for r in anywhere.rejections] == ["2 TPU pods: llama3-405b has no TPU artifact"]
    tpu_only = decide(snap, request("llama3-405b", backend="tpu"))
    assert tpu_only.error_code == "invalid_request" and "no tpu artifact" in tpu_only.message


def test_a_full_pod_says_which_slice_it_lacks() -> None:
    snap = snapshot(pods=[tpu_pod("small", shape=(2, 2))])
    first = decide(snap, request("llama3-8b", backend="tpu"))
    assert first.tpu is not None and first.tpu.shape == (2, 2)
    second = decide(apply(snap, first), request("llama3-8b", backend="tpu"))
    assert [r.describe() for r in second.rejections] == [
        "1 TPU pod: no free 2x2 slice (0 chips free, largest free legal block none) at TP=4"
    ]


# -- bad input is a typed answer ------------------------------------------------------------------------

BAD: list[tuple[dict[str, object], str]] = [
    ({"model": "llama9-1t"}, "unknown_model"),
    ({"skus": ("H100-SXM-80GB", "B300-NOPE")}, "unknown_sku"),
    ({"context_tokens": 0}, "invalid_request"),
    ({"context_tokens": -5}, "invalid_request"),
    ({"concurrency": 0}, "invalid_request"),
    ({"input_tokens": 0}, "invalid_request"),
    ({"output_tokens": -1}, "invalid_request"),
    ({"input_tokens": 4000, "output_tokens": 200}, "invalid_request"),  # longer than the 4,096 context
    ({"tp": 3}, "invalid_request"),
    ({"tp": 6}, "invalid_request"),
    ({"tp": 0}, "invalid_request"),
    ({"tp": 64}, "invalid_request"),  # llama3-8b's 32 heads do not split over 64
    ({"context_tokens": 8193}, "invalid_request"),  # llama3-8b's maximum is 8,192
    ({"dtype": "fp6"}, "invalid_request"),
    ({"kv_dtype": "bf17"}, "invalid_request"),
    ({"backend": "fpga"}, "invalid_request"),
    ({"slo": Slo(tpot_ms=0)}, "invalid_request"),
    ({"region": "mars-1"}, "invalid_request"),  # the fleet has nodes in us-west-1 only
]


@pytest.mark.parametrize(("fields", "code"), BAD, ids=[f"{next(iter(f))}={next(iter(f.values()))}" for f, _ in BAD])
def test_bad_input_is_a_typed_rejection_that_changes_nothing(fields: dict[str, object], code: str) -> None:
    snap = snapshot(node("a").nvswitch(8))
    decision = decide(snap, request(**{"model": "llama3-8b", **fields}))  # type: ignore[arg-type]
    assert decision.status == "rejected" and decision.error_code == code, decision.message
    assert decision.message and not decision.accelerators and decision.score == {}
    assert apply(snap, decision) is snap


def test_an_unknown_name_is_refused_with_the_known_ones_closest_first() -> None:
    """A model, a SKU or a region nobody knows: the refusal names the known ones, the closest first, so the
    caller fixes the request from the message."""
    snap = snapshot(
        node("a").nvswitch(8), node("b").region("us-east-1").nvswitch(8), pods=[tpu_pod("p", region="eu-west-1")]
    )
    model = decide(snap, request("llama3-70"))
    assert model.error_code == "unknown_model"
    assert model.message.startswith("unknown model 'llama3-70' (did you mean 'llama3-70b'?); known: llama3-70b, ")
    assert all(name in model.message for name in snap.models)
    sku = decide(snap, request(skus=("H100-SXM-80GB", "H100-SXM")))
    assert sku.error_code == "unknown_sku"
    assert sku.message.startswith("unknown SKU 'H100-SXM' (did you mean 'H100-SXM-80GB'?); known: H100-SXM-80GB, ")
    assert all(name in sku.message for name in snap.skus)
    region = decide(snap, request(region="us-west-2"))
    assert region.error_code == "invalid_request"
    assert region.message == (
        "unknown region 'us-west-2' (did you mean 'us-west-1'?); known: us-west-1, eu-west-1, us-east-1"
    )
    far = decide(snap, request(region="mars-1"))
    assert far.message == "unknown region 'mars-1'; known: eu-west-1, us-east-1, us-west-1"
    assert decide(snap, request(region="eu-west-1", backend="tpu")).placed  # a pod's region is known too


def test_a_region_is_not_refused_as_unknown_before_the_fleet_is_known() -> None:
    """An empty view (placement not synced yet) knows no region: the request is refused for capacity, not
    as bad input."""
    assert decide(snapshot(), request(region="us-west-1")).error_code == "no_capacity"


def test_the_context_limit_is_the_models() -> None:
    snap = snapshot(node("a").sku("H200-SXM-141GB").nvswitch(8))
    ok = decide(snap, request("llama3.1-8b", context_tokens=131_072, concurrency=1))
    assert ok.placed
    too_long = decide(snap, request("llama3.1-8b", context_tokens=131_073, concurrency=1))
    assert too_long.error_code == "invalid_request" and "131072" in too_long.message


def test_tp_candidates_skip_degrees_the_heads_do_not_split_over() -> None:
    # A llama3-8b variant with 24 heads (8 KV heads): TP 16 does not divide 24, so the ladder is 1, 2, 4, 8.
    base = snapshot(node("a").nvswitch(8))
    odd = dataclasses.replace(base.models["llama3-8b"], name="odd-24h", heads=24)
    snap = dataclasses.replace(base, models={**base.models, "odd-24h": odd})
    big = {"context_tokens": 8192, "concurrency": 64}  # KV 2 x 32 x 8 x 128 x 2 B x 8192 x 64 = 68.7 GB
    decision = decide(snap, request("odd-24h", **big))
    assert "TP=16 not considered: odd-24h's 24 attention heads do not split over TP=16" in decision.explanation
    assert decision.tp == 2
    assert decide(snap, request("odd-24h", tp=16)).error_code == "invalid_request"


def test_rejected_decisions_leave_the_snapshot_alone() -> None:
    snap = snapshot(node("a").four_plus_four())
    decision = decide(snap, request("llama3-70b", tp=8))
    assert not decision.placed and apply(snap, decision) is snap


def test_apply_refuses_a_decision_that_does_not_fit() -> None:
    snap = snapshot(node("a").nvswitch(1))
    decision = decide(snap, request("llama3-8b"))
    once = apply(snap, decision)
    with pytest.raises(ValueError, match="would hold"):
        for _ in range(10):
            once = apply(once, decision)


def test_the_link_score_is_the_mean_pair_score_over_the_fleets_best_pair() -> None:
    snap = snapshot(node("a").nvswitch(8))
    decision = decide(snap, request("mistral-7b-v0.1", tp=8, context_tokens=2048, concurrency=1))
    # NV18 ranks 5 + 18 = 23, +0.5 on the same NUMA node. NUMA halves 0-3 / 4-7: 2 x C(4,2) = 12 pairs
    # at 23.5 and 16 at 23.0; the best pair in the fleet is 23.5.
    assert link_rank(snap.nodes["a"].links.link(0, 1)) == 23
    assert decision.score["link"] == pytest.approx((12 * 23.5 + 16 * 23.0) / 28 / 23.5)


def test_request_defaults_mirror_the_api() -> None:
    req = PlacementRequest(request_id="r", tenant="t", model="m", context_tokens=1)
    assert (req.backend, req.concurrency, req.preemptible, req.tp, req.skus) == ("any", 1, False, None, None)
