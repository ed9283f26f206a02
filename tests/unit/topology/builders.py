"""Small builders for topology tests: a node from an NVLink edge list, fixture text."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from shared.domain.topology import Link, LinkKind, LinkMatrix, parse_link

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "topo"


def fixture_text(name: str) -> str:
    # newline="" keeps CRLF fixtures as they are on disk.
    with (FIXTURES / name).open(encoding="utf-8", newline="") as handle:
        return handle.read()


def node(
    gpus: int,
    nv: Mapping[tuple[int, int], int] | None = None,
    *,
    numa: Sequence[int | None] | None = None,
    other: str = "SYS",
) -> LinkMatrix:
    """A node whose pairs in `nv` are NV<n> (either order) and every other pair `other`."""
    edges = {(min(i, j), max(i, j)): n for (i, j), n in (nv or {}).items()}
    rows: list[tuple[Link, ...]] = []
    for i in range(gpus):
        row: list[Link] = []
        for j in range(gpus):
            if i == j:
                row.append(Link(LinkKind.SELF))
            elif (min(i, j), max(i, j)) in edges:
                row.append(Link(LinkKind.NVLINK, edges[(min(i, j), max(i, j))]))
            else:
                row.append(parse_link(other))
        rows.append(tuple(row))
    return LinkMatrix(tuple(rows), tuple(numa) if numa is not None else ())


def clique_edges(members: Sequence[int], links: int) -> dict[tuple[int, int], int]:
    """NV<links> between every pair of `members`."""
    return {(a, b): links for k, a in enumerate(members) for b in members[k + 1 :]}
