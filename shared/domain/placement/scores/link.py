"""Score ``link``: the mean pairwise link score of the chosen TP group (``LinkMatrix.score``: NV
link count first, same NUMA as a tie-break) over the best pair score any GPU SKU of the fleet can
offer (NV<most links of a catalog SKU in the fleet>, same NUMA). TP=1, TPU slices (ICI torus) and
multi-node fabric groups (NV<SKU links> between every pair) need no PCIe hop: a group scores by how
close it comes to the fleet's best NVLink."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Final

from shared.domain.placement.framework import SNAPSHOT, Candidate, CycleState, GpuGroup, StateKey, no_config
from shared.domain.placement.hosts import GpuHost
from shared.domain.topology import Link, LinkKind, LinkMatrix, link_score

NAME: Final = "link"
_BEST: Final[StateKey[float]] = StateKey(NAME)


def group_link_score(host: GpuHost, positions: Sequence[int]) -> float:
    """Mean pairwise link score of a group (0 for a single GPU: it has no pairs)."""
    if len(positions) < 2:
        return 0.0
    if host.matrix is None:  # multi-node fabric: NVLinked through the fabric, NUMA nodes differ
        return link_score(Link(LinkKind.NVLINK, max(1, host.sku.nvlink_links)), same_numa=False)
    return _mean_pair_score(host.matrix, tuple(host.indices[p] for p in positions))


@lru_cache(maxsize=16384)
def _mean_pair_score(matrix: LinkMatrix, group: tuple[int, ...]) -> float:
    # Pure, and a fleet repeats a few layouts and groups: memoised.
    pairs = [(a, b) for k, a in enumerate(group) for b in group[k + 1 :]]
    return sum(matrix.score(a, b) for a, b in pairs) / len(pairs)


class LinkScore:
    name: Final = NAME

    def prescore(self, state: CycleState, candidates: Sequence[Candidate]) -> None:
        if state.get(_BEST) is None:
            skus = state.read(SNAPSHOT).skus.values()
            links = max((s.nvlink_links for s in skus if not s.is_tpu), default=1)
            state.write(_BEST, link_score(Link(LinkKind.NVLINK, max(1, links)), same_numa=True))

    def score(self, state: CycleState, candidate: Candidate) -> float:
        host, group = candidate.host, candidate.binding
        if not isinstance(host, GpuHost) or not isinstance(group, GpuGroup) or len(group.positions) < 2:
            return 1.0
        return min(1.0, group_link_score(host, group.positions) / state.read(_BEST))


def factory(config: Mapping[str, object] | None = None) -> LinkScore:
    no_config(NAME, config)
    return LinkScore()
