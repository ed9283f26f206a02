"""The caches that keep a decision within a millisecond decide exactly what a fresh search decides:

* the empty fleet a refusal is judged against, shared by the snapshots of one frame (``_Frame``), and
  its verdicts ("would it ever fit"), reached by a feasibility screen instead of a scored decision;
* the KV-quantised step's feasibility screen (``fits``) before its decision;
* per TPU grid: the slices found per shape, the largest free block and the fragmentation a slice
  leaves (``TpuGrid._answers``), read instead of searched again;
* per decision: the host-scope verdicts and the ladder's GPU classes (cycle state); memoised loads,
  stage shares and statuses.

Each property replays a stream of decisions (with releases, so snapshots of one frame go back and
forth) and compares every decision with the one made on a fresh copy of the snapshot: new memo, new
frame, new TPU grids with nothing cached.
"""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.domain.placement import Decision, FleetSnapshot, PlacementRequest, apply, decide
from shared.domain.placement.decide import _feasible, _search
from shared.domain.placement.framework import DEFAULT_PROFILE, CycleState, demand_of
from shared.domain.placement.hosts import index_of
from shared.domain.placement.ladder import emptied
from shared.domain.placement.registry import framework_for
from shared.domain.placement.types import TpuPodState
from shared.domain.sim.engine import release
from shared.domain.topology.tpu import (
    TpuGrid,
    TpuSlice,
    TpuType,
    all_legal_shapes,
    allocate,
    find_free_slice,
    fragmentation,
    fragmentation_after,
    largest_free_block,
    orientations,
)
from tests.unit.placement.builders import node, request, snapshot, tpu_pod
from tests.unit.placement.test_properties import fleets, streams


def fresh(snap: FleetSnapshot) -> FleetSnapshot:
    """``snap`` with nothing derived: a new memo (and frame) and TPU grids that have answered nothing."""
    pods = {
        name: TpuPodState(
            state.pod, TpuGrid(state.grid.tpu_type, state.grid.dims, state.grid.occupancy), state.hbm_per_chip
        )
        for name, state in snap.tpu_pods.items()
    }
    fields = {f.name: getattr(snap, f.name) for f in dataclasses.fields(snap) if f.init}
    return FleetSnapshot(**{**fields, "tpu_pods": pods})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets(), streams(), st.lists(st.booleans(), min_size=8, max_size=8))
def test_decisions_with_every_cache_equal_decisions_made_fresh(
    snap: FleetSnapshot, requests: list[PlacementRequest], releases: list[bool]
) -> None:
    placed: list[Decision] = []
    for round_ in range(2):  # the second round asks the same shapes again: every cache is warm
        for i, req in enumerate(requests):
            ask = dataclasses.replace(req, request_id=f"{req.request_id}-{round_}")
            cached = decide(snap, ask)
            assert cached == decide(fresh(snap), ask)
            snap = apply(snap, cached)
            if cached.placed:
                placed.append(cached)
            if placed and releases[i % len(releases)]:  # a replica ends: the frame stays, loads go back
                snap = release(snap, placed.pop(0))


def test_the_snapshots_of_one_frame_share_one_empty_fleet_built_by_the_first_refusal() -> None:
    """A refusal on a later snapshot builds the empty fleet for its ancestors too (the simulator's runs
    all start from one snapshot), and a release keeps the frame."""
    snap = snapshot(node("a").nvswitch(8))
    full = apply(snap, decide(snap, request("llama3-70b", tp=8, request_id="x")))
    refused = decide(full, request("llama3-70b", tp=8, request_id="y", fallbacks=None))
    assert not refused.placed and refused.queueable
    empty = emptied(full)
    assert emptied(snap) is empty
    again = release(full, decide(snap, request("llama3-70b", tp=8, request_id="x")))
    assert emptied(again) is empty


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(fleets(), streams())
def test_the_feasibility_screen_answers_what_the_search_decides(
    snap: FleetSnapshot, requests: list[PlacementRequest]
) -> None:
    framework = framework_for(DEFAULT_PROFILE, None)
    for req in requests:
        state = CycleState()
        if not framework.run_prefilter(state, snap, req).ok:
            continue
        demand, index = demand_of(state), index_of(snap)
        assert _feasible(framework, state, demand, index) == _search(framework, state, demand, index).placed
        snap = apply(snap, decide(snap, req))


@st.composite
def grids(draw: st.DrawFn) -> TpuGrid:
    """A pod with a few slices taken (best fit, as placement takes them) and some freed again."""
    tpu_type = draw(st.sampled_from([TpuType.V5E, TpuType.V5P]))
    dims = draw(st.sampled_from([(8, 8), (16, 16)] if tpu_type is TpuType.V5E else [(4, 4, 4), (4, 4, 8), (8, 8, 8)]))
    grid = TpuGrid.empty(tpu_type, dims)
    taken: list[TpuSlice] = []
    for _ in range(draw(st.integers(0, 12))):
        found = find_free_slice(grid, draw(st.sampled_from(all_legal_shapes(tpu_type)[:5])))
        if found is not None:
            grid = allocate(grid, found)
            taken.append(found)
    for block in taken:
        if draw(st.booleans()):
            cells = bytearray(grid.occupancy)
            for coord in block.coords():
                index = 0
                for c, extent in zip(coord, dims, strict=True):
                    index = index * extent + c
                cells[index] = 0
            grid = TpuGrid(tpu_type, dims, bytes(cells))
    return grid


@settings(max_examples=150, deadline=None)
@given(grids(), st.data())
def test_a_grid_answers_from_its_cache_what_a_fresh_search_finds(grid: TpuGrid, data: st.DataObject) -> None:
    for shape in all_legal_shapes(grid.tpu_type)[:7]:
        first = find_free_slice(grid, shape)
        assert find_free_slice(grid, shape) == first  # from the cache
        assert first == find_free_slice(TpuGrid(grid.tpu_type, grid.dims, grid.occupancy), shape)
        if first is not None:
            # Remembered by the search (the best fit's class), and worked out from scratch: both are
            # the fragmentation of the grid built with the slice taken.
            expected = fragmentation(allocate(grid, first))
            assert fragmentation_after(grid, first) == expected
            assert fragmentation_after(TpuGrid(grid.tpu_type, grid.dims, grid.occupancy), first) == expected
    assert largest_free_block(grid) == largest_free_block(TpuGrid(grid.tpu_type, grid.dims, grid.occupancy))
    # Any free legal block, not only those a search found.
    shape = data.draw(st.sampled_from(all_legal_shapes(grid.tpu_type)[:6]))
    oriented = data.draw(st.sampled_from(orientations(shape)))
    if all(a <= d for a, d in zip(oriented, grid.dims, strict=True)):
        origin = tuple(data.draw(st.integers(0, d - a)) for a, d in zip(oriented, grid.dims, strict=True))
        block = TpuSlice(origin, oriented)
        if grid.is_free(block):
            assert fragmentation_after(grid, block) == fragmentation(allocate(grid, block))


def test_fragmentation_after_refuses_what_allocate_refuses() -> None:
    grid = allocate(TpuGrid.empty(TpuType.V5E, (4, 4)), TpuSlice((0, 0), (2, 2)))
    for bad in (TpuSlice((0, 0), (2, 2)), TpuSlice((3, 3), (2, 2)), TpuSlice((0, 0), (3, 1))):
        for call in (lambda b=bad: allocate(grid, b), lambda b=bad: fragmentation_after(grid, b)):
            try:
                call()
            except ValueError:
                continue
            raise AssertionError(f"{bad} was accepted")


def test_a_pod_scored_after_a_search_reads_the_fragmentation_the_search_left() -> None:
    """The packing score of a TPU candidate needs the fragmentation after the slice is taken: the
    slice search already knows it, so scoring builds no grid (a 4x4 v5e pod, 2x2 taken: a 2x4
    request leaves 8 free chips as one 2x4 block, fragmentation 0)."""
    pod = tpu_pod("e", "v5e", (4, 4))
    snap = snapshot(pods=[pod])
    grid = allocate(snap.tpu_pods["e"].grid, TpuSlice((0, 0), (2, 2)))
    found = find_free_slice(grid, (2, 4))
    assert found is not None
    assert grid._answers[(found.origin[0], found.origin[1], 0, found.end[0], found.end[1], 1)] == 0.0
    assert fragmentation_after(grid, found) == fragmentation(allocate(grid, found)) == 0.0
