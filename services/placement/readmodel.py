"""Placement's view of the fleet: topology (nodes, racks, TPU pods) and the ledger's capacity, read
from their tables and kept fresh — re-read on every topology/ledger event (debounced) and at least
every `HETSCHED_PLACEMENT_REFRESH_MS`. A stale view costs a retry, never an over-commit: the ledger
checks every commit against its own rows."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from sqlalchemy import text

from shared.domain.fleet import NodeProfile, Rack, TpuPod, profile_from_dict, tpu_chip_ids
from shared.domain.hardware import Sku
from shared.domain.models import ModelSpec
from shared.domain.placement.types import AcceleratorCapacity, Decision, FleetSnapshot, TpuPodState, apply
from shared.domain.topology.tpu import TpuGrid, TpuType
from shared.infra.service import Runtime

RackKey = tuple[str, str, str]


class ReadModel:
    def __init__(self, runtime: Runtime, *, skus: Mapping[str, Sku], models: Mapping[str, ModelSpec]) -> None:
        self.runtime = runtime
        self.skus = dict(skus)
        self.models = dict(models)
        self.nodes: dict[str, NodeProfile] = {}
        self.racks: dict[RackKey, Rack] = {}
        self.pods: dict[str, TpuPod] = {}
        self.snapshot = FleetSnapshot(
            nodes={}, capacity={}, racks={}, rack_power_used_w={}, tpu_pods={}, skus=self.skus, models=self.models
        )
        self._topology_dirty = True
        self._dirty = asyncio.Event()
        self._lock = asyncio.Lock()
        self.chips: dict[str, int] = {}
        self._assumed: set[tuple[Any, Any]] = set()
        self.refreshed_at = 0.0

    def invalidate(self, *, topology: bool = False) -> None:
        self._topology_dirty = self._topology_dirty or topology
        self._dirty.set()

    async def _load_topology(self) -> None:
        async with self.runtime.sessions() as session:
            rows = (await session.execute(text("SELECT profile FROM topology.nodes WHERE state = 'up'"))).scalars()
            self.nodes = {p.name: p for p in (profile_from_dict(r) for r in rows)}
            self.racks = {
                (r.region, r.cluster, r.name): Rack(
                    name=r.name, region=r.region, cluster=r.cluster, power_kw=r.power_kw
                )
                for r in await session.execute(text("SELECT region, cluster, name, power_kw FROM topology.racks"))
            }
            self.pods = {
                r.name: TpuPod(
                    name=r.name, region=r.region, type=TpuType(r.type), shape=tuple(r.shape), cluster=r.cluster
                )
                for r in await session.execute(text("SELECT name, region, cluster, type, shape FROM topology.tpu_pods"))
            }
        self._topology_dirty = False

    def _derived(
        self, capacity: Mapping[str, AcceleratorCapacity]
    ) -> tuple[dict[RackKey, float], dict[str, TpuPodState]]:
        """Rack power drawn (TDP of every busy GPU) and TPU grids (a chip with bytes reserved is taken)."""
        power: dict[RackKey, float] = {}
        for acc in capacity.values():
            if acc.reserved > 0:
                node = self.nodes[acc.node]
                key = (node.region, node.cluster, node.rack)
                sku = self.skus.get(acc.sku)
                power[key] = power.get(key, 0.0) + (sku.tdp_w if sku else 0.0)
        pods: dict[str, TpuPodState] = {}
        for pod in self.pods.values():
            ids = tpu_chip_ids(pod)
            if not all(i in self.chips for i in ids):
                continue  # the ledger has not registered this pod's chips yet
            occupancy = bytes(1 if self.chips[i] > 0 else 0 for i in ids)
            sku = self.skus.get(f"TPU-{pod.type.value.upper()}")
            pods[pod.name] = TpuPodState(
                pod=pod, grid=TpuGrid(pod.type, pod.shape, occupancy), hbm_per_chip=sku.hbm_bytes if sku else 0
            )
        return power, pods

    def on_ledger_event(self, event: Mapping[str, Any]) -> None:
        """Apply one LEDGER event to the view without reading the database.

        Commits add their shares, releases and expiries remove them, capacity changes set the
        accelerators' state. A commit this process already assumed is not counted twice. Events are
        taken at most once from core NATS; the periodic full refresh repairs anything missed.
        """
        kind = str(event.get("type", "")).rsplit(".", 1)[-1]
        payload = event.get("payload") or {}
        capacity = dict(self.snapshot.capacity)
        changed = False
        if kind in ("allocation_committed", "allocation_released", "allocation_expired"):
            if not payload.get("counts_against_hbm", True):
                return
            sign = 1 if kind == "allocation_committed" else -1
            key = (payload.get("tenant"), payload.get("request_id"))
            if sign == 1 and key in self._assumed:
                self._assumed.discard(key)
                return
            for share in payload.get("shares", []):
                acc_id, total = str(share["accelerator_id"]), int(share["total"])
                if acc_id in self.chips:
                    self.chips[acc_id] = max(0, self.chips[acc_id] + sign * total)
                    changed = True
                elif acc_id in capacity:
                    cap = capacity[acc_id]
                    capacity[acc_id] = replace(cap, reserved=max(0, cap.reserved + sign * total))
                    changed = True
        elif kind == "capacity_changed":
            for balance in payload.get("accelerators", []):
                acc_id = str(balance["id"])
                if acc_id in capacity:
                    capacity[acc_id] = replace(
                        capacity[acc_id],
                        usable=int(balance["usable"]),
                        reserved=int(balance["reserved"]),
                        available=bool(balance["available"]),
                    )
                    changed = True
                elif acc_id in self.chips:
                    self.chips[acc_id] = int(balance["reserved"])
                    changed = True
                else:
                    self.invalidate()  # a new accelerator: read it properly
        if changed:
            power, pods = self._derived(capacity)
            self.snapshot = self._next(capacity, power, pods)

    def assume(self, decision: Decision, *, tenant: str) -> None:
        """Count a decision in the view before the ledger confirms it (the scheduler's "assume"), so
        concurrent decisions do not all pick the same GPUs; the next refresh replaces it with the truth."""
        try:
            self.snapshot = apply(self.snapshot, decision)
            self._assumed.add((tenant, f"placement/{decision.request_id}"))
        except ValueError:
            self.invalidate()  # the view moved under the decision: the ledger will arbitrate

    async def refresh(self) -> FleetSnapshot:
        """Re-read the fleet; callers that arrive while a read is running share its result."""
        asked = time.monotonic()
        async with self._lock:
            if self.refreshed_at >= asked:
                return self.snapshot
            return await self._refresh()

    async def _refresh(self) -> FleetSnapshot:
        if self._topology_dirty:
            await self._load_topology()
        async with self.runtime.sessions() as session:
            rows = (
                await session.execute(
                    text("SELECT id, node, sku, hbm_usable, reserved, available FROM ledger.accelerators")
                )
            ).all()
        capacity: dict[str, AcceleratorCapacity] = {}
        chips: dict[str, int] = {}
        for r in rows:
            if r.node in self.pods:
                chips[r.id] = r.reserved
                continue
            if r.node not in self.nodes:
                continue
            index = int(r.id.rsplit("/gpu", 1)[1])
            capacity[r.id] = AcceleratorCapacity(
                id=r.id,
                node=r.node,
                index=index,
                sku=r.sku,
                usable=r.hbm_usable,
                reserved=r.reserved,
                available=r.available,
            )
        self.chips = chips
        self._assumed.clear()
        power, pods = self._derived(capacity)
        self.snapshot = self._next(capacity, power, pods)
        self.refreshed_at = time.monotonic()
        return self.snapshot

    def _next(
        self,
        capacity: dict[str, AcceleratorCapacity],
        power: dict[RackKey, float],
        pods: dict[str, TpuPodState],
    ) -> FleetSnapshot:
        """The new snapshot: when only the ledger's state changed it evolves the previous one, so the
        placement index is updated for what changed instead of rebuilt."""
        old = self.snapshot
        if old.nodes == self.nodes and old.racks == self.racks:
            return old.evolve(capacity=capacity, rack_power_used_w=power, tpu_pods=pods)
        return FleetSnapshot(
            nodes=dict(self.nodes),
            capacity=capacity,
            racks=dict(self.racks),
            rack_power_used_w=power,
            tpu_pods=pods,
            skus=self.skus,
            models=self.models,
        )

    async def run(self) -> None:
        period = self.runtime.settings.placement_refresh_ms / 1000
        while True:
            try:
                await asyncio.wait_for(self._dirty.wait(), timeout=period)
                await asyncio.sleep(0.05)  # debounce a burst of events into one read
            except TimeoutError:
                pass
            self._dirty.clear()
            try:
                await self.refresh()
            except Exception:
                self.runtime.log.exception("placement could not refresh its fleet view; keeping the last one")
