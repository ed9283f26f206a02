"""The rebalancer's detectors and their input: engine reports (each replica's load: KV cache use, queue,
requests running), GPU telemetry samples (HBM for replicas whose engine never reported, PCIe, drift per
allocation) and TPU fragmentation, turned into firing and clearing targets
(``shared.domain.rebalance.detect``) that the next tick plans. A replica is judged only once it serves
(``shared.domain.rebalance.signals``): while it is not, its targets are forgotten, so a window starts
again once it is."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime

from services.rebalancer.config import RebalanceConfig
from services.rebalancer.readmodel import RebalanceView
from shared.contracts.rebalance import DetectorView, TargetView
from shared.contracts.topology import EngineStatusEvent, GpuTelemetryEvent
from shared.domain.fleet import AcceleratorId
from shared.domain.hardware import Sku
from shared.domain.placement.view import PcieSample, pcie_utilisation
from shared.domain.rebalance.detect import SustainedDetector, Transition
from shared.domain.rebalance.signals import carried, judged, load_figure
from shared.domain.topology.tpu import fragmentation


class Detectors:
    """One sustained detector per rule, fed from telemetry and the view; the transitions they make wait in
    ``pending`` until the tick takes them (``take``)."""

    def __init__(
        self,
        *,
        config: RebalanceConfig,
        view: RebalanceView,
        skus: Mapping[str, Sku],
        log: logging.Logger | None = None,
    ) -> None:
        self._config = config
        self._view = view
        self._skus = skus
        self._log = log or logging.getLogger("hetsched.rebalance")
        self.by_rule = {rule.name: SustainedDetector(rule) for rule in config.rules}
        self.pending: list[Transition] = []
        self.drift_figures: dict[str, tuple[int, int]] = {}  # allocation -> (observed, reserved) bytes
        self._drift_checked: dict[str, datetime] = {}

    # -- the tick's side -----------------------------------------------------------------------------

    def take(self) -> list[Transition]:
        """The transitions since the last call."""
        taken, self.pending = self.pending, []
        return taken

    def sweep(self, now: datetime) -> None:
        """Targets whose samples stopped clear; TPU pods in use are measured for fragmentation."""
        for detector in self.by_rule.values():
            self.pending += detector.sweep(now)
        for name in self._view.pods:
            grid, _slices = self._view.pod_grid(name)
            if grid is None:
                continue
            if any(r.tpu_pod == name for r in self._view.replicas.values()):
                self.pending += self._see(self._config.fragmentation.name, name, fragmentation(grid), now)

    def forget_replica(self, allocation_id: str) -> None:
        """A replica released: its targets clear (told as any other clearing, on the next tick)."""
        for name in (self._config.hot.name, self._config.drift.name, self._config.drift_alarm.name):
            cleared = self.by_rule[name].forget(allocation_id)
            if cleared is not None:
                self.pending.append(cleared)

    def firing(self) -> dict[str, int]:
        return {name: len(d.firing()) for name, d in self.by_rule.items()}

    def views(self) -> list[DetectorView]:
        return [_detector_view(d) for d in self.by_rule.values()]

    # -- telemetry (the kit follows TELEMETRY and calls this: ``app.py`` follows) -----------------------

    def judged(self, allocation_id: str, now: datetime) -> bool:
        """Whether the replica (or replica allocation) may be judged at ``now`` (``signals.judged``)."""
        view = self._view
        nodes = view.nodes_of(allocation_id)
        if not nodes and (allocation := view.allocations.get(allocation_id)) is not None:
            nodes = frozenset(AcceleratorId.parse(a).host for a in allocation.bytes)
        runs = view.agent_runs_engines(nodes, now, stale_s=self._config.agent_stale_s)
        return judged(
            view.ranks.get(allocation_id), agent_runs_engines=runs, now=now, grace_s=self._config.state_grace_s
        )

    def _hot_allowed(self, allocation_id: str, now: datetime) -> bool:
        """Judged, and not a copy made for a hot replica that has carried no load yet."""
        return allocation_id not in self._view.unproven and self.judged(allocation_id, now)

    def engine_reported(self, report: EngineStatusEvent, at: datetime) -> list[Transition]:
        """A replica's engine report (folded into the view already): its load through the hot detector. A
        copy made for a hot replica that shows load for the first time is judged from now on."""
        view = self._view
        load = view.loads.get(report.replica_id)
        if load is None or load.at != at:  # a replica unknown, or a report older than the one kept
            return []
        key = report.replica_id
        if key in view.unproven and carried(load, view.ranks.get(key)):
            view.unproven.discard(key)
        if self._hot_allowed(key, at):
            out = self._see(self._config.hot.name, key, load_figure(load), at)
        else:
            out = self._forget(self._config.hot.name, key)
        self.pending += out
        return out

    def _forget(self, rule: str, key: str) -> list[Transition]:
        gone = self.by_rule[rule].forget(key)
        return [gone] if gone is not None else []

    def observe(self, sample: GpuTelemetryEvent, at: datetime) -> list[Transition]:
        """One node's GPU sample through the detectors; the transitions are planned on the next tick."""
        profile = self._view.profiles.get(sample.node)
        util: dict[str, float] = {}
        used: dict[str, int] = {}
        sizes: dict[str, int] = {}
        total = 0
        for gpu in sample.gpus:
            if gpu.memory_used_bytes is None or gpu.memory_free_bytes is None:
                continue
            size = gpu.memory_used_bytes + gpu.memory_free_bytes
            if size <= 0:
                continue
            acc = profile.accelerator_id(gpu.index) if profile is not None else f"{sample.node}/gpu{gpu.index}"
            util[acc] = gpu.memory_used_bytes / size
            used[acc] = gpu.memory_used_bytes
            sizes[acc] = size
            total += size
        out: list[Transition] = []
        on_node = self._view.replicas_on(sample.node)
        loads = self._view.loads
        hot = self._config.hot.name
        all_judged = True
        for replica in on_node:
            key = replica.allocation_id
            if not self.judged(key, at):
                all_judged = False
            if key in loads:
                continue  # its engine reports itself: judged on its reports (``engine_reported``)
            figures = [util[a] for a in replica.accelerators if a in util]
            if figures and self._hot_allowed(key, at):
                out += self._see(hot, key, max(figures), at)
            elif figures:
                out += self._forget(hot, key)
        if not on_node or not all_judged:  # nothing to consolidate, or a replica there does not serve yet
            out += self._forget(self._config.cold.name, sample.node)
        elif total:
            # Each GPU weighs its size; one of a replica whose engine reports itself reads that engine's load.
            engine_of = {a: loads[r.allocation_id] for r in on_node if r.allocation_id in loads for a in r.accelerators}
            weighted = sum(
                size * (load_figure(engine_of[acc]) if acc in engine_of else used[acc] / size)
                for acc, size in sizes.items()
            )
            out += self._see(self._config.cold.name, sample.node, weighted / total, at)
        if profile is not None:
            pcie = pcie_utilisation(
                profile,
                self._skus,
                (PcieSample(g.index, g.pcie_tx_bytes_per_s, g.pcie_rx_bytes_per_s) for g in sample.gpus),
            )
            if pcie is not None:
                out += self._see(self._config.pcie.name, sample.node, pcie, at)
        last = self._drift_checked.get(sample.node)
        if last is None or (at - last).total_seconds() >= self._config.drift_check_s:
            self._drift_checked[sample.node] = at
            out += self._drift(sample.node, used, at)
        self.pending += out
        return out

    def _see(self, rule: str, key: str, value: float, at: datetime) -> list[Transition]:
        transition = self.by_rule[rule].observe(key, value, at)
        return [transition] if transition is not None else []

    def _drift(self, node: str, used: Mapping[str, int], at: datetime) -> list[Transition]:
        """Per replica allocation alone on its GPUs: |observed - reserved| / reserved (the brief's sidecar
        rule). GPUs shared by several allocations cannot say whose bytes they hold: left out."""
        here = self._view.allocations_on(node)
        holders: dict[str, int] = {}
        for allocation in here:
            for acc in allocation.bytes:
                holders[acc] = holders.get(acc, 0) + 1
        out: list[Transition] = []
        for allocation in here:
            if not self.judged(allocation.allocation_id, at):  # its engine starts or loads: not measurable yet
                out += self._forget(self._config.drift_alarm.name, allocation.allocation_id)
                out += self._forget(self._config.drift.name, allocation.allocation_id)
                continue
            mine = [a for a in allocation.bytes if AcceleratorId.on_host(a, node)]  # exactly this node's
            if not mine or any(holders.get(a, 0) != 1 or a not in used for a in mine):
                continue
            reserved = sum(allocation.bytes[a] for a in mine)
            observed = sum(used[a] for a in mine)
            if reserved <= 0:
                continue
            ratio = abs(observed - reserved) / reserved
            self.drift_figures[allocation.allocation_id] = (observed, reserved)
            out += self._see(self._config.drift_alarm.name, allocation.allocation_id, ratio, at)
            out += self._see(self._config.drift.name, allocation.allocation_id, ratio, at)
        return out


def _detector_view(detector: SustainedDetector) -> DetectorView:
    rule = detector.rule
    return DetectorView(
        name=rule.name,
        threshold=rule.threshold,
        window_s=rule.window_s,
        above=rule.above,
        state=detector.state,
        targets=[TargetView(key=t.key, phase=t.phase, since=t.since, value=t.value) for t in detector.targets()],
    )
