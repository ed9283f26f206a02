"""The console's fleet at scale (``hetsched.console.fleetview``): each GPU's state (placed, lent, reserved hard or
soft, free, unavailable), the per-region / cluster / SKU rows, a group's nodes a page at a time, one node's GPUs,
and the alerts; then the same on the 1,024-node synthetic fleet of the placement benchmark, where the summary
must stay a few kilobytes however many GPUs there are."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import pytest

from hetsched.console.fleetview import (
    FREE,
    LENT,
    PLACED,
    RESERVED_HARD,
    RESERVED_SOFT,
    UNAVAILABLE,
    FleetIndex,
    FleetView,
    Holdings,
    ViewError,
    summary_document,
)
from hetsched.console.state import reservations_summary
from shared.contracts.fleet import AcceleratorView, DomainView, FleetGetReply, NodeView
from shared.contracts.ledger import AcceleratorLedgerView, SnapshotReply
from shared.contracts.rebalance import DetectorView, RebalanceStatusReply, TargetView
from shared.contracts.reservation import ReservationReportReply, ReservationStatusReply, ReservationStatusView
from shared.contracts.reservation_state import BorrowView
from shared.contracts.topology import AcceleratorProfile, NodeProfilePayload
from tests.bench.placement_e2e import bench_fleet

GIB = 1024**3
NOW = datetime(2025, 1, 1, tzinfo=UTC)


def node(
    name: str, *, region: str = "r1", cluster: str = "c1", sku: str = "H100", gpus: int = 4, state: str = "up"
) -> NodeView:
    return NodeView(
        name=name,
        region=region,
        cluster=cluster,
        rack="k1",
        sku=sku,
        state=state,
        kind="nvswitch-8",
        accelerators=[
            AcceleratorView(id=f"{name}/gpu{i}", index=i, hbm_total_bytes=80 * GIB, domain=f"{name}/nv0")
            for i in range(gpus)
        ],
    )


def held(acc: str, *allocations: str, used: int = 0, available: bool = True) -> AcceleratorLedgerView:
    return AcceleratorLedgerView(
        id=acc,
        node=acc.split("/")[0],
        hbm_usable_bytes=76 * GIB,
        hbm_reserved_bytes=used,
        allocations=list(allocations),
        available=available,
    )


def reservation(
    rid: str, policy: str, accelerators: list[str], borrowers: Sequence[BorrowView] = ()
) -> ReservationStatusView:
    return ReservationStatusView(
        reservation_id=rid,
        tenant=f"owner-{rid}",
        policy=policy,
        accelerators=accelerators,
        owner_used=0,
        lent=len(borrowers),
        idle=0,
        fill_rate=0.5,
        idle_cost_usd_per_hour=1.0,
        borrowers=list(borrowers),
    )


FLEET = FleetGetReply(
    nodes=[
        node("a1"),
        node("a2"),
        node("b1", cluster="c2", sku="L40S"),
        node("e1", region="r2", state="lost", gpus=2),
    ],
    domains=[
        DomainView(id="a1/nv0", kind="fully_connected", members=[f"a1/gpu{i}" for i in range(4)]),
        DomainView(id="a2/nv0", kind="fully_connected", members=[f"a2/gpu{i}" for i in range(4)]),
    ],
)
LEDGER = SnapshotReply(
    accelerators=[
        held("a1/gpu0", "al-own", used=40 * GIB),  # the owner's replica on its reserved GPU: placed
        held("a1/gpu1", "al-borrow", used=20 * GIB),  # a borrower's replica on a reserved GPU: lent
        held("a1/gpu2"),  # reserved hard, idle
        held("a1/gpu3"),  # reserved soft, idle
        held("a2/gpu0", "al-x", used=10 * GIB),  # placed, not reserved
        held("a2/gpu1", "al-x", used=10 * GIB),
        held("a2/gpu2"),
        # a2/gpu3 is not in the ledger: topology and the ledger drifted apart
        *(held(f"b1/gpu{i}") for i in range(4)),
        held("e1/gpu0", available=False),
        held("e1/gpu1", available=False),
    ]
)
STATUSES = [
    ReservationStatusReply(
        reservations=[
            reservation(
                "res-s",
                "soft",
                ["a1/gpu0", "a1/gpu1", "a1/gpu3"],
                [BorrowView(allocation_id="al-borrow", tenant="globex", accelerators=["a1/gpu1"], lent_at=NOW)],
            ),
            reservation("res-h", "hard", ["a1/gpu2"]),
        ]
    )
]
REBALANCER = RebalanceStatusReply(
    detectors=[
        DetectorView(
            name="hbm_hot",
            threshold=0.85,
            window_s=60,
            state="firing",
            targets=[
                TargetView(key="al-x", phase="firing", since=NOW, value=0.93),
                TargetView(key="b1", phase="pending", since=NOW, value=0.9),  # pending: not an alert yet
            ],
        )
    ]
)


@pytest.fixture
def view() -> FleetView:
    return FleetView.of(FleetIndex.of(FLEET, version=3), LEDGER, Holdings.of(STATUSES, REBALANCER))


def test_each_gpu_has_one_state_reserved_ones_are_not_free(view: FleetView) -> None:
    assert view.nodes["a1"].states == "plhs"
    assert view.nodes["a2"].states == "ppff"
    assert view.nodes["b1"].states == "ffff"
    assert view.nodes["e1"].states == "xx"  # a lost node's GPUs are unavailable, whatever they held
    gpus = {g["id"]: g for g in view.node("a1")["gpus"]}
    assert [g["state"] for g in gpus.values()] == [PLACED, LENT, RESERVED_HARD, RESERVED_SOFT]
    assert gpus["a1/gpu1"]["borrowers"] == ["al-borrow"]
    assert gpus["a1/gpu2"]["reservation"] == {"id": "res-h", "tenant": "owner-res-h", "policy": "hard"}
    assert gpus["a1/gpu0"]["hbm_used_bytes"] == 40 * GIB and gpus["a1/gpu0"]["hbm_usable_bytes"] == 76 * GIB
    a2 = {g["id"]: g for g in view.node("a2")["gpus"]}
    assert a2["a2/gpu3"]["state"] == FREE and a2["a2/gpu3"]["in_ledger"] is False


def test_the_summary_counts_per_region_cluster_and_sku(view: FleetView) -> None:
    summary = view.summary()
    total = summary["total"]
    assert (total["nodes"], total["gpus"]) == (4, 14)
    assert {s: total[s] for s in (PLACED, LENT, RESERVED_HARD, RESERVED_SOFT, FREE, UNAVAILABLE)} == {
        PLACED: 3,
        LENT: 1,
        RESERVED_HARD: 1,
        RESERVED_SOFT: 1,
        FREE: 6,
        UNAVAILABLE: 2,
    }
    assert total["reserved"] == 2
    assert total["fill"] == round(4 / 14, 4)
    assert total["hbm_used_bytes"] == 80 * GIB
    # a2/gpu3 is not in the ledger: its usable HBM is its total (what topology says)
    assert total["hbm_total_bytes"] == 13 * 76 * GIB + 80 * GIB
    clusters = {row["key"]: row for row in summary["groups"]["cluster"]}
    assert set(clusters) == {"r1/c1", "r1/c2", "r2/c1"}  # a cluster is named with its region
    assert (clusters["r1/c1"]["nodes"], clusters["r1/c1"]["placed"], clusters["r1/c1"]["free"]) == (2, 3, 2)
    assert {row["key"]: row["gpus"] for row in summary["groups"]["sku"]} == {"H100": 10, "L40S": 4}
    assert {row["key"]: row["unavailable"] for row in summary["groups"]["region"]} == {"r1": 0, "r2": 2}


def test_alerts_lost_nodes_ledger_drift_and_firing_detectors(view: FleetView) -> None:
    assert view.nodes["e1"].alerts == ("node lost",)
    assert view.nodes["a2"].alerts == ("1 GPU(s) not in the ledger", "hbm_hot 0.93 on al-x")
    assert view.nodes["b1"].alerts == ()  # pending is not firing
    summary = view.summary()
    assert summary["alerts_total"] == 3
    assert {(a["node"], a["what"]) for a in summary["alerts"]} == {
        ("a2", "1 GPU(s) not in the ledger"),
        ("a2", "hbm_hot 0.93 on al-x"),
        ("e1", "node lost"),
    }
    assert {row["key"]: (row["alerts"], row["nodes_alerting"]) for row in summary["groups"]["region"]} == {
        "r1": (2, 1),
        "r2": (1, 1),
    }


def test_without_a_ledger_nothing_is_said_missing(view: FleetView) -> None:
    bare = FleetView.of(view.index, None)
    assert bare.nodes["a2"].alerts == ()
    assert bare.nodes["a1"].states == "ffff"


def test_a_group_a_page_at_a_time(view: FleetView) -> None:
    page = view.group_nodes("cluster", "r1/c1", offset=1, limit=1)
    assert (page["total"], page["offset"], [n["name"] for n in page["nodes"]]) == (2, 1, ["a2"])
    assert page["nodes"][0]["gpu_states"] == "ppff"
    assert view.group_nodes("sku", "H100", limit=500)["total"] == 3
    assert view.group_nodes("region", "r1", offset=10)["nodes"] == []


@pytest.mark.parametrize(
    ("grouping", "key", "offset", "limit", "status"),
    [
        ("rack", "k1", 0, 10, 400),
        ("cluster", "r1/c1", 0, 0, 400),
        ("cluster", "r1/c1", 0, 501, 400),
        ("cluster", "r1/c1", -1, 10, 400),
        ("cluster", "c1", 0, 10, 404),  # a cluster is named with its region
    ],
)
def test_bad_questions_are_refused(
    view: FleetView, grouping: str, key: str, offset: int, limit: int, status: int
) -> None:
    with pytest.raises(ViewError) as refused:
        view.group_nodes(grouping, key, offset=offset, limit=limit)
    assert refused.value.status == status


def test_a_node_detail_with_its_nvlink_edges(view: FleetView) -> None:
    links = [["X" if i == j else "NV18" for j in range(4)] for i in range(4)]
    profile = NodeProfilePayload(
        name="a1",
        region="r1",
        cluster="c1",
        rack="k1",
        sku="H100",
        links=links,
        accelerators=[AcceleratorProfile(index=i, sku="H100", hbm_bytes=80 * GIB) for i in range(4)],
    )
    detail = view.node("a1", profile=profile)
    assert detail["allocations"] == ["al-borrow", "al-own"]
    assert [d["id"] for d in detail["domains"]] == ["a1/nv0"]
    assert len(detail["domains"][0]["edges"]) == 6
    assert view.node("a1")["domains"][0]["edges"] == []  # no profile: GPUs, no edges
    with pytest.raises(ViewError) as refused:
        view.node("nope")
    assert refused.value.status == 404


def test_the_summary_document_holds_no_gpu(view: FleetView) -> None:
    report = ReservationReportReply(reserved=4, lent=1, by_tenant={"owner-res-s": 0.5})
    labels = {"al-x": {"tenant": "t", "model": "m"}, "al-other": {"tenant": "u", "model": "n"}}
    document = summary_document(
        view,
        now=NOW,
        errors={},
        reservations=reservations_summary(report, STATUSES),
        rebalancer=REBALANCER,
        placements=[{"allocation_id": "al-x"}],
        allocations=labels,
        cross_domain_used={},
    )
    assert document["fleet"]["total"]["gpus"] == 14
    assert document["allocations"] == {"al-x": {"tenant": "t", "model": "m"}}  # labels of the rows shown only
    rows = document["reservations"]["reservations"]
    assert [(r["reservation_id"], r["accelerators_count"]) for r in rows] == [("res-s", 3), ("res-h", 1)]
    assert "a1/gpu0" not in json.dumps(document)  # no accelerator id: the drill-down says which GPU


def test_the_1024_node_fleet_summary_stays_small() -> None:
    """The placement benchmark's fleet: every fourth GPU placed, every tenth reserved; the summary's JSON is
    a few kilobytes and the fold takes a few tens of milliseconds (printed, not asserted)."""
    fleet = fleet_reply(bench_fleet(1024)[0])
    gpus = [a.id for n in fleet.nodes for a in n.accelerators]
    ledger = SnapshotReply(
        accelerators=[held(a, f"al-{i}", used=GIB) if i % 4 == 0 else held(a) for i, a in enumerate(gpus)]
    )
    reserved = [a for i, a in enumerate(gpus) if i % 10 == 1]
    statuses = [ReservationStatusReply(reservations=[reservation("res-big", "soft", reserved)])]
    started = time.perf_counter()
    index = FleetIndex.of(fleet)
    indexed = time.perf_counter()
    view = FleetView.of(index, ledger, Holdings.of(statuses))
    folded = time.perf_counter()
    body = json.dumps(view.summary())
    total = view.summary()["total"]
    assert (total["nodes"], total["gpus"]) == (1024, len(gpus))
    assert total["placed"] == len(range(0, len(gpus), 4))
    assert total["reserved_soft"] == len(reserved)
    assert len(body) < 64_000, len(body)
    print(
        f"\n1024 nodes / {len(gpus)} GPUs: index {1000 * (indexed - started):.0f} ms, "
        f"fold {1000 * (folded - indexed):.0f} ms, summary {len(body)} bytes"
    )


def fleet_reply(inventory: dict[str, Any]) -> FleetGetReply:
    """An inventory document as topology would list it (one NVLink domain per node; no profiles)."""
    nodes = []
    for region in inventory["regions"]:
        for cluster in region["clusters"]:
            for rack in cluster["racks"]:
                for n in rack["nodes"]:
                    nodes.append(
                        NodeView(
                            name=n["name"],
                            region=region["name"],
                            cluster=cluster["name"],
                            rack=rack["name"],
                            sku=n["sku"],
                            kind=n["topology"],
                            accelerators=[
                                AcceleratorView(id=f"{n['name']}/gpu{i}", index=i, hbm_total_bytes=80 * GIB)
                                for i in range(n["gpus"])
                            ],
                        )
                    )
    return FleetGetReply(nodes=nodes, total_nodes=len(nodes))


def test_the_benchmark_fleet_is_the_benchmark_s() -> None:
    fleet, gpus = bench_fleet(16)
    assert fleet == bench_fleet(16)[0]  # seeded: the same fleet every time
    assert gpus == sum(
        n["gpus"] for r in fleet["regions"] for c in r["clusters"] for k in c["racks"] for n in k["nodes"]
    )
    assert fleet["tpu_pods"] == []
