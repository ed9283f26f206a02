"""Synthetic fleets for benchmarks and property tests: inventory documents of any size, mixed SKUs.

The generator takes a seeded random source from the caller (the domain holds no randomness of its
own), so the same seed always gives the same fleet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class RandomSource(Protocol):
    """What the generator needs of ``random.Random``."""

    def random(self) -> float: ...

    def choice(self, seq: Sequence[T]) -> T: ...


# (SKU, GPUs per node, topology preset, kW per node, relative share). Shares follow a plausible
# inference fleet: mostly 8-GPU HGX/DGX boxes, with PCIe inference cards and a few Grace Hoppers.
NODE_MIX: tuple[tuple[str, int, str, float, float], ...] = (
    ("H100-SXM-80GB", 8, "nvswitch-8", 10.2, 0.30),
    ("H200-SXM-141GB", 8, "nvswitch-8", 10.2, 0.15),
    ("A100-SXM-80GB", 8, "nvswitch-8", 6.5, 0.10),
    ("H100-SXM-80GB", 8, "4+4", 10.2, 0.05),
    ("L40S-48GB", 8, "pcie", 4.0, 0.15),
    ("A100-PCIE-80GB", 8, "pairs", 3.5, 0.10),
    ("H100-PCIE-80GB", 4, "pairs", 2.5, 0.05),
    ("GH200-96GB", 1, "pcie", 1.0, 0.10),
)


def _pick_kind(rng: RandomSource) -> tuple[str, int, str, float, float]:
    roll = rng.random() * sum(share for *_x, share in NODE_MIX)
    for kind in NODE_MIX:
        roll -= kind[4]
        if roll <= 0:
            return kind
    return NODE_MIX[-1]


def synthetic_inventory(
    *,
    nodes: int,
    rng: RandomSource,
    regions: Sequence[str] = ("us-west-1", "us-east-1", "eu-west-1"),
    nodes_per_rack: int = 4,
    racks_per_cluster: int = 32,
    tpu_pods: int = 2,
) -> dict[str, Any]:
    """An inventory document with ``nodes`` nodes spread over regions, clusters and racks."""
    if nodes <= 0:
        raise ValueError("nodes must be positive")
    layout: dict[str, dict[str, dict[str, list[dict[str, Any]]]]] = {}
    rack_power: dict[str, float] = {}
    for i in range(nodes):
        region = regions[i % len(regions)]
        local = i // len(regions)
        rack_no = local // nodes_per_rack
        cluster = f"c{rack_no // racks_per_cluster + 1}"
        rack = f"{region}-{cluster}-r{rack_no % racks_per_cluster + 1:03d}"
        sku, gpus, topology, kw, _share = _pick_kind(rng)
        layout.setdefault(region, {}).setdefault(cluster, {}).setdefault(rack, []).append(
            {"name": f"n{i:05d}", "sku": sku, "gpus": gpus, "topology": topology}
        )
        rack_power[rack] = rack_power.get(rack, 0.0) + kw
    doc: dict[str, Any] = {
        "regions": [
            {
                "name": region,
                "clusters": [
                    {
                        "name": cluster,
                        "racks": [
                            # Racks are budgeted 10% above their nodes' nameplate draw.
                            {"name": rack, "power_kw": round(rack_power[rack] * 1.1, 1), "nodes": members}
                            for rack, members in racks.items()
                        ],
                    }
                    for cluster, racks in clusters.items()
                ],
            }
            for region, clusters in layout.items()
        ],
        "tpu_pods": [
            {
                "name": f"tpu-{i + 1}",
                "region": regions[i % len(regions)],
                "type": "v5e" if i % 2 == 0 else "v5p",
                "shape": [16, 16] if i % 2 == 0 else [8, 8, 8],
            }
            for i in range(tpu_pods)
        ],
    }
    return doc
