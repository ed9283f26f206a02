"""TPU pods as chip grids: legal slice shapes, free-slice search, allocation, fragmentation.

A v5e pod is a 2-D grid, a v5p pod a 3-D one. A slice is an axis-aligned block of a legal
shape (any orientation: 2x4 or 4x2; for v5p any permutation of the axes); a model lands on
one whole free slice. `TpuGrid` is immutable: `allocate` and `free` return a new grid and
leave the old one as it was, so a planner can try placements without undoing them.
A summed-area (prefix-sum) table built with the grid makes "is this block free?" O(1).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache
from math import prod
from typing import Final, cast

Shape = tuple[int, ...]
Coord = tuple[int, ...]


class TpuType(StrEnum):
    """The TPU generations we place on, named as Cloud TPU names them."""

    V5E = "v5e"
    V5P = "v5p"

    @property
    def axes(self) -> int:
        """Grid dimensionality: 2 for v5e, 3 for v5p."""
        return 2 if self is TpuType.V5E else 3


# Legal shapes as Cloud TPU names the topologies (the canonical orientation), fewest chips first.
_LEGAL_SHAPES: dict[TpuType, tuple[Shape, ...]] = {
    TpuType.V5E: ((1, 1), (2, 2), (2, 4), (4, 4), (4, 8), (8, 8), (8, 16), (16, 16)),
    TpuType.V5P: (
        (2, 2, 1),
        (2, 2, 2),
        (2, 2, 4),
        (2, 4, 4),
        (4, 4, 4),
        (4, 4, 8),
        (4, 8, 8),
        (8, 8, 8),
        (8, 8, 16),
        (8, 16, 16),
        (16, 16, 16),
    ),
}
DEFAULT_POD_DIMS: dict[TpuType, Shape] = {TpuType.V5E: (16, 16), TpuType.V5P: (16, 16, 16)}
"""A full v5e pod is 16x16 (256 chips). Real v5p pods are larger than 16x16x16 (8,960 chips);
pass the pod's real dims to `TpuGrid.empty` when modelling one."""


# Membership ignores orientation: compare shapes with their axes sorted.
_SORTED_LEGAL: dict[TpuType, frozenset[Shape]] = {
    tpu_type: frozenset(tuple(sorted(shape)) for shape in shapes) for tpu_type, shapes in _LEGAL_SHAPES.items()
}


def all_legal_shapes(tpu_type: TpuType) -> tuple[Shape, ...]:
    """Legal slice shapes in canonical orientation (v5e 2x4, v5p 2x2x1), fewest chips first."""
    return _LEGAL_SHAPES[tpu_type]


@lru_cache(maxsize=256)
def orientations(shape: Shape) -> tuple[Shape, ...]:
    """The distinct axis permutations of a shape: the shape as given first, then the rest in
    ascending order (2x4 -> (2x4, 4x2))."""
    rest = sorted(set(itertools.permutations(shape)) - {shape})
    return (shape, *rest)


def is_legal_shape(tpu_type: TpuType, shape: Sequence[int]) -> bool:
    """True when the shape has the type's number of axes and is a legal shape in some orientation."""
    return len(shape) == tpu_type.axes and tuple(sorted(shape)) in _SORTED_LEGAL[tpu_type]


def smallest_legal_shape(tpu_type: TpuType, chips: int) -> Shape | None:
    """The legal shape (canonical orientation) with the fewest chips >= `chips`; None when even
    the largest legal shape is too small. Raises `ValueError` for chips < 1."""
    if chips < 1:
        raise ValueError(f"a slice needs at least one chip, got {chips}")
    return next((shape for shape in _LEGAL_SHAPES[tpu_type] if prod(shape) >= chips), None)


def legal_shapes(tpu_type: TpuType, chips: int) -> tuple[Shape, ...]:
    """Every orientation of the smallest legal shape holding at least `chips` chips, canonical
    first (v5e, 5 chips -> ((2, 4), (4, 2))); () when no legal shape is that large."""
    shape = smallest_legal_shape(tpu_type, chips)
    return () if shape is None else orientations(shape)


@dataclass(frozen=True, slots=True)
class TpuSlice:
    """An axis-aligned block: chips at origin[i] <= c[i] < origin[i] + shape[i] on every axis."""

    origin: Coord
    shape: Shape

    def __post_init__(self) -> None:
        if len(self.origin) != len(self.shape):
            raise ValueError(f"origin {self.origin} and shape {self.shape} differ in axes")
        if any(extent < 1 for extent in self.shape) or any(start < 0 for start in self.origin):
            raise ValueError(f"bad slice origin {self.origin} / shape {self.shape}")

    @property
    def chips(self) -> int:
        return prod(self.shape)

    @property
    def end(self) -> Coord:
        """The exclusive upper corner."""
        return tuple(start + extent for start, extent in zip(self.origin, self.shape, strict=True))

    @property
    def aligned(self) -> bool:
        """Origin a multiple of the shape on every axis (buddy-style placement)."""
        return all(start % extent == 0 for start, extent in zip(self.origin, self.shape, strict=True))

    def contains(self, coord: Sequence[int]) -> bool:
        return all(a <= c < b for a, c, b in zip(self.origin, coord, self.end, strict=True))

    def overlaps(self, other: TpuSlice) -> bool:
        return all(
            a0 < b1 and b0 < a1 for a0, a1, b0, b1 in zip(self.origin, self.end, other.origin, other.end, strict=True)
        )

    def coords(self) -> Iterator[Coord]:
        """Every chip coordinate in the slice, in row-major order."""
        return itertools.product(*(range(a, b) for a, b in zip(self.origin, self.end, strict=True)))


def _pad3(values: Sequence[int], fill: int) -> tuple[int, int, int]:
    padded = (*values, *(fill,) * (3 - len(values)))
    return padded[0], padded[1], padded[2]


@dataclass(frozen=True, slots=True)
class TpuGrid:
    """A pod's chips and which are taken. Immutable (see the module docstring).

    `occupancy` holds one byte per chip (1 taken, 0 free) in row-major order, the last axis
    fastest; b"" means every chip is free. Raises `ValueError` for dims that do not match the
    type's axes or an occupancy of the wrong length or values.
    """

    tpu_type: TpuType
    dims: Shape
    occupancy: bytes = b""
    # Summed-area table over the grid padded to three axes, with a zero border.
    _prefix: tuple[int, ...] = field(init=False, repr=False, compare=False)
    # Searches already answered on this grid (it never changes): slices found per shape, the largest
    # free block, the fragmentation left after taking a block. A pod keeps its grid until a slice is
    # taken or freed, so every decision until then reads them instead of searching again.
    _answers: dict[object, object] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if len(self.dims) != self.tpu_type.axes or any(extent < 1 for extent in self.dims):
            axes = self.tpu_type.axes
            raise ValueError(f"{self.tpu_type.value} needs {axes} positive dims, got {self.dims}")
        total = prod(self.dims)
        if not self.occupancy:
            object.__setattr__(self, "occupancy", bytes(total))
        elif len(self.occupancy) != total or max(self.occupancy) > 1:
            raise ValueError(f"occupancy must be {total} bytes of 0/1")
        object.__setattr__(self, "_prefix", self._summed_area())
        object.__setattr__(self, "_answers", {})

    @classmethod
    def empty(cls, tpu_type: TpuType, dims: Shape | None = None) -> TpuGrid:
        """A pod with every chip free; `dims` defaults to `DEFAULT_POD_DIMS[tpu_type]`."""
        return cls(tpu_type, DEFAULT_POD_DIMS[tpu_type] if dims is None else dims)

    def _summed_area(self) -> tuple[int, ...]:
        size_x, size_y, size_z = _pad3(self.dims, 1)
        stride_y = size_z + 1
        stride_x = (size_y + 1) * stride_y
        table = [0] * ((size_x + 1) * stride_x)
        occupancy = self.occupancy
        if size_z == 1:  # 2-D (v5e): one running row sum per row, half the work of the 3-D loop
            for x in range(size_x):
                above, here = x * stride_x + 1, (x + 1) * stride_x + 1
                row = itertools.accumulate(occupancy[x * size_y : (x + 1) * size_y])
                for y, run in enumerate(row, start=1):
                    table[here + y * stride_y] = table[above + y * stride_y] + run
            return tuple(table)
        for x in range(size_x):
            for y in range(size_y):
                base = (x * size_y + y) * size_z
                here = (x + 1) * stride_x + (y + 1) * stride_y
                left = x * stride_x + (y + 1) * stride_y
                down = (x + 1) * stride_x + y * stride_y
                corner = x * stride_x + y * stride_y
                run = 0
                for z in range(1, size_z + 1):
                    run += occupancy[base + z - 1]
                    table[here + z] = run + table[left + z] + table[down + z] - table[corner + z]
        return tuple(table)

    @property
    def total_chips(self) -> int:
        return len(self.occupancy)

    @property
    def used_chips(self) -> int:
        return self._prefix[-1]

    @property
    def free_chips(self) -> int:
        return self.total_chips - self.used_chips

    def _index(self, coord: Sequence[int]) -> int:
        index = 0
        for c, extent in zip(coord, self.dims, strict=True):
            if not 0 <= c < extent:
                raise ValueError(f"chip {tuple(coord)} is outside the {self.dims} pod")
            index = index * extent + c
        return index

    def is_occupied(self, coord: Sequence[int]) -> bool:
        return bool(self.occupancy[self._index(coord)])

    def fits(self, block: TpuSlice) -> bool:
        """The block lies inside the pod and has the pod's number of axes."""
        return len(block.shape) == len(self.dims) and all(
            end <= extent for end, extent in zip(block.end, self.dims, strict=True)
        )

    def occupied_in(self, block: TpuSlice) -> int:
        """Taken chips inside an in-bounds block, in O(1) from the summed-area table."""
        x0, y0, z0 = _pad3(block.origin, 0)
        x1, y1, z1 = _pad3(block.end, 1)
        _, size_y, size_z = _pad3(self.dims, 1)
        sy = size_z + 1
        sx = (size_y + 1) * sy
        t = self._prefix
        return (
            t[x1 * sx + y1 * sy + z1]
            - t[x0 * sx + y1 * sy + z1]
            - t[x1 * sx + y0 * sy + z1]
            - t[x1 * sx + y1 * sy + z0]
            + t[x0 * sx + y0 * sy + z1]
            + t[x0 * sx + y1 * sy + z0]
            + t[x1 * sx + y0 * sy + z0]
            - t[x0 * sx + y0 * sy + z0]
        )

    def is_free(self, block: TpuSlice) -> bool:
        """In bounds and no chip in it taken."""
        return self.fits(block) and self.occupied_in(block) == 0

    def _with(self, block: TpuSlice, value: int) -> TpuGrid:
        cells = bytearray(self.occupancy)
        for coord in block.coords():
            cells[self._index(coord)] = value
        return TpuGrid(self.tpu_type, self.dims, bytes(cells))


def allocate(grid: TpuGrid, block: TpuSlice) -> TpuGrid:
    """A new grid with the block taken. Raises `ValueError` when the shape is not legal for
    the pod's type, the block leaves the pod, or any chip in it is already taken."""
    if not is_legal_shape(grid.tpu_type, block.shape):
        raise ValueError(f"{'x'.join(map(str, block.shape))} is not a legal {grid.tpu_type.value} slice")
    if not grid.fits(block):
        raise ValueError(f"slice {block} does not fit the {grid.dims} pod")
    if grid.occupied_in(block):
        raise ValueError(f"slice {block} overlaps taken chips")
    return grid._with(block, 1)


def occupy(grid: TpuGrid, coords: Iterable[Sequence[int]]) -> TpuGrid:
    """A new grid with these chips taken, whatever shape they make (chips a decision may not use: a
    rebalancer freeing a block marks it so). Chips already taken stay taken; the same grid when none
    changes. Raises `ValueError` for a chip outside the pod."""
    cells = bytearray(grid.occupancy)
    changed = False
    for coord in coords:
        index = grid._index(coord)
        if not cells[index]:
            cells[index] = 1
            changed = True
    return TpuGrid(grid.tpu_type, grid.dims, bytes(cells)) if changed else grid


def free(grid: TpuGrid, block: TpuSlice) -> TpuGrid:
    """A new grid with the block's chips free again. Raises `ValueError` when the block leaves
    the pod or any chip in it is not taken (freeing twice is a bug the caller should see)."""
    if not grid.fits(block):
        raise ValueError(f"slice {block} does not fit the {grid.dims} pod")
    if grid.occupied_in(block) != block.chips:
        raise ValueError(f"slice {block} is not fully allocated")
    return grid._with(block, 0)


# Internally a block is a box (x0, y0, z0, x1, y1, z1), padded to three axes: the searches
# below run thousands of O(1) tests, and tuples of ints keep each one cheap.
_Box = tuple[int, int, int, int, int, int]


def _free_boxes(grid: TpuGrid, shape: Shape, *, aligned: bool) -> Iterator[_Box]:
    """Free boxes of one oriented shape, origins ascending (aligned: origins a multiple of it)."""
    size_x, size_y, size_z = _pad3(grid.dims, 1)
    a, b, c = _pad3(shape, 1)
    if a > size_x or b > size_y or c > size_z:
        return
    t = grid._prefix
    sy = size_z + 1
    sx = (size_y + 1) * sy
    step_x, step_y, step_z = (a, b, c) if aligned else (1, 1, 1)
    for x0 in range(0, size_x - a + 1, step_x):
        x1 = x0 + a
        for y0 in range(0, size_y - b + 1, step_y):
            y1 = y0 + b
            i11, i01, i10, i00 = x1 * sx + y1 * sy, x0 * sx + y1 * sy, x1 * sx + y0 * sy, x0 * sx + y0 * sy
            for z0 in range(0, size_z - c + 1, step_z):
                z1 = z0 + c
                taken = (
                    t[i11 + z1] - t[i01 + z1] - t[i10 + z1] - t[i11 + z0]
                    + t[i00 + z1] + t[i01 + z0] + t[i10 + z0] - t[i00 + z0]
                )  # fmt: skip
                if taken == 0:
                    yield (x0, y0, z0, x1, y1, z1)


def _free_boxes_of(grid: TpuGrid, shapes: Sequence[Shape], *, aligned: bool) -> Iterator[_Box]:
    """Free boxes of the given shapes in every orientation: shape, orientation, origin order."""
    for canonical in shapes:
        for shape in orientations(canonical):
            yield from _free_boxes(grid, shape, aligned=aligned)


def _disjoint(p: _Box, q: _Box) -> bool:
    return p[3] <= q[0] or q[3] <= p[0] or p[4] <= q[1] or q[4] <= p[1] or p[5] <= q[2] or q[5] <= p[2]


def _to_slice(grid: TpuGrid, box: _Box) -> TpuSlice:
    axes = len(grid.dims)
    return TpuSlice(box[:axes], tuple(box[3 + i] - box[i] for i in range(axes)))


def _shape_classes(tpu_type: TpuType, max_chips: int) -> list[list[Shape]]:
    """Legal shapes grouped by chip count, most chips first, none above max_chips."""
    by_chips: dict[int, list[Shape]] = {}
    for shape in _LEGAL_SHAPES[tpu_type]:
        if prod(shape) <= max_chips:
            by_chips.setdefault(prod(shape), []).append(shape)
    return [by_chips[chips] for chips in sorted(by_chips, reverse=True)]


def largest_free_block(grid: TpuGrid) -> TpuSlice | None:
    """A free block of the largest legal shape that fits anywhere in the free chips (first in
    shape, orientation, origin order); None when no legal block is free."""
    answers = grid._answers
    if _LARGEST in answers:
        return cast("TpuSlice | None", answers[_LARGEST])
    found: TpuSlice | None = None
    for shapes in _shape_classes(grid.tpu_type, grid.free_chips):
        box = next(_free_boxes_of(grid, shapes, aligned=False), None)
        if box is not None:
            found = _to_slice(grid, box)
            break
    answers[_LARGEST] = found
    return found


_LARGEST: Final = "largest"  # ``TpuGrid._answers`` key of ``largest_free_block``; shapes and boxes are tuples


def fragmentation(grid: TpuGrid) -> float:
    """How scattered the free chips are, in [0, 1]:

        fragmentation = 1 - (chips of the largest free legal block) / (free chips)

    where a free legal block is an axis-aligned block of a legal shape, any orientation, any
    origin, with no chip taken. 0 when nothing is free or all free chips form one legal block;
    1 when chips are free but no legal block fits in them (e.g. lone v5p chips). A half-used
    16x16 v5e pod whose free half is one 8x16 block scores 0; free chips scattered as 2x2
    holes score 1 - 4/free.
    """
    free_chips = grid.free_chips
    if free_chips == 0:
        return 0.0
    block = largest_free_block(grid)
    return 1.0 - (block.chips if block is not None else 0) / free_chips


def fragmentation_after(grid: TpuGrid, block: TpuSlice) -> float:
    """``fragmentation(allocate(grid, block))``, without building the new grid: a block is free
    afterwards exactly when it is free now and disjoint from ``block``, so the largest free legal
    block afterwards is the first such box, by class (most chips first), orientation and origin.
    Raises ``ValueError`` as ``allocate`` does."""
    if not is_legal_shape(grid.tpu_type, block.shape):
        raise ValueError(f"{'x'.join(map(str, block.shape))} is not a legal {grid.tpu_type.value} slice")
    if not grid.fits(block):
        raise ValueError(f"slice {block} does not fit the {grid.dims} pod")
    if grid.occupied_in(block):
        raise ValueError(f"slice {block} overlaps taken chips")
    taken = _box_of(block)
    answers = grid._answers
    known = answers.get(taken)
    if isinstance(known, float):
        return known
    free_chips = grid.free_chips - block.chips
    chips = 0
    if free_chips > 0:
        for shapes in _shape_classes(grid.tpu_type, free_chips):
            if any(_disjoint(box, taken) for box in _free_boxes_of(grid, shapes, aligned=False)):
                chips = prod(shapes[0])
                break
    result = 1.0 - chips / free_chips if free_chips > 0 else 0.0
    answers[taken] = result
    return result


def _box_of(block: TpuSlice) -> _Box:
    x0, y0, z0 = _pad3(block.origin, 0)
    x1, y1, z1 = _pad3(block.end, 1)
    return (x0, y0, z0, x1, y1, z1)


def _listed(seen: list[_Box], source: Iterator[_Box]) -> Iterator[_Box]:
    """``seen``, then the rest of ``source``, appended to ``seen`` as it is read (read again from the top)."""
    yield from seen
    for box in source:
        seen.append(box)
        yield box


class _Candidates:
    """Free boxes of one shape in preference order, generated only as far as they are read:
    the aligned ones if any is free, otherwise every free one."""

    def __init__(self, grid: TpuGrid, shape: Shape) -> None:
        self._seen: list[_Box] = []
        orientations_of = list(orientations(shape))
        aligned = itertools.chain.from_iterable(
            _free_boxes(grid, oriented, aligned=True) for oriented in orientations_of
        )
        first = next(aligned, None)
        if first is not None:
            self._seen.append(first)
            self._source: Iterator[_Box] = aligned
        else:
            self._source = itertools.chain.from_iterable(
                _free_boxes(grid, oriented, aligned=False) for oriented in orientations_of
            )

    def __iter__(self) -> Iterator[_Box]:
        yield from self._seen
        for box in self._source:
            self._seen.append(box)
            yield box


def find_free_slice(grid: TpuGrid, shape: Shape) -> TpuSlice | None:
    """A free block of `shape` (trying every orientation), or None when none is free.

    Deterministic preference: (1) aligned origins (a multiple of the oriented shape on every
    axis), considered alone whenever any is free; (2) best fit: the candidate that leaves the
    largest free legal block, i.e. the lowest `fragmentation` after allocating it (the
    free-chip count afterwards is the same for every candidate); (3) orientation order of
    `orientations(shape)`, then the lowest origin. Raises `ValueError` for an illegal shape.
    """
    if not is_legal_shape(grid.tpu_type, shape):
        raise ValueError(f"{'x'.join(map(str, shape))} is not a legal {grid.tpu_type.value} slice")
    key = tuple(shape)
    answers = grid._answers
    if key in answers:
        return cast("TpuSlice | None", answers[key])
    found = _find_free_slice(grid, key)
    answers[key] = found
    return found


def _find_free_slice(grid: TpuGrid, shape: Shape) -> TpuSlice | None:
    if grid.free_chips < prod(shape):  # no search can find what is not there
        return None
    candidates = _Candidates(grid, shape)
    fallback = next(iter(candidates), None)
    if fallback is None:
        return None
    left = grid.free_chips - prod(shape)
    # Classes are visited largest first, so the first candidate that keeps a block of the
    # current class free is the best fit; later classes could only leave smaller blocks.
    for shapes in _shape_classes(grid.tpu_type, left):
        # The class's free blocks, listed only as far as the candidates need them: the first
        # candidate usually keeps one of the first blocks free.
        source = _free_boxes_of(grid, shapes, aligned=False)
        first = next(source, None)
        if first is None:
            continue
        blocks = [first]
        for candidate in candidates:
            for block in _listed(blocks, source):
                if _disjoint(candidate, block):
                    # No larger class kept a block free beside it: this is what it leaves.
                    grid._answers[candidate] = 1.0 - prod(shapes[0]) / left if left > 0 else 0.0
                    return _to_slice(grid, candidate)
    grid._answers[fallback] = 1.0 if left > 0 else 0.0  # no legal block stays free beside any candidate
    return _to_slice(grid, fallback)
