"""`nvidia-smi topo -m` outputs against their hand-read ground truth.

Two sets, the same checks: the project's own samples (tests/fixtures/topo/ground_truth.json, written
for these tests and read by hand; they run everywhere) and the real outputs in ../shared/data/topo,
reference data outside the repository (they skip on a machine without it). Only the samples named in
a ground_truth.json are parsed (the folders also hold companion outputs that are not matrices).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shared.domain.topology import ParsedTopology, maximal_nvlink_cliques, nvlink_domains, parse_topo_matrix

OWN = Path(__file__).resolve().parents[2] / "fixtures" / "topo"
TOPO = Path(__file__).resolve().parents[3].parent / "shared" / "data" / "topo"


def _truth(folder: Path) -> dict[str, dict[str, Any]]:
    path = folder / "ground_truth.json"
    if not path.is_file():
        return {}
    loaded: dict[str, dict[str, Any]] = json.loads(path.read_text(encoding="utf-8"))
    return loaded


OWN_TRUTH = _truth(OWN)
TRUTH = _truth(TOPO)
SAMPLES = [pytest.param((OWN, name, OWN_TRUTH[name]), id=f"own-{name}") for name in sorted(OWN_TRUTH)] + (
    [pytest.param((TOPO, name, TRUTH[name]), id=name) for name in sorted(TRUTH)]
    or [pytest.param((TOPO, "", {}), id="reference-samples")]
)


def _text(case: tuple[Path, str, dict[str, Any]]) -> str:
    folder, name, _truth_of = case
    if not name:
        pytest.skip(
            f"reference samples not present: {TOPO / 'ground_truth.json'} does not exist (only on the dev machine)"
        )
    return (folder / f"{name}.txt").read_text(encoding="utf-8")


@pytest.fixture(params=SAMPLES)
def sample(request: pytest.FixtureRequest) -> tuple[ParsedTopology, dict[str, Any]]:
    return parse_topo_matrix(_text(request.param)), request.param[2]


def _without_spacers(cells: list[str], columns: int) -> list[str]:
    # The ground truth keeps raw trailing cells, spacer included: drop empties right to left,
    # never the last cell, until one cell per named column remains.
    values = list(cells)
    index = len(values) - 2
    while len(values) > columns and index >= 0:
        if values[index] == "":
            del values[index]
        index -= 1
    return values


def test_shape_columns_and_nics(sample: tuple[ParsedTopology, dict[str, Any]]) -> None:
    parsed, truth = sample
    assert parsed.gpu_count == truth["gpus"]
    assert list(parsed.columns) == truth["extra_cols"]
    assert [nic.column for nic in parsed.nics] == truth["nics"]


def test_islands_and_cliques(sample: tuple[ParsedTopology, dict[str, Any]]) -> None:
    parsed, truth = sample
    islands = sorted(list(domain.gpus) for domain in nvlink_domains(parsed.matrix))
    assert islands == sorted(truth["islands"])
    cliques = sorted(list(clique) for clique in maximal_nvlink_cliques(parsed.matrix))
    assert cliques == sorted(truth["nv_cliques"])


def test_nv_link_sums(sample: tuple[ParsedTopology, dict[str, Any]]) -> None:
    parsed, truth = sample
    assert {str(gpu.index): gpu.nvlinks for gpu in parsed.gpus} == truth["nv_link_sum_per_gpu"]
    assert all(gpu.nvlinks == parsed.matrix.nvlink_sum(gpu.index) for gpu in parsed.gpus)


def test_pair_link_classes(sample: tuple[ParsedTopology, dict[str, Any]]) -> None:
    parsed, truth = sample
    pairs: dict[str, list[str]] = {}
    for i in range(parsed.gpu_count):
        for j in range(i + 1, parsed.gpu_count):
            pairs.setdefault(parsed.link(i, j).code, []).append(f"{i}-{j}")
    assert pairs == truth["pairs_by_type"]


def test_gpu_nic_links(sample: tuple[ParsedTopology, dict[str, Any]]) -> None:
    parsed, truth = sample
    for gpu in parsed.gpus:
        links = {nic.column: parsed.nic_links[gpu.index][k].code for k, nic in enumerate(parsed.nics)}
        assert links == truth["gpu_nic"][f"GPU{gpu.index}"]


def test_affinity(sample: tuple[ParsedTopology, dict[str, Any]]) -> None:
    parsed, truth = sample
    for gpu in parsed.gpus:
        raw = _without_spacers(truth["affinity"][f"GPU{gpu.index}"], len(truth["extra_cols"]))
        expected = dict(zip(truth["extra_cols"], raw, strict=True))
        assert dict(gpu.cells) == expected
        cpu = expected.get("CPU Affinity", "")
        assert gpu.cpu_affinity == (None if cpu in ("", "N/A") else cpu)
        numa = expected.get("NUMA Affinity", "")
        assert gpu.numa_affinity == (None if numa in ("", "N/A") else numa)
        gpu_numa = expected.get("GPU NUMA ID", "N/A")
        assert gpu.gpu_numa_id == (None if gpu_numa in ("", "N/A") else int(gpu_numa))


@pytest.mark.parametrize("case", SAMPLES)
def test_pasted_variants_parse_the_same(case: tuple[Path, str, dict[str, Any]]) -> None:
    # The same output pasted through a terminal (tabs -> spaces, indentation lost) or saved on
    # Windows (CRLF) must read the same.
    text = _text(case)
    original = parse_topo_matrix(text)
    spaces = "\n".join(line.expandtabs(8) for line in text.splitlines())
    dedented = "\n".join(line.expandtabs(8).lstrip() for line in text.splitlines())
    for variant in (spaces, dedented, text.replace("\n", "\r\n")):
        assert parse_topo_matrix(variant) == original


def test_the_projects_own_samples_are_there() -> None:
    assert sorted(OWN_TRUTH) == ["four_plus_four", "tab_nic_legend"]
