"""The baselines are honest: the same filters, TP rule and ladder as ours, a different choice only."""

from __future__ import annotations

import pytest

from shared.domain.placement import FleetSnapshot, PlacementRequest, apply, decide
from shared.domain.sim.kpis import nvlinked_group
from shared.domain.sim.policies import POLICIES, lowest_index_clique, make_policy
from tests.unit.placement.builders import GB, node, request, snapshot, tpu_pod


def _mixed() -> FleetSnapshot:
    return snapshot(
        node("a-l40s").sku("L40S-48GB").pcie(8),
        node("b-h100").nvswitch(8).reserve(0, int(40 * GB)),
        node("c-4p4").four_plus_four().reserve(0, int(70 * GB)),
        node("d-h200").sku("H200-SXM-141GB").nvswitch(8),
        pods=[tpu_pod("e-v5p", "v5p", (4, 4, 4), region="us-west-1")],
    )


REQUESTS = [
    request("llama3-8b", context_tokens=8192, concurrency=16),
    request("llama3-70b", context_tokens=8192, concurrency=16),
    request("mixtral-8x7b", context_tokens=8192, concurrency=16),
    request("llama3-405b", context_tokens=4096, concurrency=4),
    request("llama3-8b", context_tokens=8192, concurrency=16, backend="tpu"),
]


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_places_exactly_when_ours_does_at_the_same_count(policy: str) -> None:
    snap = _mixed()
    chooser = make_policy(policy, seed=3)
    for req in REQUESTS:
        ours, theirs = decide(snap, req), chooser.decide(snap, req)
        assert theirs.placed == ours.placed, (req.model, theirs.message)
        if ours.placed:
            assert theirs.tp == ours.tp and theirs.fallback == ours.fallback
            assert theirs.share == ours.share
            apply(snap, theirs)  # raises if it does not fit
            if theirs.tpu is None and len(theirs.accelerators) > 1:
                assert nvlinked_group(snap.nodes, theirs.accelerators)
        else:
            assert theirs.error_code == ours.error_code


def test_first_fit_takes_the_lowest_host_id() -> None:
    snap = snapshot(node("b").nvswitch(8), node("a").nvswitch(8), node("c").sku("L40S-48GB").pcie(8))
    assert make_policy("first-fit").decide(snap, request("llama3-8b")).node == "a"


def test_gpu_index_takes_the_lowest_indices_that_form_an_nvlink_clique() -> None:
    busy = node("n").nvswitch(8)
    for index in (0, 1, 2):
        busy = busy.reserve(index, int(10 * GB))
    snap = snapshot(busy)
    req = request("llama3-70b", context_tokens=4096, concurrency=4, tp=2)
    by_index = make_policy("gpu-index").decide(snap, req)
    assert by_index.accelerators == ("n/gpu3", "n/gpu4")  # device numbering: across the NUMA nodes
    assert make_policy("first-fit").decide(snap, req).accelerators == ("n/gpu4", "n/gpu5")  # the filter's group
    assert lowest_index_clique(snap, by_index) == by_index
    four_plus_four = snapshot(node("m").four_plus_four().reserve(1, int(10 * GB)))
    four = make_policy("gpu-index").decide(four_plus_four, request("llama3-70b", context_tokens=4096, tp=4))
    assert four.accelerators == ("m/gpu4", "m/gpu5", "m/gpu6", "m/gpu7")  # 0-3 holds a busy GPU; 1-4 is no clique


def test_cheapest_sku_moves_to_the_next_sku_when_the_cheapest_is_full() -> None:
    snap = snapshot(node("h100").nvswitch(1), node("l40s").sku("L40S-48GB").pcie(1))
    policy = make_policy("cheapest-sku")
    first = policy.decide(snap, request("llama3-8b"))
    assert first.sku == "L40S-48GB"
    second = policy.decide(apply(snap, first), request("llama3-8b", request_id="r2"))
    assert second.placed and second.sku == "H100-SXM-80GB"


def test_random_is_seeded_and_spreads_over_hosts() -> None:
    snap = snapshot(*(node(f"n{i}").nvswitch(8) for i in range(6)))
    chosen = set()
    for i in range(30):
        req = PlacementRequest(request_id=f"r{i}", tenant="t", model="llama3-8b", context_tokens=4096)
        first, again = make_policy("random", seed=5).decide(snap, req), make_policy("random", seed=5).decide(snap, req)
        assert first == again
        chosen.add(first.node)
    assert len(chosen) >= 4
    req = PlacementRequest(request_id="r0", tenant="t", model="llama3-8b", context_tokens=4096)
    others = {make_policy("random", seed=s).decide(snap, req).node for s in range(12)}
    assert len(others) > 1
