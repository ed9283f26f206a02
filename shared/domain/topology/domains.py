"""NVLink domains, maximal NVLink cliques and tensor-parallel group choice on one node,
and multi-node NVLink domains from NVML fabric info.

Vocabulary (DESIGN.md §2): an NVLink domain is a connected component of the NVLink graph; a
TP group must be a clique of that graph (every pair NVLinked), so it never spans domains.
Graphs are small (a node has at most a few dozen GPUs): everything runs on int bitmasks.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

from shared.domain.topology.links import LinkMatrix, link_rank


class DomainKind(StrEnum):
    """What one NVLink domain is."""

    FULLY_CONNECTED = "fully_connected"  # >= 3 GPUs, every pair NVLinked (NVSwitch, 4-GPU boards)
    PAIR = "pair"  # exactly two GPUs NVLinked to each other (bridged PCIe cards)
    PARTIAL = "partial"  # connected but not every pair NVLinked (DGX-1 hybrid cube mesh)
    SINGLE = "single"  # one GPU with no NVLink to any other GPU on the node
    MULTI_NODE = "multi_node"  # GPUs on several hosts in one NVLink fabric clique (NVL72)


class NodeKind(StrEnum):
    """What a node's NVLink layout is, as a whole."""

    FULLY_CONNECTED = "fully_connected"  # one domain of >= 2 GPUs, all pairs NVLinked (NVSwitch 8)
    FOUR_PLUS_FOUR = "4+4"  # >= 2 disjoint fully connected groups of equal size >= 3, nothing else
    PAIRS = "pairs"  # >= 2 NVLinked pairs and nothing else
    NONE = "none"  # no NVLink at all (PCIe only, or a single GPU)
    MESH = "mesh"  # one domain holding every GPU that is not a clique (hybrid cube mesh)
    MULTI_NODE = "multi_node"  # some GPU reports a multi-node fabric (GH200 NVL32, GB200 NVL72)
    MIXED = "mixed"  # anything else, e.g. a pair plus two loose GPUs


@dataclass(frozen=True, slots=True)
class NvlinkDomain:
    """One connected component of a node's NVLink graph (a lone GPU is a `single` domain).

    `cliques` are the domain's maximal all-pairs-NVLinked groups of >= 2 GPUs, largest first.
    """

    gpus: tuple[int, ...]
    kind: DomainKind
    cliques: tuple[tuple[int, ...], ...]

    @property
    def max_tp_size(self) -> int:
        """The largest TP group this domain can host (1 for a lone GPU)."""
        return max((len(clique) for clique in self.cliques), default=1)


@dataclass(frozen=True, slots=True)
class NodeTopology:
    """A node's NVLink summary: its kind, domains (by lowest GPU) and maximal cliques."""

    kind: NodeKind
    domains: tuple[NvlinkDomain, ...]
    cliques: tuple[tuple[int, ...], ...]

    @property
    def max_tp_size(self) -> int:
        return max((domain.max_tp_size for domain in self.domains), default=0)


def _bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _mask(indices: Iterable[int]) -> int:
    return sum(1 << i for i in set(indices))


@lru_cache(maxsize=1024)
def _maximal_clique_masks(adjacency: tuple[int, ...]) -> tuple[int, ...]:
    """Every maximal clique (isolated GPUs included) by Bron-Kerbosch with pivoting."""
    found: list[int] = []

    def expand(chosen: int, candidates: int, excluded: int) -> None:
        if not candidates and not excluded:
            found.append(chosen)
            return
        # Pivot on the vertex with most neighbours among the candidates: it prunes most branches.
        pivot = max(_bits(candidates | excluded), key=lambda u: (candidates & adjacency[u]).bit_count())
        for v in _bits(candidates & ~adjacency[pivot]):
            bit = 1 << v
            expand(chosen | bit, candidates & adjacency[v], excluded & adjacency[v])
            candidates &= ~bit
            excluded |= bit

    expand(0, (1 << len(adjacency)) - 1, 0)
    return tuple(found)


def _sorted_groups(masks: Iterable[int]) -> tuple[tuple[int, ...], ...]:
    groups = (tuple(_bits(mask)) for mask in masks)
    return tuple(sorted(groups, key=lambda group: (-len(group), group)))


def maximal_nvlink_cliques(matrix: LinkMatrix) -> tuple[tuple[int, ...], ...]:
    """The maximal all-pairs-NVLinked GPU groups of size >= 2, largest first, then by indices.

    A DGX-1 cube mesh gives ((0,1,2,3), (4,5,6,7), (0,4), (1,5), (2,6), (3,7)).
    """
    return _sorted_groups(mask for mask in _maximal_clique_masks(matrix.nv_masks) if mask.bit_count() >= 2)


def _components(adjacency: Sequence[int]) -> list[int]:
    seen = 0
    components: list[int] = []
    for start in range(len(adjacency)):
        if seen >> start & 1:
            continue
        component, frontier = 0, 1 << start
        while frontier:
            component |= frontier
            reach = 0
            for v in _bits(frontier):
                reach |= adjacency[v]
            frontier = reach & ~component
        seen |= component
        components.append(component)
    return components


def _is_clique(mask: int, adjacency: Sequence[int]) -> bool:
    return all(mask & ~(1 << v) & ~adjacency[v] == 0 for v in _bits(mask))


def _domain_kind(mask: int, adjacency: Sequence[int]) -> DomainKind:
    size = mask.bit_count()
    if size == 1:
        return DomainKind.SINGLE
    if not _is_clique(mask, adjacency):
        return DomainKind.PARTIAL
    return DomainKind.PAIR if size == 2 else DomainKind.FULLY_CONNECTED


def nvlink_domains(matrix: LinkMatrix) -> tuple[NvlinkDomain, ...]:
    """The node's NVLink domains: they partition the GPUs, ordered by lowest GPU index."""
    adjacency = matrix.nv_masks
    cliques = [mask for mask in _maximal_clique_masks(adjacency) if mask.bit_count() >= 2]
    return tuple(
        NvlinkDomain(
            gpus=tuple(_bits(component)),
            kind=_domain_kind(component, adjacency),
            cliques=_sorted_groups(clique for clique in cliques if clique & component),
        )
        for component in _components(adjacency)
    )


def classify_node(matrix: LinkMatrix, fabrics: Sequence[GpuFabricInfo | None] = ()) -> NodeKind:
    """The node's `NodeKind`. Rules, first match wins:

    multi_node if any GPU's fabric info is multi-node (`GpuFabricInfo.is_multi_node`);
    none if no GPU pair is NVLinked; fully_connected if one domain holds every GPU and is a
    clique (a single NVLinked pair included); mesh if one domain holds every GPU but is not a
    clique; pairs if every domain is an NVLinked pair; 4+4 if every domain is a clique of the
    same size >= 3 (two or more of them); mixed otherwise.
    """
    if any(fabric is not None and fabric.is_multi_node for fabric in fabrics):
        return NodeKind.MULTI_NODE
    domains = nvlink_domains(matrix)
    kinds = {domain.kind for domain in domains}
    sizes = {len(domain.gpus) for domain in domains}
    if kinds <= {DomainKind.SINGLE}:
        return NodeKind.NONE
    if len(domains) == 1:
        return NodeKind.MESH if kinds == {DomainKind.PARTIAL} else NodeKind.FULLY_CONNECTED
    if kinds == {DomainKind.PAIR}:
        return NodeKind.PAIRS
    if kinds == {DomainKind.FULLY_CONNECTED} and len(sizes) == 1:
        return NodeKind.FOUR_PLUS_FOUR
    return NodeKind.MIXED


def describe_node(matrix: LinkMatrix, fabrics: Sequence[GpuFabricInfo | None] = ()) -> NodeTopology:
    """Kind, domains and maximal cliques of one node in one value."""
    return NodeTopology(
        kind=classify_node(matrix, fabrics),
        domains=nvlink_domains(matrix),
        cliques=maximal_nvlink_cliques(matrix),
    )


def _free_mask(matrix: LinkMatrix, free: Iterable[int]) -> int:
    indices = set(free)
    outside = sorted(i for i in indices if not 0 <= i < matrix.gpu_count)
    if outside:
        raise ValueError(f"GPUs {outside} are not on this {matrix.gpu_count}-GPU node")
    return _mask(indices)


def largest_free_clique(matrix: LinkMatrix, free: Iterable[int]) -> int:
    """Size of the largest all-pairs-NVLinked group among the free GPUs (1 if only loose GPUs
    are free, 0 if none). Every clique of the free GPUs lies in some maximal clique of the
    node, so this is the largest intersection of a maximal clique with the free set."""
    mask = _free_mask(matrix, free)
    return max(((clique & mask).bit_count() for clique in _maximal_clique_masks(matrix.nv_masks)), default=0)


@lru_cache(maxsize=1024)
def _twin_classes(matrix: LinkMatrix) -> tuple[int, ...]:
    """GPUs that are interchangeable: same NUMA node and the same link to every other GPU.

    Swapping two twins maps the matrix onto itself, so a TP search only needs to decide how
    many GPUs to take from each class (an NVSwitch node has two classes, its NUMA halves).
    The relation is transitive, so comparing with each class's first member is enough; links
    inside a class are all equal, and so are links between two classes.
    """
    links, numa, size = matrix.links, matrix.numa, matrix.gpu_count
    firsts: list[int] = []
    classes: list[int] = []
    for v in range(size):
        for k, u in enumerate(firsts):
            if numa[u] == numa[v] and all(links[u][w] == links[v][w] for w in range(size) if w not in (u, v)):
                classes[k] |= 1 << v
                break
        else:
            firsts.append(v)
            classes.append(1 << v)
    return tuple(classes)


def _clique_choices(matrix: LinkMatrix, classes: Sequence[int], size: int) -> Iterator[int]:
    """Cliques of `size` GPUs, one per way of counting GPUs out of each (free) twin class;
    each takes the lowest-indexed members of a class, the lexicographically first choice."""
    adjacency = matrix.nv_masks
    # A class whose members are not NVLinked to each other can give at most one GPU.
    limits = [mask.bit_count() if mask.bit_count() == 1 or adjacency[_lowest(mask)] & mask else 1 for mask in classes]
    after = [sum(limits[k:]) for k in range(len(limits) + 1)]

    def choose(index: int, remaining: int, chosen: int) -> Iterator[int]:
        if remaining == 0:
            yield chosen
            return
        if after[index] < remaining:
            return
        members = classes[index]
        if chosen & ~adjacency[_lowest(members)] == 0:  # every chosen GPU NVLinks to this class
            taken = 0
            for count in range(1, min(limits[index], remaining) + 1):
                taken |= 1 << _nth_bit(members, count - 1)
                yield from choose(index + 1, remaining - count, chosen | taken)
        yield from choose(index + 1, remaining, chosen)

    return choose(0, size, 0)


def _lowest(mask: int) -> int:
    return (mask & -mask).bit_length() - 1


def _nth_bit(mask: int, n: int) -> int:
    for position, bit in enumerate(_bits(mask)):
        if position == n:
            return bit
    raise IndexError(n)


def best_tp_group(matrix: LinkMatrix, free: Iterable[int], size: int) -> tuple[int, ...] | None:
    """The best TP group of `size` GPUs among `free`, or None when no such group exists.

    Promises: every pair in the group is NVLinked (so it lies inside one NVLink domain); size
    1 takes any free GPU. Among qualifying groups the choice is, in order: the highest sum of
    pairwise `link_rank` (more NVLinks); the most same-NUMA pairs; the largest all-pairs
    NVLinked group left free afterwards (keep big groups whole); the lowest GPU indices.
    Raises `ValueError` for size < 1 or a free index outside the node.
    """
    if size < 1:
        raise ValueError(f"a TP group needs at least one GPU, got {size}")
    free_mask = _free_mask(matrix, free)
    if free_mask.bit_count() < size:
        return None
    maximal = _maximal_clique_masks(matrix.nv_masks)
    # Twins among the free GPUs stay interchangeable (swapping two free GPUs keeps the free
    # set), so counting per class covers every group up to a swap that changes no key.
    classes = [mask & free_mask for mask in _twin_classes(matrix) if mask & free_mask]
    best: tuple[int, ...] | None = None
    best_key = (0, 0, 0)
    for group in _clique_choices(matrix, classes, size):
        members = tuple(_bits(group))
        rank_sum = 0
        numa_pairs = 0
        for position, i in enumerate(members):
            for j in members[position + 1 :]:
                rank_sum += link_rank(matrix.links[i][j])
                numa_pairs += matrix.same_numa(i, j)
        left = free_mask & ~group
        key = (rank_sum, numa_pairs, max((clique & left).bit_count() for clique in maximal))
        if best is None or key > best_key or (key == best_key and members < best):
            best, best_key = members, key
    return best


# --- multi-node NVLink domains (NVML fabric info) ------------------------------------------


class FabricState(StrEnum):
    """`nvmlGpuFabricState`: only `completed` GPUs are members of their fabric clique."""

    NOT_SUPPORTED = "not_supported"
    NOT_STARTED = "not_started"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"


def _is_zero_uuid(uuid: str) -> bool:
    return all(char in "0-{}" for char in uuid.strip())


@dataclass(frozen=True, slots=True)
class GpuFabricInfo:
    """What `nvmlDeviceGetGpuFabricInfoV` reports for a GPU.

    `cluster_uuid` as text (hex, with or without dashes; all zeros on single-node systems),
    `clique_id`, `state`, and `status_ok` (the call's status field was NVML_SUCCESS).
    """

    cluster_uuid: str
    clique_id: int
    state: FabricState
    status_ok: bool = True

    @property
    def is_multi_node(self) -> bool:
        """Registered in a multi-node NVLink fabric: state completed, status OK and a non-zero
        cluster UUID (single-node HGX with Fabric Manager also reports completed, with zeros)."""
        return self.state is FabricState.COMPLETED and self.status_ok and not _is_zero_uuid(self.cluster_uuid)

    @property
    def domain_key(self) -> tuple[str, int]:
        """(normalised cluster UUID, clique id): equal keys mean one NVLink partition."""
        return self.cluster_uuid.strip().lower().replace("-", ""), self.clique_id


@dataclass(frozen=True, slots=True, order=True)
class GpuRef:
    """A GPU anywhere in the fleet: node id and the GPU's index on that node."""

    node_id: str
    gpu_index: int


@dataclass(frozen=True, slots=True)
class FabricGpu:
    """A GPU with its fabric info (None where NVML has none)."""

    gpu: GpuRef
    fabric: GpuFabricInfo | None


@dataclass(frozen=True, slots=True)
class MultiNodeDomain:
    """GPUs sharing one (cluster UUID, clique id): one NVLink domain across hosts.

    `cluster_uuid` is normalised (lower case, no dashes); `gpus` are sorted.
    """

    cluster_uuid: str
    clique_id: int
    gpus: tuple[GpuRef, ...]

    @property
    def kind(self) -> DomainKind:
        return DomainKind.MULTI_NODE

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(sorted({gpu.node_id for gpu in self.gpus}))


def multi_node_domains(gpus: Iterable[FabricGpu]) -> tuple[MultiNodeDomain, ...]:
    """Group GPUs into multi-node NVLink domains by (cluster UUID, clique id).

    Only GPUs whose fabric `is_multi_node` take part; others belong to their node's own
    domains. A domain may list one node only, when only one host has reported so far.
    Domains come sorted by (cluster UUID, clique id); a GPU listed twice counts once.
    """
    groups: dict[tuple[str, int], set[GpuRef]] = defaultdict(set)
    for entry in gpus:
        if entry.fabric is not None and entry.fabric.is_multi_node:
            groups[entry.fabric.domain_key].add(entry.gpu)
    return tuple(
        MultiNodeDomain(cluster_uuid=key[0], clique_id=key[1], gpus=tuple(sorted(members)))
        for key, members in sorted(groups.items())
    )
