"""GPU-to-GPU links in the `nvidia-smi topo -m` vocabulary, and the pairwise link score.

A link is what one cell of the topology matrix says about two devices: `X` (the device
itself), `NV<n>` (n bonded NVLinks), or the PCIe path class `PIX`, `PXB`, `PHB`, `NODE`,
`SYS` (legacy drivers print `SOC` for `SYS`). `LinkMatrix` holds those cells for the GPUs
of one node, plus each GPU's NUMA node, and answers the questions placement asks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from functools import lru_cache


class LinkKind(StrEnum):
    """The class of a topology cell; the value is the code `nvidia-smi` prints (NV without n)."""

    SELF = "X"
    NVLINK = "NV"
    PIX = "PIX"
    PXB = "PXB"
    PHB = "PHB"
    NODE = "NODE"
    SYS = "SYS"


class UnknownLinkCodeError(ValueError):
    """A cell is not one of the codes `nvidia-smi topo -m` prints."""

    def __init__(self, code: str) -> None:
        super().__init__(f"unknown link code {code!r}")
        self.code = code


# PCIe classes, nearest first; the rank is what the score builds on.
_PCIE_RANK: dict[LinkKind, int] = {
    LinkKind.SYS: 1,
    LinkKind.NODE: 2,
    LinkKind.PHB: 3,
    LinkKind.PXB: 4,
    LinkKind.PIX: 5,
}
_NVLINK_BASE_RANK = 5  # NV1 ranks 6: any NVLink beats the best PCIe path.
_SAME_NUMA_BONUS = 0.5  # below one rank step, so it only ever breaks ties.


@dataclass(frozen=True, slots=True)
class Link:
    """One matrix cell: its kind and, for NVLink, the number of bonded links (0 otherwise)."""

    kind: LinkKind
    nv_links: int = 0

    def __post_init__(self) -> None:
        if self.kind is LinkKind.NVLINK and self.nv_links < 1:
            raise ValueError("an NVLink link needs at least one link")
        if self.kind is not LinkKind.NVLINK and self.nv_links != 0:
            raise ValueError(f"{self.kind.value} carries no NVLink count")

    @property
    def code(self) -> str:
        """The cell as `nvidia-smi` prints it today (`NV18`, `PIX`, `X`; `SOC` comes back as `SYS`)."""
        if self.kind is LinkKind.NVLINK:
            return f"NV{self.nv_links}"
        return self.kind.value

    @property
    def is_nvlink(self) -> bool:
        return self.kind is LinkKind.NVLINK

    def __str__(self) -> str:
        return self.code


@lru_cache(maxsize=256)
def parse_link(code: str) -> Link:
    """Parse one cell (`X`, `NV<n>` with n >= 1, `PIX`, `PXB`, `PHB`, `NODE`, `SYS`, legacy `SOC`).

    Surrounding whitespace is ignored; codes are case-sensitive as printed. Equal codes return
    the same (immutable) object, so a fleet of identical nodes shares its links.
    Raises `UnknownLinkCodeError` (a `ValueError`) for anything else.
    """
    text = code.strip()
    if text == "SOC":  # drivers before ~2017 said SOC for the cross-socket path
        return Link(LinkKind.SYS)
    if text.startswith("NV"):
        digits = text[2:]
        if digits.isdigit() and digits.isascii() and int(digits) >= 1:
            return Link(LinkKind.NVLINK, int(digits))
        raise UnknownLinkCodeError(text)
    try:
        kind = LinkKind(text)
    except ValueError:
        raise UnknownLinkCodeError(text) from None
    if kind is LinkKind.NVLINK:  # a bare "NV" was handled above; keep mypy and readers sure
        raise UnknownLinkCodeError(text)
    return Link(kind)


def link_rank(link: Link) -> int:
    """An integer rank, higher is closer: `NV<n>` ranks 5 + n, then PIX 5, PXB 4, PHB 3, NODE 2, SYS 1.

    So every NVLink pair outranks every PCIe pair, and more bonded links outrank fewer.
    `X` (self) has no rank: asking for it is a `ValueError`.
    """
    if link.kind is LinkKind.NVLINK:
        return _NVLINK_BASE_RANK + link.nv_links
    if link.kind is LinkKind.SELF:
        raise ValueError("a GPU has no link score to itself")
    return _PCIE_RANK[link.kind]


def link_score(link: Link, *, same_numa: bool) -> float:
    """The pairwise link score; higher is better. Ordering it promises, most important first:

    1. NVLink count: `NV<n>` scores above `NV<m>` when n > m, and above every PCIe class;
    2. PCIe class: PIX > PXB > PHB > NODE > SYS;
    3. same NUMA node, as a tie-break only: +0.5, which never crosses a rank step.

    Value: `link_rank(link) + (0.5 if same_numa else 0)`, e.g. NV18 same NUMA = 23.5,
    PIX = 5.0, SYS = 1.0.
    """
    return link_rank(link) + (_SAME_NUMA_BONUS if same_numa else 0.0)


def _check_square(links: Sequence[Sequence[Link]]) -> None:
    size = len(links)
    for i, row in enumerate(links):
        if len(row) != size:
            raise ValueError(f"row GPU{i} has {len(row)} cells, expected {size}")
        for j, link in enumerate(row):
            if (i == j) != (link.kind is LinkKind.SELF):
                where = "on" if i == j else "off"
                raise ValueError(f"GPU{i}-GPU{j}: {link.code} is not allowed {where} the diagonal")
            if j < i and links[j][i] != link:
                raise ValueError(
                    f"matrix is not symmetric: GPU{j}-GPU{i} {links[j][i].code} vs GPU{i}-GPU{j} {link.code}"
                )


@dataclass(frozen=True, slots=True)
class LinkMatrix:
    """The GPU-by-GPU links of one node, indexed by GPU index, with each GPU's NUMA node.

    Invariants (checked at construction, `ValueError` otherwise): square, `X` exactly on
    the diagonal, symmetric, and `numa` is empty (unknown) or one entry per GPU (None where
    the GPU's NUMA node is unknown or spans several nodes).
    """

    links: tuple[tuple[Link, ...], ...]
    numa: tuple[int | None, ...] = ()
    # Bit j of nv_masks[i] is set when GPU i and GPU j are NVLinked: clique searches run on ints.
    nv_masks: tuple[int, ...] = field(init=False, repr=False, compare=False)
    # Matrices key analysis caches; hashing 64 links on every lookup would cost more than the lookup.
    _hash: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_square(self.links)
        if self.numa and len(self.numa) != len(self.links):
            raise ValueError(f"numa has {len(self.numa)} entries for {len(self.links)} GPUs")
        if not self.numa:
            object.__setattr__(self, "numa", (None,) * len(self.links))
        masks = tuple(sum(1 << j for j, link in enumerate(row) if link.kind is LinkKind.NVLINK) for row in self.links)
        object.__setattr__(self, "nv_masks", masks)
        object.__setattr__(self, "_hash", hash((self.links, self.numa)))

    def __hash__(self) -> int:
        return self._hash

    @classmethod
    def from_codes(cls, codes: Sequence[Sequence[str]], numa: Sequence[int | None] | None = None) -> LinkMatrix:
        """Build from printed cell codes (`[["X", "NV4"], ["NV4", "X"]]`); raises `ValueError`."""
        links = tuple(tuple(parse_link(code) for code in row) for row in codes)
        return cls(links, tuple(numa) if numa is not None else ())

    @property
    def gpu_count(self) -> int:
        return len(self.links)

    def link(self, i: int, j: int) -> Link:
        return self.links[i][j]

    def nv_links(self, i: int, j: int) -> int:
        """Bonded NVLinks between GPU i and GPU j (0 when the pair talks over PCIe)."""
        return self.links[i][j].nv_links

    def is_nvlinked(self, i: int, j: int) -> bool:
        return bool(self.nv_masks[i] >> j & 1)

    def nvlink_sum(self, i: int) -> int:
        """Total NVLinks from GPU i to the other GPUs (NV18 to 7 peers = 126)."""
        return sum(link.nv_links for link in self.links[i])

    def same_numa(self, i: int, j: int) -> bool:
        """True only when both NUMA nodes are known and equal."""
        a, b = self.numa[i], self.numa[j]
        return a is not None and a == b

    def score(self, i: int, j: int) -> float:
        """`link_score` of the pair (i != j), with its same-NUMA tie-break."""
        return link_score(self.links[i][j], same_numa=self.same_numa(i, j))

    def codes(self) -> tuple[tuple[str, ...], ...]:
        """The matrix as printed codes, for logs and tests."""
        return tuple(tuple(link.code for link in row) for row in self.links)
