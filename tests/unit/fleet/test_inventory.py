"""Inventory documents -> fleets: presets, topo files, counts, TPU pods, and errors that say where."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from shared.domain.fleet import fleet_domains, profile_to_dict
from shared.domain.inventory import InventoryError, parse_inventory, referenced_topo_files
from shared.domain.synthetic import synthetic_inventory
from shared.domain.topology import NodeKind
from shared.infra.catalog import demo_fleet_path, load_inventory, load_skus
from shared.infra.profiles import profile_from_payload, profile_to_payload

SKUS = load_skus()
FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "topo"


def doc(*nodes: dict[str, Any], pods: list[dict[str, Any]] | None = None, power_kw: Any = 20) -> dict[str, Any]:
    return {
        "regions": [
            {
                "name": "r1",
                "clusters": [{"name": "c1", "racks": [{"name": "k1", "power_kw": power_kw, "nodes": list(nodes)}]}],
            }
        ],
        "tpu_pods": pods or [],
    }


@pytest.mark.parametrize(
    ("node", "kind", "max_tp"),
    [
        ({"name": "a", "sku": "H100-SXM-80GB", "gpus": 8, "topology": "nvswitch-8"}, NodeKind.FULLY_CONNECTED, 8),
        ({"name": "a", "sku": "H100-SXM-80GB", "gpus": 8, "topology": "4+4"}, NodeKind.FOUR_PLUS_FOUR, 4),
        ({"name": "a", "sku": "A100-PCIE-80GB", "gpus": 8, "topology": "pairs"}, NodeKind.PAIRS, 2),
        ({"name": "a", "sku": "L40S-48GB", "gpus": 8, "topology": "pcie"}, NodeKind.NONE, 1),
        ({"name": "a", "sku": "H200-SXM-141GB", "gpus": 8}, NodeKind.FULLY_CONNECTED, 8),  # default for 8 NV18 GPUs
    ],
)
def test_presets_give_the_layout_they_name(node: dict[str, Any], kind: NodeKind, max_tp: int) -> None:
    fleet = parse_inventory(doc(node), skus=SKUS)
    (profile,) = fleet.nodes
    assert profile.topology.kind is kind
    assert profile.topology.max_tp_size == max_tp
    assert profile.accelerators[0].hbm_bytes == SKUS[node["sku"]].hbm_bytes


def test_topo_file_wins_over_preset_and_count_expands_names() -> None:
    text = (FIXTURES / "four_plus_four.txt").read_text()
    fleet = parse_inventory(
        doc(
            {"name": "box-{i:02d}", "count": 3, "sku": "H100-SXM-80GB", "topology": "nvswitch-8", "topo_file": "t.txt"}
        ),
        skus=SKUS,
        topo_texts={"t.txt": text},
    )
    assert [n.name for n in fleet.nodes] == ["box-01", "box-02", "box-03"]
    assert all(n.topology.kind is NodeKind.FOUR_PLUS_FOUR for n in fleet.nodes)


@pytest.mark.parametrize(
    ("bad", "where"),
    [
        (doc({"name": "a", "sku": "H999"}), "regions[0].clusters[0].racks[0].nodes[0].sku"),
        (doc({"name": "a", "sku": "L40S-48GB", "gpus": 0}), "regions[0].clusters[0].racks[0].nodes[0].gpus"),
        (
            doc({"name": "a", "sku": "L40S-48GB", "topology": "ring"}),
            "regions[0].clusters[0].racks[0].nodes[0].topology",
        ),
        (
            doc({"name": "a", "sku": "L40S-48GB", "topo_file": "x.txt"}),
            "regions[0].clusters[0].racks[0].nodes[0].topo_file",
        ),
        (
            doc({"name": "a", "sku": "L40S-48GB"}, {"name": "a", "sku": "L40S-48GB"}),
            "regions[0].clusters[0].racks[0].nodes[1].name",
        ),
        (doc({"name": "a", "sku": "TPU-V5E"}), "regions[0].clusters[0].racks[0].nodes[0].sku"),
        (doc({"name": "a", "sku": "L40S-48GB"}, power_kw=-3), "regions[0].clusters[0].racks[0].power_kw"),
        (doc(pods=[{"name": "p", "region": "r1", "type": "v6", "shape": [4, 4]}]), "tpu_pods[0].type"),
        (doc(pods=[{"name": "p", "region": "r1", "type": "v5p", "shape": [4, 4]}]), "tpu_pods[0].shape"),
        (doc(pods=[{"name": "p", "region": "mars", "type": "v5e", "shape": [4, 4]}]), "tpu_pods[0].region"),
        ({"regions": "nope"}, "regions"),
    ],
)
def test_errors_name_where_in_the_document(bad: dict[str, Any], where: str) -> None:
    with pytest.raises(InventoryError) as caught:
        parse_inventory(bad, skus=SKUS)
    assert caught.value.where == where


def test_demo_fleet_has_every_kind_the_brief_names() -> None:
    fleet, fingerprint = load_inventory(demo_fleet_path())
    assert set(fleet.regions) == {"us-west-1", "us-east-1"}
    kinds = {n.topology.kind for n in fleet.nodes}
    assert {
        NodeKind.FULLY_CONNECTED,
        NodeKind.FOUR_PLUS_FOUR,
        NodeKind.PAIRS,
        NodeKind.NONE,
        NodeKind.MULTI_NODE,
    } <= kinds
    assert {n.sku for n in fleet.nodes} >= {
        "H100-SXM-80GB",
        "H200-SXM-141GB",
        "GH200-96GB",
        "L40S-48GB",
        "A100-PCIE-80GB",
    }
    assert {(p.type.value, p.shape) for p in fleet.tpu_pods} == {("v5e", (16, 16)), ("v5p", (8, 8, 8))}
    assert all(r.power_kw for r in fleet.racks)
    domains = fleet_domains(fleet.nodes)
    multi = [d for d in domains if d.kind == "multi_node"]
    assert len(multi) == 1 and len(multi[0].members) == 4  # four GH200s in one NVLink fabric clique
    # dgx-a100-01 comes from a topo_file: one fully connected domain of 8
    assert [d.kind for d in domains if d.id.startswith("dgx-a100-01/")] == ["fully_connected"]
    assert len(fingerprint) == 32
    assert referenced_topo_files({"regions": []}) == set()


def test_profiles_round_trip_and_fingerprints_track_content() -> None:
    fleet, _ = load_inventory(demo_fleet_path())
    for node in fleet.nodes:
        payload = profile_to_payload(node)
        again = profile_from_payload(payload)
        assert again == node and again.fingerprint() == node.fingerprint()
        assert payload.model_dump(mode="json") == profile_to_dict(node)  # the wire shape is what is digested
    a, b = fleet.nodes[0], fleet.nodes[1]
    assert a.fingerprint() != b.fingerprint()  # names differ


def test_synthetic_fleets_are_seeded_and_large() -> None:
    one = synthetic_inventory(nodes=1024, rng=random.Random(7))
    two = synthetic_inventory(nodes=1024, rng=random.Random(7))
    assert one == two
    fleet = parse_inventory(one, skus=SKUS)
    assert len(fleet.nodes) == 1024
    assert len({n.sku for n in fleet.nodes}) >= 5
    assert sum(len(n.accelerators) for n in fleet.nodes) > 5000
