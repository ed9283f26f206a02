"""The read model's fold beyond bytes (``shared.domain.placement.view``): which GPUs shared replicas hold
(``AcceleratorCapacity.shared``), the cross-domain traffic per cluster (added when an allocation that
crosses is counted, given back when it ends, each once), and each node's PCIe utilisation from GPU
telemetry (the lowest sample over the window)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from shared.domain.capacity import AcceleratorCapacity
from shared.domain.memory import usable_hbm
from shared.domain.placement.view import (
    FleetView,
    LedgerMirror,
    PcieSample,
    PcieWindow,
    link_bytes_per_s,
    pcie_utilisation,
)
from tests.unit.placement.builders import models, node, skus

GB = 10**9
H100 = skus()["H100-SXM-80GB"]
USABLE = usable_hbm(H100.hbm_bytes)
T0 = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)
GEN5_X16 = link_bytes_per_s(5, 16)  # one direction: 3.938 GB/s x 16 lanes


def rows(name: str, **held: tuple[int, str, bool]) -> list[AcceleratorCapacity]:
    """The ledger's rows of one 8-GPU node; ``gpu0=(5, "al-x", True)``: 5 GB held by a shared al-x."""
    out = []
    for i in range(8):
        nbytes, allocation, shared = held.get(f"gpu{i}", (0, "", False))
        out.append(
            AcceleratorCapacity.of_ledger(
                id=f"{name}/gpu{i}",
                node=name,
                usable=USABLE,
                reserved=nbytes * GB,
                allocations=(allocation,) if allocation else (),
                shared=shared,
            )
        )
    return out


def view_of(
    ledger: list[AcceleratorCapacity] | None = None,
    *,
    cross_domain_used: dict[str, float] | None = None,
    crossing: dict[str, tuple[str, float]] | None = None,
    pcie_window_s: float = 60.0,
) -> FleetView:
    return FleetView(
        skus=skus(),
        models=models(),
        nodes=[(node("n1").nvswitch(8).profile(), True)],
        ledger=LedgerMirror(ledger or rows("n1"), cross_domain_used=cross_domain_used, crossing=crossing),
        pcie_window_s=pcie_window_s,
    )


def shared(view: FleetView, acc: str = "n1/gpu0") -> bool:
    return view.snapshot.capacity[acc].shared


# -- shared GPUs ------------------------------------------------------------------------------------


def test_a_gpu_is_shared_while_only_shared_replicas_hold_it() -> None:
    view = view_of()
    assert not shared(view)  # idle
    view.allocation_moved("al-s1", key=("t", "r1"), delta={"n1/gpu0": 10 * GB}, shared=True)
    assert shared(view)
    view.allocation_moved("al-s2", key=("t", "r2"), delta={"n1/gpu0": 10 * GB}, shared=True)
    view.allocation_moved("al-s1", key=("t", "r1"), delta={"n1/gpu0": -10 * GB})
    assert shared(view) and view.snapshot.capacity["n1/gpu0"].reserved == 10 * GB
    view.allocation_moved("al-s2", key=("t", "r2"), delta={"n1/gpu0": -10 * GB})
    assert not shared(view)  # idle again


def test_an_exclusive_holder_makes_a_gpu_not_shared() -> None:
    view = view_of()
    view.allocation_moved("al-x", key=("t", "r"), delta={"n1/gpu1": 10 * GB})
    assert not shared(view, "n1/gpu1") and view.snapshot.capacity["n1/gpu1"].reserved == 10 * GB


def test_the_snapshot_seeds_shared_gpus_and_their_events_count_once() -> None:
    view = view_of(rows("n1", gpu0=(10, "al-s", True), gpu1=(10, "al-x", False)))
    assert shared(view, "n1/gpu0") and not shared(view, "n1/gpu1")
    view.allocation_moved("al-s", key=("t", "r"), delta={"n1/gpu0": 10 * GB}, shared=True)  # in the snapshot
    assert view.snapshot.capacity["n1/gpu0"].reserved == 10 * GB
    view.allocation_moved("al-s", key=("t", "r"), delta={"n1/gpu0": -10 * GB})
    assert not shared(view, "n1/gpu0")


def test_assumed_commits_count_as_shared_or_exclusive_until_the_ledger_answers() -> None:
    view = view_of()
    token = view.assume(("t", "placement/r"), {"n1/gpu2": 5 * GB}, shared=True)
    assert shared(view, "n1/gpu2")
    exclusive = view.assume(("t", "placement/x"), {"n1/gpu2": 5 * GB})
    assert not shared(view, "n1/gpu2")  # an exclusive decision in flight there: nobody may join
    view.forget(exclusive)
    view.confirm(token, "al-r")
    assert shared(view, "n1/gpu2") and view.snapshot.capacity["n1/gpu2"].reserved == 5 * GB


# -- cross-domain traffic per cluster -----------------------------------------------------------------


def test_cross_domain_traffic_follows_allocations_once_each() -> None:
    view = view_of()
    assert view.snapshot.cross_domain_used == {}
    commit = {"n1/gpu0": GB, "n1/gpu4": GB}
    view.allocation_moved("al-c", key=("t", "r"), delta=commit, crossing=("c1", 40e9))
    view.allocation_moved("al-c", key=("t", "r"), delta=commit, crossing=("c1", 40e9))  # redelivered
    assert view.snapshot.cross_domain_used == {"c1": 40e9}
    view.allocation_moved("al-c", key=("t", "r"), delta={a: -b for a, b in commit.items()}, crossing=("c1", 40e9))
    assert view.snapshot.cross_domain_used == {}
    view.allocation_moved("al-c", key=("t", "r"), delta={a: -b for a, b in commit.items()}, crossing=("c1", 40e9))
    assert view.snapshot.cross_domain_used == {}  # an end seen twice gives back once


def test_the_snapshot_seeds_cross_domain_traffic_and_an_end_gives_it_back() -> None:
    view = view_of(
        rows("n1", gpu0=(1, "al-c", False), gpu4=(1, "al-c", False)),
        cross_domain_used={"c1": 40e9},
        crossing={"al-c": ("c1", 40e9)},
    )
    assert view.snapshot.cross_domain_used == {"c1": 40e9}
    view.allocation_moved("al-c", key=("t", "r"), delta={"n1/gpu0": GB, "n1/gpu4": GB}, crossing=("c1", 40e9))
    assert view.snapshot.cross_domain_used == {"c1": 40e9}  # the commit the snapshot holds: once
    view.allocation_moved("al-c", key=("t", "r"), delta={"n1/gpu0": -GB, "n1/gpu4": -GB}, crossing=("c1", 40e9))
    assert view.snapshot.cross_domain_used == {}


def test_an_end_the_snapshot_no_longer_counted_gives_nothing_back() -> None:
    # Read across pages: the accelerators still name al-c, the cluster totals (newer) no longer do.
    view = view_of(rows("n1", gpu0=(1, "al-c", False)), cross_domain_used={"c1": 10e9}, crossing={"al-o": ("c1", 10e9)})
    view.allocation_moved("al-c", key=("t", "r"), delta={"n1/gpu0": -GB}, crossing=("c1", 40e9))
    assert view.snapshot.cross_domain_used == {"c1": 10e9}


def test_an_assumed_cross_domain_commit_counts_until_confirmed_or_forgotten() -> None:
    view = view_of()
    token = view.assume(("t", "placement/r"), {"n1/gpu0": GB, "n1/gpu4": GB}, crossing=("c1", 30e9))
    assert view.snapshot.cross_domain_used == {"c1": 30e9}
    view.forget(token)
    assert view.snapshot.cross_domain_used == {}
    token = view.assume(("t", "placement/r"), {"n1/gpu0": GB, "n1/gpu4": GB}, crossing=("c1", 30e9))
    view.confirm(token, "al-r")
    view.allocation_moved("al-r", key=("t", "placement/r"), delta={"n1/gpu0": GB, "n1/gpu4": GB}, crossing=("c1", 30e9))
    assert view.snapshot.cross_domain_used == {"c1": 30e9}  # its event, after the confirmation: once


# -- PCIe utilisation -----------------------------------------------------------------------------------


def sample(util_gpu0: float, util_gpu1: float = 0.0) -> list[PcieSample]:
    """Two GPUs' traffic at the given shares of a Gen5 x16 direction, split between rx and tx."""
    return [
        PcieSample(index=0, rx_bytes_per_s=util_gpu0 * GEN5_X16 * 0.75, tx_bytes_per_s=util_gpu0 * GEN5_X16 * 0.25),
        PcieSample(index=1, rx_bytes_per_s=util_gpu1 * GEN5_X16, tx_bytes_per_s=None),
    ]


def test_a_nodes_utilisation_is_its_busiest_gpus_traffic_over_its_link() -> None:
    profile = node("n1").nvswitch(8).profile()
    assert pcie_utilisation(profile, skus(), sample(0.3, 0.8)) == pytest.approx(0.8)
    assert pcie_utilisation(profile, skus(), [PcieSample(index=0, rx_bytes_per_s=3 * GEN5_X16)]) == 1.0  # capped
    assert pcie_utilisation(profile, skus(), [PcieSample(index=0)]) is None  # nothing reported
    assert pcie_utilisation(profile, skus(), [PcieSample(index=42, rx_bytes_per_s=1e9)]) is None  # no such GPU
    assert GEN5_X16 == pytest.approx(63.0e9, rel=1e-3)


def test_a_node_counts_as_busy_only_when_it_stayed_busy_for_the_window() -> None:
    view = view_of()
    view.gpu_telemetry("n1", T0, sample(0.9))
    assert view.snapshot.pcie_util == {}  # watched for less than a window: unknown
    view.gpu_telemetry("n1", T0 + timedelta(seconds=30), sample(0.8))
    assert view.snapshot.pcie_util == {}
    view.gpu_telemetry("n1", T0 + timedelta(seconds=60), sample(0.85))
    assert view.snapshot.pcie_util == {"n1": pytest.approx(0.8)}  # the lowest of the window
    view.gpu_telemetry("n1", T0 + timedelta(seconds=75), sample(0.2))  # one quiet sample clears it
    assert view.snapshot.pcie_util["n1"] == pytest.approx(0.2)
    for k in range(1, 5):
        view.gpu_telemetry("n1", T0 + timedelta(seconds=75 + 20 * k), sample(0.95))
    # The window ending at 155 s starts at 95 s: the 75 s sample (0.2) no longer counts.
    assert view.snapshot.pcie_util["n1"] == pytest.approx(0.95)


def test_window_zero_takes_the_latest_sample_and_old_or_foreign_samples_change_nothing() -> None:
    view = view_of(pcie_window_s=0)
    view.gpu_telemetry("n1", T0, sample(0.8))
    assert view.snapshot.pcie_util == {"n1": pytest.approx(0.8)}
    view.gpu_telemetry("n1", T0 - timedelta(seconds=1), sample(0.1))  # older than the latest: a replay
    view.gpu_telemetry("nobody", T0, sample(0.1))  # no profile: no link to measure against
    assert view.snapshot.pcie_util == {"n1": pytest.approx(0.8)}
    view.node_removed("n1")
    assert view.snapshot.pcie_util == {}


def test_the_pcie_window_keeps_one_sample_before_the_window_as_its_start() -> None:
    window = PcieWindow(10)
    assert window.observe("n", T0, 0.9) is False  # not covered yet: unknown stays unknown
    assert window.observe("n", T0 + timedelta(seconds=4), 0.7) is False
    assert window.observe("n", T0 + timedelta(seconds=12), 0.8) is True
    assert window.util == {"n": 0.7}  # [2 s, 12 s]: the 0 s sample holds the value at 2 s, then 0.7, 0.8
    assert window.observe("n", T0 + timedelta(seconds=15), 0.9) is False
    assert window.util == {"n": 0.7}  # [5 s, 15 s] starts with the 4 s sample's 0.7
    assert window.observe("n", T0 + timedelta(seconds=23), 0.9) is True
    assert window.util == {"n": 0.8}  # [13 s, 23 s] starts with the 12 s sample's 0.8


def test_a_resynced_view_keeps_the_pcie_windows_of_the_one_it_replaces() -> None:
    old = view_of(pcie_window_s=0)
    old.gpu_telemetry("n1", T0, sample(0.9))
    new = view_of(pcie_window_s=0)
    new.adopt(old)
    assert new.snapshot.pcie_util == {"n1": pytest.approx(0.9)}
