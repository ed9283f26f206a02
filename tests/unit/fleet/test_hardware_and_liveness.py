"""SKU catalog facts, device-name mapping, and the heartbeat rule on a fake clock."""

from __future__ import annotations

import pytest

from shared.domain.hardware import CatalogError, parse_sku_catalog, sku_from_device_name
from shared.domain.liveness import Liveness, LivenessTracker
from shared.infra.catalog import load_skus

GIB = 1024**3


def test_catalog_has_the_api_md_skus_with_datasheet_figures() -> None:
    skus = load_skus()
    assert {
        "H100-SXM-80GB",
        "H100-PCIE-80GB",
        "H200-SXM-141GB",
        "GH200-96GB",
        "GH200-144GB",
        "L40S-48GB",
        "A100-SXM-40GB",
        "A100-SXM-80GB",
        "A100-PCIE-40GB",
        "A100-PCIE-80GB",
        "TPU-V5E",
        "TPU-V5P",
    } <= set(skus)
    assert skus["H100-SXM-80GB"].memory_bandwidth_bytes_per_s == 3.35e12
    assert (
        skus["H200-SXM-141GB"].hbm_bytes == 141 * GIB and skus["H200-SXM-141GB"].memory_bandwidth_bytes_per_s == 4.8e12
    )
    assert skus["L40S-48GB"].memory_bandwidth_bytes_per_s == 864e9 and skus["L40S-48GB"].nvlink_links == 0
    assert skus["A100-SXM-40GB"].memory_bandwidth_bytes_per_s == 1.555e12
    assert skus["A100-SXM-80GB"].memory_bandwidth_bytes_per_s == 2.039e12
    assert skus["TPU-V5E"].hbm_bytes == 16 * GIB and skus["TPU-V5P"].hbm_bytes == 95 * GIB
    assert all(s.source for s in skus.values())


def test_catalog_errors_name_the_field() -> None:
    with pytest.raises(CatalogError, match=r"skus.X.hbm_bytes"):
        parse_sku_catalog({"skus": {"X": {"hbm_bytes": -1}}})


@pytest.mark.parametrize(
    ("name", "memory", "sku"),
    [
        ("NVIDIA H100 80GB HBM3", 81559 * 2**20, "H100-SXM-80GB"),
        ("NVIDIA H100 PCIe", 81559 * 2**20, "H100-PCIE-80GB"),
        ("NVIDIA H200", 143771 * 2**20, "H200-SXM-141GB"),
        ("NVIDIA GH200 480GB", 97871 * 2**20, "GH200-96GB"),
        ("NVIDIA GH200 144G HBM3e", 146 * GIB, "GH200-144GB"),
        ("NVIDIA L40S", 46068 * 2**20, "L40S-48GB"),
        ("NVIDIA A100-SXM4-40GB", 40536 * 2**20, "A100-SXM-40GB"),
        ("NVIDIA A100-SXM4-80GB", 81920 * 2**20, "A100-SXM-80GB"),
        ("NVIDIA A100 80GB PCIe", 81920 * 2**20, "A100-PCIE-80GB"),
        ("NVIDIA A100-PCIE-40GB", 40536 * 2**20, "A100-PCIE-40GB"),
        ("NVIDIA GeForce RTX 4090", 24 * GIB, None),
    ],
)
def test_device_names_map_to_catalog_skus(name: str, memory: int, sku: str | None) -> None:
    assert sku_from_device_name(name, memory) == sku


def test_lost_after_three_missed_beats_and_recovered_on_the_next() -> None:
    tracker = LivenessTracker(interval_ms=1000, missed_beats=3)
    tracker.watch("n1", now_ms=0)
    tracker.beat("n1", now_ms=1000)
    assert tracker.evaluate(now_ms=4000) == []  # silent 3000 ms: exactly 3 intervals, not more
    (lost,) = tracker.evaluate(now_ms=4001)
    assert (lost.node, lost.to, lost.silent_ms) == ("n1", Liveness.LOST, 3001)
    assert tracker.evaluate(now_ms=9000) == []  # reported once
    recovered = tracker.beat("n1", now_ms=9500)
    assert recovered is not None and recovered.to is Liveness.UP and recovered.silent_ms == 8500
    assert tracker.beat("n1", now_ms=9600) is None
    assert tracker.state("n1") is Liveness.UP


def test_watching_starts_a_grace_period() -> None:
    tracker = LivenessTracker(interval_ms=500, missed_beats=3)
    tracker.watch("n2", now_ms=10_000)
    assert tracker.evaluate(now_ms=11_400) == []
    assert [t.node for t in tracker.evaluate(now_ms=11_501)] == ["n2"]
