"""Handlers of the rebalancer service: the third stage of the pipeline (prefilter -> score -> rebalance).

It learns the fleet from TOPOLOGY events, the replicas (with the request each was placed with) from
PLACEMENT events, the allocations from LEDGER events (``readmodel``), and follows TELEMETRY (an ordered
consumer of what the nodes' agents publish from now on): GPU samples, each engine's own report
(``engine_status``: its queue and KV in use, what it has in flight), and each rank's lifecycle
(``replica_state``: whether a copy's engine serves yet). Detectors (``detectors``; sustained
windows with hysteresis from ``shared.domain.rebalance.detect``) turn samples into firing targets; each
firing becomes a plan (``planner``; ``shared.domain.rebalance.plans``, ``tpu_defrag``) that runs
make-before-break through placement (``runner``):

- ``hbm_hot`` (a replica's engine above 0.85 of its KV cache, or with requests waiting, for 60 s; its GPUs'
  HBM use where the engine never reported): ``replicate``, a copy onto idle capacity, at most
  ``HETSCHED_REBALANCE_REPLICATE_PER_MODEL_HOUR`` of one tenant's model an hour; a copy is not itself
  judged hot before it has carried load;
- ``hbm_cold`` (a node's GPUs, each read as its replica's engine load or its HBM use, below 0.30 for
  300 s): ``consolidate``, its replicas moved so the node idles;
- ``tpu_fragmentation`` (a pod above 0.3): ``defragment``, slices moved out of an 8x8 block;
- ``pcie_hot`` (a node above 0.7 for 60 s): ``throttle``, placement takes no new replica there until it
  clears (``throttle_started`` / ``throttle_ended``);
- a node whose NVLink cliques change (``node_changed``): ``replace`` of the TP groups that no longer sit
  on one clique;
- ``hbm_drift`` per allocation (|observed - reserved| > 10% of it, checked every 10 s): an alarm at once
  (``drift_alarm``), and ``replace`` when it lasts.

Hot, cold and drift judge a replica only once it serves: where its node's agent reports lifecycle, every
rank ``ready`` and ``HETSCHED_REBALANCE_STATE_GRACE_S`` past the last state change
(``shared.domain.rebalance.signals``).

A plan places every copy first (placement.place with the replica's own request, a new id, the old GPUs
withheld), then, move by move, drains each old replica once its copy's engine is ready (every rank's
``replica_state`` from its node's agent; ``HETSCHED_REBALANCE_WAIT_FOR_READY``, ``shared.domain.rebalance.ready``)
and releases it once its messages in flight are done (admission sends it nothing new meanwhile:
``replica_draining``): its engine reported itself idle after the drain started, or never reported at all, or
``HETSCHED_REBALANCE_DRAIN_TIMEOUT_S`` passed (``shared.domain.rebalance.drain``). A copy that cannot be
placed, or whose engine fails or is not ready within ``HETSCHED_REBALANCE_READY_TIMEOUT_S``, fails the plan:
the copies whose old replicas still serve are released (rolled back).
Copies are rate-limited per cluster
(``HETSCHED_REBALANCE_MIGRATIONS_PER_MIN``). Plans and their steps are in Postgres and resume after a
restart (a step's placement request id is fixed, so asking again answers the same).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from datetime import UTC, datetime

from pydantic import BaseModel

from services.rebalancer.config import RebalanceConfig
from services.rebalancer.detectors import Detectors
from services.rebalancer.mapping import plan_view, replica_of
from services.rebalancer.metrics import RebalanceMetrics
from services.rebalancer.planner import Planner
from services.rebalancer.progress import Progress
from services.rebalancer.readmodel import Allocation, RebalanceView
from services.rebalancer.runner import PlanRunner
from services.rebalancer.store import Loaded, RebalanceStore
from shared.contracts.engines import ReplicaStateEvent
from shared.contracts.envelope import EventEnvelope
from shared.contracts.ledger import AllocationEvent
from shared.contracts.placement import PlacementEvent, PlacementReleasedEvent
from shared.contracts.rebalance import (
    NodeThrottleEvent,
    PlanView,
    RebalanceEventName,
    RebalanceStatusReply,
    RebalanceStatusRequest,
    ReplicaDrainingEvent,
)
from shared.contracts.subjects import Context
from shared.contracts.topology import (
    EngineStatusEvent,
    GpuTelemetryEvent,
    NodeProfileEvent,
    NodeStateEvent,
    TpuPodEvent,
)
from shared.domain.hardware import Sku
from shared.domain.models import ModelSpec
from shared.domain.rebalance.detect import Transition
from shared.domain.rebalance.plans import Plan
from shared.infra.clock import Clock
from shared.infra.rpc import RpcClient
from shared.infra.uow import UnitOfWork, UnitOfWorkFactory

RECENT = 50
RECENT_PLANS = 1000
"""Plans read at start for the copies made for hot replicas (not judged hot before they carry load) and the
per-model cap on copies."""
BROKEN_SCAN_S = 5.0
"""How often every NVLinked TP group is checked against its node's current cliques."""


class RebalanceHandlers:
    """The rebalancer's use cases: the events it follows, ``rebalance.status``, and the tick that plans and
    runs. Holds the read model (``view``), the detectors and what is under way (``progress``)."""

    def __init__(
        self,
        *,
        uow: UnitOfWorkFactory,
        store: RebalanceStore,
        rpc: RpcClient,
        clock: Clock,
        config: RebalanceConfig,
        skus: Mapping[str, Sku],
        models: Mapping[str, ModelSpec],
        log: logging.Logger | None = None,
        metrics: RebalanceMetrics | None = None,
        restate_s: float | None = None,
    ) -> None:
        self._uow = uow
        self._store = store
        self._clock = clock
        self._config = config
        self._log = log or logging.getLogger("hetsched.rebalance")
        self._metrics = metrics
        self._restate_s = restate_s  # how often throttles and draining replicas are restated; None: never
        self._restated_at: datetime | None = None
        self._scanned = datetime.min.replace(tzinfo=UTC)
        self.view = RebalanceView()
        self.progress = Progress()
        self.detectors = Detectors(
            config=config,
            view=self.view,
            skus=skus,
            log=self._log,
        )
        self.planner = Planner(
            uow=uow,
            store=store,
            rpc=rpc,
            config=config,
            view=self.view,
            detectors=self.detectors,
            progress=self.progress,
            skus=skus,
            models=models,
            log=self._log,
        )
        self.runner = PlanRunner(
            uow=uow,
            store=store,
            rpc=rpc,
            clock=clock,
            config=config,
            view=self.view,
            progress=self.progress,
            log=self._log,
            metrics=metrics,
        )
        if metrics is not None:  # every detector shows from the start, firing or not
            metrics.firing(dict.fromkeys(self.detectors.by_rule, 0))

    # -- start and stop ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Rebuild memory from the tables, end throttles a previous run left (its windows restart), and
        follow GPU telemetry."""
        loaded = await self._uow.run(lambda uow: self._store.load(session=uow.session))
        self._rebuild(loaded)
        plans = await self._uow.run(lambda uow: self._store.plans(session=uow.session, states=("open", "running")))
        self.progress.active = {view.target for view in plans if view.kind != "throttle"}
        recent = await self._uow.run(lambda uow: self._store.recent_plans(session=uow.session, limit=RECENT_PLANS))
        self.planner.remember_copies([view for view in recent if view.kind == "replicate"])

        async def unthrottle(uow: UnitOfWork) -> None:
            for node in sorted(loaded.throttles):
                await self._store.set_throttle(session=uow.session, node=node, on=False, now=uow.now)
                ended = Plan(f"throttle-{node}", "throttle", "", node, "ended at restart", uow.now, state="done")
                await self._store.save_plan(session=uow.session, plan=plan_view(ended), now=uow.now)
                uow.emit(Context.REBALANCE, RebalanceEventName.THROTTLE_ENDED, NodeThrottleEvent(node=node, value=0.0))
                await self._store.add_action(
                    session=uow.session, at=uow.now, plan_id=None, what=f"throttle ended on {node} (restart)"
                )

        if loaded.throttles:
            await self._uow.run(unthrottle)

    def _rebuild(self, loaded: Loaded) -> None:
        for event in loaded.replicas.values():
            self.view.placed(event)
        for allocation in loaded.allocations.values():
            self.view.allocated(allocation)
        for node in loaded.nodes.values():
            self.view.profiled(node)
        for pod in loaded.pods.values():
            self.view.pod_profiled(pod)

    def observe(self, sample: GpuTelemetryEvent, at: datetime) -> list[Transition]:
        """One node's GPU sample through the detectors (``Detectors.observe``). A sample whose agent runs the
        node's engines marks the node so first: a replica there that no engine reports on yet is starting."""
        if sample.engines:
            self.view.engines_said(sample.node, at)
        return self.detectors.observe(sample, at)

    def on_engine_status(self, report: EngineStatusEvent, at: datetime) -> None:
        """A replica's engine report made at ``at``: what it has in flight (read when it drains), and its load
        (the hot detector's input once it serves)."""
        self.view.engine_reported(report, at)
        self.detectors.engine_reported(report, at)

    def on_replica_state(self, report: ReplicaStateEvent, at: datetime) -> None:
        """A rank's lifecycle state made at ``at`` by its node's agent (a copy serves once every rank is ready)."""
        self.view.replica_state(report, at)

    # -- status ------------------------------------------------------------------------------------

    async def status(self, request: RebalanceStatusRequest) -> BaseModel:
        """Detectors with their targets, plans open or running (and the last finished), recent actions."""

        async def read(uow: UnitOfWork) -> BaseModel:
            live = await self._store.plans(session=uow.session, states=("open", "running"))
            recent = await self._store.recent_plans(session=uow.session, limit=20)
            actions = await self._store.actions(session=uow.session, limit=RECENT)
            seen: set[str] = set()
            plans: list[PlanView] = []
            for view in [*live, *recent]:
                if view.plan_id not in seen:
                    seen.add(view.plan_id)
                    plans.append(view)
            return RebalanceStatusReply(detectors=self.detectors.views(), plans=plans, recent=actions)

        return await self._uow.run(read)

    # -- events: rows in the consumer's transaction, the view once it commits ---------------------

    async def on_placement_decided(self, *, uow: UnitOfWork, event: EventEnvelope, payload: PlacementEvent) -> None:
        replica = replica_of(payload)
        if replica is None:
            return
        await self._store.put_replica(
            session=uow.session, allocation_id=replica.allocation_id, tenant=replica.tenant, event=payload
        )
        uow.after_commit(lambda: self.view.placed(payload))

    async def on_placement_released(
        self, *, uow: UnitOfWork, event: EventEnvelope, payload: PlacementReleasedEvent
    ) -> None:
        await self._store.drop_replica(session=uow.session, allocation_id=payload.allocation_id)
        uow.after_commit(lambda: self._released(payload.allocation_id))

    def _released(self, allocation_id: str) -> None:
        self.view.released(allocation_id)
        self.progress.forget(allocation_id)
        self.detectors.forget_replica(allocation_id)

    async def on_allocation_committed(self, *, uow: UnitOfWork, event: EventEnvelope, payload: AllocationEvent) -> None:
        allocation = Allocation(
            allocation_id=payload.allocation_id,
            kind=payload.kind,
            parent_id=payload.parent_id,
            bytes={s.accelerator_id: s.total_bytes for s in payload.shares},
        )
        await self._store.put_allocation(session=uow.session, allocation=allocation)
        uow.after_commit(lambda: self.view.allocated(allocation))

    async def on_allocation_ended(self, *, uow: UnitOfWork, event: EventEnvelope, payload: AllocationEvent) -> None:
        await self._store.drop_allocation(session=uow.session, allocation_id=payload.allocation_id)
        uow.after_commit(lambda: self.view.allocation_ended(payload.allocation_id))

    async def on_node_profiled(self, *, uow: UnitOfWork, event: EventEnvelope, payload: NodeProfileEvent) -> None:
        await self._store.put_node(session=uow.session, event=payload)
        uow.after_commit(lambda: self._profiled(payload))

    def _profiled(self, payload: NodeProfileEvent) -> None:
        if self.view.profiled(payload):
            self.progress.changed_nodes.add(payload.node)  # its NVLink graph changed: check its TP groups

    async def on_node_removed(self, *, uow: UnitOfWork, event: EventEnvelope, payload: NodeStateEvent) -> None:
        await self._store.drop_node(session=uow.session, name=payload.node)
        uow.after_commit(lambda: self.view.node_removed(payload.node))

    async def on_tpu_pod_profiled(self, *, uow: UnitOfWork, event: EventEnvelope, payload: TpuPodEvent) -> None:
        await self._store.put_pod(session=uow.session, event=payload)
        uow.after_commit(lambda: self.view.pod_profiled(payload))

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

    async def tick_once(self) -> None:
        now = self._clock()
        self.detectors.sweep(now)
        if self._metrics is not None:
            self._metrics.firing(self.detectors.firing())
        progress = self.progress
        if (now - self._scanned).total_seconds() >= BROKEN_SCAN_S or progress.changed_nodes:
            self._scanned = now
            progress.changed_nodes |= self.planner.broken_nodes(now)
        transitions = self.detectors.take()
        changed, progress.changed_nodes = progress.changed_nodes, set()
        retry, progress.retry = progress.retry, []
        if transitions or changed or retry:
            await self.planner.plan(transitions, retry=retry, changed_nodes=changed, now=now)
        await self.runner.run_plans()

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
        throttled = sorted(self.progress.throttled)
        samples = {t.key: t.value for t in self.detectors.by_rule[self._config.pcie.name].targets()}
        running = await self._uow.run(
            lambda uow: self._store.plans(session=uow.session, states=("open", "running"), limit=10_000)
        )
        draining = sorted(
            (step.allocation_id, view.plan_id)
            for view in running
            for step in view.steps
            if step.allocation_id in self.progress.draining
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
