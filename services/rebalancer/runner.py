"""Running plans make-before-break through placement: each copy placed first (rate-limited per cluster),
then, move by move, the old replica drained once its copy's engine is ready (the agents' ``replica_state``:
``shared.domain.rebalance.ready``) and released once it has drained (its engine's reports:
``shared.domain.rebalance.drain``). A copy that cannot be placed fails the plan, and so does one whose engine
fails or is not ready in time: the copies whose old replicas still serve are released (rolled back).
Every step is recorded with its event."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from services.rebalancer.config import RebalanceConfig
from services.rebalancer.mapping import move_request, plan_of_view, plan_view
from services.rebalancer.metrics import RebalanceMetrics
from services.rebalancer.progress import CopyPlaced, Progress
from services.rebalancer.readmodel import RebalanceView
from services.rebalancer.store import RebalanceStore
from shared.contracts.base import Rejected
from shared.contracts.placement import PlaceReply, ReleaseReply, ReleaseRequest
from shared.contracts.rebalance import PlanEvent, RebalanceEventName, ReplicaDrainingEvent
from shared.contracts.subjects import Context, Rpc
from shared.domain.errors import ErrorCode
from shared.domain.rebalance.drain import Drained, drained
from shared.domain.rebalance.plans import Plan, copy_failed, next_step, rolled_back, step_done, step_failed
from shared.domain.rebalance.ready import Readiness, copy_readiness
from shared.infra.clock import Clock
from shared.infra.rpc import RpcClient, RpcError
from shared.infra.uow import UnitOfWork, UnitOfWorkFactory

STEPS_PER_TICK = 8
PLACE_TIMEOUT_S = 30.0


@dataclass
class _Bucket:
    """Copies a cluster may still start: ``migrations_per_min`` per minute, a burst of as many."""

    tokens: float
    at: datetime


class PlanRunner:
    def __init__(
        self,
        *,
        uow: UnitOfWorkFactory,
        store: RebalanceStore,
        rpc: RpcClient,
        clock: Clock,
        config: RebalanceConfig,
        view: RebalanceView,
        progress: Progress,
        log: logging.Logger,
        metrics: RebalanceMetrics | None = None,
    ) -> None:
        self._uow = uow
        self._store = store
        self._rpc = rpc
        self._clock = clock
        self._config = config
        self._view = view
        self._progress = progress
        self._log = log
        self._metrics = metrics
        self._buckets: dict[str, _Bucket] = {}
        self._watching_since = clock()  # agents' reports followed from about now (TELEMETRY from new events)

    async def run_plans(self) -> None:
        """Advance every open or running plan as far as it can go now (rate limit, drains)."""
        views = await self._uow.run(lambda uow: self._store.plans(session=uow.session, states=("open", "running")))
        for view in views:
            plan = plan_of_view(view)
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
        request = self._view.requests.get(step.allocation_id)
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
                    nodes = frozenset(p.node for p in reply.placements)
                    self._progress.copies[reply.allocation_id] = CopyPlaced(at=self._clock(), nodes=nodes)
                    if plan.kind == "replicate":  # not judged hot itself before it carries load
                        self._view.unproven.add(reply.allocation_id)
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
            replica = self._view.replicas.get(step.allocation_id)
            if replica is None or request is None:
                after, note = step_done(plan, index), f"{step.allocation_id} was released already"
            else:
                if step.allocation_id not in self._progress.draining:
                    copy = next(
                        (
                            s.new_allocation_id
                            for s in plan.steps
                            if s.action == "place" and s.allocation_id == step.allocation_id
                        ),
                        None,
                    )
                    readiness = Readiness.UNWATCHED if copy is None else self._readiness(copy)
                    if readiness is Readiness.WAIT:
                        return None  # the copy's engine starts or loads: the old replica keeps serving
                    if readiness in (Readiness.FAILED, Readiness.TIMED_OUT):
                        return await self._abandon(plan, index, copy or "", readiness)
                    await self._drain(plan, step.allocation_id)
                if not self._drained(plan, step.allocation_id):
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

    def _readiness(self, copy: str) -> Readiness:
        """Whether the old replica of ``copy`` may be drained now (``copy_readiness``): the copy's ranks as
        reported, and whether an agent runs engines on its nodes (one reported within the stale window)."""
        now = self._clock()
        placed = self._progress.copies.get(copy)
        if placed is None:  # placed before this process started: its wait counts from now
            since, nodes = self._progress.resumed.setdefault(copy, now), self._view.nodes_of(copy)
        else:
            since, nodes = placed.at, placed.nodes | self._view.nodes_of(copy)
        stale_s = self._config.agent_stale_s
        cutoff = since - timedelta(seconds=stale_s)
        agents = self._view.agents
        return copy_readiness(
            self._view.ranks.get(copy),
            mode=self._config.wait_for_ready,
            agent_seen=any((at := agents.get(node)) is not None and at >= cutoff for node in nodes),
            since=since,
            watching_since=self._watching_since,
            now=now,
            timeout_s=self._config.ready_timeout_s,
            stale_s=stale_s,
        )

    async def _abandon(self, plan: Plan, index: int, copy: str, readiness: Readiness) -> Plan:
        """The copy of release step ``index`` will not serve: the plan rolls back before that old replica is
        drained (``copy_failed``), and the copies whose old replicas still serve are released."""
        old = plan.steps[index].allocation_id
        ranks = self._view.ranks.get(copy)
        if readiness is Readiness.FAILED and ranks is not None:
            why = f"its engine reported {ranks.describe()}"
        else:
            seen = ranks.describe() if ranks is not None else "no report"
            why = f"its engine was not ready within {self._config.ready_timeout_s:.0f} s ({seen})"
        failed, copies = copy_failed(plan, index)
        await self._release_copies(failed, copies)
        after = rolled_back(failed)
        note = f"copy {copy} of {old} will not serve: {why}; {len(copies)} copy(ies) released, {old} kept"
        self._log.warning("plan %s rolled back: %s", plan.plan_id, note)
        await self._record(after, index, note)
        return after

    async def _release_copies(self, plan: Plan, copies: list[str]) -> None:
        replicas = self._view.replicas
        for copy_id in copies:
            old = next((s.allocation_id for s in plan.steps if s.new_allocation_id == copy_id), None)
            tenant = replicas[old].tenant if old in replicas else None
            if tenant is None:
                tenant = next((r.tenant for r in replicas.values() if r.allocation_id == copy_id), None)
            if tenant is None:
                continue
            try:
                await self._rpc.ask(
                    Rpc.PLACEMENT_RELEASE, ReleaseRequest(allocation_id=copy_id, tenant=tenant), ReleaseReply
                )
            except RpcError as exc:
                self._log.warning("could not release copy %s of a failed plan: %s", copy_id, exc)

    def _drained(self, plan: Plan, allocation_id: str) -> bool:
        """The draining replica may be released now (``drained``); a drain not seen before counts from now
        (after a restart, from when it is first seen again)."""
        now = self._clock()
        started = self._progress.drain_started.setdefault(allocation_id, now)
        verdict = drained(
            self._view.engines.get(allocation_id), started=started, now=now, timeout_s=self._config.drain_timeout_s
        )
        if verdict is Drained.TIMED_OUT:
            self._log.warning(
                "plan %s: %s not reported idle within %.0f s of its drain; released with work possibly in flight",
                plan.plan_id,
                allocation_id,
                self._config.drain_timeout_s,
            )
        return verdict is not Drained.WAIT

    async def _drain(self, plan: Plan, allocation_id: str) -> None:
        async def work(uow: UnitOfWork) -> None:
            uow.emit(
                Context.REBALANCE,
                RebalanceEventName.REPLICA_DRAINING,
                ReplicaDrainingEvent(allocation_id=allocation_id, plan_id=plan.plan_id),
            )
            await self._store.add_action(
                session=uow.session,
                at=uow.now,
                plan_id=plan.plan_id,
                what=f"{allocation_id} draining (no new requests)",
            )
            uow.after_commit(lambda: self._drained_from(allocation_id, now))

        now = self._clock()
        await self._uow.run(work)

    def _drained_from(self, allocation_id: str, started: datetime) -> None:
        self._progress.draining.add(allocation_id)
        self._progress.drain_started[allocation_id] = started

    async def _record(self, plan: Plan, index: int, note: str) -> None:
        view = plan_view(plan)
        finished = plan.state not in ("open", "running")

        async def work(uow: UnitOfWork) -> None:
            await self._store.save_plan(session=uow.session, plan=view, now=uow.now)
            uow.emit(Context.REBALANCE, RebalanceEventName.PLAN_STEP, PlanEvent(plan=view, step=index, note=note))
            await self._store.add_action(session=uow.session, at=uow.now, plan_id=plan.plan_id, what=note)
            if finished:
                uow.emit(Context.REBALANCE, RebalanceEventName.PLAN_FINISHED, PlanEvent(plan=view, note=plan.state))
                await self._store.add_action(
                    session=uow.session, at=uow.now, plan_id=plan.plan_id, what=f"{plan.kind} {plan.state}"
                )
                uow.after_commit(lambda: self._finished(plan))

        await self._uow.run(work)

    def _finished(self, plan: Plan) -> None:
        """A plan done or rolled back: its target may be planned again, and no move of it waits any more."""
        self._progress.active.discard(plan.target)
        for step in plan.steps:
            if step.new_allocation_id is not None:
                self._progress.copies.pop(step.new_allocation_id, None)
                self._progress.resumed.pop(step.new_allocation_id, None)

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
