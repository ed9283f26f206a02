"""The exact batch reference (MILP via HiGHS) against the greedy decide + apply loop."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.domain.placement import FleetSnapshot, PlacementRequest
from tests.unit.placement.builders import node, request, snapshot, tpu_pod

pytest.importorskip("scipy")  # the MILP reference needs SciPy's HiGHS; everything else here does not

from tests.reference.milp import candidate_options, greedy_batch, objective, optimal_batch


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


MODELS = ["llama3-8b", "mistral-7b-v0.1", "gemma2-9b", "llama3-70b", "mixtral-8x7b"]


@st.composite
def instances(draw: st.DrawFn) -> tuple[FleetSnapshot, list[PlacementRequest]]:
    kinds = [
        lambda b: b.nvswitch(4),
        lambda b: b.sku("H200-SXM-141GB").nvswitch(2),
        lambda b: b.sku("L40S-48GB").pcie(2),
        lambda b: b.sku("A100-PCIE-80GB").pairs(4),
    ]
    builders = [draw(st.sampled_from(kinds))(node(f"n{i}")) for i in range(draw(st.integers(1, 3)))]
    reqs = [
        request(
            draw(st.sampled_from(MODELS)),
            request_id=f"r{i}",
            context_tokens=draw(st.sampled_from([1024, 4096, 8192])),
            concurrency=draw(st.integers(1, 24)),
            dtype=draw(st.sampled_from([None, "fp8"])),
        )
        for i in range(draw(st.integers(1, 5)))
    ]
    return snapshot(*builders, power_kw=draw(st.sampled_from([None, 2.0, 8.0]))), reqs


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(instances())
def test_the_milp_is_never_worse_than_the_greedy(instance: tuple[FleetSnapshot, list[PlacementRequest]]) -> None:
    snap, reqs = instance
    options = candidate_options(snap, reqs)
    greedy, _ = greedy_batch(snap, reqs, options=options)
    best = optimal_batch(snap, reqs, options=options)
    assert best.optimal
    assert best.objective >= greedy.objective - 1e-6
    assert best.placed >= greedy.placed
