"""Handlers of the rebalancer service: the third stage of the pipeline (prefilter -> score -> rebalance).

It learns the fleet from TOPOLOGY events, the replicas (with the request each was placed with) from
PLACEMENT events, the allocations and KV holds from LEDGER events, and follows GPU telemetry (TELEMETRY,
an ordered consumer of new samples from the nodes' agents). Detectors (``shared.domain.rebalance.detect``,
sustained windows with hysteresis) turn samples into firing targets; each firing becomes a plan
(``shared.domain.rebalance.plans``, ``tpu_defrag``) that runs make-before-break through placement:

- ``hbm_hot`` (a replica's GPUs above 0.85 for 60 s): ``replicate``, a copy onto idle capacity;
- ``hbm_cold`` (a node below 0.30 for 300 s): ``consolidate``, its replicas moved so the node idles;
- ``tpu_fragmentation`` (a pod above 0.3): ``defragment``, slices moved out of an 8x8 block;
- ``pcie_hot`` (a node above 0.7 for 60 s): ``throttle``, placement takes no new replica there until it
  clears (``throttle_started`` / ``throttle_ended``);
- a node whose NVLink cliques change (``node_changed``): ``replace`` of the TP groups that no longer sit
  on one clique;
- ``hbm_drift`` per allocation (|observed - reserved| > 10% of it, checked every 10 s): an alarm at once
  (``drift_alarm``), and ``replace`` when it lasts.

A plan places every copy first (placement.place with the replica's own request, a new id, the old GPUs
withheld), then releases the old ones, each only once its messages in flight are done (no KV hold left;
admission sends it nothing new meanwhile: ``replica_draining``). A copy that cannot be placed fails the
plan and the copies already placed are released (rolled back). Copies are rate-limited per cluster
(``HETSCHED_REBALANCE_MIGRATIONS_PER_MIN``). Plans and their steps are in Postgres and resume after a
restart (a step's placement request id is fixed, so asking again answers the same).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from pydantic import BaseModel, ValidationError

from services.rebalancer import store
from services.rebalancer.mapping import cliques_of, move_request, plan_of_view, plan_view, replica_of
from services.rebalancer.metrics import RebalanceMetrics
from shared.contracts.base import Rejected
from shared.contracts.envelope import EventEnvelope
from shared.contracts.ledger import AllocationEvent
from shared.contracts.permissions import EVENT_PUBLISHERS
from shared.contracts.placement import PlaceReply, PlaceRequest, ReleaseReply, ReleaseRequest
from shared.contracts.placement_events import PlacementEvent, PlacementReleasedEvent
from shared.contracts.rebalance import (
    ActionView,
    DetectorEvent,
    DetectorView,
    DriftAlarmEvent,
    NodeThrottleEvent,
    PlanEvent,
    PlanView,
    RebalanceEventName,
    RebalanceStatusReply,
    RebalanceStatusRequest,
    ReplicaDrainingEvent,
    TargetView,
)
from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context, Rpc, Subjects, names_scope
from shared.contracts.topology import GpuTelemetryEvent, NodeProfileEvent, NodeStateEvent, TpuPodEvent
from shared.domain.errors import ErrorCode
from shared.domain.fleet import AcceleratorId, NodeProfile, tpu_chip_id
from shared.domain.hardware import Sku
from shared.domain.models import ModelSpec
from shared.domain.placement import decide
from shared.domain.placement.types import Decision, FleetSnapshot
from shared.domain.placement.view import PcieSample, pcie_utilisation
from shared.domain.placement.withhold import withhold
from shared.domain.rebalance.detect import Rule, SustainedDetector, Transition
from shared.domain.rebalance.plans import (
    Move,
    Plan,
    Replica,
    broken_groups,
    consolidate,
    next_step,
    replicate_plan,
    rolled_back,
    step_done,
    step_failed,
)
from shared.domain.rebalance.plans import plan_of as make_plan
from shared.domain.rebalance.plans import replace as replace_moves
from shared.domain.rebalance.tpu_defrag import defragment
from shared.domain.topology.tpu import TpuGrid, TpuSlice, TpuType, allocate, fragmentation, is_legal_shape
from shared.infra.bus import follow
from shared.infra.clock import Clock
from shared.infra.fleet_view import SnapshotError, fetch_view
from shared.infra.profiles import profile_from_payload
from shared.infra.rpc import RpcClient, RpcError
from shared.infra.uow import UnitOfWork, UnitOfWorkFactory

RECENT = 50
BROKEN_SCAN_S = 5.0
"""How often every NVLinked TP group is checked against its node's current cliques."""
REPLACE_RETRY_S = 300.0
"""A broken group whose re-placement could not be planned or failed is tried again after this long."""
STEPS_PER_TICK = 8
PLACE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class RebalanceConfig:
    """The detectors' rules and the executor's limits (settings; defaults from the brief)."""

    hot: Rule
    cold: Rule
    fragmentation: Rule
    pcie: Rule
    drift_alarm: Rule
    drift: Rule
    migrations_per_min: float = 2.0
    drift_check_s: float = 10.0
    tick_s: float = 1.0
    defrag_block: tuple[int, ...] = (8, 8)


@dataclass
class _Bucket:
    """Copies a cluster may still start: ``migrations_per_min`` per minute, a burst of as many."""

    tokens: float
    at: datetime


@dataclass
class _Pending:
    """What the detectors and events asked for since the last tick (planned outside any transaction:
    planning may read the fleet over RPC)."""

    transitions: list[Transition] = field(default_factory=list)
    changed_nodes: set[str] = field(default_factory=set)
    retry: list[Transition] = field(default_factory=list)  # fired, announced, not planned yet


class RebalanceHandlers:
    def __init__(
        self,
        *,
        uow: UnitOfWorkFactory,
        rpc: RpcClient,
        clock: Clock,
        config: RebalanceConfig,
        skus: Mapping[str, Sku],
        models: Mapping[str, ModelSpec],
        jetstream: Callable[[], JetStreamContext] | None = None,
        subjects: Subjects | None = None,
        stream_prefix: str = "",
        log: logging.Logger | None = None,
        metrics: RebalanceMetrics | None = None,
        restate_s: float | None = None,
    ) -> None:
        self._restate_s = restate_s  # how often throttles and draining replicas are restated; None: never
        self._restated_at: datetime | None = None
        self._uow = uow
        self._metrics = metrics
        self._rpc = rpc
        self._clock = clock
        self._config = config
        self._skus = skus
        self._models = models
        self._jetstream = jetstream
        self._subjects = subjects
        self._stream_prefix = stream_prefix
        self._log = log or logging.getLogger("hetsched.rebalance")
        self._detectors = {
            rule.name: SustainedDetector(rule)
            for rule in (config.hot, config.cold, config.fragmentation, config.pcie, config.drift_alarm, config.drift)
        }
        if metrics is not None:  # every detector shows from the start, firing or not
            metrics.firing(dict.fromkeys(self._detectors, 0))
        # What the events told (kept in Postgres, rebuilt from it at start).
        self._replicas: dict[str, Replica] = {}
        self._requests: dict[str, PlaceRequest] = {}
        self._allocations: dict[str, store.Allocation] = {}
        self._holds: dict[str, set[str]] = {}  # replica -> its live KV holds
        self._by_node: dict[str, set[str]] = {}  # node (or TPU pod) -> replica allocations on it
        self._profiles: dict[str, NodeProfile] = {}
        self._cliques: dict[str, list[frozenset[str]]] = {}
        self._pods: dict[str, TpuPodEvent] = {}
        self._throttled: set[str] = set()
        self._active: set[str] = set()  # targets with a plan open or running
        self._draining: set[str] = set()  # replicas told draining
        self._buckets: dict[str, _Bucket] = {}
        self._drift_checked: dict[str, datetime] = {}
        self._drift_figures: dict[str, tuple[int, int]] = {}
        self._pending = _Pending()
        self._telemetry: Subscription | None = None
        self._nvlinked: set[str] = set()  # TP groups placed to be NVLinked (no cross-domain, no pipeline)
        self._scanned = datetime.min.replace(tzinfo=UTC)
        self._replace_tried: dict[str, datetime] = {}

    # -- start ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Rebuild memory from the tables, end throttles a previous run left (its windows restart), and
        follow GPU telemetry."""
        loaded = await self._uow.run(lambda uow: store.load(session=uow.session))
        for body in loaded.replicas.values():
            self._remember(PlacementEvent.model_validate(body))
        for allocation in loaded.allocations.values():
            self._allocated(allocation)
        for body in loaded.nodes.values():
            self._profile(NodeProfileEvent.model_validate(body))
        self._pods = {name: TpuPodEvent.model_validate(body) for name, body in loaded.pods.items()}
        plans = await self._uow.run(lambda uow: store.plans(session=uow.session, states=("open", "running")))
        self._active = {
            view.target for view in (PlanView.model_validate(body) for body in plans) if view.kind != "throttle"
        }

        async def unthrottle(uow: UnitOfWork) -> None:
            for node in loaded.throttles:
                await store.set_throttle(session=uow.session, node=node, on=False, now=uow.now)
                ended = Plan(f"throttle-{node}", "throttle", "", node, "ended at restart", uow.now, state="done")
                await store.save_plan(
                    session=uow.session,
                    plan_id=ended.plan_id,
                    state="done",
                    body=plan_view(ended).model_dump(mode="json"),
                    now=uow.now,
                )
                uow.emit(Context.REBALANCE, RebalanceEventName.THROTTLE_ENDED, NodeThrottleEvent(node=node, value=0.0))
                await store.add_action(
                    session=uow.session, at=uow.now, plan_id=None, what=f"throttle ended on {node} (restart)"
                )

        if loaded.throttles:
            await self._uow.run(unthrottle)
        await self._follow_telemetry()

    async def _follow_telemetry(self) -> None:
        if self._jetstream is None or self._subjects is None:
            return
        try:
            self._telemetry = await follow(
                self._jetstream(),
                self._subjects.events_of(Context.TELEMETRY),
                stream=stream_name(Context.TELEMETRY, stream_prefix=self._stream_prefix),
                cb=self._on_telemetry,
                deliver_policy=DeliverPolicy.NEW,
                log=self._log,
            )
        except Exception as exc:  # the stream may not exist yet: the tick retries
            self._log.debug("no TELEMETRY stream yet", extra={"error": str(exc)[:200]})

    async def stop(self) -> None:
        if self._telemetry is not None:
            try:
                await self._telemetry.unsubscribe()
            except Exception:
                self._log.debug("could not unsubscribe from telemetry", exc_info=True)
            self._telemetry = None

    # -- status -----------------------------------------------------------------------------------

    async def status(self, request: RebalanceStatusRequest) -> BaseModel:
        """Detectors with their targets, plans open or running (and the last finished), recent actions."""

        async def read(uow: UnitOfWork) -> BaseModel:
            live = await store.plans(session=uow.session, states=("open", "running"))
            recent_plans = await store.recent_plans(session=uow.session, limit=20)
            actions = await store.actions(session=uow.session, limit=RECENT)
            seen: set[str] = set()
            plans: list[PlanView] = []
            for body in [*live, *recent_plans]:
                view = PlanView.model_validate(body)
                if view.plan_id not in seen:
                    seen.add(view.plan_id)
                    plans.append(view)
            return RebalanceStatusReply(
                detectors=[self._detector_view(d) for d in self._detectors.values()],
                plans=plans,
                recent=[ActionView(at=at, plan_id=plan_id, what=what) for at, plan_id, what in actions],
            )

        return await self._uow.run(read)

    @staticmethod
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

    # -- events ------------------------------------------------------------------------------------

    async def on_placement_decided(self, *, uow: UnitOfWork, event: EventEnvelope, payload: PlacementEvent) -> None:
        replica = replica_of(payload)
        if replica is None:
            return
        await store.put_replica(
            session=uow.session,
            allocation_id=replica.allocation_id,
            tenant=replica.tenant,
            body=payload.model_dump(mode="json"),
        )
        self._remember(payload)

    async def on_placement_released(
        self, *, uow: UnitOfWork, event: EventEnvelope, payload: PlacementReleasedEvent
    ) -> None:
        await store.drop_replica(session=uow.session, allocation_id=payload.allocation_id)
        self._forget(payload.allocation_id)

    async def on_allocation_committed(self, *, uow: UnitOfWork, event: EventEnvelope, payload: AllocationEvent) -> None:
        allocation = store.Allocation(
            allocation_id=payload.allocation_id,
            kind=payload.kind,
            parent_id=payload.parent_id,
            bytes={s.accelerator_id: s.total for s in payload.shares},
        )
        await store.put_allocation(session=uow.session, allocation=allocation)
        self._allocated(allocation)

    async def on_allocation_ended(self, *, uow: UnitOfWork, event: EventEnvelope, payload: AllocationEvent) -> None:
        await store.drop_allocation(session=uow.session, allocation_id=payload.allocation_id)
        gone = self._allocations.pop(payload.allocation_id, None)
        if gone is not None and gone.parent_id is not None:
            self._holds.get(gone.parent_id, set()).discard(gone.allocation_id)
        if gone is not None:
            for node in {AcceleratorId.parse(a).host for a in gone.bytes}:
                self._by_node.get(node, set()).discard(gone.allocation_id)

    async def on_node_profiled(self, *, uow: UnitOfWork, event: EventEnvelope, payload: NodeProfileEvent) -> None:
        await store.put_node(session=uow.session, name=payload.node, body=payload.model_dump(mode="json"))
        before = self._cliques.get(payload.node)
        self._profile(payload)
        if before is not None and before != self._cliques.get(payload.node):
            self._pending.changed_nodes.add(payload.node)  # its NVLink graph changed: check its TP groups

    async def on_node_removed(self, *, uow: UnitOfWork, event: EventEnvelope, payload: NodeStateEvent) -> None:
        await store.drop_node(session=uow.session, name=payload.node)
        self._profiles.pop(payload.node, None)
        self._cliques.pop(payload.node, None)

    async def on_tpu_pod_profiled(self, *, uow: UnitOfWork, event: EventEnvelope, payload: TpuPodEvent) -> None:
        await store.put_pod(session=uow.session, name=payload.pod, body=payload.model_dump(mode="json"))
        self._pods[payload.pod] = payload

    # -- memory ------------------------------------------------------------------------------------

    def _remember(self, event: PlacementEvent) -> None:
        replica = replica_of(event)
        if replica is not None and event.request is not None:
            self._replicas[replica.allocation_id] = replica
            self._requests[replica.allocation_id] = event.request
            reply = event.reply
            one_node = len({p.node for p in reply.placements}) == 1
            if replica.tp > 1 and one_node and reply.pp == 1 and reply.fallback != "cross_domain":
                self._nvlinked.add(replica.allocation_id)

    def _forget(self, allocation_id: str) -> None:
        self._replicas.pop(allocation_id, None)
        self._requests.pop(allocation_id, None)
        self._nvlinked.discard(allocation_id)
        self._replace_tried.pop(allocation_id, None)
        self._draining.discard(allocation_id)
        for name in (self._config.hot.name, self._config.drift.name, self._config.drift_alarm.name):
            cleared = self._detectors[name].forget(allocation_id)
            if cleared is not None:  # told as any other clearing, on the next tick
                self._pending.transitions.append(cleared)

    def _allocated(self, allocation: store.Allocation) -> None:
        self._allocations[allocation.allocation_id] = allocation
        if allocation.parent_id is not None:
            self._holds.setdefault(allocation.parent_id, set()).add(allocation.allocation_id)
        if allocation.kind == "replica":  # the drift check reads a node's replicas on each of its samples
            for node in {AcceleratorId.parse(a).host for a in allocation.bytes}:
                self._by_node.setdefault(node, set()).add(allocation.allocation_id)

    def _profile(self, payload: NodeProfileEvent) -> None:
        try:
            profile = profile_from_payload(payload.profile)
        except ValueError:
            return
        self._profiles[payload.node] = profile
        self._cliques[payload.node] = sorted(cliques_of(profile), key=sorted)

    # -- telemetry ---------------------------------------------------------------------------------

    async def _on_telemetry(self, msg: Msg) -> None:
        try:
            envelope = EventEnvelope.model_validate_json(msg.data)
        except ValidationError:
            return
        if not envelope.type.endswith(".gpu"):
            return
        try:
            payload = GpuTelemetryEvent.model_validate(envelope.payload)
        except ValidationError:
            return
        # A node's own agent, on its own node's subject (as the durable consumers check).
        if envelope.source != EVENT_PUBLISHERS[Context.TELEMETRY] or not names_scope(msg.subject, payload.node):
            return
        self.observe(payload, envelope.occurred_at)

    def observe(self, sample: GpuTelemetryEvent, at: datetime) -> list[Transition]:
        """One node's GPU sample through the detectors; the transitions are planned on the next tick."""
        profile = self._profiles.get(sample.node)
        util: dict[str, float] = {}
        used: dict[str, int] = {}
        total_used = total = 0
        for gpu in sample.gpus:
            if gpu.memory_used_bytes is None or gpu.memory_free_bytes is None:
                continue
            size = gpu.memory_used_bytes + gpu.memory_free_bytes
            if size <= 0:
                continue
            acc = profile.accelerator_id(gpu.index) if profile is not None else f"{sample.node}/gpu{gpu.index}"
            util[acc] = gpu.memory_used_bytes / size
            used[acc] = gpu.memory_used_bytes
            total_used += gpu.memory_used_bytes
            total += size
        out: list[Transition] = []
        on_node = [r for r in self._replicas.values() if r.node == sample.node]
        for replica in on_node:
            figures = [util[a] for a in replica.accelerators if a in util]
            if figures:
                out += self._see(self._config.hot.name, replica.allocation_id, max(figures), at)
        if total and on_node:
            out += self._see(self._config.cold.name, sample.node, total_used / total, at)
        elif not on_node:
            gone = self._detectors[self._config.cold.name].forget(sample.node)
            out += [gone] if gone is not None else []
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
        self._pending.transitions += out
        return out

    def _see(self, rule: str, key: str, value: float, at: datetime) -> list[Transition]:
        transition = self._detectors[rule].observe(key, value, at)
        return [transition] if transition is not None else []

    def _drift(self, node: str, used: Mapping[str, int], at: datetime) -> list[Transition]:
        """Per replica allocation alone on its GPUs: |observed - reserved| / reserved (the brief's sidecar
        rule). GPUs shared by several allocations cannot say whose bytes they hold: left out."""
        here = [self._allocations[a] for a in self._by_node.get(node, ()) if a in self._allocations]
        holders: dict[str, int] = {}
        for allocation in here:
            for acc in allocation.bytes:
                holders[acc] = holders.get(acc, 0) + 1
        out: list[Transition] = []
        for allocation in here:
            mine = [a for a in allocation.bytes if AcceleratorId.on_host(a, node)]  # exactly this node's
            if not mine or any(holders.get(a, 0) != 1 or a not in used for a in mine):
                continue
            reserved = sum(allocation.bytes[a] for a in mine)
            observed = sum(used[a] for a in mine)
            if reserved <= 0:
                continue
            ratio = abs(observed - reserved) / reserved
            self._drift_figures[allocation.allocation_id] = (observed, reserved)
            out += self._see(self._config.drift_alarm.name, allocation.allocation_id, ratio, at)
            out += self._see(self._config.drift.name, allocation.allocation_id, ratio, at)
        return out

    # -- the loop ------------------------------------------------------------------------------------

    async def tick(self) -> None:
        """Forever: sweep stale targets, watch TPU fragmentation, plan what fired, run the plans."""
        while True:
            try:
                await self.tick_once()
                await self.restate(self._clock())  # in the tick's task: no throttle changes meanwhile
            except Exception:
                self._log.exception("rebalance tick failed; retrying")
            await asyncio.sleep(self._config.tick_s)

    async def restate(self, now: datetime) -> int:
        """Every ``restate_s``: publish each throttle still on (``throttle_started``) and each replica still
        draining under a running plan (``replica_draining``) again, marked ``restated``. Placement folds the
        REBALANCE stream from its first sequence at each start, and the stream keeps events only
        ``HETSCHED_STREAM_REBALANCE_MAX_AGE_S`` (four times ``restate_s``): without this a throttle or a drain
        older than that would be missing from the fold (docs/RETENTION.md). How many it restated."""
        if self._restate_s is None:
            return 0
        if self._restated_at is not None and (now - self._restated_at).total_seconds() < self._restate_s:
            return 0
        self._restated_at = now
        throttled = sorted(self._throttled)
        samples = {t.key: t.value for t in self._detectors[self._config.pcie.name].targets()}
        running = await self._uow.run(
            lambda uow: store.plans(session=uow.session, states=("open", "running"), limit=10_000)
        )
        draining = sorted(
            (step.allocation_id, view.plan_id)
            for view in (PlanView.model_validate(body) for body in running)
            for step in view.steps
            if step.allocation_id in self._draining
        )
        if not throttled and not draining:
            return 0

        async def work(uow: UnitOfWork) -> None:
            for node in throttled:
                uow.emit(
                    Context.REBALANCE,
                    RebalanceEventName.THROTTLE_STARTED,
                    NodeThrottleEvent(node=node, value=samples.get(node, 0.0), restated=True),
                )
            for allocation_id, plan_id in draining:
                uow.emit(
                    Context.REBALANCE,
                    RebalanceEventName.REPLICA_DRAINING,
                    ReplicaDrainingEvent(allocation_id=allocation_id, plan_id=plan_id, restated=True),
                )

        await self._uow.run(work)
        return len(throttled) + len(draining)

    async def tick_once(self) -> None:
        now = self._clock()
        if self._telemetry is None:
            await self._follow_telemetry()
        for detector in self._detectors.values():
            self._pending.transitions += detector.sweep(now)
        self._watch_pods(now)
        if self._metrics is not None:
            self._metrics.firing({name: len(d.firing()) for name, d in self._detectors.items()})
        if (now - self._scanned).total_seconds() >= BROKEN_SCAN_S or self._pending.changed_nodes:
            self._scanned = now
            self._pending.changed_nodes |= self._broken_nodes(now)
        pending, self._pending = self._pending, _Pending()
        if pending.transitions or pending.changed_nodes or pending.retry:
            await self._plan(pending, now)
        await self.run_plans()

    def _broken_nodes(self, now: datetime) -> set[str]:
        """Nodes holding a TP group placed to be NVLinked whose GPUs no longer sit on one clique of the
        node's current NVLink graph (a link went down): whatever order the events came in, and after a
        restart. A group whose re-placement was tried lately is left alone for ``REPLACE_RETRY_S``."""
        nodes: set[str] = set()
        for allocation_id in self._nvlinked:
            replica = self._replicas.get(allocation_id)
            if replica is None or replica.node is None or allocation_id in self._active:
                continue
            tried = self._replace_tried.get(allocation_id)
            if tried is not None and (now - tried).total_seconds() < REPLACE_RETRY_S:
                continue
            cliques = self._cliques.get(replica.node)
            if cliques is None:
                continue
            group = frozenset(replica.accelerators)
            if not any(group <= clique for clique in cliques):
                nodes.add(replica.node)
        return nodes

    def _watch_pods(self, now: datetime) -> None:
        for name, pod in self._pods.items():
            grid, _slices = self._pod_grid(name, pod)
            if grid is None:
                continue
            used = [r for r in self._replicas.values() if r.tpu_pod == name]
            if used:
                self._pending.transitions += self._see(self._config.fragmentation.name, name, fragmentation(grid), now)

    def _pod_grid(self, name: str, pod: TpuPodEvent) -> tuple[TpuGrid | None, dict[str, TpuSlice]]:
        try:
            grid = TpuGrid.empty(TpuType(pod.type), tuple(pod.shape))
        except ValueError:
            return None, {}
        slices: dict[str, TpuSlice] = {}
        for replica in self._replicas.values():
            if replica.tpu_pod == name and replica.tpu_slice is not None:
                try:
                    grid = allocate(grid, replica.tpu_slice)
                except ValueError:
                    continue
                slices[replica.allocation_id] = replica.tpu_slice
        return grid, slices

    # -- planning ------------------------------------------------------------------------------------

    async def _plan(self, pending: _Pending, now: datetime) -> None:
        fired: dict[str, list[Transition]] = {}
        cleared: dict[str, list[Transition]] = {}
        for t in [*pending.transitions, *pending.retry]:
            (fired if t.fired else cleared).setdefault(t.rule, []).append(t)
        plans: list[Plan] = []
        needs_snapshot = bool(
            fired.get(self._config.cold.name)
            or fired.get(self._config.drift.name)
            or pending.changed_nodes
            or fired.get(self._config.fragmentation.name)
        )
        snapshot: FleetSnapshot | None = None
        if needs_snapshot:
            try:
                snapshot = (await fetch_view(self._rpc, skus=self._skus, models=self._models)).snapshot
            except (SnapshotError, RpcError) as exc:
                self._log.warning("no fleet snapshot to plan on: %s (retried on the next tick)", exc)
                # What needs the fleet is planned again next tick (its events are not emitted twice).
                later = {self._config.cold.name, self._config.drift.name, self._config.fragmentation.name}
                self._pending.retry += [t for t in pending.transitions if t.fired and t.rule in later]
                self._pending.changed_nodes |= pending.changed_nodes
        for t in fired.get(self._config.hot.name, []):
            replica = self._replicas.get(t.key)
            if replica is not None and replica.allocation_id not in self._active:
                reason = f"{t.rule} {t.value:.2f} > {self._config.hot.threshold} for {self._config.hot.window_s:g} s"
                plans.append(replicate_plan(replica, _plan_id(), now, reason=reason))
        if snapshot is not None:
            plans += self._consolidation(snapshot, fired.get(self._config.cold.name, []), now)
            plans += self._defragmentation(snapshot, fired.get(self._config.fragmentation.name, []), now)
            plans += self._replacements(snapshot, fired.get(self._config.drift.name, []), pending.changed_nodes, now)
        throttles = [(t, True) for t in fired.get(self._config.pcie.name, [])]
        throttles += [(t, False) for t in cleared.get(self._config.pcie.name, [])]

        async def work(uow: UnitOfWork) -> None:
            for t in pending.transitions:
                rule = self._detectors[t.rule].rule
                name = RebalanceEventName.DETECTOR_FIRED if t.fired else RebalanceEventName.DETECTOR_CLEARED
                payload = DetectorEvent(
                    detector=t.rule, key=t.key, value=t.value, threshold=rule.threshold, window_s=rule.window_s
                )
                uow.emit(Context.REBALANCE, name, payload)
                verb = "fired" if t.fired else "cleared"
                await store.add_action(
                    session=uow.session, at=uow.now, plan_id=None, what=f"{t.rule} {verb} on {t.key} ({t.value:.3f})"
                )
                if t.fired and t.rule == self._config.drift_alarm.name:
                    observed, reserved = self._drift_figures.get(t.key, (0, 0))
                    uow.emit(
                        Context.REBALANCE,
                        RebalanceEventName.DRIFT_ALARM,
                        DriftAlarmEvent(
                            allocation_id=t.key, observed_bytes=observed, reserved_bytes=reserved, ratio=t.value
                        ),
                    )
            for t, on in throttles:
                await self._throttle(uow, t.key, on=on, value=t.value)
            for plan in plans:
                view = plan_view(plan)
                await store.add_plan(
                    session=uow.session,
                    plan_id=plan.plan_id,
                    state=plan.state,
                    body=view.model_dump(mode="json"),
                    now=uow.now,
                )
                uow.emit(Context.REBALANCE, RebalanceEventName.PLAN_CREATED, PlanEvent(plan=view))
                await store.add_action(
                    session=uow.session,
                    at=uow.now,
                    plan_id=plan.plan_id,
                    what=f"{plan.kind} planned for {plan.target}: {plan.reason}",
                )
            await store.trim_actions(session=uow.session)

        await self._uow.run(work)
        self._active |= {plan.target for plan in plans}

    async def _throttle(self, uow: UnitOfWork, node: str, *, on: bool, value: float) -> None:
        if on == (node in self._throttled):
            return
        await store.set_throttle(session=uow.session, node=node, on=on, now=uow.now)
        name = RebalanceEventName.THROTTLE_STARTED if on else RebalanceEventName.THROTTLE_ENDED
        uow.emit(Context.REBALANCE, name, NodeThrottleEvent(node=node, value=value))
        what = (
            f"cold starts throttled on {node} (PCIe {value:.2f})"
            if on
            else f"throttle on {node} ended (PCIe {value:.2f})"
        )
        await store.add_action(session=uow.session, at=uow.now, plan_id=None, what=what)
        # A throttle is a plan of its own (no steps): running while it lasts.
        plan_id = f"throttle-{node}"
        profile = self._profiles.get(node)
        cluster = f"{profile.region}/{profile.cluster}" if profile is not None else ""
        plan = Plan(plan_id, "throttle", cluster, node, what, uow.now, state="running" if on else "done")
        body = plan_view(plan).model_dump(mode="json")
        await store.put_plan(session=uow.session, plan_id=plan_id, state=plan.state, body=body, now=uow.now)
        if on:
            self._throttled.add(node)
        else:
            self._throttled.discard(node)

    def _consolidation(self, snapshot: FleetSnapshot, fired: list[Transition], now: datetime) -> list[Plan]:
        if not fired:
            return []
        detector = self._detectors[self._config.cold.name]
        cold = sorted(
            (t for t in detector.targets() if t.phase == "firing" and t.key not in self._active),
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
            withhold(snapshot, idle), list(self._replicas.values()), [t.key for t in cold], decide=decide
        )
        if not moves:
            return []
        # Placement withholds them too when the plan runs, so the copies land where they were planned to.
        moves = [dataclasses.replace(m, avoid=m.avoid | frozenset(idle)) for m in moves]
        nodes = sorted({m.replica.node or "" for m in moves})
        figures = ", ".join(f"{t.key} {t.value:.2f}" for t in cold if t.key in nodes)
        reason = f"hbm_cold < {self._config.cold.threshold} for {self._config.cold.window_s:g} s: {figures}"
        return [make_plan("consolidate", _plan_id(), moves[0].replica.cluster, ",".join(nodes), reason, now, moves)]

    def _defragmentation(self, snapshot: FleetSnapshot, fired: list[Transition], now: datetime) -> list[Plan]:
        plans: list[Plan] = []
        for t in fired:
            pod = self._pods.get(t.key)
            if pod is None or t.key in self._active:
                continue
            grid, slices = self._pod_grid(t.key, pod)
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
            moves = [
                Move(replica=self._replicas[m.allocation_id], avoid=block_chips, decision=_unplanned(m.allocation_id))
                for m in slice_moves
                if m.allocation_id in self._replicas
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
        replicas = list(self._replicas.values())
        for node in sorted(changed):
            broken = [
                r
                for r in broken_groups(replicas, node, self._cliques.get(node, []))
                if r.allocation_id not in self._active and r.allocation_id in self._nvlinked
            ]
            for r in broken:
                self._replace_tried[r.allocation_id] = now
            moves = replace_moves(snapshot, broken, decide=decide)
            if moves:
                reason = f"{node}'s NVLink graph changed: {len(moves)} TP group(s) no longer on one clique"
                plans.append(make_plan("replace", _plan_id(), moves[0].replica.cluster, node, reason, now, moves))
        for t in fired:
            replica = self._replicas.get(t.key)
            if replica is None or t.key in self._active:
                continue
            moves = replace_moves(snapshot, [replica], decide=decide)
            if moves:
                reason = (
                    f"hbm_drift {t.value:.2f} > {self._config.drift.threshold} for {self._config.drift.window_s:g} s"
                )
                plans.append(make_plan("replace", _plan_id(), replica.cluster, t.key, reason, now, moves))
        return plans

    # -- running plans -------------------------------------------------------------------------------

    async def run_plans(self) -> None:
        """Advance every open or running plan as far as it can go now (rate limit, drains)."""
        bodies = await self._uow.run(lambda uow: store.plans(session=uow.session, states=("open", "running")))
        for body in bodies:
            plan = plan_of_view(PlanView.model_validate(body))
            if plan.kind == "throttle":
                continue
            try:
                for _ in range(STEPS_PER_TICK):
                    advanced = await self._advance(plan)
                    if advanced is None:
                        break
                    plan = advanced
                    if plan.state not in ("open", "running"):
                        break
            except Exception:  # one plan's trouble never stops the others
                self._log.exception("plan %s could not advance; retried on the next tick", plan.plan_id)

    async def _advance(self, plan: Plan) -> Plan | None:
        """One step of the plan, recorded with its event; None when it cannot go on now."""
        index = next_step(plan)
        if index is None:
            return None
        step = plan.steps[index]
        request = self._requests.get(step.allocation_id)
        note: str
        if step.action == "place":
            if request is None:  # the replica was released meanwhile: nothing to move
                after = step_done(plan, index, skipped=True)
                note = f"{step.allocation_id} is gone: nothing to copy"
            else:
                if not self._take(plan.cluster):
                    return None
                ask = move_request(request, request_id=f"{plan.plan_id}/{index}", avoid=step.avoid)
                try:
                    reply = await self._rpc.ask(Rpc.PLACEMENT_PLACE, ask, PlaceReply, timeout_s=PLACE_TIMEOUT_S)
                except RpcError as exc:
                    self._log.warning("placement.place for plan %s: %s (retried)", plan.plan_id, exc)
                    return None
                if isinstance(reply, PlaceReply) and reply.status == "placed" and reply.allocation_id:
                    after = step_done(plan, index, new_allocation_id=reply.allocation_id)
                    where = ", ".join(a for p in reply.placements for a in p.accelerators) or (
                        reply.tpu_slice.pod if reply.tpu_slice else "?"
                    )
                    note = f"placed {reply.allocation_id} for {step.allocation_id} on {where}"
                    if self._metrics is not None:
                        self._metrics.copy_placed(plan.kind)
                else:
                    why = (
                        reply.error.message
                        if isinstance(reply, Rejected)
                        else (reply.error.message if reply.error else reply.status)
                    )
                    failed, copies = step_failed(plan, index)
                    await self._release_copies(failed, copies)
                    after = rolled_back(failed)
                    note = f"could not place a copy of {step.allocation_id}: {why}; {len(copies)} copy(ies) released"
        else:
            replica = self._replicas.get(step.allocation_id)
            if replica is None or request is None:
                after, note = step_done(plan, index), f"{step.allocation_id} was released already"
            else:
                if step.allocation_id not in self._draining:
                    await self._drain(plan, step.allocation_id)
                if self._holds.get(step.allocation_id):
                    return None  # messages in flight finish on it first
                try:
                    released = await self._rpc.ask(
                        Rpc.PLACEMENT_RELEASE,
                        ReleaseRequest(allocation_id=step.allocation_id, tenant=replica.tenant),
                        ReleaseReply,
                    )
                except RpcError as exc:
                    self._log.warning("placement.release for plan %s: %s (retried)", plan.plan_id, exc)
                    return None
                if isinstance(released, Rejected) and released.error.code is not ErrorCode.NOT_FOUND:
                    self._log.warning(
                        "placement.release %s refused: %s (retried)", step.allocation_id, released.error.message
                    )
                    return None
                after, note = step_done(plan, index), f"released {step.allocation_id}"
        await self._record(after, index, note)
        return after

    async def _release_copies(self, plan: Plan, copies: list[str]) -> None:
        for copy_id in copies:
            old = next((s.allocation_id for s in plan.steps if s.new_allocation_id == copy_id), None)
            tenant = self._replicas[old].tenant if old in self._replicas else None
            if tenant is None:
                tenant = next((r.tenant for r in self._replicas.values() if r.allocation_id == copy_id), None)
            if tenant is None:
                continue
            try:
                await self._rpc.ask(
                    Rpc.PLACEMENT_RELEASE, ReleaseRequest(allocation_id=copy_id, tenant=tenant), ReleaseReply
                )
            except RpcError as exc:
                self._log.warning("could not release copy %s of a failed plan: %s", copy_id, exc)

    async def _drain(self, plan: Plan, allocation_id: str) -> None:
        async def work(uow: UnitOfWork) -> None:
            uow.emit(
                Context.REBALANCE,
                RebalanceEventName.REPLICA_DRAINING,
                ReplicaDrainingEvent(allocation_id=allocation_id, plan_id=plan.plan_id),
            )
            await store.add_action(
                session=uow.session,
                at=uow.now,
                plan_id=plan.plan_id,
                what=f"{allocation_id} draining (no new requests)",
            )

        await self._uow.run(work)
        self._draining.add(allocation_id)

    async def _record(self, plan: Plan, index: int, note: str) -> None:
        view = plan_view(plan)

        async def work(uow: UnitOfWork) -> None:
            body = view.model_dump(mode="json")
            await store.save_plan(session=uow.session, plan_id=plan.plan_id, state=plan.state, body=body, now=uow.now)
            uow.emit(Context.REBALANCE, RebalanceEventName.PLAN_STEP, PlanEvent(plan=view, step=index, note=note))
            await store.add_action(session=uow.session, at=uow.now, plan_id=plan.plan_id, what=note)
            if plan.state not in ("open", "running"):
                uow.emit(Context.REBALANCE, RebalanceEventName.PLAN_FINISHED, PlanEvent(plan=view, note=plan.state))
                await store.add_action(
                    session=uow.session, at=uow.now, plan_id=plan.plan_id, what=f"{plan.kind} {plan.state}"
                )

        await self._uow.run(work)
        if plan.state not in ("open", "running"):
            self._active.discard(plan.target)

    def _take(self, cluster: str) -> bool:
        """A copy may start in ``cluster`` now (``migrations_per_min``, a burst of as many)."""
        now = self._clock()
        rate = self._config.migrations_per_min
        bucket = self._buckets.setdefault(cluster, _Bucket(tokens=rate, at=now))
        bucket.tokens = min(max(1.0, rate), bucket.tokens + (now - bucket.at).total_seconds() * rate / 60)
        bucket.at = now
        if bucket.tokens < 1:
            return False
        bucket.tokens -= 1
        return True


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
