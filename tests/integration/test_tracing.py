"""One trace per request, end to end: topology, the ledger, placement, the router and the rebalancer as
processes exporting their spans to the console (``HETSCHED_OTEL_EXPORTER=console``: one JSON line per
span on stdout, which ``ServiceProcesses`` writes to each process's log file). A `route.select` with
``admit`` sent inside a root span of this process is served in that trace by the router, placement's
admission and the ledger's commit, and the KV hold the commit announces is consumed in it (the
rebalancer's durable LEDGER consumer, which keeps each replica's holds)."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import nats
import pytest
import pytest_asyncio
from opentelemetry.sdk.trace import TracerProvider

from hetsched.engine_sim import EngineLoad, publish_engine_status
from hetsched.stack import wait_healthy
from shared.contracts.health import HealthReply, HealthRequest
from shared.contracts.ledger import LedgerEventName
from shared.contracts.placement import PlaceReply, PlaceRequest, ReleaseReply, ReleaseRequest
from shared.contracts.routing import RouteSelectReply, RouteSelectRequest
from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context, Rpc, Subjects
from shared.infra import tracing
from shared.infra.catalog import demo_fleet_path
from shared.infra.requests import Endpoint, RequestServer
from shared.infra.rpc import RpcClient
from shared.infra.settings import Settings
from tests.conftest import ServiceProcesses
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROCESSES = {
    "topology_discovery": "tr_topology",
    "capacity_ledger": "tr_ledger",
    "placement": "tr_placement",
    "cross_region_router": "tr_router",
    "rebalancer": "tr_rebalancer",
}
TRACED = {
    "HETSCHED_OTEL_EXPORTER": "console",
    "OTEL_BSP_SCHEDULE_DELAY": "100",  # ms: spans reach stdout a tenth of a second after they end
}


@dataclass(frozen=True)
class Span:
    process: str
    name: str
    kind: str
    trace_id: str
    attributes: dict[str, Any]


def spans_of(procs: ServiceProcesses, process: str) -> list[Span]:
    """The spans a process printed (its log file also holds its JSON log lines: those have no span context)."""
    found = []
    for line in procs.log(process).splitlines():
        if not line.startswith("{"):
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("context"), dict) and "kind" in doc:
            found.append(
                Span(
                    process=process,
                    name=doc["name"],
                    kind=doc["kind"],
                    trace_id=doc["context"]["trace_id"],
                    attributes=doc.get("attributes") or {},
                )
            )
    return found


@dataclass
class Traced:
    rpc: RpcClient
    procs: ServiceProcesses
    settings: Settings
    replica: str


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def traced(service_processes: ServiceProcesses, settings: Settings) -> AsyncIterator[Traced]:
    service_processes.start(
        "topology_discovery",
        name=PROCESSES["topology_discovery"],
        HETSCHED_TOPOLOGY_INVENTORY=str(demo_fleet_path()),
        **TRACED,
    )
    for package in ("capacity_ledger", "placement", "rebalancer"):
        service_processes.start(package, name=PROCESSES[package], **TRACED)
    service_processes.start(
        "cross_region_router", name=PROCESSES["cross_region_router"], HETSCHED_ROUTE_FLUSH_MS="100", **TRACED
    )
    subjects = Subjects(settings.kit.subject_prefix)
    health = await wait_healthy(
        nats_url=settings.kit.nats_url or "", subjects=subjects, deadline_s=60, only=set(PROCESSES)
    )
    assert all(h["status"] == "ok" for h in health.values()), health
    rpc = await RpcClient.connect(settings.kit.nats_url or "", subjects, timeout_s=10)

    async def placed() -> PlaceReply | None:
        reply = await rpc.ask(
            Rpc.PLACEMENT_PLACE,
            PlaceRequest(
                request_id="tr-replica",
                tenant="platform",
                model="llama3.1-8b",
                context_tokens=65536,
                concurrency=8,
                region="us-west-1",
                backend="gpu",
            ),
            PlaceReply,
        )
        return reply if isinstance(reply, PlaceReply) and reply.status == "placed" else None

    replica = await wait_for(placed, 30, what="placement sees the demo fleet")
    assert replica is not None and replica.allocation_id is not None
    # The engine's report puts the replica in rotation (as `hetsched engine-sim` does).
    status = EngineLoad(jitter=0, queue_depth=0, base_latency_ms=40).status(
        replica_id=replica.allocation_id, node=replica.placements[0].node, rng=random.Random(0)
    )
    nc = await nats.connect(settings.kit.nats_url or "")
    try:
        await publish_engine_status(nc.jetstream(), subjects, status)
    finally:
        await nc.close()
    yield Traced(rpc=rpc, procs=service_processes, settings=settings, replica=replica.allocation_id)
    # The session's database is shared with later modules: the replica goes (its holds with it).
    released = await rpc.ask(
        Rpc.PLACEMENT_RELEASE, ReleaseRequest(allocation_id=replica.allocation_id, tenant="platform"), ReleaseReply
    )
    assert getattr(released, "status", None) == "released", released
    await rpc.close()
    for name in reversed(PROCESSES.values()):
        service_processes.stop(name)


async def committed_event(settings: Settings, allocation_id: str) -> tuple[dict[str, Any], dict[str, str]] | None:
    """The ledger's ``allocation_committed`` of ``allocation_id`` and its NATS headers, once published."""
    nc = await nats.connect(settings.kit.nats_url or "")
    try:
        js = nc.jetstream()
        stream = stream_name(Context.LEDGER, stream_prefix=settings.kit.stream_prefix)
        last = (await js.stream_info(stream)).state.last_seq
        subject = Subjects(settings.kit.subject_prefix).event(Context.LEDGER, LedgerEventName.ALLOCATION_COMMITTED)
        sub = await js.pull_subscribe(subject, stream=stream)
        try:
            while True:
                try:
                    msgs = await sub.fetch(256, timeout=0.5)
                except TimeoutError:
                    return None
                for msg in msgs:
                    try:
                        body = json.loads(msg.data)
                    except ValueError:
                        body = None
                    if isinstance(body, dict) and body.get("payload", {}).get("allocation_id") == allocation_id:
                        return body, dict(msg.headers or {})
                    if msg.metadata.sequence.stream >= last:
                        return None
        finally:
            await sub.unsubscribe()
    finally:
        await nc.close()


async def test_a_routed_request_is_one_trace_and_a_placement_s_event_carries_it_to_the_consumers(
    traced: Traced,
) -> None:
    """A routed request (route.select with admission) is one trace across the router and placement; the
    admission is counted in placement's memory, so the ledger has no span in it. A placement made in a trace
    is committed by the ledger in that trace, and its event carries the trace to the services consuming it."""
    tracer = TracerProvider().get_tracer("tests.tracing")  # this process's root span; it exports nothing
    attempt = 0

    async def routed_in_a_trace() -> tuple[str, RouteSelectReply] | None:
        nonlocal attempt
        attempt += 1
        with tracer.start_as_current_span("test.route") as root:
            reply = await traced.rpc.ask(
                Rpc.ROUTE_SELECT,
                RouteSelectRequest(
                    request_id=f"tr-{attempt}",
                    tenant="platform",  # the tenant that placed the replica: its requests may use it
                    model="chat-long",
                    input_tokens=1000,
                    output_tokens=256,
                    origin_region="us-west-1",
                    session_id=f"tr-session-{attempt}",
                    admit=True,
                ),
                RouteSelectReply,
            )
        admitted = (
            isinstance(reply, RouteSelectReply) and reply.admission is not None and reply.admission.status == "admitted"
        )
        return (f"0x{root.get_span_context().trace_id:032x}", reply) if admitted else None  # type: ignore[return-value]

    routed = await wait_for(routed_in_a_trace, 20, what="the replica is in rotation")
    assert routed is not None
    route_trace, reply = routed
    assert reply.admission is not None and reply.admission.replica_id == traced.replica

    def in_trace(process: str, trace_id: str) -> set[tuple[str, str]]:
        return {(s.name, s.kind) for s in spans_of(traced.procs, process) if s.trace_id == trace_id}

    def routed_spans() -> bool:
        return ("route.select", "SpanKind.SERVER") in in_trace(PROCESSES["cross_region_router"], route_trace) and (
            "placement.admit",
            "SpanKind.SERVER",
        ) in in_trace(PROCESSES["placement"], route_trace)

    # Each process prints its spans a tenth of a second after they end (the batch processor's delay).
    await wait_for(routed_spans, 15, what="the router's and placement's spans in the request's trace")
    assert not in_trace(PROCESSES["capacity_ledger"], route_trace), "an admission makes no ledger call"

    with tracer.start_as_current_span("test.place") as root:
        placed = await traced.rpc.ask(
            Rpc.PLACEMENT_PLACE,
            PlaceRequest(
                request_id="tr-traced-replica",
                tenant="platform",
                model="llama3.1-8b",
                context_tokens=8192,
                region="us-west-1",
                backend="gpu",
            ),
            PlaceReply,
        )
    assert isinstance(placed, PlaceReply) and placed.status == "placed" and placed.allocation_id, placed
    place_trace = f"{root.get_span_context().trace_id:032x}"
    # The ledger's event for the replica records the trace, and the relay sends it as a header too.
    published = await wait_for(
        lambda: committed_event(traced.settings, placed.allocation_id or ""),
        15,
        what="the ledger's allocation_committed for the replica",
    )
    assert published is not None
    committed, headers = published
    assert committed["traceparent"].split("-")[1] == place_trace
    assert headers.get("traceparent") == committed["traceparent"]

    def consumed() -> bool:
        return any(
            s.trace_id == f"0x{place_trace}"
            and s.kind == "SpanKind.CONSUMER"
            and s.name == committed["type"]
            and s.attributes.get("messaging.message.id") == committed["event_id"]
            for s in spans_of(traced.procs, PROCESSES["rebalancer"])
        )

    await wait_for(consumed, 15, what="the rebalancer's consumer span in the placement's trace")
    released = await traced.rpc.ask(
        Rpc.PLACEMENT_RELEASE,
        ReleaseRequest(allocation_id=placed.allocation_id, tenant="platform"),
        ReleaseReply,
    )
    assert isinstance(released, ReleaseReply), released


async def test_without_an_exporter_no_span_is_made_and_the_trace_still_crosses_a_call(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``HETSCHED_OTEL_EXPORTER=none``: the request server makes no span, yet the handler runs in its
    caller's trace, so what it calls or emits carries that trace on."""
    monkeypatch.setattr(tracing, "_tracer", None)  # as configure_telemetry leaves it without an exporter
    subjects = Subjects(f"{settings.kit.subject_prefix}-tr")  # no service answers here but this test's server
    seen: list[str | None] = []

    async def handler(_request: HealthRequest) -> HealthReply:
        seen.append(tracing.traceparent())
        return HealthReply(status="ok", service="tr", version="0", checks={})

    server = RequestServer()
    server.add(Endpoint(subjects.rpc(Rpc.ROUTE_HEALTH), "tr", HealthRequest, handler, 1))
    rpc = await RpcClient.connect(settings.kit.nats_url or "", subjects, timeout_s=5)
    try:
        await server.start(rpc.nc)
        with TracerProvider().get_tracer("tests.tracing").start_as_current_span("test.none") as root:
            reply = await rpc.ask(Rpc.ROUTE_HEALTH, HealthRequest(), HealthReply)
        await rpc.ask(Rpc.ROUTE_HEALTH, HealthRequest(), HealthReply)  # no trace: none invented
    finally:
        await server.stop()
        await rpc.close()
    assert isinstance(reply, HealthReply)
    context = root.get_span_context()
    # No span between the caller and the handler: the handler's context is the caller's span itself.
    assert seen == [f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}", None]
