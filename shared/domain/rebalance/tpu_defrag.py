"""Defragmenting a TPU pod: free one aligned block of a wanted shape by moving the slices in it.

A pod whose free chips are scattered (``topology.tpu.fragmentation`` above the threshold) cannot take a
large slice although it has the chips. The planner picks an aligned block of the wanted shape whose
slices can all be moved out, make-before-break: each slice's new position is allocated while its old
one is still held (so it never overlaps the old one, another slice or the block), then the old one is
freed, which may make room for the next slice. A moved slice keeps its legal shape (or takes another
orientation of it) and, being an axis-aligned block, stays contiguous.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from shared.domain.topology.tpu import (
    Shape,
    TpuGrid,
    TpuSlice,
    allocate,
    find_free_slice,
    free,
    is_legal_shape,
    orientations,
)

__all__ = ["SliceMove", "defragment"]


@dataclass(frozen=True, slots=True)
class SliceMove:
    """Move one replica's slice: allocate ``new`` (while ``old`` is held), then free ``old``."""

    allocation_id: str
    old: TpuSlice
    new: TpuSlice


def _aligned_blocks(grid: TpuGrid, want: Shape) -> Iterator[TpuSlice]:
    """Every aligned in-bounds block of ``want`` in each of its orientations."""
    for shape in orientations(want):
        if any(extent > dim for extent, dim in zip(shape, grid.dims, strict=True)):
            continue
        starts = (range(0, dim - extent + 1, extent) for extent, dim in zip(shape, grid.dims, strict=True))
        for origin in itertools.product(*starts):
            yield TpuSlice(tuple(origin), shape)


def _blocked(grid: TpuGrid, block: TpuSlice) -> TpuGrid:
    """``grid`` with ``block``'s chips marked taken: the space a moved slice may use."""
    cells = bytearray(grid.occupancy)
    for coord in block.coords():
        index = 0
        for c, extent in zip(coord, grid.dims, strict=True):
            index = index * extent + c
        cells[index] = 1
    return TpuGrid(grid.tpu_type, grid.dims, bytes(cells))


def _evacuate(
    grid: TpuGrid, block: TpuSlice, inside: list[tuple[str, TpuSlice]]
) -> tuple[TpuGrid, list[SliceMove]] | None:
    """Move ``inside`` out of ``block`` one by one (largest first, then by origin); each new position is
    ``find_free_slice``'s best fit on the grid with every old slice still held and ``block`` barred.
    Returns the grid afterwards and the moves, or None when some slice finds no room."""
    moves: list[SliceMove] = []
    for allocation_id, old in sorted(inside, key=lambda item: (-item[1].chips, item[1].origin, item[0])):
        new = find_free_slice(_blocked(grid, block), old.shape)
        if new is None:
            return None
        grid = free(allocate(grid, new), old)  # make-before-break: the copy first, then the old freed
        moves.append(SliceMove(allocation_id, old, new))
    return grid, moves


def defragment(
    grid: TpuGrid, slices: Mapping[str, TpuSlice], *, want: tuple[int, ...] = (8, 8)
) -> tuple[TpuSlice, list[SliceMove]] | None:
    """An aligned block of shape ``want`` (any orientation) and the slice moves that free it.

    ``slices`` are the pod's allocations by id (on ``grid``). Blocks are tried by the number of slices
    overlapping them (fewest moves first), ties by the lowest origin, then orientation order; a block
    holding chips no slice in ``slices`` accounts for is never chosen (nothing known can free them).
    For a block, its slices are moved out one at a time, largest first (the hardest to fit while the
    space is tightest), each to ``find_free_slice``'s best fit outside the block, allocated while the
    old one is still held and the old one freed after (so applying the moves in order, allocate then
    free, never overlaps anything). The search is greedy per block, not exhaustive: a block whose
    slices would fit only in another order is passed over. Returns the block and the moves in order
    (no moves when a block is already free); None when no block can be freed. ``ValueError`` when
    ``want`` is not a legal shape for the pod's type or a slice is not held on ``grid``.
    """
    if not is_legal_shape(grid.tpu_type, want):
        raise ValueError(f"{'x'.join(map(str, want))} is not a legal {grid.tpu_type.value} slice")
    for allocation_id, held in slices.items():
        if not grid.fits(held) or grid.occupied_in(held) != held.chips:
            raise ValueError(f"slice {allocation_id} {held} is not held on the pod")
    candidates: list[tuple[int, tuple[int, ...], int, TpuSlice, list[tuple[str, TpuSlice]]]] = []
    for order, block in enumerate(_aligned_blocks(grid, want)):
        inside = sorted((a, s) for a, s in slices.items() if s.overlaps(block))
        # Chips in the block that the overlapping slices do not explain belong to someone unknown.
        explained = sum(sum(1 for c in s.coords() if block.contains(c)) for _, s in inside)
        if grid.occupied_in(block) != explained:
            continue
        candidates.append((len(inside), block.origin, order, block, inside))
    for _, _, _, block, inside in sorted(candidates, key=lambda c: c[:3]):
        result = _evacuate(grid, block, inside)
        if result is not None:
            after, moves = result
            if after.is_free(block):
                return block, moves
    return None
