"""`nvidia-smi topo -m` and `--query-gpu` parsing, over hand-written fixtures in tests/fixtures/topo."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from shared.domain.topology import (
    TopologyParseError,
    parse_int_list,
    parse_query_gpu_csv,
    parse_topo_matrix,
)
from tests.unit.topology.builders import fixture_text

ALL_THREE = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")


@dataclass(frozen=True)
class Expect:
    """What one fixture must parse to. Pairs are (i, j) with i < j; affinity per GPU is
    (cpu_affinity, numa_affinity, gpu_numa_id) after parsing."""

    fixture: str
    gpus: int
    columns: tuple[str, ...]
    pairs: dict[str, list[tuple[int, int]]]
    affinity: dict[int, tuple[str | None, str | None, int | None]]
    nics: tuple[tuple[str, str | None], ...] = ()
    nic_links: dict[int, tuple[str, ...]] = field(default_factory=dict)


CASES = [
    Expect(
        "tab_nic_legend.txt",
        gpus=4,
        columns=ALL_THREE,
        pairs={"NV6": [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]},
        affinity={0: ("0-15,32-47", "0", None), 3: ("16-31,48-63", "1", None)},
        nics=(("NIC0", "mlx5_0"), ("NIC1", "mlx5_3")),  # NIC Legend: NIC1 is mlx5_3, not mlx5_1
        nic_links={0: ("PIX", "SYS"), 1: ("PXB", "SYS"), 2: ("SYS", "PIX"), 3: ("SYS", "PXB")},
    ),
    Expect(
        "space_separated.txt",
        gpus=2,
        columns=ALL_THREE,
        pairs={"NV12": [(0, 1)]},
        affinity={0: ("0-31", "0", None), 1: ("0-31", "0", None)},
        nics=(("NIC0", "mlx5_1"),),
        nic_links={0: ("NODE",), 1: ("NODE",)},
    ),
    Expect(
        "old_mlx5_columns.txt",
        gpus=2,
        columns=("CPU Affinity",),
        pairs={"SYS": [(0, 1)]},  # printed SOC
        affinity={0: ("0-9,20-29", None, None), 1: ("10-19,30-39", None, None)},
        nics=(("mlx5_0", "mlx5_0"), ("mlx5_1", "mlx5_1")),
        nic_links={0: ("PHB", "SYS"), 1: ("SYS", "PHB")},
    ),
    Expect(
        "empty_cpu_affinity_tab.txt",
        gpus=4,
        columns=ALL_THREE,
        pairs={"NODE": [(0, 1), (2, 3)], "SYS": [(0, 2), (0, 3), (1, 2), (1, 3)]},
        affinity={0: (None, "0", None), 1: (None, "0", None), 2: ("3", "1", None), 3: ("3", "1", None)},
    ),
    Expect(
        "empty_cpu_affinity_spaces.txt",  # same matrix; the empty cells vanished in the paste
        gpus=4,
        columns=ALL_THREE,
        pairs={"NODE": [(0, 1), (2, 3)], "SYS": [(0, 2), (0, 3), (1, 2), (1, 3)]},
        affinity={0: (None, "0", None), 1: (None, "0", None), 2: ("3", "1", None), 3: ("3", "1", None)},
    ),
    Expect(
        "numa_na_padding.txt",  # "0-7\t\tN/A": the empty cell is padding, NUMA Affinity is N/A
        gpus=2,
        columns=("CPU Affinity", "NUMA Affinity"),
        pairs={"NV2": [(0, 1)]},
        affinity={0: ("0-7", None, None), 1: ("0-7", None, None)},
    ),
    Expect(
        "pairs.txt",
        gpus=4,
        columns=ALL_THREE,
        pairs={"NV4": [(0, 1), (2, 3)], "SYS": [(0, 2), (0, 3), (1, 2), (1, 3)]},
        affinity={0: ("0-11", "0", None), 2: ("12-23", "1", None)},
    ),
    Expect(
        "pcie_only_crlf.txt",
        gpus=4,
        columns=ALL_THREE,
        pairs={"PIX": [(0, 1)], "NODE": [(0, 2), (1, 2)], "SYS": [(0, 3), (1, 3), (2, 3)]},
        affinity={0: ("0-23", "0", None), 3: ("24-47", "1", None)},
    ),
    Expect(
        "gb_tray_gpu_numa_id.txt",
        gpus=4,
        columns=ALL_THREE,
        pairs={"NV18": [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]},
        affinity={0: ("0-71", "0,2-9", 2), 1: ("0-71", "0,10-17", 10), 3: ("72-143", "1,26-33", 26)},
        nics=(("NIC0", "mlx5_0"),),
        nic_links={0: ("SYS",), 3: ("SYS",)},
    ),
]


def _pairs(fixture: str) -> dict[str, list[tuple[int, int]]]:
    parsed = parse_topo_matrix(fixture_text(fixture))
    out: dict[str, list[tuple[int, int]]] = {}
    for i in range(parsed.gpu_count):
        for j in range(i + 1, parsed.gpu_count):
            out.setdefault(parsed.link(i, j).code, []).append((i, j))
    return out


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.fixture)
def test_fixture_parses(case: Expect) -> None:
    parsed = parse_topo_matrix(fixture_text(case.fixture))
    assert parsed.gpu_count == case.gpus
    assert parsed.columns == case.columns
    assert _pairs(case.fixture) == case.pairs
    for index, (cpu, numa, gpu_numa) in case.affinity.items():
        gpu = parsed.gpus[index]
        assert (gpu.cpu_affinity, gpu.numa_affinity, gpu.gpu_numa_id) == (cpu, numa, gpu_numa)
    assert tuple((nic.column, nic.device) for nic in parsed.nics) == case.nics
    for index, codes in case.nic_links.items():
        assert tuple(link.code for link in parsed.nic_links[index]) == codes
    for i in range(parsed.gpu_count):
        assert parsed.link(i, i).code == "X"


def test_gpu_facts_on_the_cube_mesh() -> None:
    parsed = parse_topo_matrix(fixture_text("cube_mesh.txt"))
    # NV1 to 3 quad peers + NV1 to GPU i+4 = 4 links per GPU.
    assert [gpu.nvlinks for gpu in parsed.gpus] == [4] * 8
    assert parsed.gpus[5].cpus == tuple(range(20, 40))
    assert parsed.gpus[5].numa_nodes == (1,)
    assert parsed.matrix.numa == (0, 0, 0, 0, 1, 1, 1, 1)
    assert parsed.gpus[0].cells == (("CPU Affinity", "0-19"), ("NUMA Affinity", "0"))


def test_numa_lists_and_gpu_numa_id() -> None:
    parsed = parse_topo_matrix(fixture_text("gb_tray_gpu_numa_id.txt"))
    # "0,2-9" = 0 plus 2..9: 1 + 8 = 9 nodes.
    assert parsed.gpus[0].numa_nodes == (0, 2, 3, 4, 5, 6, 7, 8, 9)
    assert [gpu.gpu_numa_id for gpu in parsed.gpus] == [2, 10, 18, 26]
    assert parsed.matrix.numa == (None,) * 4  # several NUMA nodes: no single one to prefer
    assert [gpu.nvlinks for gpu in parsed.gpus] == [54] * 4  # NV18 x 3 peers


def test_nic_lookup_and_closest() -> None:
    parsed = parse_topo_matrix(fixture_text("tab_nic_legend.txt"))
    assert parsed.nic_link(0, "NIC0").code == "PIX"
    assert parsed.nic_link(0, "mlx5_3").code == "SYS"
    assert [nic.column for nic in parsed.closest_nics(1)] == ["NIC0"]  # PXB beats SYS
    assert [nic.column for nic in parsed.closest_nics(2)] == ["NIC1"]
    with pytest.raises(KeyError):
        parsed.nic_link(0, "mlx5_9")
    no_nics = parse_topo_matrix(fixture_text("pairs.txt"))
    assert no_nics.closest_nics(0) == ()


def test_nic_without_legend_has_no_device() -> None:
    text = "\tGPU0\tNIC0\tCPU Affinity\nGPU0\t X \tPHB\t0-7\nNIC0\tPHB\t X \t\n"
    parsed = parse_topo_matrix(text)
    assert [(nic.column, nic.device) for nic in parsed.nics] == [("NIC0", None)]


@pytest.mark.parametrize(
    "transform",
    [
        pytest.param(lambda text: "\n".join(line.expandtabs(8) for line in text.splitlines()), id="spaces"),
        pytest.param(lambda text: text.replace("\r\n", "\n").replace("\n", "\r\n"), id="crlf"),
        pytest.param(lambda text: "\n".join(line + " \t " for line in text.splitlines()), id="trailing-ws"),
        pytest.param(lambda text: "\x1b[1m$ nvidia-smi topo -m\x1b[0m\n" + text + "\n$ exit\n", id="ansi-prompt"),
        pytest.param(lambda text: "\n".join(line.expandtabs(8).lstrip() for line in text.splitlines()), id="dedent"),
    ],
)
@pytest.mark.parametrize(
    "fixture", ["tab_nic_legend.txt", "empty_cpu_affinity_tab.txt", "numa_na_padding.txt", "cube_mesh.txt"]
)
def test_layout_variants_parse_the_same(fixture: str, transform: object) -> None:
    assert callable(transform)
    text = fixture_text(fixture)
    assert parse_topo_matrix(transform(text)) == parse_topo_matrix(text)


@pytest.mark.parametrize(
    ("fixture", "line", "reason"),
    [
        ("garbled_unknown_code.txt", 3, "unknown link code 'NVX' (GPU1, column GPU2)"),
        ("truncated_rows.txt", 6, "expected a row for GPU3 (truncated?), found end of input"),
        ("truncated_row.txt", 4, "expected 4 link cells for GPU2, found 2"),
        ("asymmetric.txt", 4, "matrix is not symmetric: GPU1-GPU2 NV4 vs GPU2-GPU1 NV2"),
        ("no_header.txt", None, "no header line with GPU0 found"),
    ],
)
def test_broken_fixtures(fixture: str, line: int | None, reason: str) -> None:
    with pytest.raises(TopologyParseError) as caught:
        parse_topo_matrix(fixture_text(fixture))
    assert (caught.value.line, caught.value.reason) == (line, reason)
    assert isinstance(caught.value, ValueError)
    assert str(caught.value) == (reason if line is None else f"line {line}: {reason}")


HEAD = "\tGPU0\tGPU1\tCPU Affinity\n"


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        (HEAD + "GPU0\t X \tNV4\t0-7\nGPU2\tNV4\t X \t0-7\n", 3, "expected a row for GPU1 (truncated?), found 'GPU2'"),
        (HEAD + "GPU0\t X \tNV4\tPIX\t0-7\n", 2, "expected 2 link cells for GPU0, found 3"),
        (HEAD + "GPU0\tNV4\tNV4\t0-7\n", 2, "expected X on the diagonal for GPU0, found NV4"),
        (HEAD + "GPU0\t X \t X \t0-7\n", 2, "unexpected X for GPU0-GPU1, found X"),
        (
            HEAD + "GPU0\t X \tNV4\t0-7\t8-15\n",
            2,
            "expected at most 1 values (CPU Affinity) after the links of GPU0, found 2",
        ),
        (HEAD + "GPU0\t X \n", 2, "expected 2 link cells for GPU0, found 1"),
        (HEAD + "\nLegend:\n", 3, "expected a row for GPU0 (truncated?), found 'Legend:'"),
        (
            "\tGPU0\tGPU NUMA ID\nGPU0\t X \tfour\n",
            2,
            "expected an integer or N/A for GPU NUMA ID of GPU0, found 'four'",
        ),
    ],
)
def test_inline_errors(text: str, line: int, reason: str) -> None:
    with pytest.raises(TopologyParseError) as caught:
        parse_topo_matrix(text)
    assert (caught.value.line, caught.value.reason) == (line, reason)


def test_prose_starting_with_gpu0_is_not_a_header() -> None:
    text = "GPU0 is busy\n" + HEAD + "GPU0\t X \tPHB\t0-7\nGPU1\tPHB\t X \t0-7\n"
    assert parse_topo_matrix(text).gpu_count == 2


def test_single_gpu_without_trailing_columns() -> None:
    parsed = parse_topo_matrix("\tGPU0\nGPU0\t X \n")
    assert parsed.gpu_count == 1
    assert parsed.columns == ()
    assert parsed.gpus[0].cpu_affinity is None


def test_second_output_legend_is_not_ours() -> None:
    first = "\tGPU0\tNIC0\nGPU0\t X \tPIX\nNIC0\tPIX\t X \n"
    second = "\tGPU0\tNIC0\nGPU0\t X \tSYS\nNIC0\tSYS\t X \n\nNIC Legend:\n\n  NIC0: mlx5_7\n"
    assert parse_topo_matrix(first + "\n" + second).nics[0].device is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0-47,96-143", (*range(0, 48), *range(96, 144))),
        ("6,14,22,30", (6, 14, 22, 30)),
        ("0,3-5", (0, 3, 4, 5)),
        ("1", (1,)),
        (" 2-3 ", (2, 3)),
        ("5,1-2,2", (1, 2, 5)),  # sorted, distinct
        ("", None),
        ("N/A", None),
        ("3-1", None),
        ("0-", None),
        ("a-b", None),
        ("0-999999999", None),  # absurd: garbage, not a machine
    ],
)
def test_parse_int_list(text: str, expected: tuple[int, ...] | None) -> None:
    assert parse_int_list(text) == expected


# --- nvidia-smi --query-gpu --------------------------------------------------------------

MIB = 1 << 20


def test_query_csv_with_header_and_units() -> None:
    first, second = parse_query_gpu_csv(fixture_text("query_gpu.csv"))
    assert first.index == 0
    assert first.name == "NVIDIA H100 80GB HBM3"
    assert first.uuid == "GPU-00000000-1111-2222-3333-444444444444"
    assert first.pci_bus_id == "00000000:18:00.0"
    assert first.memory_total_bytes == 81559 * MIB  # = 85,520,809,984 bytes
    assert first.memory_used_bytes == 1 * MIB
    assert (first.pcie_link_gen_max, first.pcie_link_width_max) == (5, 16)
    assert first.power_limit_w == 700.0
    assert second.power_limit_w is None  # [N/A]
    assert second.memory_total_bytes == 46068 * MIB


def test_query_csv_noheader_nounits() -> None:
    rows = parse_query_gpu_csv(fixture_text("query_gpu_noheader_nounits.csv"))
    assert [row.index for row in rows] == [0, 1]
    assert rows[0].memory_total_bytes == 40960 * MIB  # unit-less memory is MiB: 40 GiB
    assert rows[0].power_limit_w == 400.0
    assert rows[1].pcie_link_gen_max is None  # [Not Supported]


def test_query_csv_header_in_any_order_with_nounits() -> None:
    text = "memory.total [MiB], index, power.limit [W], utilization.gpu [%]\n81559, 3, 700.00, 12\n"
    (row,) = parse_query_gpu_csv(text)
    assert (row.index, row.memory_total_bytes, row.power_limit_w) == (3, 81559 * MIB, 700.0)
    assert row.name is None and row.uuid is None  # not queried


def test_query_csv_units_override_header() -> None:
    (row,) = parse_query_gpu_csv("index, memory.total [MiB]\n0, 80 GiB\n")
    assert row.memory_total_bytes == 80 << 30


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        (fixture_text("query_gpu_short_row.csv"), 3, "expected 9 comma-separated fields, found 5"),
        (
            "index, memory.total [MiB]\n0, lots\n",
            2,
            "expected a memory size like '81559 MiB' for memory.total, found 'lots'",
        ),
        (
            "index, power.limit [W]\n0, 7 horses\n",
            2,
            "expected a power like '700.00 W' for power.limit, found '7 horses'",
        ),
        ("index, pcie.link.gen.max\nzero, 4\n", 2, "expected an integer for index, found 'zero'"),
        ("nothing to see here\n", None, "no --query-gpu header or data row found"),
    ],
)
def test_query_csv_errors(text: str, line: int | None, reason: str) -> None:
    with pytest.raises(TopologyParseError) as caught:
        parse_query_gpu_csv(text)
    assert (caught.value.line, caught.value.reason) == (line, reason)
