"""What every service shares: wiring a FastStream app from a declarative service definition.

A service module declares its name, schema and request/reply routes; ``build_app`` wires the broker,
the health subject, typed dispatch for every route (a route with no handler yet answers
``not_implemented``), the database engine, stream creation and the outbox relay.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any

import nats
from faststream import AckPolicy, FastStream
from faststream.nats import JStream, NatsBroker, NatsMessage, PullSub
from faststream.nats.opentelemetry import NatsTelemetryMiddleware
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from pydantic import BaseModel
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from shared.contracts.base import ErrorCode, Request, rejected
from shared.contracts.health import HealthReply, HealthRequest
from shared.contracts.streams import stream_name, stream_specs
from shared.contracts.subjects import Context, Rpc, Subjects
from shared.infra.bus import EventHandler, ensure_streams, idempotent
from shared.infra.db import make_engine, make_sessions
from shared.infra.outbox import OutboxRelay
from shared.infra.requests import Endpoint, RequestServer
from shared.infra.settings import Settings
from shared.infra.telemetry import configure_telemetry

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/hetsched"


def hetsched_version() -> str:
    try:
        return package_version("hetsched")
    except PackageNotFoundError:
        return "0.0.0+local"


@dataclass
class Runtime:
    """The live parts of one service process, handed to route factories and lifecycle hooks."""

    name: str
    schema: str
    settings: Settings
    subjects: Subjects
    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    log: logging.Logger
    uses_database: bool = True
    nc: NatsClient | None = None
    js: JetStreamContext | None = None
    relay: OutboxRelay | None = None
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)

    def spawn(self, coro: Awaitable[Any], *, name: str) -> None:
        """Run a background loop for the life of the service (cancelled at stop)."""
        self.tasks.append(asyncio.ensure_future(coro))
        self.tasks[-1].set_name(name)


# Event consumers ack after the handler's transaction commits and nack (redeliver) when it raised;
# FastStream's default for NATS would drop a message whose handler raised.
EVENT_ACK_POLICY = AckPolicy.NACK_ON_ERROR

RouteFactory = Callable[[Runtime], Callable[[Any], Awaitable[BaseModel]]]
Hook = Callable[[Runtime], Awaitable[None]]


@dataclass(frozen=True)
class Route:
    """One request/reply subject: its request model and, once built, the handler factory."""

    rpc: Rpc
    model: type[Request]
    factory: RouteFactory | None = None


@dataclass(frozen=True)
class EventRoute:
    """A durable, explicit-ack, idempotent consumer of one context's events (``event`` may be ``*``)."""

    context: Context
    event: str
    durable: str
    factory: Callable[[Runtime], EventHandler]


@dataclass(frozen=True)
class ServiceDefinition:
    name: str
    health: Rpc
    schema: str
    routes: tuple[Route, ...] = ()
    on_start: tuple[Hook, ...] = ()
    on_stop: tuple[Hook, ...] = ()
    events: tuple[EventRoute, ...] = ()
    # Other subscriptions (core NATS, e.g. heartbeats), wired with the runtime.
    extra: Callable[[NatsBroker, Runtime], None] | None = None


def _not_implemented(service: str, rpc: Rpc) -> Callable[[Any], Awaitable[BaseModel]]:
    async def handler(_request: Any) -> BaseModel:
        return rejected(ErrorCode.NOT_IMPLEMENTED, f"{rpc.value} is not built yet in {service}")

    return handler


def _health(runtime: Runtime) -> Callable[[HealthRequest], Awaitable[BaseModel]]:
    async def handler(_request: HealthRequest) -> BaseModel:
        checks: dict[str, str] = {}
        if runtime.uses_database:
            try:
                async with runtime.engine.connect() as conn:
                    await asyncio.wait_for(conn.execute(text("SELECT 1")), timeout=2)
                checks["postgres"] = "ok"
            except Exception as exc:
                checks["postgres"] = f"error: {type(exc).__name__}"
        checks["nats"] = "ok" if runtime.nc is not None and runtime.nc.is_connected else "error: disconnected"
        healthy = all(v == "ok" for v in checks.values())
        return HealthReply(
            status="ok" if healthy else "degraded", service=runtime.name, version=hetsched_version(), checks=checks
        )

    return handler


def _subscribe_events(broker: NatsBroker, runtime: Runtime, route: EventRoute) -> None:
    settings = runtime.settings
    durable = f"{settings.subject_prefix}-{runtime.schema}-{route.durable}"
    apply = idempotent(
        sessions=runtime.sessions, schema=runtime.schema, consumer=route.durable, handler=route.factory(runtime)
    )

    async def on_event(msg: NatsMessage) -> None:
        await apply(msg.body)

    on_event.__name__ = durable.replace("-", "_").replace(".", "_")
    broker.subscriber(
        runtime.subjects.event(route.context, route.event),
        stream=JStream(stream_name(route.context, stream_prefix=settings.stream_prefix), declare=False),
        durable=durable,
        pull_sub=PullSub(batch_size=64, timeout=1.0),
        ack_policy=EVENT_ACK_POLICY,
        title=durable,
    )(on_event)


def build_app(
    definition: ServiceDefinition, settings: Settings, *, database: bool = True
) -> tuple[FastStream, Runtime]:
    """Wire one service. Nothing connects until the app starts.

    ``database=False`` is for processes that own no state (topology agents): no outbox relay, and
    health does not check Postgres.
    """
    log = logging.getLogger(f"hetsched.{definition.name}")
    tracer_provider, meter_provider = configure_telemetry(service=definition.name, exporter=settings.otel_exporter)
    nats_url = settings.nats_url or DEFAULT_NATS_URL
    broker = NatsBroker(
        nats_url,
        max_reconnect_attempts=-1,  # ride out a NATS restart instead of exiting
        reconnect_time_wait=1,
        logger=log,
        log_level=logging.DEBUG,  # per-message "Received/Processed" lines only at debug
        # Tracing costs about a millisecond per message: only when something exports the spans.
        middlewares=[NatsTelemetryMiddleware(tracer_provider=tracer_provider, meter_provider=meter_provider)]
        if settings.otel_exporter != "none"
        else [],
    )
    engine = make_engine(settings.database_url or DEFAULT_DATABASE_URL, pool_size=settings.db_pool_size)
    runtime = Runtime(
        name=definition.name,
        schema=definition.schema,
        settings=settings,
        subjects=Subjects(settings.subject_prefix),
        engine=engine,
        sessions=make_sessions(engine),
        log=log,
        uses_database=database,
    )
    queue = f"{settings.subject_prefix}.{definition.schema}"
    requests = RequestServer()
    requests.add(Endpoint(runtime.subjects.rpc(definition.health), queue, HealthRequest, _health(runtime), 4))
    for route in definition.routes:
        handler = route.factory(runtime) if route.factory else _not_implemented(definition.name, route.rpc)
        requests.add(Endpoint(runtime.subjects.rpc(route.rpc), queue, route.model, handler, settings.request_workers))
    for event_route in definition.events:
        _subscribe_events(broker, runtime, event_route)
    if definition.extra is not None:
        definition.extra(broker, runtime)

    app = FastStream(broker, logger=log)

    @app.on_startup
    async def _connect() -> None:
        # Our own connection for JetStream management and the relay, so publishing does not depend
        # on FastStream internals.
        runtime.nc = await nats.connect(
            nats_url, max_reconnect_attempts=-1, reconnect_time_wait=0.5, name=definition.name
        )
        runtime.js = runtime.nc.jetstream()
        await ensure_streams(
            runtime.js,
            stream_specs(
                subjects=runtime.subjects,
                stream_prefix=settings.stream_prefix,
                duplicate_window_s=settings.stream_duplicate_window_s,
                telemetry_max_age_s=settings.telemetry_max_age_s,
            ),
        )
        if database:
            runtime.relay = OutboxRelay(
                sessions=runtime.sessions,
                js=runtime.js,
                schema=definition.schema,
                batch=settings.outbox_batch,
                poll_ms=settings.outbox_poll_ms,
            )
            runtime.spawn(runtime.relay.run(), name="outbox-relay")
        for hook in definition.on_start:
            await hook(runtime)
        await requests.start(runtime.nc)  # last: answer only once everything behind the answers runs

    @app.after_startup
    async def _ready() -> None:
        log.info("service ready", extra={"nats": nats_url, "subject_prefix": settings.subject_prefix})

    @app.on_shutdown
    async def _stop() -> None:
        await requests.stop()  # first: no new requests, in-flight ones finish
        for hook in definition.on_stop:
            await hook(runtime)
        if runtime.relay is not None:
            runtime.relay.stop()
        for task in runtime.tasks:
            task.cancel()
        await asyncio.gather(*runtime.tasks, return_exceptions=True)
        if runtime.nc is not None:
            await runtime.nc.drain()
        await engine.dispose()
        log.info("service stopped")

    return app, runtime


def run_service(bootstrap: Callable[[Settings], tuple[FastStream, Runtime]], *, name: str) -> None:
    """Entry point of ``python -m services.<name>``: logs, settings, run until SIGINT/SIGTERM."""
    from shared.infra.logs import configure_logging
    from shared.infra.settings import load_settings

    settings = load_settings()
    configure_logging(service=name, level=settings.log_level, fmt=settings.log_format)
    app, _runtime = bootstrap(settings)
    asyncio.run(app.run())
