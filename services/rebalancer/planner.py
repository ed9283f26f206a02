"""Planning: what the detectors fired (and NVLink graphs that changed) becomes plans, recorded with their
events in one transaction; a PCIe-hot node is throttled (a plan of its own, without steps)."""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import Mapping
from datetime import datetime

from services.rebalancer.config import RebalanceConfig
from services.rebalancer.detectors import Detectors
from services.rebalancer.mapping import plan_view
from services.rebalancer.progress import Progress
from services.rebalancer.readmodel import RebalanceView
from services.rebalancer.store import RebalanceStore
from shared.contracts.rebalance import (
    DetectorEvent,
    DriftAlarmEvent,
    NodeThrottleEvent,
    PlanEvent,
    PlanView,
    RebalanceEventName,
)
from shared.contracts.subjects import Context
from shared.domain.fleet import NodeProfile, tpu_chip_id
from shared.domain.hardware import Sku
from shared.domain.models import ModelSpec
from shared.domain.placement import decide
from shared.domain.placement.types import Decision, FleetSnapshot
from shared.domain.placement.withhold import withhold
from shared.domain.rebalance.detect import Transition
from shared.domain.rebalance.plans import Move, Plan, broken_groups, consolidate, replicate_plan
from shared.domain.rebalance.plans import plan_of as make_plan
from shared.domain.rebalance.plans import replace as replace_moves
from shared.domain.rebalance.tpu_defrag import defragment
from shared.domain.topology.tpu import TpuSlice, is_legal_shape
from shared.infra.fleet_view import SnapshotError, fetch_view
from shared.infra.rpc import RpcClient, RpcError
from shared.infra.uow import UnitOfWork, UnitOfWorkFactory

HOUR_S = 3600.0
REPLACE_RETRY_S = 300.0
"""A broken group whose re-placement could not be planned or failed is tried again after this long."""


class Planner:
    def __init__(
        self,
        *,
        uow: UnitOfWorkFactory,
        store: RebalanceStore,
        rpc: RpcClient,
        config: RebalanceConfig,
        view: RebalanceView,
        detectors: Detectors,
        progress: Progress,
        skus: Mapping[str, Sku],
        models: Mapping[str, ModelSpec],
        log: logging.Logger,
    ) -> None:
        self._uow = uow
        self._store = store
        self._rpc = rpc
        self._config = config
        self._view = view
        self._detectors = detectors
        self._progress = progress
        self._skus = skus
        self._models = models
        self._log = log

    async def plan(
        self, transitions: list[Transition], *, retry: list[Transition], changed_nodes: set[str], now: datetime
    ) -> None:
        """Announce the new ``transitions``, plan what fired (also ``retry``: fired earlier, planned not yet)
        reading the fleet when a planner needs it, and record the plans; what needs the fleet is planned
        again on the next tick when it cannot be read."""
        fired: dict[str, list[Transition]] = {}
        cleared: dict[str, list[Transition]] = {}
        for t in [*transitions, *retry]:
            (fired if t.fired else cleared).setdefault(t.rule, []).append(t)
        config = self._config
        plans: list[Plan] = []
        needs_snapshot = bool(
            fired.get(config.cold.name)
            or fired.get(config.drift.name)
            or changed_nodes
            or fired.get(config.fragmentation.name)
        )
        snapshot: FleetSnapshot | None = None
        if needs_snapshot:
            try:
                snapshot = (await fetch_view(self._rpc, skus=self._skus, models=self._models)).snapshot
            except (SnapshotError, RpcError) as exc:
                self._log.warning("no fleet snapshot to plan on: %s (retried on the next tick)", exc)
                # What needs the fleet is planned again next tick (its events are not emitted twice).
                later = {config.cold.name, config.drift.name, config.fragmentation.name}
                self._progress.retry += [t for t in transitions if t.fired and t.rule in later]
                self._progress.changed_nodes |= changed_nodes
        capped: list[str] = []
        for t in fired.get(config.hot.name, []):
            replica = self._view.replicas.get(t.key)
            if replica is not None and replica.allocation_id not in self._progress.active:
                model = (replica.tenant, replica.request.model)
                if not self._may_replicate(model, now):
                    capped.append(
                        f"{t.rule} on {t.key}: no copy, {config.replicate_per_model_hour} of {replica.tenant}'s "
                        f"{replica.request.model} made within the hour"
                    )
                    continue
                self._progress.replicated.setdefault(model, []).append(now)
                reason = f"{t.rule} {t.value:.2f} > {config.hot.threshold} for {config.hot.window_s:g} s"
                plans.append(replicate_plan(replica, _plan_id(), now, reason=reason))
        if snapshot is not None:
            cold = fired.get(config.cold.name, [])
            if cold and await self._consolidating():
                # One consolidation at a time: while one waits for its copies' engines (minutes), another
                # would move replicas onto the node it drains, or move its copies back.
                self._log.info("a consolidation is under way: no other planned now")
                cold = []
            plans += self._consolidation(snapshot, cold, now)
            plans += self._defragmentation(fired.get(config.fragmentation.name, []), now)
            plans += self._replacements(snapshot, fired.get(config.drift.name, []), changed_nodes, now)
        throttles = [(t, True) for t in fired.get(config.pcie.name, [])]
        throttles += [(t, False) for t in cleared.get(config.pcie.name, [])]

        async def work(uow: UnitOfWork) -> None:
            for t in transitions:
                await self._announce(uow, t)
            throttled = set(self._progress.throttled)  # as this transaction leaves it
            for t, on in throttles:
                await self._throttle(uow, throttled, t.key, on=on, value=t.value)
            if throttled != self._progress.throttled:
                uow.after_commit(lambda: self._progress.throttling(throttled))
            for plan in plans:
                view = plan_view(plan)
                await self._store.add_plan(session=uow.session, plan=view, now=uow.now)
                uow.emit(Context.REBALANCE, RebalanceEventName.PLAN_CREATED, PlanEvent(plan=view))
                await self._store.add_action(
                    session=uow.session,
                    at=uow.now,
                    plan_id=plan.plan_id,
                    what=f"{plan.kind} planned for {plan.target}: {plan.reason}",
                )
            for what in capped:
                await self._store.add_action(session=uow.session, at=uow.now, plan_id=None, what=what)
            await self._store.trim_actions(session=uow.session)
            uow.after_commit(lambda: self._progress.active.update(plan.target for plan in plans))

        await self._uow.run(work)

    def _may_replicate(self, model: tuple[str, str], now: datetime) -> bool:
        """Fewer than ``replicate_per_model_hour`` copies of this tenant's model planned within the hour."""
        recent = [at for at in self._progress.replicated.get(model, []) if (now - at).total_seconds() < HOUR_S]
        self._progress.replicated[model] = recent
        return len(recent) < self._config.replicate_per_model_hour

    def remember_copies(self, plans: list[PlanView]) -> None:
        """At start: the replicate plans recorded (any state), for the per-model cap (those whose replica is
        known) and the copies not judged hot before they carry load (those still placed; whether one
        carried load before the restart is not kept, so each has to show it again)."""
        for view in plans:
            replica = self._view.replicas.get(view.target)
            if replica is not None:
                self._progress.replicated.setdefault((replica.tenant, replica.request.model), []).append(
                    view.created_at
                )
            for step in view.steps:
                if step.new_allocation_id is not None and step.new_allocation_id in self._view.replicas:
                    self._view.unproven.add(step.new_allocation_id)

    async def _consolidating(self) -> bool:
        """Whether a consolidation plan is open or running."""
        views = await self._uow.run(lambda uow: self._store.plans(session=uow.session, states=("open", "running")))
        return any(view.kind == "consolidate" for view in views)

    async def _announce(self, uow: UnitOfWork, t: Transition) -> None:
        rule = self._detectors.by_rule[t.rule].rule
        name = RebalanceEventName.DETECTOR_FIRED if t.fired else RebalanceEventName.DETECTOR_CLEARED
        payload = DetectorEvent(
            detector=t.rule, key=t.key, value=t.value, threshold=rule.threshold, window_s=rule.window_s
        )
        uow.emit(Context.REBALANCE, name, payload)
        verb = "fired" if t.fired else "cleared"
        await self._store.add_action(
            session=uow.session, at=uow.now, plan_id=None, what=f"{t.rule} {verb} on {t.key} ({t.value:.3f})"
        )
        if t.fired and t.rule == self._config.drift_alarm.name:
            observed, reserved = self._detectors.drift_figures.get(t.key, (0, 0))
            uow.emit(
                Context.REBALANCE,
                RebalanceEventName.DRIFT_ALARM,
                DriftAlarmEvent(allocation_id=t.key, observed_bytes=observed, reserved_bytes=reserved, ratio=t.value),
            )

    async def _throttle(self, uow: UnitOfWork, throttled: set[str], node: str, *, on: bool, value: float) -> None:
        """Start or end the throttle of ``node`` (``throttled``: the nodes throttled so far, changed here)."""
        if on == (node in throttled):
            return
        await self._store.set_throttle(session=uow.session, node=node, on=on, now=uow.now)
        name = RebalanceEventName.THROTTLE_STARTED if on else RebalanceEventName.THROTTLE_ENDED
        uow.emit(Context.REBALANCE, name, NodeThrottleEvent(node=node, value=value))
        what = (
            f"cold starts throttled on {node} (PCIe {value:.2f})"
            if on
            else f"throttle on {node} ended (PCIe {value:.2f})"
        )
        await self._store.add_action(session=uow.session, at=uow.now, plan_id=None, what=what)
        # A throttle is a plan of its own (no steps): running while it lasts.
        profile = self._view.profiles.get(node)
        cluster = f"{profile.region}/{profile.cluster}" if profile is not None else ""
        plan = Plan(f"throttle-{node}", "throttle", cluster, node, what, uow.now, state="running" if on else "done")
        await self._store.put_plan(session=uow.session, plan=plan_view(plan), now=uow.now)
        if on:
            throttled.add(node)
        else:
            throttled.discard(node)

    def broken_nodes(self, now: datetime) -> set[str]:
        """Nodes holding a TP group placed to be NVLinked whose GPUs no longer sit on one clique of the
        node's current NVLink graph (a link went down): whatever order the events came in, and after a
        restart. A group whose re-placement was tried lately is left alone for ``REPLACE_RETRY_S``."""
        nodes: set[str] = set()
        for allocation_id in self._view.nvlinked:
            replica = self._view.replicas.get(allocation_id)
            if replica is None or replica.node is None or allocation_id in self._progress.active:
                continue
            tried = self._progress.replace_tried.get(allocation_id)
            if tried is not None and (now - tried).total_seconds() < REPLACE_RETRY_S:
                continue
            cliques = self._view.cliques.get(replica.node)
            if cliques is None:
                continue
            group = frozenset(replica.accelerators)
            if not any(group <= clique for clique in cliques):
                nodes.add(replica.node)
        return nodes

    def _consolidation(self, snapshot: FleetSnapshot, fired: list[Transition], now: datetime) -> list[Plan]:
        if not fired:
            return []
        detector = self._detectors.by_rule[self._config.cold.name]
        cold = sorted(
            (t for t in detector.targets() if t.phase == "firing" and t.key not in self._progress.active),
            key=lambda t: (t.value, t.key),
        )
        # Copies go only to nodes already in use: moving onto an idle node would free one node by waking another.
        regions = {snapshot.nodes[t.key].region for t in cold if t.key in snapshot.nodes}
        idle = [
            acc
            for profile in snapshot.nodes.values()
            if profile.region in regions
            and all(snapshot.capacity[a].reserved == 0 for a in _gpus(profile) if a in snapshot.capacity)
            for acc in _gpus(profile)
        ][:4000]  # PlaceRequest.avoid_accelerators holds 4,096
        moves = consolidate(
            withhold(snapshot, idle), list(self._view.replicas.values()), [t.key for t in cold], decide=decide
        )
        if not moves:
            return []
        # Placement withholds them too when the plan runs, so the copies land where they were planned to.
        moves = [dataclasses.replace(m, avoid=m.avoid | frozenset(idle)) for m in moves]
        nodes = sorted({m.replica.node or "" for m in moves})
        figures = ", ".join(f"{t.key} {t.value:.2f}" for t in cold if t.key in nodes)
        reason = f"hbm_cold < {self._config.cold.threshold} for {self._config.cold.window_s:g} s: {figures}"
        return [make_plan("consolidate", _plan_id(), moves[0].replica.cluster, ",".join(nodes), reason, now, moves)]

    def _defragmentation(self, fired: list[Transition], now: datetime) -> list[Plan]:
        plans: list[Plan] = []
        for t in fired:
            if t.key not in self._view.pods or t.key in self._progress.active:
                continue
            grid, slices = self._view.pod_grid(t.key)
            if grid is None or not is_legal_shape(grid.tpu_type, self._config.defrag_block):
                continue  # e.g. a v5p pod (3 axes): no 8x8 block to free
            try:
                found = defragment(grid, slices, want=self._config.defrag_block)
            except ValueError as exc:
                self._log.warning("cannot defragment %s: %s", t.key, exc)
                continue
            if found is None or not found[1]:
                continue
            block, slice_moves = found
            block_chips = frozenset(_chips(t.key, block))
            replicas = self._view.replicas
            moves = [
                Move(replica=replicas[m.allocation_id], avoid=block_chips, decision=_unplanned(m.allocation_id))
                for m in slice_moves
                if m.allocation_id in replicas
            ]
            if not moves:
                continue
            reason = (
                f"tpu_fragmentation {t.value:.2f} > {self._config.fragmentation.threshold}: free the "
                f"{'x'.join(map(str, block.shape))} block at {block.origin}"
            )
            plans.append(make_plan("defragment", _plan_id(), moves[0].replica.cluster, t.key, reason, now, moves))
        return plans

    def _replacements(
        self, snapshot: FleetSnapshot, fired: list[Transition], changed: set[str], now: datetime
    ) -> list[Plan]:
        plans: list[Plan] = []
        replicas = list(self._view.replicas.values())
        active = self._progress.active
        for node in sorted(changed):
            broken = [
                r
                for r in broken_groups(replicas, node, self._view.cliques.get(node, []))
                if r.allocation_id not in active and r.allocation_id in self._view.nvlinked
            ]
            for r in broken:
                self._progress.replace_tried[r.allocation_id] = now
            moves = replace_moves(snapshot, broken, decide=decide)
            if moves:
                reason = f"{node}'s NVLink graph changed: {len(moves)} TP group(s) no longer on one clique"
                plans.append(make_plan("replace", _plan_id(), moves[0].replica.cluster, node, reason, now, moves))
        for t in fired:
            replica = self._view.replicas.get(t.key)
            if replica is None or t.key in active:
                continue
            moves = replace_moves(snapshot, [replica], decide=decide)
            if moves:
                reason = (
                    f"hbm_drift {t.value:.2f} > {self._config.drift.threshold} for {self._config.drift.window_s:g} s"
                )
                plans.append(make_plan("replace", _plan_id(), replica.cluster, t.key, reason, now, moves))
        return plans


def _plan_id() -> str:
    return f"rb-{uuid.uuid4().hex[:12]}"


def _gpus(profile: NodeProfile) -> list[str]:
    return [profile.accelerator_id(a.index) for a in profile.accelerators]


def _chips(pod: str, block: TpuSlice) -> list[str]:
    return [tpu_chip_id(pod, coord) for coord in block.coords()]


def _unplanned(allocation_id: str) -> Decision:
    """A move's advisory decision when the planner chose a position itself (the defragmenter): placement
    decides the copy's place when the plan runs, with the block withheld."""
    return Decision(request_id=f"{allocation_id}:move", status="rejected", message="decided when the plan runs")
