"""Defragmenting a TPU pod (issue 16): a fragmented v5e 16x16 pod ends with a free 8x8 block, every
slice legal and contiguous at every step, moves applied make-before-break."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from shared.domain.rebalance.tpu_defrag import SliceMove, defragment
from shared.domain.topology.tpu import (
    TpuGrid,
    TpuSlice,
    TpuType,
    allocate,
    fragmentation,
    free,
    is_legal_shape,
    largest_free_block,
)

# A v5e pod with small slices scattered over every 8x8 quadrant: quadrant (0,0) holds a and b,
# (0,8) only c, (8,0) d and e, (8,8) f and g. No 8x8 window anywhere is free.
FRAGMENTED: dict[str, TpuSlice] = {
    "a": TpuSlice((2, 2), (2, 2)),
    "b": TpuSlice((5, 4), (2, 4)),
    "c": TpuSlice((3, 11), (2, 2)),
    "d": TpuSlice((8, 0), (4, 4)),
    "e": TpuSlice((12, 5), (2, 2)),
    "f": TpuSlice((11, 11), (2, 2)),
    "g": TpuSlice((15, 15), (1, 1)),
}


def grid_of(
    slices: Mapping[str, TpuSlice], tpu_type: TpuType = TpuType.V5E, dims: tuple[int, ...] = (16, 16)
) -> TpuGrid:
    grid = TpuGrid.empty(tpu_type, dims)
    for block in slices.values():
        grid = allocate(grid, block)
    return grid


def problems(grid: TpuGrid, held: Mapping[str, TpuSlice]) -> list[str]:
    """Slices overlapping, illegal, outside the pod, or not taken on the grid; chips taken that no
    slice holds."""
    found = [f"{a} {s} is not legal" for a, s in held.items() if not is_legal_shape(grid.tpu_type, s.shape)]
    found += [f"{a} {s} leaves the pod" for a, s in held.items() if not grid.fits(s)]
    found += [f"{a} {s} not taken" for a, s in held.items() if grid.fits(s) and grid.occupied_in(s) != s.chips]
    items = sorted(held.items())
    found += [f"{a} overlaps {b}" for i, (a, s) in enumerate(items) for b, t in items[i + 1 :] if s.overlaps(t)]
    if grid.used_chips != sum(s.chips for s in held.values()):
        found.append(f"{grid.used_chips} chips taken, slices hold {sum(s.chips for s in held.values())}")
    return found


def replay(
    grid: TpuGrid, slices: Mapping[str, TpuSlice], moves: list[SliceMove]
) -> tuple[TpuGrid, dict[str, TpuSlice], list[str]]:
    """Apply the moves make-before-break (allocate the new slice while the old is held, then free the
    old), checking the pod after every half-step; ``allocate`` itself refuses an overlap."""
    held: dict[str, TpuSlice] = dict(slices)
    seen: list[str] = []
    for move in moves:
        assert held[move.allocation_id] == move.old
        assert tuple(sorted(move.new.shape)) == tuple(sorted(move.old.shape))  # same shape, any orientation
        grid = allocate(grid, move.new)
        seen += problems(grid, {**held, f"{move.allocation_id}+copy": move.new})
        grid = free(grid, move.old)
        held[move.allocation_id] = move.new
        seen += problems(grid, held)
    return grid, held, seen


def test_a_fragmented_pod_ends_with_a_free_8x8_block() -> None:
    """Free chips: 256 - (4+8+4+16+4+4+1) = 215; the largest free legal block is 4x8 (32 chips), so
    fragmentation = 1 - 32/215 = 0.85 > 0.3. Quadrant (0,8) holds one slice (c): fewest moves, so it
    is the block, and one move frees it; the largest free block is then 8x8 or more."""
    grid = grid_of(FRAGMENTED)
    before = fragmentation(grid)
    assert before == pytest.approx(1 - 32 / 215)
    largest = largest_free_block(grid)
    assert largest is not None and largest.chips < 64

    result = defragment(grid, FRAGMENTED)

    assert result is not None
    block, moves = result
    assert block == TpuSlice((0, 8), (8, 8))
    assert [m.allocation_id for m in moves] == ["c"]
    after, held, seen = replay(grid, FRAGMENTED, moves)
    assert seen == []
    assert after.is_free(block)
    assert all(not s.overlaps(block) for s in held.values())
    assert fragmentation(after) < before


def test_fewest_moves_first_then_lowest_origin() -> None:
    """With quadrant (0,8) taken by an allocation the rebalancer does not know of (a chip at (0,15)),
    every other quadrant needs two moves: the lowest origin, (0,0), is freed (a then b, the larger first)."""
    stranger = TpuSlice((0, 15), (1, 1))
    grid = allocate(grid_of(FRAGMENTED), stranger)

    result = defragment(grid, FRAGMENTED)

    assert result is not None
    block, moves = result
    assert block == TpuSlice((0, 0), (8, 8))
    assert [m.allocation_id for m in moves] == ["b", "a"]
    after, _, seen = replay(grid, {**FRAGMENTED, "stranger": stranger}, moves)
    assert seen == [] and after.is_free(block)


def test_a_slice_straddling_the_block_moves_whole() -> None:
    """A 4x4 across the line between quadrants (origin (6,6)) overlaps all four: each quadrant needs
    at least that move; (0,0) wins the tie, and the 4x4 lands clear of the block."""
    slices = {"x": TpuSlice((6, 6), (4, 4))}
    grid = grid_of(slices)

    result = defragment(grid, slices)

    assert result is not None
    block, moves = result
    assert block == TpuSlice((0, 0), (8, 8)) and len(moves) == 1
    assert not moves[0].new.overlaps(block) and not moves[0].new.overlaps(moves[0].old)
    after, _, seen = replay(grid, slices, moves)
    assert seen == [] and after.is_free(block)


def test_a_block_already_free_needs_no_move() -> None:
    slices = {"a": TpuSlice((0, 0), (2, 2))}
    assert defragment(grid_of(slices), slices) == (TpuSlice((0, 8), (8, 8)), [])


def test_the_other_orientation_counts() -> None:
    """Wanting 8x16: both 8x16 blocks hold a slice, the 16x8 block on the right holds none."""
    slices = {"p": TpuSlice((0, 0), (2, 2)), "q": TpuSlice((8, 0), (2, 2))}
    assert defragment(grid_of(slices), slices, want=(8, 16)) == (TpuSlice((0, 8), (16, 8)), [])


def test_no_block_can_be_freed() -> None:
    """Four 8x8 slices fill the pod: moving any of them needs another free 8x8."""
    slices = {f"q{i}": TpuSlice((x, y), (8, 8)) for i, (x, y) in enumerate([(0, 0), (0, 8), (8, 0), (8, 8)])}
    assert defragment(grid_of(slices), slices) is None
    # Three 8x8 and two 4x8 in the last quadrant: the 4x8s could leave only into free chips, and none are.
    crowded = {**{k: v for k, v in slices.items() if k != "q3"}, "s": TpuSlice((8, 8), (4, 8))}
    crowded["t"] = TpuSlice((12, 8), (4, 8))
    assert defragment(grid_of(crowded), crowded) is None


def test_v5p_three_axes() -> None:
    """An 8x8x8 v5p pod with a 2x2x2 slice inside each 4x4x4 octant: every octant needs one move, so
    the lowest origin wins and its slice moves out."""
    slices = {
        f"o{i}": TpuSlice((x + 1, y + 1, z + 1), (2, 2, 2))
        for i, (x, y, z) in enumerate([(x, y, z) for x in (0, 4) for y in (0, 4) for z in (0, 4)])
    }
    grid = grid_of(slices, TpuType.V5P, (8, 8, 8))

    result = defragment(grid, slices, want=(4, 4, 4))

    assert result is not None
    block, moves = result
    assert block == TpuSlice((0, 0, 0), (4, 4, 4)) and [m.allocation_id for m in moves] == ["o0"]
    after, _, seen = replay(grid, slices, moves)
    assert seen == [] and after.is_free(block)


def test_bad_input_is_refused() -> None:
    grid = grid_of(FRAGMENTED)
    with pytest.raises(ValueError, match="legal"):
        defragment(grid, FRAGMENTED, want=(3, 3))
    with pytest.raises(ValueError, match="not held"):
        defragment(grid, {**FRAGMENTED, "ghost": TpuSlice((0, 0), (2, 2))})
