"""Link codes, the pairwise link score and LinkMatrix invariants."""

from __future__ import annotations

import pytest

from shared.domain.topology import Link, LinkKind, LinkMatrix, UnknownLinkCodeError, link_rank, link_score, parse_link


@pytest.mark.parametrize(
    ("code", "kind", "nv_links"),
    [
        ("X", LinkKind.SELF, 0),
        (" X ", LinkKind.SELF, 0),  # tab-separated output pads the diagonal
        ("NV1", LinkKind.NVLINK, 1),
        ("NV18", LinkKind.NVLINK, 18),
        ("PIX", LinkKind.PIX, 0),
        ("PXB", LinkKind.PXB, 0),
        ("PHB", LinkKind.PHB, 0),
        ("NODE", LinkKind.NODE, 0),
        ("SYS", LinkKind.SYS, 0),
        ("SOC", LinkKind.SYS, 0),  # pre-2017 drivers
    ],
)
def test_parse_link(code: str, kind: LinkKind, nv_links: int) -> None:
    link = parse_link(code)
    assert (link.kind, link.nv_links) == (kind, nv_links)


@pytest.mark.parametrize("code", ["NV", "NV0", "NVX", "NV-1", "nv4", "PCI", "", "N/A", "0-7"])
def test_parse_link_rejects(code: str) -> None:
    with pytest.raises(UnknownLinkCodeError, match="unknown link code"):
        parse_link(code)


def test_soc_prints_as_sys_and_links_are_shared() -> None:
    assert parse_link("SOC").code == "SYS"
    assert parse_link("NV4") is parse_link("NV4")  # one object per code across a fleet


def test_link_value_checks_nv_count() -> None:
    with pytest.raises(ValueError):
        Link(LinkKind.NVLINK, 0)
    with pytest.raises(ValueError):
        Link(LinkKind.PIX, 2)


def test_rank_orders_nvlink_count_then_pcie_class() -> None:
    codes_best_first = ["NV18", "NV12", "NV2", "NV1", "PIX", "PXB", "PHB", "NODE", "SYS"]
    ranks = [link_rank(parse_link(code)) for code in codes_best_first]
    assert ranks == sorted(ranks, reverse=True)
    assert len(set(ranks)) == len(ranks)
    # NV<n> ranks 5 + n: NV18 = 23, NV1 = 6 > PIX = 5.
    assert (ranks[0], ranks[3], ranks[4]) == (23, 6, 5)


@pytest.mark.parametrize(
    ("better", "worse"),
    [
        (("NV2", False), ("NV1", True)),  # a link more beats same-NUMA
        (("PIX", False), ("PXB", True)),
        (("NODE", False), ("SYS", True)),
        (("NV4", True), ("NV4", False)),  # same NUMA only breaks ties
        (("SYS", True), ("SYS", False)),
    ],
)
def test_link_score_order(better: tuple[str, bool], worse: tuple[str, bool]) -> None:
    assert link_score(parse_link(better[0]), same_numa=better[1]) > link_score(parse_link(worse[0]), same_numa=worse[1])


def test_link_score_values_and_self() -> None:
    # NV18 same NUMA = 5 + 18 + 0.5
    assert link_score(parse_link("NV18"), same_numa=True) == 23.5
    with pytest.raises(ValueError):
        link_score(parse_link("X"), same_numa=True)


def test_matrix_queries() -> None:
    matrix = LinkMatrix.from_codes([["X", "NV4", "SYS"], ["NV4", "X", "PIX"], ["SYS", "PIX", "X"]], [0, 0, 1])
    assert matrix.gpu_count == 3
    assert matrix.is_nvlinked(0, 1) and not matrix.is_nvlinked(1, 2)
    assert matrix.nv_links(1, 0) == 4
    assert [matrix.nvlink_sum(i) for i in range(3)] == [4, 4, 0]
    assert matrix.same_numa(0, 1) and not matrix.same_numa(1, 2)
    assert matrix.score(0, 1) == 9.5  # NV4: 5 + 4, same NUMA +0.5
    assert matrix.score(1, 2) == 5.0  # PIX, NUMA 0 vs 1
    assert matrix.codes()[1] == ("NV4", "X", "PIX")
    assert matrix.nv_masks == (0b010, 0b001, 0b000)


def test_unknown_numa_is_never_same() -> None:
    matrix = LinkMatrix.from_codes([["X", "PIX"], ["PIX", "X"]])
    assert matrix.numa == (None, None)
    assert not matrix.same_numa(0, 1)


@pytest.mark.parametrize(
    ("codes", "message"),
    [
        ([["X", "NV4"], ["NV2", "X"]], "not symmetric"),
        ([["NV4", "NV4"], ["NV4", "X"]], "diagonal"),
        ([["X", "X"], ["X", "X"]], "diagonal"),
        ([["X", "NV4"], ["NV4"]], "cells"),
    ],
)
def test_matrix_invariants(codes: list[list[str]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LinkMatrix.from_codes(codes)


def test_matrix_numa_length_checked() -> None:
    with pytest.raises(ValueError, match="numa"):
        LinkMatrix.from_codes([["X", "PIX"], ["PIX", "X"]], [0])


def test_equal_matrices_hash_equal() -> None:
    codes = [["X", "NV4"], ["NV4", "X"]]
    assert LinkMatrix.from_codes(codes, [0, 0]) == LinkMatrix.from_codes(codes, [0, 0])
    assert hash(LinkMatrix.from_codes(codes)) == hash(LinkMatrix.from_codes(codes))
