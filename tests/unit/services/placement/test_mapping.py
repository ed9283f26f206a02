"""Placement's contract <-> domain mapping: the view seeded from `fleet.get` / `ledger.snapshot` and fed
the TOPOLOGY and LEDGER events as their contract payloads."""

from __future__ import annotations

from services.placement.mapping import apply_event, view_from
from shared.contracts.fleet import FleetGetReply, NodeView, RackView, TpuPodView
from shared.contracts.ledger import (
    AcceleratorBalance,
    AcceleratorLedgerView,
    AllocationEvent,
    CapacityChangedEvent,
    LedgerEvent,
    ShareOut,
    SnapshotReply,
)
from shared.contracts.topology import NodeProfileEvent, NodeStateEvent, TopologyEvent, TpuPodEvent
from shared.domain.fleet import AcceleratorId
from shared.domain.memory import usable_hbm
from shared.infra.profiles import profile_to_payload
from tests.unit.placement.builders import models, node, skus

USABLE = usable_hbm(skus()["H100-SXM-80GB"].hbm_bytes)
GB = 10**9


def rows(name: str, *, reserved: int = 0, allocation: str | None = None) -> list[AcceleratorLedgerView]:
    return [
        AcceleratorLedgerView(
            id=AcceleratorId.gpu(name, i),
            node=name,
            hbm_usable=USABLE,
            hbm_reserved=reserved,
            allocations=[allocation] if allocation else [],
        )
        for i in range(8)
    ]


def allocation(name: str, allocation_id: str, nbytes: int, *, counts: bool = True) -> AllocationEvent:
    return AllocationEvent(
        allocation_id=allocation_id,
        request_id="r",
        tenant="t",
        kind="replica" if counts else "request",
        counts_against_hbm=counts,
        shares=[
            ShareOut(
                accelerator_id=AcceleratorId.gpu(name, 0), weights=nbytes, kv=0, activation=0, workspace=0, total=nbytes
            )
        ],
    )


def test_a_view_seeded_from_the_snapshots_follows_the_events() -> None:
    profile = node("n1").nvswitch(8).profile()
    fleet = FleetGetReply(
        nodes=[
            NodeView(
                name="n1",
                region="us-west-1",
                cluster="c1",
                rack="r1",
                sku="H100-SXM-80GB",
                profile=profile_to_payload(profile),
            )
        ],
        racks=[RackView(region="us-west-1", cluster="c1", name="r1", power_kw=40.0)],
        tpu_pods=[TpuPodView(name="p1", region="us-west-1", type="v5e", shape=[2, 2], chips=4, cluster="c9")],
    )
    ledger = SnapshotReply(accelerators=rows("n1", reserved=GB, allocation="al-0"))
    view = view_from(
        fleet=fleet, profiles={"n1": profile_to_payload(profile)}, ledger=ledger, skus=skus(), models=models()
    )
    gpu0 = AcceleratorId.gpu("n1", 0)
    assert view.snapshot.capacity[gpu0].reserved == GB
    assert view.snapshot.racks[("us-west-1", "c1", "r1")].power_kw == 40.0
    assert view.pods["p1"].cluster == "c9"

    apply_event(view, LedgerEvent.ALLOCATION_COMMITTED, allocation("n1", "al-0", GB))  # in the snapshot
    apply_event(view, LedgerEvent.ALLOCATION_COMMITTED, allocation("n1", "al-1", 2 * GB))
    apply_event(view, LedgerEvent.ALLOCATION_COMMITTED, allocation("n1", "al-q", 5 * GB, counts=False))
    assert view.snapshot.capacity[gpu0].reserved == 3 * GB
    apply_event(view, LedgerEvent.ALLOCATION_EXPIRED, allocation("n1", "al-0", GB))
    assert view.snapshot.capacity[gpu0].reserved == 2 * GB

    lost = NodeStateEvent(node="n1", region="us-west-1", accelerators=[gpu0])
    apply_event(view, TopologyEvent.NODE_LOST, lost)
    assert "n1" not in view.snapshot.nodes
    apply_event(view, TopologyEvent.NODE_RECOVERED, lost)
    down = AcceleratorBalance(id=gpu0, usable=USABLE, reserved=0, available=False)
    apply_event(view, LedgerEvent.CAPACITY_CHANGED, CapacityChangedEvent(node="n1", reason="lost", accelerators=[down]))
    cap = view.snapshot.capacity[gpu0]
    assert "n1" in view.snapshot.nodes and not cap.available and cap.reserved == 2 * GB

    other = node("n2").nvswitch(8).profile()
    apply_event(
        view,
        TopologyEvent.NODE_PROFILED,
        NodeProfileEvent(
            node="n2", region="us-west-1", kind="nvswitch", fingerprint="f", profile=profile_to_payload(other)
        ),
    )
    assert "n2" in view.profiles and "n2" not in view.snapshot.nodes  # the ledger does not know its GPUs yet
    balances = [AcceleratorBalance(id=r.id, usable=USABLE, reserved=0, available=True) for r in rows("n2")]
    apply_event(
        view, LedgerEvent.CAPACITY_CHANGED, CapacityChangedEvent(node="n2", reason="profiled", accelerators=balances)
    )
    assert "n2" in view.snapshot.nodes
    apply_event(view, TopologyEvent.NODE_REMOVED, NodeStateEvent(node="n2", region="us-west-1", accelerators=[]))
    assert "n2" not in view.snapshot.nodes

    pod = TpuPodEvent(pod="p1", region="us-west-1", type="v5e", shape=[2, 2], sku="TPU-V5E", hbm_per_chip=16 * GB)
    apply_event(view, TopologyEvent.TPU_POD_PROFILED, pod)
    assert view.pods["p1"].cluster == "c9"  # kept from fleet.get: the event does not carry it
