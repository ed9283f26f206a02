"""Withholding accelerators from one decision: the snapshot as a decision may use it, with some GPUs
unavailable and some TPU chips taken. What a tenant may not use (another tenant's reservation), what a
replica being moved must leave (the rebalancer's ``avoid_accelerators``), a node placement must not load
(a PCIe throttle)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from shared.domain.fleet import AcceleratorId
from shared.domain.placement.types import FleetSnapshot
from shared.domain.topology.tpu import occupy


def withhold(snapshot: FleetSnapshot, accelerators: Iterable[str]) -> FleetSnapshot:
    """``snapshot`` with these accelerators unusable by the decision at hand: GPUs unavailable, TPU chips
    taken (what a tenant may not use, or what a replica being moved must leave). Ids the snapshot does
    not know are ignored."""
    capacity = dict(snapshot.capacity)
    changed: set[str] = set()
    chips: dict[str, list[tuple[int, ...]]] = {}
    for acc in accelerators:
        cap = capacity.get(acc)
        if cap is not None:
            if cap.available:
                capacity[acc] = replace(cap, available=False)
                changed.add(acc)
            continue
        try:
            parsed = AcceleratorId.parse(acc)
        except ValueError:
            continue
        if parsed.chip is not None and parsed.host in snapshot.tpu_pods:
            chips.setdefault(parsed.host, []).append(parsed.chip)
    pods = dict(snapshot.tpu_pods)
    touched: set[str] = set()
    for pod, coords in chips.items():
        state = pods[pod]
        try:
            grid = occupy(state.grid, coords)
        except ValueError:
            continue
        if grid is not state.grid:
            pods[pod] = replace(state, grid=grid)
            touched.add(pod)
    if not changed and not touched:
        return snapshot
    return snapshot.evolve(
        capacity=capacity if changed else None,
        tpu_pods=pods if touched else None,
        changed=(frozenset(changed), frozenset(), frozenset(touched)),
    )
