"""TPU pods: legal shapes, free-slice search, allocation, fragmentation."""

from __future__ import annotations

import itertools
from math import prod

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.domain.topology import (
    Shape,
    TpuGrid,
    TpuSlice,
    TpuType,
    all_legal_shapes,
    allocate,
    find_free_slice,
    fragmentation,
    free,
    is_legal_shape,
    largest_free_block,
    legal_shapes,
    orientations,
    smallest_legal_shape,
)

V5E, V5P = TpuType.V5E, TpuType.V5P


def grid_with(tpu_type: TpuType, dims: Shape, *blocks: tuple[Shape, Shape]) -> TpuGrid:
    """A pod with the given (origin, shape) blocks allocated."""
    grid = TpuGrid.empty(tpu_type, dims)
    for origin, shape in blocks:
        grid = allocate(grid, TpuSlice(origin, shape))
    return grid


# --- shapes ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tpu_type", "shape", "legal"),
    [
        (V5E, (1, 1), True),
        (V5E, (2, 4), True),
        (V5E, (4, 2), True),  # the other orientation
        (V5E, (16, 8), True),
        (V5E, (2, 8), False),
        (V5E, (3, 3), False),
        (V5E, (2, 2, 1), False),  # v5e is 2-D
        (V5P, (2, 2, 1), True),
        (V5P, (2, 1, 2), True),  # any permutation of the axes
        (V5P, (4, 2, 4), True),
        (V5P, (16, 8, 16), True),
        (V5P, (1, 1, 1), False),
        (V5P, (2, 2), False),
        (V5P, (2, 2, 3), False),
    ],
)
def test_is_legal_shape(tpu_type: TpuType, shape: Shape, legal: bool) -> None:
    assert is_legal_shape(tpu_type, shape) is legal


@pytest.mark.parametrize(
    ("tpu_type", "chips", "shape"),
    [
        (V5E, 1, (1, 1)),
        (V5E, 2, (2, 2)),
        (V5E, 4, (2, 2)),
        (V5E, 5, (2, 4)),
        (V5E, 9, (4, 4)),
        (V5E, 17, (4, 8)),
        (V5E, 33, (8, 8)),
        (V5E, 65, (8, 16)),
        (V5E, 256, (16, 16)),
        (V5E, 257, None),
        (V5P, 1, (2, 2, 1)),
        (V5P, 5, (2, 2, 2)),
        (V5P, 9, (2, 2, 4)),
        (V5P, 33, (4, 4, 4)),  # 64 chips
        (V5P, 4096, (16, 16, 16)),
        (V5P, 4097, None),
    ],
)
def test_smallest_legal_shape(tpu_type: TpuType, chips: int, shape: Shape | None) -> None:
    assert smallest_legal_shape(tpu_type, chips) == shape


def test_legal_shapes_lists_orientations() -> None:
    assert legal_shapes(V5E, 5) == ((2, 4), (4, 2))
    assert legal_shapes(V5E, 3) == ((2, 2),)
    assert legal_shapes(V5P, 16) == ((2, 2, 4), (2, 4, 2), (4, 2, 2))
    assert legal_shapes(V5E, 300) == ()
    with pytest.raises(ValueError):
        legal_shapes(V5E, 0)


def test_orientations_and_catalogue() -> None:
    assert orientations((4, 2)) == ((4, 2), (2, 4))  # as given first
    assert orientations((2, 2)) == ((2, 2),)
    assert len(orientations((2, 4, 8))) == 6
    assert all_legal_shapes(V5E)[0] == (1, 1) and all_legal_shapes(V5E)[-1] == (16, 16)
    chips = [prod(shape) for shape in all_legal_shapes(V5P)]
    assert chips == sorted(chips) and all_legal_shapes(V5P)[0] == (2, 2, 1)  # 4 chips, the smallest v5p slice
    assert orientations((2, 2, 1)) == ((2, 2, 1), (1, 2, 2), (2, 1, 2))


# --- grid --------------------------------------------------------------------------------------


def test_grid_construction_and_counts() -> None:
    pod = TpuGrid.empty(V5E)
    assert pod.dims == (16, 16) and (pod.total_chips, pod.used_chips, pod.free_chips) == (256, 0, 256)
    assert TpuGrid.empty(V5P).total_chips == 16**3
    with pytest.raises(ValueError):
        TpuGrid(V5E, (4, 4, 4))
    with pytest.raises(ValueError):
        TpuGrid(V5E, (2, 2), bytes([0, 1, 2, 0]))
    with pytest.raises(ValueError):
        TpuGrid(V5E, (2, 2), bytes(3))


def test_allocate_returns_a_new_grid_and_leaves_the_old_one() -> None:
    before = TpuGrid.empty(V5E, (4, 4))
    after = allocate(before, TpuSlice((0, 2), (2, 2)))
    assert before.used_chips == 0 and after.used_chips == 4
    assert after.is_occupied((1, 3)) and not after.is_occupied((2, 3))
    assert free(after, TpuSlice((0, 2), (2, 2))) == before


def test_occupied_in_is_a_block_count() -> None:
    grid = grid_with(V5E, (8, 8), ((0, 0), (2, 2)), ((4, 4), (4, 4)))
    # The 8x8 block holds both: 4 + 16 = 20 taken; the 4x4 at (2,2) overlaps the second at (4..5, 4..5) = 4.
    assert grid.occupied_in(TpuSlice((0, 0), (8, 8))) == 20
    assert grid.occupied_in(TpuSlice((2, 2), (4, 4))) == 4
    assert grid.is_free(TpuSlice((2, 0), (2, 4)))
    assert not grid.is_free(TpuSlice((6, 0), (4, 2)))  # leaves the pod


@pytest.mark.parametrize(
    ("block", "message"),
    [
        (TpuSlice((0, 0), (2, 8)), "not a legal v5e slice"),
        (TpuSlice((6, 0), (4, 4)), "does not fit"),
        (TpuSlice((0, 0), (2, 2)), "overlaps taken chips"),
    ],
)
def test_allocate_errors(block: TpuSlice, message: str) -> None:
    grid = grid_with(V5E, (8, 8), ((1, 1), (1, 1)))
    with pytest.raises(ValueError, match=message):
        allocate(grid, block)


def test_free_errors() -> None:
    grid = grid_with(V5E, (8, 8), ((0, 0), (2, 2)))
    with pytest.raises(ValueError, match="not fully allocated"):
        free(grid, TpuSlice((0, 0), (2, 4)))
    with pytest.raises(ValueError, match="does not fit"):
        free(grid, TpuSlice((7, 7), (2, 2)))
    with pytest.raises(ValueError, match="outside"):
        grid.is_occupied((8, 0))


def test_slice_geometry() -> None:
    block = TpuSlice((2, 4), (2, 4))
    assert (block.chips, block.end, block.aligned) == (8, (4, 8), True)
    assert block.contains((3, 7)) and not block.contains((4, 7))
    assert block.overlaps(TpuSlice((3, 0), (1, 5))) and not block.overlaps(TpuSlice((0, 0), (2, 8)))
    assert not TpuSlice((1, 0), (2, 2)).aligned
    assert len(list(block.coords())) == 8
    with pytest.raises(ValueError):
        TpuSlice((0, 0), (2, 2, 1))
    with pytest.raises(ValueError):
        TpuSlice((-1, 0), (1, 1))


# --- search ------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 1), (2, 2), (2, 4), (4, 2), (8, 16), (16, 16)])
def test_empty_pod_takes_the_origin(shape: Shape) -> None:
    assert find_free_slice(TpuGrid.empty(V5E), shape) == TpuSlice((0, 0), shape)


def test_other_orientation_when_the_asked_one_does_not_fit() -> None:
    # A 4x16 pod: 8x4 cannot stand, 4x8 can.
    assert find_free_slice(TpuGrid.empty(V5E, (4, 16)), (8, 4)) == TpuSlice((0, 0), (4, 8))


def test_aligned_origin_before_an_unaligned_one() -> None:
    # Chip (0,0) taken in an 8x8 pod: the unaligned (0,1) is free, but the aligned (0,2) is chosen.
    grid = grid_with(V5E, (8, 8), ((0, 0), (1, 1)))
    assert find_free_slice(grid, (2, 2)) == TpuSlice((0, 2), (2, 2))


def test_best_fit_keeps_the_largest_block() -> None:
    # 8x8 pod, quadrant x 4..7 / y 4..7 taken: free = 64 - 16 = 48; the largest free blocks are
    # 4x8 at (0,0) and 8x4 at (0,0), 32 chips each. A 2x2 at (0,0) breaks both (largest left
    # 16: fragmentation 1 - 16/44 = 0.64); the 2x2 at (0,4) keeps 8x4 (1 - 32/44 = 0.27).
    grid = grid_with(V5E, (8, 8), ((4, 4), (4, 4)))
    chosen = find_free_slice(grid, (2, 2))
    assert chosen == TpuSlice((0, 4), (2, 2))
    after = allocate(grid, chosen)
    assert fragmentation(after) == pytest.approx(1 - 32 / 44)
    assert fragmentation(allocate(grid, TpuSlice((0, 0), (2, 2)))) == pytest.approx(1 - 16 / 44)


def test_unaligned_when_no_aligned_origin_is_free() -> None:
    # 2x6 pod; (0,0), (1,3), (0,5) taken block every aligned 2x2 (y 0-1, 2-3, 4-5); y 1-2 is free.
    grid = grid_with(V5E, (2, 6), ((0, 0), (1, 1)), ((1, 3), (1, 1)), ((0, 5), (1, 1)))
    assert find_free_slice(grid, (2, 2)) == TpuSlice((0, 1), (2, 2))


def test_no_room_and_illegal_shapes() -> None:
    full = grid_with(V5E, (4, 4), ((0, 0), (4, 4)))
    assert find_free_slice(full, (1, 1)) is None
    assert find_free_slice(TpuGrid.empty(V5E, (4, 4)), (4, 8)) is None  # larger than the pod
    with pytest.raises(ValueError, match="not a legal"):
        find_free_slice(TpuGrid.empty(V5E), (3, 3))


def test_v5p_search_in_three_dimensions() -> None:
    grid = grid_with(V5P, (4, 4, 4), ((0, 0, 0), (2, 2, 4)))
    block = find_free_slice(grid, (2, 2, 4))
    assert block is not None and block.chips == 16 and grid.is_free(block)
    assert block.aligned
    # 2x2x1 asked: any orientation; free 48 chips left, so the result must keep a 32-chip block.
    small = find_free_slice(grid, (2, 2, 1))
    assert small is not None
    left = largest_free_block(allocate(grid, small))
    assert left is not None and left.chips == 32


# --- fragmentation -----------------------------------------------------------------------------


def holes(*origins: Shape) -> TpuGrid:
    """An 8x8 v5e pod with everything taken except 2x2 holes at the origins."""
    grid = grid_with(V5E, (8, 8), ((0, 0), (8, 8)))
    for origin in origins:
        grid = free(grid, TpuSlice(origin, (2, 2)))
    return grid


@pytest.mark.parametrize(
    ("grid", "expected"),
    [
        (TpuGrid.empty(V5E), 0.0),  # everything free is one 16x16
        (grid_with(V5E, (16, 16), ((0, 0), (16, 16))), 0.0),  # nothing free
        (grid_with(V5E, (16, 16), ((0, 0), (8, 16))), 0.0),  # free half = one 8x16 block
        (holes((0, 0), (0, 4), (4, 0), (4, 4)), 1 - 4 / 16),  # 4 holes of 4: largest 4 of 16
        (holes((0, 0), (0, 2)), 0.0),  # two adjacent holes make one 2x4
        (holes((0, 0), (0, 2), (0, 6)), 1 - 8 / 12),
        # 2x2x2 v5p pod, one 2x2x1 layer taken: the other layer is a legal 1x2x2 block.
        (grid_with(V5P, (2, 2, 2), ((0, 0, 0), (2, 2, 1))), 0.0),
    ],
)
def test_fragmentation(grid: TpuGrid, expected: float) -> None:
    assert fragmentation(grid) == pytest.approx(expected)


def test_lone_v5p_chip_is_fully_fragmented() -> None:
    # v5p's smallest slice is 4 chips: one free chip cannot host anything.
    grid = free(grid_with(V5P, (2, 2, 2), ((0, 0, 0), (2, 2, 2))), TpuSlice((1, 1, 1), (1, 1, 1)))
    assert grid.free_chips == 1
    assert largest_free_block(grid) is None
    assert fragmentation(grid) == 1.0


# --- properties --------------------------------------------------------------------------------

POD = {V5E: (8, 8), V5P: (4, 4, 4)}


def _brute_has_free_block(grid: TpuGrid, shape: Shape) -> bool:
    for oriented in orientations(shape):
        if any(size > extent for size, extent in zip(oriented, grid.dims, strict=True)):
            continue
        for origin in itertools.product(*(range(d - s + 1) for d, s in zip(grid.dims, oriented, strict=True))):
            if not any(grid.is_occupied(c) for c in TpuSlice(origin, oriented).coords()):
                return True
    return False


@settings(max_examples=60, deadline=None)
@given(st.sampled_from([V5E, V5P]), st.data())
def test_found_slices_are_free_legal_in_bounds_and_disjoint(tpu_type: TpuType, data: st.DataObject) -> None:
    grid = TpuGrid.empty(tpu_type, POD[tpu_type])
    shapes = [shape for shape in all_legal_shapes(tpu_type) if prod(shape) <= grid.total_chips]
    held: list[TpuSlice] = []
    for _ in range(data.draw(st.integers(1, 12))):
        release: bool = bool(held) and data.draw(st.integers(0, 3)) == 0  # one step in four frees
        if release:
            grid = free(grid, held.pop(data.draw(st.integers(0, len(held) - 1))))
            continue
        shape = data.draw(st.sampled_from(shapes))
        block = find_free_slice(grid, shape)
        assert (block is not None) == _brute_has_free_block(grid, shape)
        if block is None:
            continue
        assert is_legal_shape(tpu_type, block.shape) and sorted(block.shape) == sorted(shape)
        assert grid.fits(block) and grid.is_free(block)
        grid = allocate(grid, block)
        held.append(block)
        assert all(not a.overlaps(b) for a, b in itertools.combinations(held, 2))
        assert grid.used_chips == sum(h.chips for h in held)
        assert 0.0 <= fragmentation(grid) <= 1.0
