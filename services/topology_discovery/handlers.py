"""Handlers of topology-discovery in fleet mode: the fleet's owner. Loads the inventory, takes agents'
reports, tracks their liveness from heartbeats, answers `fleet.get` / `fleet.describe` from its own
tables, and keeps the reserved bytes per accelerator from the LEDGER events.

Each method reads like a sentence: load -> call the pure core -> write + emit (one unit of work) -> reply.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession

from services.topology_discovery.mapping import (
    counted_shares,
    describe_reply,
    domains_by_node,
    fleet_reply,
    profile_event,
    tpu_pod_event,
)
from services.topology_discovery.metrics import TopologyMetrics
from services.topology_discovery.store import FleetPage, TopologyStore
from shared.contracts.base import ErrorCode, rejected
from shared.contracts.envelope import EventEnvelope
from shared.contracts.fleet import FleetDescribeRequest, FleetGetReply, FleetGetRequest
from shared.contracts.ledger import AllocationEvent
from shared.contracts.subjects import Context
from shared.contracts.topology import (
    Heartbeat,
    NodeProfileFailedEvent,
    NodeProfilePayload,
    NodeStateEvent,
    TopologyEventName,
    TopologyReportReply,
    TopologyReportRequest,
)
from shared.domain.fleet import Fleet, diff_profiles, fleet_domains
from shared.domain.hardware import Sku
from shared.domain.inventory import InventoryError
from shared.domain.liveness import Liveness, LivenessTracker, Transition
from shared.infra.catalog import inventory_fingerprint, load_inventory
from shared.infra.clock import MonotonicMs
from shared.infra.profiles import profile_from_payload
from shared.infra.uow import UnitOfWork, UnitOfWorkFactory

INVENTORY_SOURCE = "inventory"
DEFAULT_PAGE_NODES = 256


@dataclass(frozen=True, slots=True)
class SyncCounts:
    """What an inventory load changed, node by node."""

    new: int
    changed: int
    unchanged: int
    removed: int


class TopologyHandlers:
    def __init__(
        self,
        *,
        uow: UnitOfWorkFactory,
        monotonic_ms: MonotonicMs,
        skus: Mapping[str, Sku],
        tracker: LivenessTracker,
        log: logging.Logger,
        store: TopologyStore | None = None,
        inventory: Path | None = None,
        max_payload: Callable[[], int] = lambda: 1 << 20,
        liveness_period_s: float = 1.0,
        metrics: TopologyMetrics | None = None,
    ) -> None:
        self._uow = uow
        self._metrics = metrics
        self._monotonic_ms = monotonic_ms  # liveness counts silence on a monotonic clock; timestamps come from uow.now
        self._skus = skus
        self._tracker = tracker
        self._log = log
        self._store = store or TopologyStore()
        self._inventory = inventory
        self._max_payload = max_payload
        self._liveness_period_s = liveness_period_s

    # -- requests ------------------------------------------------------------------------------

    async def fleet_get(self, request: FleetGetRequest) -> BaseModel:
        # A page must fit one NATS message: start from the asked (or default) size and halve until it does.
        budget = int(self._max_payload() * 0.9)
        limit = request.limit or DEFAULT_PAGE_NODES
        while True:
            reply = await self._page(
                region=request.region, after=request.cursor, limit=limit, profiles=request.profiles
            )
            if limit == 1 or len(reply.model_dump_json()) <= budget:
                return reply
            limit = max(1, limit // 2)

    async def _page(self, *, region: str | None, after: str | None, limit: int, profiles: bool) -> FleetGetReply:
        async def read(session: AsyncSession) -> FleetPage:
            return await self._store.fleet_page(
                session=session, region=region, after=after, limit=limit, profiles=profiles
            )

        return fleet_reply(await self._uow.read(read), self._skus)

    async def fleet_describe(self, request: FleetDescribeRequest) -> BaseModel:
        async def read(session: AsyncSession) -> tuple[FleetPage, NodeProfilePayload | None]:
            page = await self._store.fleet_page(session=session, node=request.node)
            return page, await self._store.node_profile(session=session, name=request.node)

        page, profile = await self._uow.read(read)
        if not page.nodes or profile is None:
            return rejected(ErrorCode.NOT_FOUND, f"no node {request.node!r}")
        return describe_reply(page, profile, self._skus)

    async def report(self, request: TopologyReportRequest) -> BaseModel:
        """An agent's report: a failure is published and the stored profile stays; a new or changed
        profile is stored with its event; an unchanged one only (re)starts the liveness watch."""
        if request.error is not None:
            return await self._profile_failed(request)
        assert request.profile is not None  # the contract demands exactly one of profile and error
        try:
            node = profile_from_payload(request.profile)
        except ValueError as exc:
            return rejected(ErrorCode.INVALID_REQUEST, f"profile does not describe a node: {exc}")
        if node.name != request.node:
            return rejected(ErrorCode.INVALID_REQUEST, f"profile is for {node.name!r}, report is for {request.node!r}")
        if node.source == INVENTORY_SOURCE:
            return rejected(ErrorCode.INVALID_REQUEST, "agents report with source nvml or nvidia-smi")
        fingerprint = node.fingerprint()

        async def work(uow: UnitOfWork) -> BaseModel:
            stored = await self._store.node(session=uow.session, name=node.name)
            if stored is not None and stored.source == INVENTORY_SOURCE:
                return rejected(ErrorCode.CONFLICT, f"node {node.name} is defined by the inventory")
            if stored is not None and stored.fingerprint == fingerprint:
                return TopologyReportReply(status="unchanged", fingerprint=fingerprint)
            await self._store.upsert_nodes(session=uow.session, nodes=[node], now=uow.now)
            domains = fleet_domains(await self._store.profiles(session=uow.session))
            await self._store.replace_domains(session=uow.session, domains=domains)
            previous = stored.fingerprint if stored is not None else None
            name = TopologyEventName.NODE_CHANGED if previous else TopologyEventName.NODE_PROFILED
            own = domains_by_node(domains).get(node.name, [])
            uow.emit(Context.TOPOLOGY, name, profile_event(node, own, previous))
            changed[:] = [previous is not None]
            return TopologyReportReply(status="accepted", fingerprint=fingerprint)

        changed: list[bool] = []
        reply = await self._uow.run(work)
        if isinstance(reply, TopologyReportReply):
            self._tracker.watch(node.name, now_ms=self._monotonic_ms())
            if self._metrics is not None:
                self._metrics.profiles_changed(sum(changed))
                self._metrics.refreshed()
                self._metrics.profiled(node.name)
        return reply

    async def _profile_failed(self, request: TopologyReportRequest) -> BaseModel:
        assert request.error is not None

        async def work(uow: UnitOfWork) -> None:
            payload = NodeProfileFailedEvent(node=request.node, error=request.error)
            uow.emit(Context.TOPOLOGY, TopologyEventName.NODE_PROFILE_FAILED, payload)

        await self._uow.run(work)
        if self._metrics is not None:
            self._metrics.profile_failed(request.node)
        self._log.warning(
            "agent could not profile its node; previous profile stays",
            extra={"node": request.node, "error": request.error.message, "line": request.error.line},
        )
        return TopologyReportReply(status="accepted")

    # -- inventory -----------------------------------------------------------------------------

    async def load_inventory(self) -> None:
        """At start: load the inventory file unless Postgres already holds exactly this file's fleet.

        A file that does not parse is logged with where it is; the previously stored fleet stays in force.
        """
        path = self._inventory
        if path is None:
            return
        try:
            fingerprint = await asyncio.to_thread(inventory_fingerprint, path)

            async def stored(session: AsyncSession) -> str | None:
                return await self._store.source_fingerprint(session=session, name=INVENTORY_SOURCE)

            if await self._uow.read(stored) == fingerprint:
                self._log.info(
                    "inventory unchanged since last load; serving the stored fleet", extra={"path": str(path)}
                )
                if self._metrics is not None:
                    self._metrics.refreshed()
                return
            fleet, fingerprint = await asyncio.to_thread(load_inventory, path, skus=dict(self._skus))
            counts = await self.sync_inventory(fleet, fingerprint)
            self._log.info("inventory loaded", extra={"path": str(path), **asdict(counts)})
            if self._metrics is not None:
                self._metrics.profiles_changed(counts.changed)
                self._metrics.refreshed()
        except InventoryError as exc:
            self._log.error(
                "inventory rejected; keeping the stored fleet", extra={"path": str(path), "error": str(exc)}
            )

    async def sync_inventory(self, fleet: Fleet, fingerprint: str) -> SyncCounts:
        """Make the stored fleet match an inventory, with one event per node that is new, changed or gone.

        Nodes that agents reported are never the inventory's: listing one is an ``InventoryError``.
        """

        async def work(uow: UnitOfWork) -> tuple[SyncCounts, tuple[str, ...]]:
            stored = await self._store.nodes(session=uow.session)
            inventory = {n: s.fingerprint for n, s in stored.items() if s.source == INVENTORY_SOURCE}
            clash = sorted(n.name for n in fleet.nodes if n.name in stored and n.name not in inventory)
            if clash:
                raise InventoryError("inventory", f"nodes already reported by agents: {', '.join(clash[:5])}")
            diff = diff_profiles(inventory, fleet.nodes, removable=inventory)
            removed_ids = await self._store.accelerator_ids(session=uow.session, nodes=diff.removed)
            await self._store.upsert_nodes(session=uow.session, nodes=[*diff.new, *diff.changed], now=uow.now)
            await self._store.delete_nodes(session=uow.session, names=diff.removed)
            await self._store.replace_static(session=uow.session, racks=fleet.racks, tpu_pods=fleet.tpu_pods)
            domains = fleet_domains(await self._store.profiles(session=uow.session))
            await self._store.replace_domains(session=uow.session, domains=domains)
            own = domains_by_node(domains)
            for node in diff.new:
                uow.emit(
                    Context.TOPOLOGY, TopologyEventName.NODE_PROFILED, profile_event(node, own.get(node.name, []), None)
                )
            for node in diff.changed:
                changed = profile_event(node, own.get(node.name, []), inventory[node.name])
                uow.emit(Context.TOPOLOGY, TopologyEventName.NODE_CHANGED, changed)
            for name in diff.removed:
                gone = NodeStateEvent(node=name, region=stored[name].region, accelerators=removed_ids[name])
                uow.emit(Context.TOPOLOGY, TopologyEventName.NODE_REMOVED, gone)
            for pod in fleet.tpu_pods:
                uow.emit(Context.TOPOLOGY, TopologyEventName.TPU_POD_PROFILED, tpu_pod_event(pod, self._skus))
            await self._store.record_source(
                session=uow.session, name=INVENTORY_SOURCE, fingerprint=fingerprint, now=uow.now
            )
            counts = SyncCounts(
                new=len(diff.new), changed=len(diff.changed), unchanged=len(diff.unchanged), removed=len(diff.removed)
            )
            return counts, diff.removed

        counts, removed = await self._uow.run(work)
        for name in removed:
            self._tracker.forget(name)  # a node that left the fleet is never declared lost
            if self._metrics is not None:
                self._metrics.forget(name)
        return counts

    # -- liveness ------------------------------------------------------------------------------

    async def watch_agents(self) -> None:
        """At start: watch every agent-reported node in Postgres (lost ones stay lost until they beat)."""

        async def read(session: AsyncSession) -> dict[str, Liveness]:
            nodes = await self._store.nodes(session=session)
            return {n.name: n.state for n in nodes.values() if n.source != INVENTORY_SOURCE}

        now = self._monotonic_ms()
        for name, state in (await self._uow.read(read)).items():
            self._tracker.watch(name, now_ms=now, state=state)

    async def heartbeat(self, beat: Heartbeat) -> None:
        if self._tracker.state(beat.node) is None:
            return  # not (yet) a reported node: its first report starts the watch
        recovered = self._tracker.beat(beat.node, now_ms=self._monotonic_ms())
        if self._metrics is not None:
            self._metrics.refreshed()
            self._metrics.beat(beat.node)
        if recovered is not None:
            await self._record(recovered)

    async def liveness_tick(self) -> list[Transition]:
        """Declare lost every watched node silent for longer than the missed beats allow."""
        recorded = []
        for transition in self._tracker.evaluate(now_ms=self._monotonic_ms()):
            try:
                await self._record(transition)
                recorded.append(transition)
            except Exception:
                self._log.exception("could not record a lost node; will retry", extra={"node": transition.node})
        if self._metrics is not None:
            self._metrics.nodes(self._tracker.counts())
        return recorded

    async def liveness_loop(self) -> None:
        while True:
            await asyncio.sleep(self._liveness_period_s)
            await self.liveness_tick()
            if self._metrics is not None:  # the map is maintained: every silent node has been judged
                self._metrics.refreshed()

    async def _record(self, transition: Transition) -> None:
        """Store a lost/recovered node with its event; undone in the tracker when it could not be stored."""
        lost = transition.to is Liveness.LOST

        async def work(uow: UnitOfWork) -> bool:
            region = await self._store.set_liveness(
                session=uow.session,
                node=transition.node,
                expected=Liveness.UP if lost else Liveness.LOST,
                to=transition.to,
            )
            if region is None:
                return False  # another fleet instance already flipped it, or the node is gone
            ids = await self._store.accelerator_ids(session=uow.session, nodes=[transition.node])
            payload = NodeStateEvent(
                node=transition.node,
                region=region,
                accelerators=ids[transition.node],
                last_seen_ms_ago=round(transition.silent_ms, 1),
            )
            uow.emit(
                Context.TOPOLOGY, TopologyEventName.NODE_LOST if lost else TopologyEventName.NODE_RECOVERED, payload
            )
            return True

        try:
            changed = await self._uow.run(work)
        except Exception:
            self._tracker.revert(transition)
            raise
        if changed:
            message = "node lost" if lost else "node recovered"
            self._log.warning(message, extra={"node": transition.node, "silent_ms": transition.silent_ms})

    # -- LEDGER events: reserved bytes per accelerator, eventually consistent with the ledger --
    #
    # The ledger's reserved bytes are the sum of its active counted shares, so the allocation events
    # alone determine them: a commit adds its shares, a release or expiry takes them off, each share
    # once (topology.reserved_shares), in whichever order the two arrive. The inbox applies each event
    # once. capacity_changed's absolute figures are not used: a consumer handles a fetched batch
    # concurrently, so an absolute figure could land after a later share and undo it.

    async def on_allocation_committed(self, *, uow: UnitOfWork, event: EventEnvelope, payload: AllocationEvent) -> None:
        await self._store.reserve_shares(
            session=uow.session, allocation_id=payload.allocation_id, shares=counted_shares(payload)
        )

    async def on_allocation_ended(self, *, uow: UnitOfWork, event: EventEnvelope, payload: AllocationEvent) -> None:
        """`allocation_released` and `allocation_expired`: the shares go back."""
        await self._store.release_shares(
            session=uow.session, allocation_id=payload.allocation_id, shares=counted_shares(payload)
        )
