"""The nvidia-smi provider on captured outputs, and `hetsched topo parse` as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.topology_discovery.providers import NodePlace, ProviderError
from services.topology_discovery.providers.nvidia_smi import NvidiaSmiProvider
from shared.domain.topology import NodeKind

REPO = Path(__file__).resolve().parents[3]
FIXTURES = REPO / "tests" / "fixtures" / "topo"
SHARED_TOPO = REPO.parent / "shared" / "data" / "topo"
PLACE = NodePlace(name="n1", region="r", cluster="c", rack="k")


def test_provider_reads_captured_topology_and_devices(tmp_path: Path) -> None:
    query = tmp_path / "q.csv"
    rows = [
        "index, name, uuid, pci.bus_id, memory.total [MiB], memory.used [MiB], pcie.link.gen.max, "
        "pcie.link.width.max, power.limit [W]"
    ]
    rows += [
        f"{i}, NVIDIA H100 80GB HBM3, GPU-{i}, 00000000:{i + 10}:00.0, 81559 MiB, 1 MiB, 5, 16, 700.00 W"
        for i in range(8)
    ]
    query.write_text("\n".join(rows) + "\n")
    provider = NvidiaSmiProvider(place=PLACE, topo_file=FIXTURES / "four_plus_four.txt", query_file=query)
    profile = provider.profile()
    assert profile.topology.kind is NodeKind.FOUR_PLUS_FOUR
    assert profile.sku == "H100-SXM-80GB" and profile.accelerators[7].hbm_bytes == 81559 * 2**20
    assert profile.accelerators[2].power_limit_w == 700 and profile.source == "nvidia-smi"


@pytest.mark.parametrize(
    "name", ["truncated_row.txt", "truncated_rows.txt", "garbled_unknown_code.txt", "asymmetric.txt"]
)
def test_provider_errors_name_the_line(name: str) -> None:
    provider = NvidiaSmiProvider(place=PLACE, topo_file=FIXTURES / name, sku_override="H100-SXM-80GB")
    with pytest.raises(ProviderError) as caught:
        provider.profile()
    assert caught.value.line is not None and "line" in str(caught.value)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hetsched.cli", *args], capture_output=True, text=True, timeout=60)


def test_topo_parse_json_has_the_api_md_shape() -> None:
    done = _cli("topo", "parse", str(FIXTURES / "four_plus_four.txt"), "--json")
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert set(data) == {"gpus", "nics", "links", "nvlink_domains"}
    assert set(data["gpus"][0]) == {"index", "cpu_affinity", "numa_affinity", "gpu_numa_id", "nvlinks"}
    assert data["links"][0][0] == "X" and len(data["links"]) == 8
    assert [(d["members"], d["kind"], d["cliques"]) for d in data["nvlink_domains"]] == [
        ([0, 1, 2, 3], "fully_connected", [[0, 1, 2, 3]]),
        ([4, 5, 6, 7], "fully_connected", [[4, 5, 6, 7]]),
    ]
    assert data["gpus"][0]["nvlinks"] == 36  # NV12 to three peers


def test_topo_parse_of_a_bad_file_exits_non_zero_with_the_line() -> None:
    done = _cli("topo", "parse", str(FIXTURES / "truncated_row.txt"))
    assert done.returncode != 0
    assert "line 4" in done.stderr and "expected" in done.stderr


@pytest.mark.skipif(not SHARED_TOPO.exists(), reason="../shared/data/topo is not present (a user's machine)")
def test_topo_parse_json_on_every_real_sample_matches_the_ground_truth() -> None:
    from typer.testing import CliRunner

    from hetsched.cli import app

    truth = json.loads((SHARED_TOPO / "ground_truth.json").read_text())
    runner = CliRunner()
    for key, expected in truth.items():
        done = runner.invoke(app, ["topo", "parse", str(SHARED_TOPO / f"{key}.txt"), "--json"])
        assert done.exit_code == 0, (key, done.output)
        data = json.loads(done.stdout)
        islands = sorted(sorted(d["members"]) for d in data["nvlink_domains"] if len(d["members"]) > 1)
        assert islands == sorted(sorted(i) for i in expected["islands"] if len(i) > 1), key
        sums = {str(g["index"]): g["nvlinks"] for g in data["gpus"]}
        assert sums == {k: v for k, v in expected["nv_link_sum_per_gpu"].items()}, key
