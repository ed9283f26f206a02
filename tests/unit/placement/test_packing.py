"""Score ``packing``: its look-ahead on NVLink groups, and ``bound`` never below ``score``."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.domain.placement import DEFAULT_PROFILE, FleetSnapshot, PlacementRequest, decide
from shared.domain.placement.framework import Candidate, CycleState, GpuGroup, demand_of
from shared.domain.placement.hosts import GpuHost, GpuLoad, index_of
from shared.domain.placement.registry import framework_for
from shared.domain.placement.scores.packing import PackingScore
from tests.unit.placement.builders import node, request, snapshot


def packing_of(snap: FleetSnapshot, req: PlacementRequest, host_id: str, positions: tuple[int, ...]) -> float:
    state = CycleState()
    framework_for(DEFAULT_PROFILE).run_prefilter(state, snap, req)
    index = index_of(snap)
    host, load = index.hosts[host_id], index.loads[host_id]
    share = demand_of(state).share_for(host, len(positions))
    return PackingScore().score(state, Candidate(host, load, len(positions), share, GpuGroup(positions)))


def test_a_tp2_group_keeps_the_only_tp8_group_whole() -> None:
    # Same SKU, so the bytes fit is equal (b). In a quad of an idle 4+4 node: domain 1 - 2/4, node
    # 1 - 6/8, group TP=4 before and after: b + 0.5 + 0.25 + 1. On an idle NVSwitch node of 8: domain
    # 1 - 6/8, node 1 - 6/8, group TP=8 -> TP=4: b + 0.25 + 0.25 + 0.5.
    snap = snapshot(node("quads").four_plus_four(), node("switch").nvswitch(8))
    req = request("llama3-8b", tp=2)
    quads, switch = packing_of(snap, req, "quads", (0, 1)), packing_of(snap, req, "switch", (0, 1))
    assert quads - switch == pytest.approx((0.5 + 0.25 + 1 - (0.25 + 0.25 + 0.5)) / 4)


def test_the_look_ahead_only_counts_whole_tp_degrees() -> None:
    # Six idle GPUs of an NVSwitch node hold TP=4 at most; taking one leaves five: still TP=4 (1.0),
    # where taking one of eight idle ones leaves seven: TP=8 -> TP=4 (0.5).
    req = request("llama3-8b", tp=1)
    busy = snapshot(node("a").nvswitch(8).reserve(0, 10**9).reserve(1, 10**9))
    idle = snapshot(node("a").nvswitch(8))
    # bytes fit equal; domain and node fit 1 - 5/8 vs 1 - 7/8; group fit 1.0 vs 0.5.
    assert packing_of(busy, req, "a", (2,)) - packing_of(idle, req, "a", (2,)) == pytest.approx((0.25 + 0.25 + 0.5) / 4)


def test_a_shared_replica_joining_a_shared_gpu_takes_no_group() -> None:
    # gpu0 held by a shared replica, gpu1-3 by exclusive ones, gpu4-7 idle (TP=4 at most). Joining
    # gpu0 keeps the idle quad (group fit 1.0); taking gpu4 leaves three idle GPUs, TP=2 (0.5).
    builder = node("a").nvswitch(8).reserve(0, 10**9, shared=True)
    for index in (1, 2, 3):
        builder.reserve(index, 10**9)
    snap = snapshot(builder)
    req = request("llama3-8b", sharing="shared")
    state = CycleState()
    framework_for(DEFAULT_PROFILE).run_prefilter(state, snap, req)
    need = demand_of(state).gpu_shares[1].total
    usable = snap.capacity["a/gpu0"].usable
    # bytes fit need / free; domain and node fit 1 - 4/8 (joining) vs 1 - 3/8; group fit 1.0 vs 0.5.
    expected = (need / (usable - 10**9) - need / usable - 0.125 - 0.125 + 0.5) / 4
    assert packing_of(snap, req, "a", (0,)) - packing_of(snap, req, "a", (4,)) == pytest.approx(expected)
    assert decide(snap, req).accelerators == ("a/gpu0",)


KINDS = [
    lambda b: b.nvswitch(8),
    lambda b: b.four_plus_four(),
    lambda b: b.sku("A100-PCIE-80GB").pairs(4),
    lambda b: b.sku("L40S-48GB").pcie(4),
    lambda b: b.sku("V100-SXM2-32GB").cube_mesh(),
]


@st.composite
def loaded_nodes(draw: st.DrawFn) -> tuple[FleetSnapshot, PlacementRequest]:
    builder = draw(st.sampled_from(KINDS))(node("n"))
    gpus = builder.matrix.gpu_count
    for index in draw(st.sets(st.integers(0, gpus - 1), max_size=gpus - 1)):
        builder.reserve(index, draw(st.integers(1, 20)) * 10**9, shared=draw(st.booleans()))
    sharing = draw(st.sampled_from(["exclusive", "shared"]))
    req = request(
        draw(st.sampled_from(["llama3-8b", "mistral-7b-v0.1", "gemma2-9b"])),
        concurrency=draw(st.integers(1, 16)),
        sharing=sharing,
        **({"tp": 1} if sharing == "shared" else {}),
    )
    return snapshot(builder), req


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(loaded_nodes())
def test_the_bound_is_never_below_the_score_of_any_group(instance: tuple[FleetSnapshot, PlacementRequest]) -> None:
    snap, req = instance
    state = CycleState()
    framework_for(DEFAULT_PROFILE).run_prefilter(state, snap, req)
    demand = demand_of(state)
    index = index_of(snap)
    host, load = index.hosts["n"], index.loads["n"]
    assert isinstance(host, GpuHost) and isinstance(load, GpuLoad) and host.matrix is not None
    plugin = PackingScore()
    free, _ = load.room(req.sharing)
    for tp, share in demand.gpu_shares.items():
        room = [p for p in range(host.size) if load.available[p] and free[p] >= share.total]
        bound = plugin.bound(state, Candidate(host, load, tp, share))
        for group in itertools.combinations(room, tp):
            indices = [host.indices[p] for p in group]
            if not all(host.matrix.nv_masks[a] >> b & 1 for a, b in itertools.combinations(indices, 2)):
                continue
            score = plugin.score(state, Candidate(host, load, tp, share, GpuGroup(group)))
            assert 0.0 <= score <= bound + 1e-12
