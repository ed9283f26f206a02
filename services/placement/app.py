"""Wiring of the placement service: place / explain / release / renew over the pure pipeline, with the
reservation made through the ledger (optimistic: the view it decided on travels with the commit, and a
conflict retries on the fresh view)."""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

from faststream import FastStream
from nats.aio.msg import Msg
from opentelemetry import metrics
from pydantic import BaseModel
from sqlalchemy import text

from services.placement.readmodel import ReadModel
from services.placement.tables import DecisionRow
from shared.contracts.base import ErrorCode, rejected
from shared.contracts.envelope import new_event
from shared.contracts.placement import (
    AcceleratorShare,
    AdmitRequest,
    NodePlacement,
    PlaceReply,
    PlaceRequest,
    ReleaseReply,
    ReleaseRequest,
    RenewReply,
    RenewRequest,
    TpuSlice,
)
from shared.contracts.placement_events import (
    PLACEMENT_DECIDED,
    PLACEMENT_REJECTED,
    PLACEMENT_RELEASED,
    PlacementEvent,
    PlacementReleasedEvent,
)
from shared.contracts.subjects import Context, Rpc
from shared.domain.placement import decide
from shared.domain.placement.types import Decision, FleetSnapshot, PlacementRequest, Slo
from shared.infra.catalog import load_models, load_skus
from shared.infra.outbox import enqueue
from shared.infra.service import Route, Runtime, ServiceDefinition, build_app
from shared.infra.settings import Settings

SCHEMA = "placement"
SOURCE = "placement"
MAX_ATTEMPTS = 4
_meter = metrics.get_meter("hetsched.placement")
DECISION_MS = _meter.create_histogram("hetsched.placement.decision_ms", unit="ms", description="Pure decision time")
TP_DEGREE = _meter.create_counter("hetsched.placement.tp_degree", description="Placed replicas by TP degree")
NVLINK_GROUPS = _meter.create_counter(
    "hetsched.placement.tp_groups", description="TP>1 groups placed, by whether every pair is NVLinked"
)
REJECTIONS = _meter.create_counter("hetsched.placement.rejections", description="Rejections by reason")


def to_domain(request: PlaceRequest) -> PlacementRequest:
    slo = request.slo
    return PlacementRequest(
        request_id=request.request_id,
        tenant=request.tenant,
        model=request.model,
        context_tokens=request.context_tokens,
        concurrency=request.concurrency,
        dtype=request.dtype,
        kv_dtype=request.kv_dtype,
        input_tokens=request.input_tokens,
        output_tokens=request.output_tokens,
        tp=request.tp,
        backend=request.backend,
        skus=tuple(request.skus) if request.skus else None,
        region=request.region,
        preemptible=request.preemptible,
        slo=Slo(ttft_ms=slo.ttft_ms, tpot_ms=slo.tpot_ms, p99_ms=slo.p99_ms) if slo else None,
    )


def to_reply(decision: Decision, snapshot: FleetSnapshot, *, allocation_id: str | None = None) -> PlaceReply:
    share = decision.share
    placements: list[NodePlacement] = []
    if decision.placed and decision.tpu is None:
        by_node: dict[str, list[str]] = {}
        for acc in decision.accelerators:
            by_node.setdefault(acc.rsplit("/gpu", 1)[0], []).append(acc)
        placements = [NodePlacement(node=n, accelerators=accs, domain=decision.domain) for n, accs in by_node.items()]
    error = None
    if not decision.placed:
        error = rejected(ErrorCode(decision.error_code or "no_capacity"), decision.message or "no placement").error
    return PlaceReply(
        status=decision.status,
        request_id=decision.request_id,
        allocation_id=allocation_id,
        region=decision.region,
        cluster=decision.cluster,
        backend="tpu" if decision.tpu is not None else ("gpu" if decision.placed else None),
        sku=decision.sku,
        tp=decision.tp,
        placements=placements,
        tpu_slice=TpuSlice(pod=decision.tpu.pod, origin=list(decision.tpu.origin), shape=list(decision.tpu.shape))
        if decision.tpu is not None
        else None,
        hbm_per_accelerator=AcceleratorShare(
            weights=share.weights,
            kv=share.kv,
            activation=share.activation,
            workspace=share.workspace,
            total=share.total,
        )
        if share is not None and decision.placed
        else None,
        score=dict(decision.score),
        explanation=list(decision.explanation),
        error=error,
    )


class Placement:
    def __init__(self, runtime: Runtime) -> None:
        settings = runtime.settings
        self.runtime = runtime
        self.model = ReadModel(
            runtime, skus=load_skus(settings.sku_catalog), models=load_models(settings.model_catalog)
        )

    async def start(self) -> None:
        try:
            await self.model.refresh()
        except Exception:
            self.runtime.log.exception("first fleet read failed; retrying in the background")
        self.runtime.spawn(self.model.run(), name="placement-view")

    def _decide(self, request: PlaceRequest) -> tuple[Decision, FleetSnapshot, float]:
        snapshot = self.model.snapshot
        started = time.perf_counter()
        decision = decide(snapshot, to_domain(request))
        elapsed = (time.perf_counter() - started) * 1000
        DECISION_MS.record(elapsed)
        return decision, snapshot, elapsed

    async def _commit(self, request: PlaceRequest, decision: Decision, snapshot: FleetSnapshot) -> dict[str, Any]:
        share = decision.share
        assert share is not None and self.runtime.nc is not None
        if decision.tpu is not None:
            # A slice is exclusive: each chip is reserved whole.
            pod = snapshot.tpu_pods[decision.tpu.pod]
            shares = [{"accelerator_id": chip, "weights": pod.usable_per_chip} for chip in decision.tpu.chips]
            expected = {chip: 0 for chip in decision.tpu.chips}
        else:
            shares = [
                {
                    "accelerator_id": acc,
                    "weights": share.weights,
                    "kv": share.kv,
                    "activation": share.activation,
                    "workspace": share.workspace,
                }
                for acc in decision.accelerators
            ]
            expected = {acc: snapshot.capacity[acc].reserved for acc in decision.accelerators}
        body = {
            "request_id": f"placement/{request.request_id}",
            "tenant": request.tenant,
            "kind": "replica",
            "preemptible": request.preemptible,
            "lease_s": request.lease_s or self.runtime.settings.placement_default_lease_s,
            "shares": shares,
            "expected": expected,
        }
        msg = await self.runtime.nc.request(
            self.runtime.subjects.rpc(Rpc.LEDGER_COMMIT), json.dumps(body).encode(), timeout=10
        )
        reply: dict[str, Any] = json.loads(msg.data)
        return reply

    async def _record(
        self, request: PlaceRequest, reply: PlaceReply, event: str, decision_ms: float, attempts: int
    ) -> None:
        payload = PlacementEvent(
            request_id=request.request_id,
            tenant=request.tenant,
            model=request.model,
            reply=reply.model_dump(mode="json"),
            decision_ms=round(decision_ms, 3),
            attempts=attempts,
        ).model_dump(mode="json")
        envelope = new_event(
            type=f"placement.{event}",
            source=SOURCE,
            payload=payload,
            occurred_at=datetime.now(UTC),
            tenant=request.tenant,
            correlation_id=request.request_id,
        )
        async with self.runtime.sessions() as session, session.begin():
            if reply.status == "placed":
                await session.execute(
                    text(
                        "INSERT INTO placement.decisions (tenant, request_id, status, allocation_id, reply) "
                        "VALUES (:t, :r, 'placed', :a, CAST(:reply AS jsonb)) ON CONFLICT DO NOTHING"
                    ),
                    {
                        "t": request.tenant,
                        "r": request.request_id,
                        "a": reply.allocation_id,
                        "reply": reply.model_dump_json(),
                    },
                )
            await enqueue(
                session=session,
                schema=SCHEMA,
                subject=self.runtime.subjects.event(Context.PLACEMENT, event),
                event=envelope,
            )
        if self.runtime.relay:
            self.runtime.relay.wake()

    def _count(self, decision: Decision) -> None:
        if decision.placed and decision.tp:
            TP_DEGREE.add(1, {"tp": decision.tp})
            if decision.tp > 1 and decision.tpu is None:
                NVLINK_GROUPS.add(1, {"nvlinked": decision.domain is not None})
        elif not decision.placed:
            REJECTIONS.add(1, {"reason": decision.error_code or "no_capacity"})

    async def place(self, request: PlaceRequest) -> BaseModel:
        async with self.runtime.sessions() as session:
            row = await session.get(DecisionRow, (request.tenant, request.request_id))
        if row is not None:
            return PlaceReply.model_validate(row.reply)  # same request id: the same decision, reserved once
        total_ms = 0.0
        for attempt in range(1, MAX_ATTEMPTS + 1):
            decision, snapshot, elapsed = self._decide(request)
            total_ms += elapsed
            if not decision.placed:
                reply = to_reply(decision, snapshot)
                self._count(decision)
                await self._record(request, reply, PLACEMENT_REJECTED, total_ms, attempt)
                return reply
            self.model.assume(decision, tenant=request.tenant)
            committed = await self._commit(request, decision, snapshot)
            if committed.get("status") == "committed":
                reply = to_reply(decision, snapshot, allocation_id=committed["allocation_id"])
                reply = reply.model_copy(
                    update={"explanation": [*reply.explanation, f"reserved in the ledger after {attempt} attempt(s)"]}
                )
                self._count(decision)
                await self._record(request, reply, PLACEMENT_DECIDED, total_ms, attempt)
                return reply
            code = (committed.get("error") or {}).get("code")
            if code not in ("conflict", "no_capacity"):
                return rejected(ErrorCode(code or "internal"), (committed.get("error") or {}).get("message", "ledger"))
            await self.model.refresh()  # the view was stale: decide again on the ledger's current one
        return rejected(ErrorCode.CONFLICT, f"the fleet kept changing under {MAX_ATTEMPTS} attempts; retry")

    async def explain(self, request: PlaceRequest) -> BaseModel:
        decision, snapshot, _elapsed = self._decide(request)
        reply = to_reply(decision, snapshot)
        return reply.model_copy(update={"explanation": ["dry run: nothing was reserved", *reply.explanation]})

    async def _forward(self, rpc: Rpc, body: dict[str, Any]) -> dict[str, Any]:
        assert self.runtime.nc is not None
        msg = await self.runtime.nc.request(self.runtime.subjects.rpc(rpc), json.dumps(body).encode(), timeout=10)
        reply: dict[str, Any] = json.loads(msg.data)
        return reply

    async def release(self, request: ReleaseRequest) -> BaseModel:
        reply = await self._forward(
            Rpc.LEDGER_RELEASE, {"allocation_id": request.allocation_id, "tenant": request.tenant}
        )
        if reply.get("status") != "released":
            return ReleaseReply(status="rejected", error=reply.get("error"))
        envelope = new_event(
            type=f"placement.{PLACEMENT_RELEASED}",
            source=SOURCE,
            occurred_at=datetime.now(UTC),
            payload=PlacementReleasedEvent(allocation_id=request.allocation_id, tenant=request.tenant).model_dump(
                mode="json"
            ),
            tenant=request.tenant,
        )
        async with self.runtime.sessions() as session, session.begin():
            await session.execute(
                text("UPDATE placement.decisions SET status = 'released' WHERE allocation_id = :a"),
                {"a": request.allocation_id},
            )
            await enqueue(
                session=session,
                schema=SCHEMA,
                subject=self.runtime.subjects.event(Context.PLACEMENT, PLACEMENT_RELEASED),
                event=envelope,
            )
        self.model.invalidate()
        return ReleaseReply(status="released")

    async def renew(self, request: RenewRequest) -> BaseModel:
        reply = await self._forward(
            Rpc.LEDGER_RENEW,
            {"allocation_id": request.allocation_id, "tenant": request.tenant, "lease_s": request.lease_s},
        )
        if reply.get("status") != "renewed":
            return RenewReply(status="rejected", error=reply.get("error"))
        return RenewReply(status="renewed", lease_expires_at=reply.get("lease_expires_at"))


_INSTANCES: dict[int, Placement] = {}


def _placement(runtime: Runtime) -> Placement:
    placement = _INSTANCES.get(id(runtime))
    if placement is None:
        placement = _INSTANCES[id(runtime)] = Placement(runtime)
    return placement


def _route(method: str) -> Callable[[Runtime], Callable[[Any], Awaitable[BaseModel]]]:
    def factory(runtime: Runtime) -> Callable[[Any], Awaitable[BaseModel]]:
        placement = _placement(runtime)
        handler: Callable[[Any], Awaitable[BaseModel]] = getattr(placement, method)
        return handler

    return factory


async def _start(runtime: Runtime) -> None:
    await _placement(runtime).start()


async def _watch_events(runtime: Runtime) -> None:
    """Ledger events update the view in place; topology events make it re-read the fleet. Plain
    core-NATS subscriptions: this path sees every commit and release, so it stays light."""
    assert runtime.nc is not None
    model = _placement(runtime).model

    async def on_ledger(msg: Msg) -> None:
        try:
            model.on_ledger_event(json.loads(msg.data))
        except (ValueError, KeyError, TypeError):
            model.invalidate()

    async def on_topology(msg: Msg) -> None:
        model.invalidate(topology=True)

    await runtime.nc.subscribe(f"{runtime.subjects.prefix}.events.ledger.>", cb=on_ledger)
    await runtime.nc.subscribe(f"{runtime.subjects.prefix}.events.topology.>", cb=on_topology)


SERVICE = ServiceDefinition(
    name="placement",
    health=Rpc.PLACEMENT_HEALTH,
    schema=SCHEMA,
    routes=(
        Route(Rpc.PLACEMENT_PLACE, PlaceRequest, _route("place")),
        Route(Rpc.PLACEMENT_EXPLAIN, PlaceRequest, _route("explain")),
        Route(Rpc.PLACEMENT_RELEASE, ReleaseRequest, _route("release")),
        Route(Rpc.PLACEMENT_RENEW, RenewRequest, _route("renew")),
        Route(Rpc.PLACEMENT_ADMIT, AdmitRequest),
    ),
    on_start=(_start, _watch_events),
)


def bootstrap(settings: Settings) -> tuple[FastStream, Runtime]:
    return build_app(SERVICE, settings)


__all__ = ["SERVICE", "bootstrap", "to_domain", "to_reply"]
