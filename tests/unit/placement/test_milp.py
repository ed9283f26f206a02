"""The exact batch reference (MILP via HiGHS) against the greedy decide + apply loop."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from shared.domain.placement import FleetSnapshot, PlacementRequest
from tests.unit.placement.builders import node, request, small_instances, snapshot, tpu_pod

pytest.importorskip("scipy")  # the MILP reference needs SciPy's HiGHS; everything else here does not

from tests.reference.milp import (
    candidate_options,
    greedy_batch,
    objective,
    online_bound,
    optimal_batch,
    planned_batch,
)


def test_greedy_is_myopic_where_the_milp_is_not() -> None:
    # One 2-GPU H100 node and one H200. llama3-70b fp8, 8k x 16: at TP=1 it needs
    # 70.6 (weights) + 42.9 (KV 2 x 80 x 8 x 128 x 2 B x 131,072 tokens) + 1.5 + 1.1 = 116.1 GB per GPU:
    # only the H200 (139.3 GB usable) holds it; at TP=2 each H100 holds 58 GB. The second request
    # pins TP=1. Greedy gives the first request the fewest GPUs (the H200), and the second no longer
    # fits anywhere; the MILP puts the first on the H100 pair and both are placed.
    snap = snapshot(node("h100").nvswitch(2), node("h200").sku("H200-SXM-141GB").nvswitch(1))
    shape = {"dtype": "fp8", "context_tokens": 8192, "concurrency": 16}
    reqs = [request("llama3-70b", request_id="a", **shape), request("llama3-70b", request_id="b", tp=1, **shape)]
    greedy, decisions = greedy_batch(snap, reqs)
    best = optimal_batch(snap, reqs)
    assert [d.node for d in decisions] == ["h200", None] and greedy.placed == 1
    assert best.optimal and best.placed == 2
    assert [(p.host, p.tp) for p in best.placements if p is not None] == [("h100", 2), ("h200", 1)]
    assert best.objective > greedy.objective
    # No online placement does better: the first request must take the free H200 (fewest GPUs).
    bound = online_bound(snap, reqs)
    assert bound.optimal and bound.placed == 1 and bound.objective == pytest.approx(greedy.objective)
    # Decided together, the pinned request goes first and both are placed.
    planned, _ = planned_batch(snap, reqs)
    assert planned.placed == 2


def test_the_online_bound_follows_the_fewest_accelerators_rule() -> None:
    # An H100 pair and an H200 (TP=2 and TP=1 options for the same replica): when the H200 is taken
    # first by a request that fits only there, the next one must take the pair; with the H200 free
    # it must take the H200, and a TP=1-only request behind it is refused.
    snap = snapshot(node("h100").nvswitch(2), node("h200").sku("H200-SXM-141GB").nvswitch(1))
    shape = {"dtype": "fp8", "context_tokens": 8192, "concurrency": 16}
    pinned, free = (request("llama3-70b", request_id=i, tp=t, **shape) for i, t in (("p", 1), ("f", None)))
    assert online_bound(snap, [pinned, free]).placed == 2
    assert online_bound(snap, [free, pinned]).placed == 1
    assert online_bound(snap, [free, free, pinned]).placed == 2


def test_the_online_bound_counts_rack_power() -> None:
    # 2 kW for 700 W H100s: two busy GPUs. A TP=2 replica first leaves no power for a TP=1 one.
    snap = snapshot(node("a").nvswitch(4), power_kw=2.0)
    reqs = [request("llama3-70b", request_id="two", tp=2), request("llama3-8b", request_id="one")]
    assert online_bound(snap, reqs).placed == 1
    assert optimal_batch(snap, reqs).placed == 1
    assert online_bound(snap, [*reversed(reqs), reqs[1]]).placed == 2


def test_the_online_bound_is_for_exclusive_placements() -> None:
    snap = snapshot(node("a").nvswitch(1))
    with pytest.raises(ValueError, match="exclusive"):
        online_bound(snap, [request("llama3-8b", sharing="shared")])


def test_objective_counts_placements_before_quality() -> None:
    snap = snapshot(node("a").nvswitch(2))
    (options,) = candidate_options(snap, [request("llama3-8b")])
    best = max(options, key=lambda o: o.quality)
    assert objective([best]) == pytest.approx(1 + best.quality / 2)
    assert objective([None]) == 0.0
    assert objective([best, None]) < objective([options[0], options[0]])


def test_options_are_nvlink_cliques_and_tpu_slices() -> None:
    snap = snapshot(node("a").four_plus_four(), pods=[tpu_pod("p", shape=(4, 4))])
    (options,) = candidate_options(snap, [request("llama3-8b", tp=4)])
    gpu = [o for o in options if o.tpu is None]
    # Two NVLink quads, and nothing else of four: C(4,4) x 2.
    assert sorted(o.accelerators for o in gpu) == [tuple(f"a/gpu{i}" for i in q) for q in ((0, 1, 2, 3), (4, 5, 6, 7))]
    tpu = [o for o in options if o.tpu is not None]
    assert {o.tpu.shape for o in tpu if o.tpu is not None} == {(2, 2)}
    assert len(tpu) == 9  # 3 x 3 origins of a 2x2 block in a 4x4 pod


def test_an_exclusive_group_is_alone_on_its_gpus() -> None:
    # Two llama3-8b replicas (about 14 GB each at 4k x 4) would fit one H100's HBM together, but an
    # exclusive replica never shares its GPU: on a one-GPU node only one is placed, by both.
    snap = snapshot(node("a").nvswitch(1))
    reqs = [request("llama3-8b", request_id="a"), request("llama3-8b", request_id="b")]
    options = candidate_options(snap, reqs)
    greedy, _ = greedy_batch(snap, reqs, options=options)
    best = optimal_batch(snap, reqs, options=options)
    assert best.optimal and best.placed == greedy.placed == 1


def test_shared_replicas_pile_up_on_one_gpu_within_its_hbm() -> None:
    snap = snapshot(node("a").nvswitch(1))
    reqs = [request("llama3-8b", request_id=f"s{i}", sharing="shared") for i in range(3)]
    (one, *_) = candidate_options(snap, reqs)
    share = one[0].share_bytes
    fit = min(3, snap.capacity["a/gpu0"].free // share)
    assert fit >= 2  # the point of the test: more than one shares the GPU
    options = candidate_options(snap, reqs)
    greedy, _ = greedy_batch(snap, reqs, options=options)
    best = optimal_batch(snap, reqs, options=options)
    assert best.optimal and best.placed == greedy.placed == fit


def test_a_shared_replica_and_an_exclusive_group_never_meet() -> None:
    snap = snapshot(node("a").nvswitch(1))
    reqs = [request("llama3-8b", request_id="s", sharing="shared"), request("llama3-8b", request_id="e")]
    options = candidate_options(snap, reqs)
    greedy, _ = greedy_batch(snap, reqs, options=options)
    best = optimal_batch(snap, reqs, options=options)
    assert best.optimal and best.placed == greedy.placed == 1


def test_options_follow_what_each_mode_may_use() -> None:
    # gpu0 is held by a shared replica, gpu1 by an exclusive one, gpu2 and gpu3 are idle.
    snap = snapshot(node("a").nvswitch(4).reserve(0, 10**9, shared=True).reserve(1, 10**9))
    reqs = [request("llama3-8b", request_id="e", tp=1), request("llama3-8b", request_id="s", sharing="shared")]
    exclusive, shared = candidate_options(snap, reqs)
    assert sorted(o.accelerators for o in exclusive) == [("a/gpu2",), ("a/gpu3",)]
    assert sorted(o.accelerators for o in shared) == [("a/gpu0",), ("a/gpu2",), ("a/gpu3",)]
    assert all(o.shared for o in shared) and not any(o.shared for o in exclusive)


def test_the_fallback_ladder_is_not_modelled() -> None:
    snap = snapshot(node("a").nvswitch(1))
    with pytest.raises(ValueError, match="exact placements only"):
        candidate_options(snap, [request("llama3-8b", fallbacks=None)])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_instances(held=True))
def test_the_milp_is_never_worse_than_the_greedy(instance: tuple[FleetSnapshot, list[PlacementRequest]]) -> None:
    snap, reqs = instance
    options = candidate_options(snap, reqs)
    greedy, _ = greedy_batch(snap, reqs, options=options)
    best = optimal_batch(snap, reqs, options=options)
    assert best.optimal
    assert best.objective >= greedy.objective - 1e-6
    assert best.placed >= greedy.placed
    planned, _ = planned_batch(snap, reqs, options=options, max_decisions=200)
    assert best.objective >= planned.objective - 1e-6
    assert planned.placed >= greedy.placed
    if not any(r.sharing == "shared" for r in reqs):
        bound = online_bound(snap, reqs, options=options)
        assert bound.optimal
        assert greedy.objective - 1e-6 <= bound.objective <= best.objective + 1e-6
