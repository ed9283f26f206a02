"""Fleet mode: owns the fleet. Loads the inventory, takes agents' reports, tracks their liveness,
answers `fleet.get` / `fleet.describe` from Postgres."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from faststream.nats import NatsBroker, NatsMessage
from pydantic import BaseModel, ValidationError
from sqlalchemy import select, update

from services.topology_discovery import store
from services.topology_discovery.tables import NodeRow
from shared.contracts.base import ErrorCode, rejected
from shared.contracts.fleet import DomainView, FleetDescribeReply, FleetDescribeRequest, FleetGetRequest, NodeView
from shared.contracts.subjects import Context
from shared.contracts.topology import (
    NODE_CHANGED,
    NODE_LOST,
    NODE_PROFILE_FAILED,
    NODE_PROFILED,
    NODE_RECOVERED,
    NODE_REMOVED,
    TPU_POD_PROFILED,
    Heartbeat,
    NodeProfileEvent,
    NodeProfileFailedEvent,
    NodeStateEvent,
    TopologyReportReply,
    TopologyReportRequest,
    TpuPodEvent,
)
from shared.domain.fleet import Domain, Fleet, NodeProfile, diff_profiles, profile_from_dict, profile_to_dict
from shared.domain.hardware import Sku
from shared.domain.inventory import InventoryError
from shared.domain.liveness import Liveness, LivenessTracker, Transition
from shared.infra.catalog import inventory_fingerprint, load_inventory, load_skus
from shared.infra.service import Runtime

INVENTORY_SOURCE = "inventory"
NODES = NodeRow.__table__  # type: ignore[attr-defined]


def _monotonic_ms() -> float:
    return time.monotonic() * 1000


class FleetState:
    """Per-process state of the fleet mode: the SKU catalog and the liveness tracker."""

    def __init__(self, runtime: Runtime, *, clock_ms: Callable[[], float] = _monotonic_ms) -> None:
        settings = runtime.settings
        self.runtime = runtime
        self.skus: dict[str, Sku] = load_skus(settings.sku_catalog)
        self.clock_ms = clock_ms
        self.tracker = LivenessTracker(
            interval_ms=settings.topology_heartbeat_s * 1000, missed_beats=settings.topology_missed_heartbeats
        )


def _profile_event(node: NodeProfile, domains: tuple[Domain, ...], previous: str | None) -> dict[str, Any]:
    own = [d for d in domains if any(m.startswith(f"{node.name}/") for m in d.members)]
    return NodeProfileEvent(
        node=node.name,
        region=node.region,
        kind=node.topology.kind.value,
        fingerprint=node.fingerprint(),
        previous_fingerprint=previous,
        profile=profile_to_dict(node),
        domains=[{"id": d.id, "kind": d.kind, "members": list(d.members)} for d in own],
    ).model_dump(mode="json")


async def sync_inventory(
    runtime: Runtime, fleet: Fleet, fingerprint: str, *, skus: dict[str, Sku] | None = None
) -> dict[str, int]:
    """Make the stored fleet match an inventory, with one event per node that is new, changed or gone."""
    subjects = runtime.subjects
    skus = skus or {}
    async with runtime.sessions() as session, session.begin():
        stored_inventory = await store.stored_fingerprints(session, source=INVENTORY_SOURCE)
        stored_all = await store.stored_fingerprints(session)
        clash = [n.name for n in fleet.nodes if n.name in stored_all and n.name not in stored_inventory]
        if clash:
            raise InventoryError("inventory", f"nodes already reported by agents: {', '.join(sorted(clash)[:5])}")
        diff = diff_profiles(stored_inventory, fleet.nodes, removable=stored_inventory)
        await store.upsert_nodes(session, [*diff.new, *diff.changed])
        await store.delete_nodes(session, diff.removed)
        await store.replace_static(session, fleet)
        domains = await store.rebuild_domains(session)
        for node in diff.new:
            await store.emit(
                session,
                subjects=subjects,
                context=Context.TOPOLOGY,
                event=NODE_PROFILED,
                payload=_profile_event(node, domains, None),
            )
        for node in diff.changed:
            await store.emit(
                session,
                subjects=subjects,
                context=Context.TOPOLOGY,
                event=NODE_CHANGED,
                payload=_profile_event(node, domains, stored_inventory[node.name]),
            )
        for name in diff.removed:
            payload = NodeStateEvent(node=name, region="", accelerators=[]).model_dump(mode="json")
            await store.emit(session, subjects=subjects, context=Context.TOPOLOGY, event=NODE_REMOVED, payload=payload)
        for pod in fleet.tpu_pods:
            sku = f"TPU-{pod.type.value.upper()}"
            payload = TpuPodEvent(
                pod=pod.name,
                region=pod.region,
                type=pod.type.value,
                shape=list(pod.shape),
                sku=sku,
                hbm_per_chip=skus[sku].hbm_bytes if sku in skus else 0,
            ).model_dump(mode="json")
            await store.emit(
                session, subjects=subjects, context=Context.TOPOLOGY, event=TPU_POD_PROFILED, payload=payload
            )
        await store.record_source(session, INVENTORY_SOURCE, fingerprint)
    if runtime.relay:
        runtime.relay.wake()
    return {
        "new": len(diff.new),
        "changed": len(diff.changed),
        "unchanged": len(diff.unchanged),
        "removed": len(diff.removed),
    }


async def load_configured_inventory(runtime: Runtime, state: FleetState) -> None:
    """At start: load the inventory file unless Postgres already holds exactly this file's fleet."""
    path = runtime.settings.topology_inventory
    if path is None:
        return
    try:
        fingerprint = await asyncio.to_thread(inventory_fingerprint, path)
        async with runtime.sessions() as session:
            stored = await store.source_fingerprint(session, INVENTORY_SOURCE)
        if stored == fingerprint:
            runtime.log.info("inventory unchanged since last load; serving the stored fleet", extra={"path": str(path)})
            return
        fleet, fingerprint = await asyncio.to_thread(load_inventory, path, skus=state.skus)
        counts = await sync_inventory(runtime, fleet, fingerprint, skus=state.skus)
        runtime.log.info("inventory loaded", extra={"path": str(path), **counts})
    except InventoryError as exc:
        # The previously stored fleet stays in force; the error is logged with where it is.
        runtime.log.error("inventory rejected; keeping the stored fleet", extra={"path": str(path), "error": str(exc)})


async def watch_agents(runtime: Runtime, state: FleetState) -> None:
    """Start tracking every agent-reported node stored in Postgres (lost ones stay lost until they beat)."""
    async with runtime.sessions() as session:
        rows = (
            await session.execute(select(NODES.c.name, NODES.c.state).where(NODES.c.source != INVENTORY_SOURCE))
        ).all()
    now = state.clock_ms()
    for name, node_state in rows:
        state.tracker.watch(name, now_ms=now, state=Liveness(node_state))


async def _apply_transition(runtime: Runtime, transition: Transition) -> None:
    expected, new_state = ("up", "lost") if transition.to is Liveness.LOST else ("lost", "up")
    async with runtime.sessions() as session, session.begin():
        result = await session.execute(
            update(NODES)
            .where(NODES.c.name == transition.node, NODES.c.state == expected)
            .values(state=new_state)
            .returning(NODES.c.region)
        )
        region = result.scalar_one_or_none()
        if region is None:
            return  # another fleet instance already flipped it, or the node is gone
        payload = NodeStateEvent(
            node=transition.node,
            region=region,
            accelerators=await store.accelerator_ids(session, transition.node),
            last_seen_ms_ago=round(transition.silent_ms, 1),
        ).model_dump(mode="json")
        event = NODE_LOST if transition.to is Liveness.LOST else NODE_RECOVERED
        await store.emit(session, subjects=runtime.subjects, context=Context.TOPOLOGY, event=event, payload=payload)
    runtime.log.warning(f"node {event}", extra={"node": transition.node, "silent_ms": transition.silent_ms})
    if runtime.relay:
        runtime.relay.wake()


async def liveness_loop(runtime: Runtime, state: FleetState) -> None:
    period = max(runtime.settings.topology_heartbeat_s / 4, 0.05)
    while True:
        await asyncio.sleep(period)
        for transition in state.tracker.evaluate(now_ms=state.clock_ms()):
            try:
                await _apply_transition(runtime, transition)
            except Exception:
                runtime.log.exception("could not record a lost node; will retry", extra={"node": transition.node})
                state.tracker.beat(transition.node, now_ms=state.clock_ms() - state.tracker.deadline_ms - 1)


def subscribe_heartbeats(broker: NatsBroker, runtime: Runtime, state: FleetState) -> None:
    async def on_heartbeat(msg: NatsMessage) -> None:
        try:
            beat = Heartbeat.model_validate_json(msg.body)
        except ValidationError:
            return
        if state.tracker.state(beat.node) is None:
            return  # not (yet) a reported node: its first report starts the watch
        recovered = state.tracker.beat(beat.node, now_ms=state.clock_ms())
        if recovered is not None:
            await _apply_transition(runtime, recovered)

    broker.subscriber(runtime.subjects.heartbeat(), title="topology heartbeats")(on_heartbeat)


def report_handler(runtime: Runtime, state: FleetState) -> Callable[[TopologyReportRequest], Awaitable[BaseModel]]:
    async def handle(request: TopologyReportRequest) -> BaseModel:
        subjects = runtime.subjects
        if request.error is not None:
            async with runtime.sessions() as session, session.begin():
                payload = NodeProfileFailedEvent(node=request.node, error=request.error).model_dump(mode="json")
                await store.emit(
                    session, subjects=subjects, context=Context.TOPOLOGY, event=NODE_PROFILE_FAILED, payload=payload
                )
            runtime.log.warning(
                "agent could not profile its node; previous profile stays",
                extra={"node": request.node, "error": request.error.message, "line": request.error.line},
            )
            if runtime.relay:
                runtime.relay.wake()
            return TopologyReportReply(status="accepted")
        try:
            node = profile_from_dict(request.profile or {})
        except (KeyError, TypeError, ValueError) as exc:
            return rejected(ErrorCode.INVALID_REQUEST, f"profile does not describe a node: {exc}")
        if node.name != request.node:
            return rejected(ErrorCode.INVALID_REQUEST, f"profile is for {node.name!r}, report is for {request.node!r}")
        if node.source == INVENTORY_SOURCE:
            return rejected(ErrorCode.INVALID_REQUEST, "agents report with source nvml or nvidia-smi")
        fingerprint = node.fingerprint()
        async with runtime.sessions() as session, session.begin():
            stored = await store.stored_fingerprints(session)
            previous = stored.get(node.name)
            inventory_owned = await session.get(NodeRow, node.name)
            if inventory_owned is not None and inventory_owned.source == INVENTORY_SOURCE:
                return rejected(ErrorCode.CONFLICT, f"node {node.name} is defined by the inventory")
            if previous == fingerprint:
                state.tracker.watch(node.name, now_ms=state.clock_ms())
                return TopologyReportReply(status="unchanged", fingerprint=fingerprint)
            await store.upsert_nodes(session, [node])
            domains = await store.rebuild_domains(session)
            await store.emit(
                session,
                subjects=subjects,
                context=Context.TOPOLOGY,
                event=NODE_CHANGED if previous else NODE_PROFILED,
                payload=_profile_event(node, domains, previous),
            )
        state.tracker.watch(node.name, now_ms=state.clock_ms())
        if runtime.relay:
            runtime.relay.wake()
        return TopologyReportReply(status="accepted", fingerprint=fingerprint)

    return handle


DEFAULT_PAGE_NODES = 256


def fleet_get_handler(runtime: Runtime, state: FleetState) -> Callable[[FleetGetRequest], Awaitable[BaseModel]]:
    async def handle(request: FleetGetRequest) -> BaseModel:
        # A page must fit one NATS message: start from the asked (or default) size and halve until it does.
        budget = int((runtime.nc.max_payload if runtime.nc else 1 << 20) * 0.9)
        limit = request.limit or DEFAULT_PAGE_NODES
        async with runtime.sessions() as session:
            while True:
                reply = await store.fleet_view(
                    session, region=request.region, skus=state.skus, after=request.cursor, limit=limit
                )
                if limit == 1 or len(reply.model_dump_json()) <= budget:
                    return reply
                limit = max(1, limit // 2)

    return handle


def fleet_describe_handler(
    runtime: Runtime, state: FleetState
) -> Callable[[FleetDescribeRequest], Awaitable[BaseModel]]:
    async def handle(request: FleetDescribeRequest) -> BaseModel:
        async with runtime.sessions() as session:
            row = await session.get(NodeRow, request.node)
            if row is None:
                return rejected(ErrorCode.NOT_FOUND, f"no node {request.node!r}")
            view = await store.fleet_view(session, region=row.region, skus=state.skus)
        node = next(n for n in view.nodes if n.name == request.node)
        ids = {a.id for a in node.accelerators}
        domains = [d for d in view.domains if ids & set(d.members)]
        return FleetDescribeReply(
            node=NodeView.model_validate(node.model_dump()),
            profile=row.profile,
            domains=[DomainView.model_validate(d.model_dump()) for d in domains],
        )

    return handle
