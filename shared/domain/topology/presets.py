"""Link matrices for the node layouts seen in practice, for demo fleets, tests and benchmarks.

Every preset puts the first half of the GPUs on NUMA node 0 and the second half on NUMA node
1 (GPU i is on node `2 * i // gpus`). Builders are cached: equal arguments return the same
immutable `LinkMatrix`, so a fleet of 1,024 identical nodes holds one matrix, not 1,024.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

from shared.domain.topology.links import Link, LinkKind, LinkMatrix
from shared.domain.topology.topo_text import ParsedTopology

PRESET_NAMES = ("nvswitch-8", "4+4", "pairs", "pcie")

_SELF = Link(LinkKind.SELF)


def _numa(gpus: int) -> tuple[int, ...]:
    return tuple(2 * i // gpus for i in range(gpus))


def _build(gpus: int, cell: Callable[[int, int, bool], Link]) -> LinkMatrix:
    """A matrix whose off-diagonal cell (i < j) is `cell(i, j, same_numa)`, mirrored below."""
    if gpus < 1:
        raise ValueError(f"a node needs at least one GPU, got {gpus}")
    numa = _numa(gpus)
    upper = {(i, j): cell(i, j, numa[i] == numa[j]) for i in range(gpus) for j in range(i + 1, gpus)}
    rows = tuple(tuple(_SELF if i == j else upper[(min(i, j), max(i, j))] for j in range(gpus)) for i in range(gpus))
    return LinkMatrix(rows, numa)


def _require_even(gpus: int, layout: str) -> None:
    if gpus < 2 or gpus % 2:
        raise ValueError(f"{layout} needs an even number of GPUs >= 2, got {gpus}")


# One cache entry per (layout, gpus, nv_links), however the public builder was called:
# keyword, positional or default arguments all land on the same shared matrix.
@lru_cache(maxsize=256)
def _cached(layout: str, gpus: int, nv_links: int) -> LinkMatrix:
    if layout in ("4+4", "pairs"):
        _require_even(gpus, layout)
    if layout == "pcie":
        return _build(gpus, _pcie_cell)
    nv = Link(LinkKind.NVLINK, nv_links)
    phb, sys = Link(LinkKind.PHB), Link(LinkKind.SYS)
    if layout == "nvswitch":
        return _build(gpus, lambda _i, _j, _same: nv)
    if layout == "4+4":
        return _build(gpus, lambda _i, _j, same: nv if same else sys)
    return _build(gpus, lambda i, j, same: nv if i // 2 == j // 2 else phb if same else sys)


def _pcie_cell(i: int, j: int, same: bool) -> Link:
    if not same:
        return Link(LinkKind.SYS)
    if i // 2 == j // 2:
        return Link(LinkKind.PIX)
    if i // 4 == j // 4:
        return Link(LinkKind.PXB)
    return Link(LinkKind.NODE)


def nvswitch(gpus: int = 8, nv_links: int = 18) -> LinkMatrix:
    """`nvswitch-8`: every pair `NV<nv_links>` through NVSwitch. 18 links is H100/H200 SXM
    (HGX/DGX); use 12 for A100 SXM, 6 for V100 on NVSwitch (DGX-2)."""
    return _cached("nvswitch", gpus, _positive(nv_links))


def four_plus_four(gpus: int = 8, nv_links: int = 12) -> LinkMatrix:
    """`4+4`: two fully NVLinked groups (the NUMA halves: 0-3 and 4-7 for 8 GPUs), `NV<n>`
    inside a group and `SYS` between groups (they meet only over PCIe and the CPU link)."""
    return _cached("4+4", gpus, _positive(nv_links))


def nvlink_pairs(gpus: int = 8, nv_links: int = 4) -> LinkMatrix:
    """`pairs`: PCIe cards with NVLink bridges, GPU 2k <-> 2k+1 `NV<n>`; other pairs `PHB`
    on the same NUMA node and `SYS` across NUMA nodes."""
    return _cached("pairs", gpus, _positive(nv_links))


def pcie_only(gpus: int = 8) -> LinkMatrix:
    """`pcie`: no NVLink (L40S-style). Within a NUMA half, GPUs 2k and 2k+1 share a PCIe switch
    (`PIX`), GPUs of one group of four share a bridge (`PXB`), the rest meet at the host
    bridges (`NODE`, from 16 GPUs up); across NUMA halves `SYS`."""
    return _cached("pcie", gpus, 0)


def _positive(nv_links: int) -> int:
    if nv_links < 1:
        raise ValueError(f"an NVLink preset needs nv_links >= 1, got {nv_links}")
    return nv_links


def preset(name: str, *, gpus: int = 8, nv_links: int | None = None) -> LinkMatrix:
    """The matrix of a named preset (`PRESET_NAMES`); `nv_links` None takes the preset's
    default. Raises `ValueError` for an unknown name, or `nv_links` given to `pcie`."""
    if name == "nvswitch-8":
        return nvswitch(gpus) if nv_links is None else nvswitch(gpus, nv_links)
    if name == "4+4":
        return four_plus_four(gpus) if nv_links is None else four_plus_four(gpus, nv_links)
    if name == "pairs":
        return nvlink_pairs(gpus) if nv_links is None else nvlink_pairs(gpus, nv_links)
    if name == "pcie":
        if nv_links is not None:
            raise ValueError("the pcie preset has no NVLink")
        return pcie_only(gpus)
    raise ValueError(f"unknown topology preset {name!r}; known: {', '.join(PRESET_NAMES)}")


def from_parsed(parsed: ParsedTopology) -> LinkMatrix:
    """The link matrix of a parsed `nvidia-smi topo -m`, with each GPU's NUMA node where its
    NUMA affinity names exactly one node."""
    return parsed.matrix
