"""The fold behind placement's read model (``shared.domain.placement.view``): seeded from snapshots, fed
events, idempotent per (allocation, accelerator), with the decisions' own assumptions on top."""

from __future__ import annotations

import random

import pytest

from shared.domain.capacity import AcceleratorCapacity
from shared.domain.memory import usable_hbm
from shared.domain.placement import decide
from shared.domain.placement.view import FleetView, LedgerMirror, overlay, reservation
from shared.domain.topology.tpu import TpuType
from tests.unit.placement.builders import models, node, request, skus, tpu_pod

GB = 10**9
H100 = skus()["H100-SXM-80GB"]
USABLE = usable_hbm(H100.hbm_bytes)
KEY = ("acme", "placement/r-1")


def ledger_rows(name: str, gpus: int = 8, **reserved: int) -> list[AcceleratorCapacity]:
    """The ledger's rows for one node; ``gpu3=5`` reserves 5 GB on gpu3 (for allocation ``al-gpu3``)."""
    rows = []
    for i in range(gpus):
        held = reserved.get(f"gpu{i}", 0) * GB
        rows.append(
            AcceleratorCapacity.of_ledger(
                id=f"{name}/gpu{i}",
                node=name,
                usable=USABLE,
                reserved=held,
                allocations=(f"al-gpu{i}",) if held else (),
            )
        )
    return rows


def view_of(*names: str, rows: list[AcceleratorCapacity] | None = None, pods: tuple[str, ...] = ()) -> FleetView:
    profiles = [(node(n).nvswitch(8).profile(), True) for n in names]
    pod_list = [(tpu_pod(p, shape=(4, 4)), None) for p in pods]
    if rows is None:
        rows = [r for n in names for r in ledger_rows(n)]
    return FleetView(skus=skus(), models=models(), nodes=profiles, pods=pod_list, ledger=LedgerMirror(rows))


def commit(
    view: FleetView, allocation_id: str, shares: list[tuple[str, int]], key: tuple[str, str] = ("t", "r")
) -> None:
    """An `allocation_committed` event as the ledger's fold turns it into bytes per accelerator."""
    view.allocation_moved(allocation_id, key=key, delta=dict(shares))


def end(view: FleetView, allocation_id: str, shares: list[tuple[str, int]]) -> None:
    """An `allocation_released` / `allocation_expired` event."""
    view.allocation_moved(allocation_id, key=("t", "r"), delta={acc: -nbytes for acc, nbytes in shares})


def reserved(view: FleetView, acc: str) -> int:
    return view.snapshot.capacity[acc].reserved


# -- the ledger's part --------------------------------------------------------------------------


def test_a_commit_the_snapshot_holds_is_not_counted_twice() -> None:
    view = view_of("n1", rows=ledger_rows("n1", gpu0=10))
    commit(view, "al-gpu0", [("n1/gpu0", 10 * GB)], ("t", "r"))
    assert reserved(view, "n1/gpu0") == 10 * GB


def test_a_release_of_an_allocation_never_seen_is_ignored() -> None:
    view = view_of("n1", rows=ledger_rows("n1", gpu0=10))
    end(view, "al-elsewhere", [("n1/gpu0", 10 * GB)])
    assert reserved(view, "n1/gpu0") == 10 * GB


def test_commit_then_release_after_the_snapshot_nets_to_nothing_once() -> None:
    view = view_of("n1")
    commit(view, "al-1", [("n1/gpu0", 7 * GB), ("n1/gpu1", 7 * GB)], ("t", "r"))
    commit(view, "al-1", [("n1/gpu0", 7 * GB), ("n1/gpu1", 7 * GB)], ("t", "r"))  # again
    assert reserved(view, "n1/gpu0") == 7 * GB
    end(view, "al-1", [("n1/gpu0", 7 * GB), ("n1/gpu1", 7 * GB)])
    end(view, "al-1", [("n1/gpu0", 7 * GB), ("n1/gpu1", 7 * GB)])  # redelivered
    assert reserved(view, "n1/gpu0") == reserved(view, "n1/gpu1") == 0


def test_a_commit_half_in_a_paged_snapshot_counts_only_the_other_half() -> None:
    # Page 1 (gpu0) was read before al-9 committed, page 2 (gpu1) after: the event adds gpu0 only.
    rows = ledger_rows("n1")
    rows[1] = AcceleratorCapacity.of_ledger(
        id="n1/gpu1", node="n1", usable=USABLE, reserved=3 * GB, allocations=("al-9",)
    )
    view = view_of("n1", rows=rows)
    commit(view, "al-9", [("n1/gpu0", 3 * GB), ("n1/gpu1", 3 * GB)], ("t", "r"))
    assert (reserved(view, "n1/gpu0"), reserved(view, "n1/gpu1")) == (3 * GB, 3 * GB)


def test_capacity_changes_keep_the_reserved_bytes_the_allocations_say() -> None:
    view = view_of("n1", rows=ledger_rows("n1", gpu0=10))
    stale = AcceleratorCapacity.of_ledger(id="n1/gpu0", node="n1", usable=USABLE, reserved=0, available=False)
    view.capacity_changed([stale])
    cap = view.snapshot.capacity["n1/gpu0"]
    assert (cap.reserved, cap.available, cap.free) == (10 * GB, False, 0)


# -- topology -----------------------------------------------------------------------------------


def test_a_node_is_placed_on_once_the_ledger_knows_all_its_gpus() -> None:
    view = view_of()
    view.node_profiled(node("n2").nvswitch(8).profile())
    assert "n2" not in view.snapshot.nodes
    view.capacity_changed(ledger_rows("n2")[:4])
    assert "n2" not in view.snapshot.nodes
    view.capacity_changed(ledger_rows("n2")[4:])
    assert "n2" in view.snapshot.nodes and len(view.snapshot.capacity) == 8


def test_lost_nodes_leave_the_snapshot_and_come_back_on_recovery() -> None:
    view = view_of("n1", "n2")
    view.node_up("n1", False)
    assert set(view.snapshot.nodes) == {"n2"} and "n1/gpu0" not in view.snapshot.capacity
    view.node_up("n1", True)
    assert set(view.snapshot.nodes) == {"n1", "n2"}
    view.node_removed("n2")
    assert set(view.snapshot.nodes) == {"n1"}


def test_a_region_whose_nodes_are_all_lost_is_still_known() -> None:
    """Its nodes lost, us-west-1 is still a region a request may name: refused for capacity (it may wait),
    not as unknown; a region the view never heard of is bad input naming the known ones."""
    view = view_of("n1")
    view.node_up("n1", False)
    assert view.snapshot.nodes == {}
    lost = decide(view.snapshot, request(region="us-west-1"))
    assert lost.error_code == "no_capacity", lost.message
    never = decide(view.snapshot, request(region="mars-1"))
    assert (never.error_code, never.message) == ("invalid_request", "unknown region 'mars-1'; known: us-west-1")


def test_tpu_chips_with_bytes_reserved_are_taken() -> None:
    pod = tpu_pod("p1", shape=(4, 4))
    hbm = skus()["TPU-V5E"].hbm_bytes
    chips = [
        AcceleratorCapacity.of_ledger(id=f"p1/{x}.{y}", node="p1", usable=usable_hbm(hbm), reserved=0)
        for x in range(4)
        for y in range(4)
    ]
    view = view_of(rows=chips, pods=("p1",))
    assert view.snapshot.tpu_pods["p1"].grid.free_chips == 16
    commit(view, "al-t", [("p1/0.0", 1), ("p1/0.1", 1)], ("t", "r"))
    assert view.snapshot.tpu_pods["p1"].grid.free_chips == 14
    assert view.snapshot.tpu_pods["p1"].pod.type is TpuType.V5E and pod.name == "p1"


# -- assumptions --------------------------------------------------------------------------------


def test_assume_counts_now_and_forget_gives_it_back_once() -> None:
    view = view_of("n1")
    token = view.assume(KEY, {"n1/gpu0": 20 * GB})
    assert reserved(view, "n1/gpu0") == 20 * GB and view.assumed == 1
    view.forget(token)
    view.forget(token)
    assert reserved(view, "n1/gpu0") == 0 and view.assumed == 0


def test_a_confirmed_assumption_is_not_counted_again_by_its_event() -> None:
    view = view_of("n1")
    token = view.assume(KEY, {"n1/gpu0": 20 * GB})
    view.confirm(token, "al-1")
    commit(view, "al-1", [("n1/gpu0", 20 * GB)], KEY)
    assert reserved(view, "n1/gpu0") == 20 * GB and view.assumed == 0
    end(view, "al-1", [("n1/gpu0", 20 * GB)])
    assert reserved(view, "n1/gpu0") == 0


def test_an_event_before_the_commit_reply_ends_the_assumption() -> None:
    view = view_of("n1")
    token = view.assume(KEY, {"n1/gpu0": 20 * GB})
    commit(view, "al-1", [("n1/gpu0", 20 * GB)], KEY)
    assert reserved(view, "n1/gpu0") == 20 * GB and view.assumed == 0
    view.confirm(token, "al-1")  # the reply, late: nothing more
    view.forget(token)
    assert reserved(view, "n1/gpu0") == 20 * GB


def test_a_new_view_adopts_the_assumptions_in_flight() -> None:
    old = view_of("n1")
    token = old.assume(KEY, {"n1/gpu0": 20 * GB})
    new = view_of("n1")
    new.adopt(old)
    assert reserved(new, "n1/gpu0") == 20 * GB
    new.forget(token)
    assert reserved(new, "n1/gpu0") == 0


def test_reservation_holds_a_tpu_slice_whole() -> None:
    view = view_of(
        rows=[
            AcceleratorCapacity.of_ledger(id=f"p1/{x}.{y}", node="p1", usable=1, reserved=0)
            for x in range(4)
            for y in range(4)
        ],
        pods=("p1",),
    )
    decision = decide(view.snapshot, request("llama3-8b", backend="tpu"))
    assert decision.placed and decision.tpu is not None
    held = reservation(view.snapshot, decision)
    assert set(held) == set(decision.tpu.chips)
    assert {share.total for share in held.values()} == {view.snapshot.tpu_pods["p1"].usable_per_chip}


# -- the snapshot -------------------------------------------------------------------------------


def test_the_incremental_snapshot_equals_a_fresh_build() -> None:
    rng = random.Random(3)
    view = view_of("n1", "n2", "n3")
    live: dict[str, list[tuple[str, int]]] = {}
    tokens: list[int] = []
    for step in range(200):
        _ = view.snapshot  # decisions read it between events
        move = rng.random()
        if move < 0.4:
            accs = rng.sample([f"n{n}/gpu{i}" for n in (1, 2, 3) for i in range(8)], rng.randint(1, 4))
            live[f"al-{step}"] = [(a, rng.randint(1, 5) * GB) for a in accs]
            commit(view, f"al-{step}", live[f"al-{step}"], ("t", str(step)))
        elif move < 0.7 and live:
            allocation = rng.choice(sorted(live))
            end(view, allocation, live.pop(allocation))
        elif move < 0.85:
            tokens.append(view.assume(("t", f"a{step}"), {f"n{rng.randint(1, 3)}/gpu{rng.randint(0, 7)}": GB}))
        elif tokens:
            view.forget(tokens.pop(rng.randrange(len(tokens))))
    incremental = view.snapshot
    view._snapshot = None  # force a rebuild from the same state
    assert incremental == view.snapshot


def test_overlay_takes_the_fresher_figures_of_a_conflict() -> None:
    view = view_of("n1")
    fresher = {"n1/gpu0": AcceleratorCapacity.of_ledger(id="n1/gpu0", node="n1", usable=USABLE, reserved=50 * GB)}
    after = overlay(view.snapshot, fresher)
    assert after.capacity["n1/gpu0"].reserved == 50 * GB and view.snapshot.capacity["n1/gpu0"].reserved == 0
    assert after.rack_power_used_w[("us-west-1", "c1", "r1")] == pytest.approx(H100.tdp_w)
    assert overlay(view.snapshot, {}) is view.snapshot
