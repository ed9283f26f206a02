"""Preset node layouts: their cells, NUMA halves, kinds, sharing, and `from_parsed`."""

from __future__ import annotations

import pytest

from shared.domain.topology import (
    PRESET_NAMES,
    LinkMatrix,
    NodeKind,
    best_tp_group,
    classify_node,
    four_plus_four,
    from_parsed,
    nvlink_pairs,
    nvswitch,
    parse_topo_matrix,
    pcie_only,
    preset,
)
from tests.unit.topology.builders import fixture_text


def row(matrix: LinkMatrix, i: int) -> list[str]:
    return [link.code for link in matrix.links[i]]


@pytest.mark.parametrize(
    ("matrix", "gpu", "expected_row"),
    [
        (nvswitch(), 0, ["X", "NV18", "NV18", "NV18", "NV18", "NV18", "NV18", "NV18"]),
        (nvswitch(nv_links=12), 5, ["NV12", "NV12", "NV12", "NV12", "NV12", "X", "NV12", "NV12"]),
        (four_plus_four(), 1, ["NV12", "X", "NV12", "NV12", "SYS", "SYS", "SYS", "SYS"]),
        (four_plus_four(), 6, ["SYS", "SYS", "SYS", "SYS", "NV12", "NV12", "X", "NV12"]),
        (nvlink_pairs(), 2, ["PHB", "PHB", "X", "NV4", "SYS", "SYS", "SYS", "SYS"]),
        (nvlink_pairs(), 7, ["SYS", "SYS", "SYS", "SYS", "PHB", "PHB", "NV4", "X"]),
        # 8 GPUs: switch pairs 0-1, 2-3 (PIX); one bridge per NUMA half of 4 (PXB); SYS across.
        (pcie_only(), 0, ["X", "PIX", "PXB", "PXB", "SYS", "SYS", "SYS", "SYS"]),
        # 16 GPUs: a NUMA half holds 8, so GPU 0 reaches 4..7 through the host bridges (NODE).
        (pcie_only(16), 0, ["X", "PIX", "PXB", "PXB"] + ["NODE"] * 4 + ["SYS"] * 8),
    ],
)
def test_preset_rows(matrix: LinkMatrix, gpu: int, expected_row: list[str]) -> None:
    assert row(matrix, gpu) == expected_row


@pytest.mark.parametrize(
    ("name", "kind", "max_tp"),
    [("nvswitch-8", NodeKind.FULLY_CONNECTED, 8), ("4+4", NodeKind.FOUR_PLUS_FOUR, 4),
     ("pairs", NodeKind.PAIRS, 2), ("pcie", NodeKind.NONE, 1)],
)  # fmt: skip
def test_named_presets(name: str, kind: NodeKind, max_tp: int) -> None:
    matrix = preset(name)
    assert name in PRESET_NAMES
    assert classify_node(matrix) == kind
    assert matrix.numa == (0, 0, 0, 0, 1, 1, 1, 1)  # GPU i on NUMA 2*i // 8
    assert best_tp_group(matrix, range(8), max_tp) is not None
    assert best_tp_group(matrix, range(8), max_tp * 2) is None


def test_preset_parameters() -> None:
    assert preset("nvswitch-8", gpus=4, nv_links=6).link(0, 3).code == "NV6"
    assert preset("4+4", nv_links=4).link(0, 1).code == "NV4"
    assert preset("pairs", nv_links=2).link(4, 5).code == "NV2"
    assert nvswitch(3).numa == (0, 0, 1)  # 2*i // 3 = 0, 0, 1
    assert nvswitch(1).codes() == (("X",),)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: preset("dgx-1"), "unknown topology preset 'dgx-1'"),
        (lambda: preset("pcie", nv_links=4), "no NVLink"),
        (lambda: four_plus_four(7), "even number"),
        (lambda: nvlink_pairs(0), "even number"),
        (lambda: nvswitch(0), "at least one GPU"),
        (lambda: nvswitch(nv_links=0), "nv_links >= 1"),
    ],
)
def test_preset_errors(call: object, message: str) -> None:
    assert callable(call)
    with pytest.raises(ValueError, match=message):
        call()


def test_presets_are_shared_so_a_big_fleet_is_cheap() -> None:
    # 1,024 nodes x 8 GPUs: one matrix object per layout, not one per node.
    fleet = [preset(PRESET_NAMES[k % len(PRESET_NAMES)]) for k in range(1024)]
    assert len({id(matrix) for matrix in fleet}) == len(PRESET_NAMES)
    assert sum(matrix.gpu_count for matrix in fleet) == 8192
    assert preset("nvswitch-8") is nvswitch()


def test_from_parsed_keeps_links_and_numa() -> None:
    parsed = parse_topo_matrix(fixture_text("four_plus_four.txt"))
    matrix = from_parsed(parsed)
    # The fixture is the 4+4 preset with NV12 and the same NUMA halves.
    assert matrix == four_plus_four()
    assert classify_node(matrix) == NodeKind.FOUR_PLUS_FOUR
