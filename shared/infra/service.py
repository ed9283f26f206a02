"""What every service shares: wiring a FastStream app from a declarative service definition.

A service's ``app.py`` declares its name, schema, request/reply routes, event consumers and
background loops, plus ``wire(runtime) -> Ctx``, which builds the service's objects once (handlers
with their dependencies passed by keyword). ``build_app`` wires the broker, the health subject,
typed dispatch for every route (a route with no handler yet answers ``not_implemented``), the
database engine (as the service's own role), stream creation, the outbox relay and the unit of
work. Route, consumer and loop factories receive the ``Ctx``; nothing lives in module globals.
See docs/SERVICE.md.
"""

from __future__ import annotations

import asyncio
import cProfile
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from faststream import FastStream
from faststream.nats import NatsBroker
from faststream.nats.opentelemetry import NatsTelemetryMiddleware
from faststream.nats.security import NatsSecurity
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from pydantic import BaseModel, ValidationError

from shared.contracts.base import ErrorCode, rejected
from shared.contracts.health import HealthRequest
from shared.contracts.permissions import owned_streams
from shared.contracts.streams import deadletter_stream_name, stream_name
from shared.contracts.subjects import Rpc, Subjects, names_scope
from shared.infra.bus import ensure_streams
from shared.infra.clock import Clock, system_clock
from shared.infra.consumers import subscribe_consumer
from shared.infra.db import (
    DEFAULT_DATABASE_URL,
    DatabaseMissing,
    application_name,
    check_database,
    database_tls,
    make_engine,
    make_sessions,
    service_database_url,
)
from shared.infra.definition import (
    DEFAULT_STALE_AFTER_MS,
    Consumer,
    Hook,
    Listen,
    Loop,
    Route,
    RouteFactory,
    ServiceDefinition,
    durable_name,
    grant_of,
)
from shared.infra.follow import ReadSide
from shared.infra.health import health_handler, health_probes, hetsched_version
from shared.infra.identity import connect_options
from shared.infra.metrics import ServiceMetrics
from shared.infra.outbox import OutboxRelay
from shared.infra.refusal import REFUSED_EXIT, ConnectionGuard, NatsRefused, refusal_reason
from shared.infra.refusal import connect as guarded_connect
from shared.infra.requests import Endpoint, RequestServer
from shared.infra.retention import Pruner, Retention, stream_specs_for
from shared.infra.rpc import RpcClient
from shared.infra.runtime import Runtime
from shared.infra.settings import Settings, nats_servers
from shared.infra.telemetry import configure_telemetry
from shared.infra.uow import UnitOfWorkFactory

__all__ = [  # the declarations are built from here (docs/SERVICE.md): they live in definition.py
    "DEFAULT_STALE_AFTER_MS",
    "Consumer",
    "Hook",
    "Listen",
    "Loop",
    "Route",
    "RouteFactory",
    "Runtime",
    "ServiceDefinition",
    "build_app",
    "durable_name",
    "grant_of",
    "hetsched_version",
    "run_service",
]

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"


DRAIN_TIMEOUT_S = 5
"""How long a stopping service waits for its background tasks to end, then for its NATS subscriptions and
publishes to drain."""


def _not_implemented(service: str, rpc: Rpc) -> Callable[[Any], Awaitable[BaseModel]]:
    async def handler(_request: Any) -> BaseModel:
        return rejected(ErrorCode.NOT_IMPLEMENTED, f"{rpc.value} is not built yet in {service}")

    return handler


def _listener(listen: Listen, handler: Callable[[Any], Awaitable[None]]) -> Callable[[Msg], Awaitable[None]]:
    async def on_message(msg: Msg) -> None:
        try:
            message = listen.model.model_validate_json(msg.data)
        except ValidationError:
            return
        if listen.node_scoped and not names_scope(msg.subject, getattr(message, "node", "")):
            return
        await handler(message)

    return on_message


def build_app(
    definition: ServiceDefinition,
    settings: Settings,
    *,
    database: bool = True,
    clock: Clock = system_clock,
    rpc: RpcClient | None = None,
) -> tuple[FastStream, Runtime]:
    """Wire one service. Nothing connects until the app starts.

    ``database=False`` is for processes that own no state (topology agents): no outbox relay, and
    health does not check Postgres. ``clock`` and ``rpc`` let a test hand in its own.
    """
    log = logging.getLogger(f"hetsched.{definition.name}")
    tracer_provider, meter_provider = configure_telemetry(service=definition.name, exporter=settings.kit.otel_exporter)
    nats_url = settings.kit.nats_url or DEFAULT_NATS_URL
    nats_options = connect_options(settings)  # its own NKey, inbox and TLS (docs/SECURITY.md)
    broker_options = {k: v for k, v in nats_options.items() if k != "tls"}
    if "tls" in nats_options:  # FastStream takes the TLS context as its security object
        broker_options["security"] = NatsSecurity(ssl_context=nats_options["tls"])
    holder: list[Runtime] = []
    app_holder: list[FastStream] = []

    def refused(refusal: NatsRefused) -> None:
        # Refused on a connection that was up (its credential revoked): stop, and `run_service` exits
        # with the line. Once: the other connection is refused too.
        if holder[0].refused is None:
            holder[0].refused = refusal
            log.error(refusal.line)
            for each in (guard, broker_guard):
                each.silence(refusal)
            app_holder[0].exit()

    # A refusal ends the process with one line naming the setting to fix, not a reconnect loop.
    guard = ConnectionGuard.of(nats_url, nats_options, on_refused=refused)
    broker_guard = ConnectionGuard.of(nats_url, nats_options, on_refused=refused)
    broker = NatsBroker(
        nats_servers(nats_url),  # a cluster's URL lists every node
        **broker_options,
        **broker_guard.options(),
        max_reconnect_attempts=-1,  # ride out a NATS restart instead of exiting
        reconnect_time_wait=1,
        logger=log,
        log_level=logging.DEBUG,  # per-message "Received/Processed" lines only at debug
        # Tracing costs about a millisecond per message: only when something exports the spans.
        middlewares=[NatsTelemetryMiddleware(tracer_provider=tracer_provider, meter_provider=meter_provider)]
        if settings.kit.otel_exporter != "none"
        else [],
    )
    engine = make_engine(
        service_database_url(settings, definition.schema),
        pool_size=settings.kit.db_pool_size,
        application_name=application_name(definition.schema),  # hetsched-ledger in pg_stat_activity
        tls=database_tls(settings),
    )
    sessions = make_sessions(engine)
    subjects = Subjects(settings.kit.subject_prefix)
    runtime = Runtime(
        name=definition.name,
        schema=definition.schema,
        settings=settings,
        subjects=subjects,
        engine=engine,
        sessions=sessions,
        log=log,
        uow=UnitOfWorkFactory(
            sessions=sessions,
            schema=definition.schema,
            source=definition.name,
            subjects=subjects,
            clock=clock,
            wake=lambda: holder[0].wake_relay(),
            max_event_bytes=settings.kit.event_max_bytes,
        ),
        rpc=rpc or RpcClient(lambda: holder[0].nats, subjects, timeout_s=settings.kit.rpc_timeout_ms / 1000),
        clock=clock,
        uses_database=database,
        metrics=ServiceMetrics(definition.name),
    )
    holder.append(runtime)
    runtime.read_side = ReadSide.of(
        definition.follows,
        stream_of=lambda context: stream_name(context, stream_prefix=settings.kit.stream_prefix),
        subject_of=subjects.events_of,
        jetstream=lambda: holder[0].jetstream,
        clock=clock,
        log=log,
        stale_after_ms=definition.stale_after_ms(settings),
    )
    ctx: Any = definition.wire(runtime)
    runtime.read_side.bind(ctx)
    read_side = runtime.read_side
    queue = f"{settings.kit.subject_prefix}.{definition.schema}"
    requests = RequestServer(
        max_request_bytes=settings.kit.request_max_bytes, default_deadline_ms=settings.kit.request_deadline_ms
    )
    extra_checks = (lambda: definition.checks(ctx)) if definition.checks is not None else None  # type: ignore[misc]
    requests.add(
        Endpoint(
            runtime.subjects.rpc(definition.health),
            queue,
            HealthRequest,
            health_handler(runtime, extra_checks, requests, probes=health_probes(definition.calls)),
            4,
        )
    )
    for route in definition.routes:
        handler = route.factory(ctx) if route.factory else _not_implemented(definition.name, route.rpc)
        requests.add(
            Endpoint(
                runtime.subjects.rpc(route.rpc),
                queue,
                route.model,
                handler,
                settings.kit.request_workers,
                scope_of=route.scope_of,
            )
        )
    event_loops = [subscribe_consumer(runtime, consumer, ctx) for consumer in definition.consumers]
    runtime.consumers = event_loops
    if definition.consumers or database:  # the kit's counters: events given up on (not an agent's: it has neither)
        runtime.metrics.export_kit(
            lambda: {loop.durable: loop.dead_lettered for loop in runtime.consumers},
            lambda: runtime.relay.quarantined if runtime.relay is not None else 0,
        )
    listeners = [(listen, listen.on(ctx)) for listen in definition.listens]

    app = FastStream(broker, logger=log)
    app_holder.append(app)

    @app.on_startup
    async def _connect() -> None:
        if settings.kit.metrics_port >= 0:  # -1: no endpoint (e.g. several services in one test process)
            try:
                runtime.metrics.serve(
                    settings.kit.metrics_host,
                    settings.kit.metrics_port,
                    max_connections=settings.kit.metrics_max_connections,
                    read_timeout_s=settings.kit.metrics_read_timeout_s,
                )
            except OSError as exc:  # a port taken: the service runs, its metrics say why they are missing
                log.warning("metrics endpoint not served", extra={"error": str(exc)[:200]})
        # Our own connection for JetStream management, the relay and calls to other services, so
        # publishing does not depend on FastStream internals.
        runtime.nc = await guarded_connect(
            nats_url,
            guard,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            name=definition.name,
            # A pull subscription whose last fetch the server is still filling never drains (nothing reads
            # it any more): give up on it after this long at shutdown; its events are redelivered.
            drain_timeout=DRAIN_TIMEOUT_S,
            **nats_options,
        )
        runtime.js = runtime.nc.jetstream()
        specs = stream_specs_for(settings, subjects=runtime.subjects)  # with their limits (docs/RETENTION.md)
        if settings.kit.nats_nkey_seed_file is not None:
            # An identity of its own: it manages only its own streams (and may create DEADLETTER); the
            # operator (`hetsched up`) or the owners create the rest, which its consumers wait for.
            owned = {stream_name(c, stream_prefix=settings.kit.stream_prefix) for c in owned_streams(definition.name)}
            creatable = (
                {deadletter_stream_name(stream_prefix=settings.kit.stream_prefix)} if definition.consumers else set()
            )
            await ensure_streams(runtime.js, tuple(s for s in specs if s.name in owned))
            await ensure_streams(runtime.js, tuple(s for s in specs if s.name in creatable), update=False)
        else:
            await ensure_streams(runtime.js, specs)
        if database:
            runtime.relay = OutboxRelay(
                sessions=runtime.sessions,
                js=runtime.js,
                schema=definition.schema,
                batch=settings.kit.outbox_batch,
                poll_ms=settings.kit.outbox_poll_ms,
                subject_prefix=settings.kit.subject_prefix,
            )
            runtime.spawn(runtime.relay.run(), name="outbox-relay")
            runtime.pruner = Pruner(
                sessions=runtime.sessions,
                schema=definition.schema,
                clock=runtime.clock,
                retention=Retention.of(settings),
                every_s=settings.kit.retention_prune_s,
                batch=settings.kit.retention_prune_batch,
            )
            runtime.spawn(runtime.pruner.run(), name="retention-prune")
        for seeding in read_side.seedings:  # one attempt first, so the first requests find a seeded view
            await seeding.first()
            runtime.spawn(seeding.run(), name=f"seed-{seeding.seed.name}")
        for follower in read_side.unseeded:
            runtime.spawn(follower.run(), name=f"follow-{follower.context.value}")
        for listen, handler in listeners:
            await runtime.nats.subscribe(listen.subject(subjects), cb=_listener(listen, handler))
        for hook in definition.on_start:
            await hook(ctx)
        for event_loop in event_loops:
            runtime.spawn(event_loop.run(runtime), name=f"consumer-{event_loop.durable}")
        for loop in definition.loops:
            runtime.spawn(loop.factory(ctx)(), name=loop.name)
        await requests.start(runtime.nc)  # last: answer only once everything behind the answers runs

    @app.after_startup
    async def _ready() -> None:
        connection = getattr(broker, "_connection", None)  # FastStream's own connection, up by now
        if isinstance(connection, NatsClient):
            broker_guard.bind(connection)
        log.info("service ready", extra={"nats": nats_url, "subject_prefix": settings.kit.subject_prefix})

    @app.on_shutdown
    async def _stop() -> None:
        await requests.stop()  # first: no new requests, in-flight ones finish
        for hook in definition.on_stop:
            await hook(ctx)
        await read_side.close()
        if runtime.relay is not None:
            runtime.relay.stop()
        for task in runtime.tasks:
            task.cancel()
        if runtime.tasks:
            # Bounded: a task cancelled inside a JetStream fetch can stay "cancelling" until the server
            # answers its pull (seen with a deep backlog); its unacknowledged events come again anyway.
            _done, stuck = await asyncio.wait(runtime.tasks, timeout=DRAIN_TIMEOUT_S)
            if stuck:
                log.warning("tasks still stopping; going on", extra={"tasks": sorted(t.get_name() for t in stuck)})
        if runtime.nc is not None:
            try:
                await runtime.nc.drain()
            except Exception:  # a drain that timed out: close; unacknowledged events come again
                log.warning("NATS did not drain in time; closing", extra={"timeout_s": DRAIN_TIMEOUT_S})
                if not runtime.nc.is_closed:
                    await runtime.nc.close()
        await engine.dispose()
        log.info("service stopped")

    return app, runtime


def run_service(bootstrap: Callable[[Settings], tuple[FastStream, Runtime]], *, name: str) -> None:
    """Entry point of ``python -m services.<name>``: logs, settings, run until SIGINT/SIGTERM. NATS refusing
    the process's credential (``shared.infra.refusal``) ends it with one ERROR line naming the setting to
    fix and exit status ``REFUSED_EXIT``."""
    from shared.infra.logs import configure_logging
    from shared.infra.settings import load_settings

    settings = load_settings()
    configure_logging(service=name, level=settings.kit.log_level, fmt=settings.kit.log_format)
    app, runtime = bootstrap(settings)
    if runtime.uses_database:  # a database that does not exist: one line saying how to make it, exit 2
        try:
            asyncio.run(check_database(service_database_url(settings, runtime.schema), tls=database_tls(settings)))
        except DatabaseMissing:  # named as configured (its user may create it; the service's role may not)
            configured = DatabaseMissing(settings.kit.database_url or DEFAULT_DATABASE_URL)
            logging.getLogger(f"hetsched.{runtime.name}").error(str(configured))
            raise SystemExit(2) from None
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    loop.set_exception_handler(_quiet_after_refusal(runtime))
    profiler = _profiler(settings)
    try:
        loop.run_until_complete(app.run())
    except NatsRefused as refused:  # at the first connection: nothing else started
        runtime.refused = refused
        runtime.log.error(refused.line)
    except Exception:
        if runtime.refused is None:
            raise
        # Stopping after a refusal: a connection that was refused cannot drain; the line is logged.
        runtime.log.debug("stopping after NATS refused this process", exc_info=True)
    finally:
        _close_loop(loop)
        if profiler is not None and settings.kit.profile_dir is not None:
            profiler.disable()
            settings.kit.profile_dir.mkdir(parents=True, exist_ok=True)
            profiler.dump_stats(settings.kit.profile_dir / f"{name}-{os.getpid()}.prof")
    if runtime.refused is not None:
        raise SystemExit(REFUSED_EXIT)


def _profiler(settings: Settings) -> cProfile.Profile | None:
    """``HETSCHED_PROFILE_DIR``: the whole run profiled (a diagnostic; the profile is written at the end)."""
    if settings.kit.profile_dir is None:
        return None
    profiler = cProfile.Profile(time.process_time)  # CPU, not wall time: a busy machine's waits are not work
    profiler.enable()
    return profiler


def _quiet_after_refusal(runtime: Runtime) -> Callable[[asyncio.AbstractEventLoop, dict[str, Any]], None]:
    """The loop's exception handler: once NATS refused the process (its line logged), the refusal raised
    again inside a client's reconnect task is not worth a traceback."""

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        if runtime.refused is not None and error is not None and refusal_reason(error) is not None:
            return
        loop.default_exception_handler(context)

    return handler


def _close_loop(loop: asyncio.AbstractEventLoop) -> None:
    """``asyncio.run``'s ending, bounded: a task that ignores its cancellation (a library that turns it into
    a timeout and retries) cannot keep a stopped service's process alive."""
    try:
        pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
        for task in pending:
            task.cancel()
        if pending:
            loop.run_until_complete(asyncio.wait(pending, timeout=DRAIN_TIMEOUT_S))
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.run_until_complete(asyncio.wait_for(loop.shutdown_default_executor(), DRAIN_TIMEOUT_S))
    except Exception:  # nothing left worth waiting for: the process ends
        logging.getLogger("hetsched").debug("closing the event loop", exc_info=True)
    finally:
        asyncio.set_event_loop(None)
        loop.close()
