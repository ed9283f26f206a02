"""NVLink domains, maximal cliques, node kinds, TP group choice and multi-node fabric domains."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.domain.topology import (
    DomainKind,
    FabricGpu,
    FabricState,
    GpuFabricInfo,
    GpuRef,
    LinkMatrix,
    NodeKind,
    best_tp_group,
    classify_node,
    describe_node,
    four_plus_four,
    largest_free_clique,
    link_rank,
    maximal_nvlink_cliques,
    multi_node_domains,
    nvlink_domains,
    nvlink_pairs,
    nvswitch,
    parse_topo_matrix,
    pcie_only,
)
from tests.unit.topology.builders import clique_edges, fixture_text, node

HALVES = [0, 0, 0, 0, 1, 1, 1, 1]

# DGX-1 (V100) hybrid cube mesh, as NVIDIA documents it and go-gpuallocator models it:
# two quads with NV1/NV2 inside, and GPU i <-> i+4 across (NV2 for 0-4 and 1-5, NV1 for 2-6 and 3-7).
DGX1_V100 = {
    (0, 1): 1, (0, 2): 1, (0, 3): 2, (1, 2): 2, (1, 3): 1, (2, 3): 2,
    (4, 5): 1, (4, 6): 1, (4, 7): 2, (5, 6): 2, (5, 7): 1, (6, 7): 2,
    (0, 4): 2, (1, 5): 2, (2, 6): 1, (3, 7): 1,
}  # fmt: skip


def cube_mesh() -> LinkMatrix:
    return node(8, DGX1_V100, numa=HALVES)


# --- domains, cliques and node kinds ---------------------------------------------------------

KIND_CASES = [
    # (id, matrix, node kind, [(domain gpus, domain kind)], maximal cliques)
    ("nvswitch-8", nvswitch(), NodeKind.FULLY_CONNECTED,
     [((0, 1, 2, 3, 4, 5, 6, 7), DomainKind.FULLY_CONNECTED)], [(0, 1, 2, 3, 4, 5, 6, 7)]),
    ("4+4", four_plus_four(), NodeKind.FOUR_PLUS_FOUR,
     [((0, 1, 2, 3), DomainKind.FULLY_CONNECTED), ((4, 5, 6, 7), DomainKind.FULLY_CONNECTED)],
     [(0, 1, 2, 3), (4, 5, 6, 7)]),
    ("3+3", node(6, {**clique_edges([0, 1, 2], 4), **clique_edges([3, 4, 5], 4)}), NodeKind.FOUR_PLUS_FOUR,
     [((0, 1, 2), DomainKind.FULLY_CONNECTED), ((3, 4, 5), DomainKind.FULLY_CONNECTED)],
     [(0, 1, 2), (3, 4, 5)]),
    ("pairs", nvlink_pairs(), NodeKind.PAIRS,
     [((0, 1), DomainKind.PAIR), ((2, 3), DomainKind.PAIR), ((4, 5), DomainKind.PAIR), ((6, 7), DomainKind.PAIR)],
     [(0, 1), (2, 3), (4, 5), (6, 7)]),
    ("pcie", pcie_only(4), NodeKind.NONE,
     [((0,), DomainKind.SINGLE), ((1,), DomainKind.SINGLE), ((2,), DomainKind.SINGLE), ((3,), DomainKind.SINGLE)],
     []),
    ("dgx1-v100", cube_mesh(), NodeKind.MESH,
     [((0, 1, 2, 3, 4, 5, 6, 7), DomainKind.PARTIAL)],
     [(0, 1, 2, 3), (4, 5, 6, 7), (0, 4), (1, 5), (2, 6), (3, 7)]),
    ("one-gpu", node(1), NodeKind.NONE, [((0,), DomainKind.SINGLE)], []),
    ("one-pair", node(2, {(0, 1): 4}), NodeKind.FULLY_CONNECTED, [((0, 1), DomainKind.PAIR)], [(0, 1)]),
    ("pair+loose", node(4, {(1, 2): 4}), NodeKind.MIXED,
     [((0,), DomainKind.SINGLE), ((1, 2), DomainKind.PAIR), ((3,), DomainKind.SINGLE)], [(1, 2)]),
    ("quad+pair", node(6, {**clique_edges([0, 1, 2, 3], 6), (4, 5): 6}), NodeKind.MIXED,
     [((0, 1, 2, 3), DomainKind.FULLY_CONNECTED), ((4, 5), DomainKind.PAIR)], [(0, 1, 2, 3), (4, 5)]),
    ("two-chains", node(6, {(0, 1): 1, (1, 2): 1, (3, 4): 1, (4, 5): 1}), NodeKind.MIXED,
     [((0, 1, 2), DomainKind.PARTIAL), ((3, 4, 5), DomainKind.PARTIAL)], [(0, 1), (1, 2), (3, 4), (4, 5)]),
]  # fmt: skip


@pytest.mark.parametrize(("name", "matrix", "kind", "domains", "cliques"), KIND_CASES, ids=[c[0] for c in KIND_CASES])
def test_domains_and_kinds(
    name: str,
    matrix: LinkMatrix,
    kind: NodeKind,
    domains: list[tuple[tuple[int, ...], DomainKind]],
    cliques: list[tuple[int, ...]],
) -> None:
    assert classify_node(matrix) == kind
    assert [(domain.gpus, domain.kind) for domain in nvlink_domains(matrix)] == domains
    assert list(maximal_nvlink_cliques(matrix)) == cliques
    summary = describe_node(matrix)
    assert (summary.kind, summary.cliques) == (kind, tuple(cliques))


@pytest.mark.parametrize(
    ("fixture", "kind", "max_tp"),
    [
        ("tab_nic_legend.txt", NodeKind.FULLY_CONNECTED, 4),
        ("four_plus_four.txt", NodeKind.FOUR_PLUS_FOUR, 4),
        ("pairs.txt", NodeKind.PAIRS, 2),
        ("pcie_only_crlf.txt", NodeKind.NONE, 1),
        ("cube_mesh.txt", NodeKind.MESH, 4),
        ("numa_na_padding.txt", NodeKind.FULLY_CONNECTED, 2),
    ],
)
def test_fixture_node_kinds(fixture: str, kind: NodeKind, max_tp: int) -> None:
    summary = describe_node(parse_topo_matrix(fixture_text(fixture)).matrix)
    assert (summary.kind, summary.max_tp_size) == (kind, max_tp)


def test_domain_cliques_stay_inside_their_domain() -> None:
    quad, pair = nvlink_domains(node(6, {**clique_edges([0, 1, 2, 3], 6), (4, 5): 6}))
    assert (quad.cliques, quad.max_tp_size) == (((0, 1, 2, 3),), 4)
    assert (pair.cliques, pair.max_tp_size) == (((4, 5),), 2)
    (loose, *_) = nvlink_domains(pcie_only(2))
    assert (loose.cliques, loose.max_tp_size) == ((), 1)


# --- TP groups ---------------------------------------------------------------------------------

ALL8 = range(8)

TP_CASES = [
    # (id, matrix, free GPUs, size, expected group) -- why, with the arithmetic
    # NVSwitch, all free: every pair NV18 (rank 23); same-NUMA pairs decide -> the NUMA-0 quad (6 pairs vs <= 3).
    ("nvswitch tp4", nvswitch(), ALL8, 4, (0, 1, 2, 3)),
    ("nvswitch tp8", nvswitch(), ALL8, 8, tuple(ALL8)),
    ("nvswitch tp8 one busy", nvswitch(), range(1, 8), 8, None),
    # 16 GPUs behind NVSwitch (DGX-2 style): the NUMA-0 half 0..7 has 28 same-NUMA pairs.
    ("nvswitch-16 tp8", nvswitch(16, 6), range(16), 8, tuple(range(8))),
    # Odd GPUs free: 1,3,5,7 on NUMA 0 (6 same-NUMA pairs) beat any mix.
    ("nvswitch-16 tp4 odd", nvswitch(16, 6), range(1, 16, 2), 4, (1, 3, 5, 7)),
    # Free {2,3} on NUMA 0 and {4..7} on NUMA 1: (2,3) leaves 4 free together, (4,5) leaves 4 too
    # (NVSwitch: any free set is a clique); equal keys -> lowest indices.
    ("nvswitch tp2 ties", nvswitch(), [2, 3, 4, 5, 6, 7], 2, (2, 3)),
    # 4+4: a TP group never crosses the SYS link between the quads.
    ("4+4 tp8", four_plus_four(), ALL8, 8, None),
    ("4+4 tp5", four_plus_four(), ALL8, 5, None),
    ("4+4 tp4", four_plus_four(), ALL8, 4, (0, 1, 2, 3)),
    # Free {0,1} + {4..7}, TP=2: (0,1) leaves the quad 4-7 whole (4 free); (4,5) leaves at most 2.
    ("4+4 keep quad", four_plus_four(), [0, 1, 4, 5, 6, 7], 2, (0, 1)),
    # TP=1 with {0..3} + {4} free: taking 4 leaves the quad (4); taking 0 leaves 3.
    ("4+4 tp1 best fit", four_plus_four(), [0, 1, 2, 3, 4], 1, (4,)),
    ("pairs tp2", nvlink_pairs(), [1, 2, 3, 5], 2, (2, 3)),
    ("pairs tp4", nvlink_pairs(), ALL8, 4, None),
    ("pcie tp2", pcie_only(), ALL8, 2, None),
    ("pcie tp1", pcie_only(), [3, 6], 1, (3,)),
    # Cube mesh TP=2: NV2 (rank 7) beats NV1 (6); among same-NUMA NV2 pairs all leave a quad -> lowest (0,3).
    ("dgx1 tp2", cube_mesh(), ALL8, 2, (0, 3)),
    # Quads tie: 0-1 NV1 6 + 0-2 NV1 6 + 0-3 NV2 7 + 1-2 NV2 7 + 1-3 NV1 6 + 2-3 NV2 7 = 39 each.
    ("dgx1 tp4", cube_mesh(), ALL8, 4, (0, 1, 2, 3)),
    ("dgx1 tp4 quad0 broken", cube_mesh(), [1, 2, 3, 4, 5, 6, 7], 4, (4, 5, 6, 7)),
    ("dgx1 tp8", cube_mesh(), ALL8, 8, None),
    # Free {0,4,5}: 0-4 NV2 (rank 7, across NUMA) beats 4-5 NV1 (rank 6, same NUMA); 0-5 is SYS.
    ("dgx1 cross", cube_mesh(), [0, 4, 5], 2, (0, 4)),
    # Link count beats NUMA: 0-1 NV2 across NUMA (7) > 1-2 NV1 same NUMA (6.5 as a pair score).
    ("nv beats numa", node(3, {(0, 1): 2, (1, 2): 1}, numa=[0, 1, 1]), range(3), 2, (0, 1)),
    # Equal links, NUMA decides: NV4 everywhere, (0,2) share NUMA 0.
    ("numa decides", node(4, clique_edges([0, 1, 2, 3], 4), numa=[0, 1, 0, 1]), range(4), 2, (0, 2)),
    ("not enough free", nvswitch(), [0, 1], 4, None),
]


@pytest.mark.parametrize(("name", "matrix", "free", "size", "expected"), TP_CASES, ids=[c[0] for c in TP_CASES])
def test_best_tp_group(
    name: str, matrix: LinkMatrix, free: Sequence[int], size: int, expected: tuple[int, ...] | None
) -> None:
    assert best_tp_group(matrix, free, size) == expected


def test_tp_group_arguments_checked() -> None:
    with pytest.raises(ValueError, match="at least one GPU"):
        best_tp_group(nvswitch(), ALL8, 0)
    with pytest.raises(ValueError, match=r"GPUs \[8\] are not on this 8-GPU node"):
        best_tp_group(nvswitch(), [7, 8], 2)
    with pytest.raises(ValueError):
        largest_free_clique(nvswitch(), [-1])


@pytest.mark.parametrize(
    ("matrix", "free", "expected"),
    [
        (nvswitch(), ALL8, 8),
        (four_plus_four(), [0, 1, 4, 5, 6], 3),
        (cube_mesh(), [0, 4, 5, 6], 3),  # 4-5-6 is a clique (NV1, NV1, NV2); 0 only reaches 4
        (pcie_only(), [2, 5], 1),
        (pcie_only(), [], 0),
    ],
)
def test_largest_free_clique(matrix: LinkMatrix, free: Sequence[int], expected: int) -> None:
    assert largest_free_clique(matrix, free) == expected


# --- multi-node fabric domains -----------------------------------------------------------------

CLUSTER = "3f2a9c1e-0000-4b6d-9e8f-0123456789ab"
ZERO = "00000000-0000-0000-0000-000000000000"


@pytest.mark.parametrize(
    ("fabric", "multi"),
    [
        (GpuFabricInfo(CLUSTER, 7, FabricState.COMPLETED), True),
        (GpuFabricInfo(ZERO, 0, FabricState.COMPLETED), False),  # single-node HGX with Fabric Manager
        (GpuFabricInfo("", 0, FabricState.COMPLETED), False),
        (GpuFabricInfo(CLUSTER, 7, FabricState.IN_PROGRESS), False),
        (GpuFabricInfo(CLUSTER, 7, FabricState.NOT_SUPPORTED), False),
        (GpuFabricInfo(CLUSTER, 7, FabricState.COMPLETED, status_ok=False), False),
    ],
)
def test_fabric_is_multi_node(fabric: GpuFabricInfo, multi: bool) -> None:
    assert fabric.is_multi_node is multi


def _tray(node_id: str, fabric: GpuFabricInfo | None, gpus: int = 4) -> list[FabricGpu]:
    return [FabricGpu(GpuRef(node_id, index), fabric) for index in range(gpus)]


def test_multi_node_domains_group_by_cluster_and_clique() -> None:
    clique7 = GpuFabricInfo(CLUSTER, 7, FabricState.COMPLETED)
    clique7_undashed = GpuFabricInfo(CLUSTER.replace("-", "").upper(), 7, FabricState.COMPLETED)
    clique8 = GpuFabricInfo(CLUSTER, 8, FabricState.COMPLETED)
    members = [
        *_tray("tray-b", clique7_undashed),
        *_tray("tray-a", clique7),
        *_tray("tray-c", clique8, gpus=2),
        *_tray("hgx-1", GpuFabricInfo(ZERO, 0, FabricState.COMPLETED), gpus=8),
        *_tray("tray-d", GpuFabricInfo(CLUSTER, 7, FabricState.IN_PROGRESS)),
        *_tray("pcie-1", None),
        FabricGpu(GpuRef("tray-a", 0), clique7),  # reported twice: counted once
    ]
    seven, eight = multi_node_domains(members)
    assert (seven.clique_id, seven.nodes, len(seven.gpus)) == (7, ("tray-a", "tray-b"), 8)  # 2 trays x 4
    assert seven.gpus[0] == GpuRef("tray-a", 0) and seven.gpus[-1] == GpuRef("tray-b", 3)
    assert seven.cluster_uuid == CLUSTER.replace("-", "")
    assert seven.kind is DomainKind.MULTI_NODE
    assert (eight.clique_id, eight.nodes, len(eight.gpus)) == (8, ("tray-c",), 2)


def test_fabric_makes_a_node_multi_node() -> None:
    tray = nvswitch(4)
    assert classify_node(tray) == NodeKind.FULLY_CONNECTED
    fabrics = [GpuFabricInfo(CLUSTER, 7, FabricState.COMPLETED)] * 4
    assert classify_node(tray, fabrics) == NodeKind.MULTI_NODE
    assert classify_node(tray, [GpuFabricInfo(ZERO, 0, FabricState.COMPLETED)] * 4) == NodeKind.FULLY_CONNECTED


# --- properties ------------------------------------------------------------------------------


@st.composite
def nv_graphs(draw: st.DrawFn) -> LinkMatrix:
    gpus = draw(st.integers(min_value=1, max_value=9))
    pairs = [(i, j) for i in range(gpus) for j in range(i + 1, gpus)]
    counts = draw(st.lists(st.sampled_from([0, 0, 0, 1, 2, 4, 12, 18]), min_size=len(pairs), max_size=len(pairs)))
    numa = draw(st.lists(st.sampled_from([0, 1, None]), min_size=gpus, max_size=gpus))
    other = draw(st.sampled_from(["PIX", "PXB", "PHB", "NODE", "SYS"]))
    return node(gpus, {pair: n for pair, n in zip(pairs, counts, strict=True) if n}, numa=numa, other=other)


def _is_clique(matrix: LinkMatrix, group: Sequence[int]) -> bool:
    return all(matrix.is_nvlinked(a, b) for a, b in itertools.combinations(group, 2))


def _key(matrix: LinkMatrix, group: Sequence[int], free: set[int]) -> tuple[int, int, int]:
    ranks = sum(link_rank(matrix.link(a, b)) for a, b in itertools.combinations(group, 2))
    numa = sum(matrix.same_numa(a, b) for a, b in itertools.combinations(group, 2))
    return ranks, numa, _brute_largest_clique(matrix, free - set(group))


def _brute_largest_clique(matrix: LinkMatrix, gpus: set[int]) -> int:
    for size in range(len(gpus), 0, -1):
        if any(_is_clique(matrix, group) for group in itertools.combinations(sorted(gpus), size)):
            return size
    return 0


@settings(max_examples=150, deadline=None)
@given(nv_graphs())
def test_domains_partition_the_gpus_and_never_share_an_nv_edge(matrix: LinkMatrix) -> None:
    domains = nvlink_domains(matrix)
    seen = sorted(gpu for domain in domains for gpu in domain.gpus)
    assert seen == list(range(matrix.gpu_count))
    where = {gpu: k for k, domain in enumerate(domains) for gpu in domain.gpus}
    for a, b in itertools.combinations(range(matrix.gpu_count), 2):
        if matrix.is_nvlinked(a, b):
            assert where[a] == where[b]
    for domain in domains:
        assert (domain.kind is DomainKind.SINGLE) == (len(domain.gpus) == 1)


@settings(max_examples=150, deadline=None)
@given(nv_graphs())
def test_maximal_cliques_are_cliques_and_maximal(matrix: LinkMatrix) -> None:
    cliques = maximal_nvlink_cliques(matrix)
    for clique in cliques:
        assert _is_clique(matrix, clique)
        outside = set(range(matrix.gpu_count)) - set(clique)
        assert not any(_is_clique(matrix, (*clique, v)) for v in outside)
    for a, b in itertools.combinations(range(matrix.gpu_count), 2):
        if matrix.is_nvlinked(a, b):
            assert any(a in clique and b in clique for clique in cliques)


@settings(max_examples=200, deadline=None)
@given(nv_graphs(), st.data())
def test_tp_group_is_a_free_clique_with_the_best_key(matrix: LinkMatrix, data: st.DataObject) -> None:
    free = set(data.draw(st.sets(st.integers(0, matrix.gpu_count - 1))))
    size = data.draw(st.integers(1, max(1, matrix.gpu_count)))
    group = best_tp_group(matrix, free, size)
    options = [g for g in itertools.combinations(sorted(free), size) if _is_clique(matrix, g)]
    if not options:
        assert group is None
        return
    assert group is not None
    assert len(group) == size and set(group) <= free and _is_clique(matrix, group)
    assert len({domain.gpus for domain in nvlink_domains(matrix) if set(group) & set(domain.gpus)}) == 1
    best = max(_key(matrix, option, free) for option in options)
    assert _key(matrix, group, free) == best
    assert group == min(option for option in options if _key(matrix, option, free) == best)
    assert largest_free_clique(matrix, free) == _brute_largest_clique(matrix, free)
