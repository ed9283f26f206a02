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
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Any

import nats
from faststream import FastStream
from faststream.nats import NatsBroker
from faststream.nats.opentelemetry import NatsTelemetryMiddleware
from faststream.nats.security import NatsSecurity
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.errors import ConnectionClosedError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from nats.js.errors import NotFoundError, ServiceUnavailableError
from pydantic import BaseModel, ValidationError
from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker

from shared.contracts.base import ErrorCode, Request, rejected
from shared.contracts.health import HealthReply, HealthRequest
from shared.contracts.permissions import NODE_SCOPED_EVENTS, ServiceGrant, owned_streams, service_identity
from shared.contracts.streams import deadletter_stream_name, stream_name
from shared.contracts.subjects import NODE_SCOPED, TENANT_SCOPED, Context, Rpc, Subjects, names_scope
from shared.infra.bus import TypedEventHandler, consume, ensure_streams
from shared.infra.clock import Clock, system_clock
from shared.infra.db import application_name, database_tls, make_engine, make_sessions, service_database_url
from shared.infra.deadletter import UnappliableEvent, dead_letter, redelivery_delay_s
from shared.infra.follow import Follow, Follower, ReadSide
from shared.infra.identity import connect_options
from shared.infra.metrics import ServiceMetrics
from shared.infra.outbox import OutboxRelay
from shared.infra.requests import Endpoint, RequestServer
from shared.infra.retention import Pruner, Retention, stream_specs_for
from shared.infra.rpc import RpcClient
from shared.infra.settings import Settings, nats_servers
from shared.infra.telemetry import configure_telemetry
from shared.infra.uow import UnitOfWorkFactory, committed_on

DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
DEFAULT_STALE_AFTER_MS = 5000.0


def hetsched_version() -> str:
    try:
        return package_version("hetsched")
    except PackageNotFoundError:
        return "0.0.0+local"


@dataclass
class Runtime:
    """The live parts of one service process. Only wiring (``wire``, ``build_app``) sees it; handlers
    get what they use passed by keyword."""

    name: str
    schema: str
    settings: Settings
    subjects: Subjects
    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]
    log: logging.Logger
    uow: UnitOfWorkFactory
    rpc: RpcClient
    clock: Clock = system_clock
    uses_database: bool = True
    nc: NatsClient | None = None
    js: JetStreamContext | None = None
    relay: OutboxRelay | None = None
    pruner: Pruner | None = None  # deletes outbox and inbox rows past their retention
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    # The event consumers, for their counters (redelivered, dead_lettered).
    consumers: list[_EventLoop] = field(default_factory=list)
    # Its Prometheus metrics (``shared.infra.metrics``), served over HTTP once it starts.
    metrics: ServiceMetrics = field(default_factory=lambda: ServiceMetrics("unknown"))
    # Its followers (``shared.infra.follow``), built before ``wire`` so that it may hand one to what waits on it.
    read_side: ReadSide | None = None

    def follower(self, context: Context) -> Follower:
        """The kit's follower of ``context`` (declared in the service's ``follows``)."""
        if self.read_side is None or context not in self.read_side.followers:
            raise KeyError(f"{self.name} does not follow {context.value}")
        return self.read_side.followers[context]

    @property
    def nats(self) -> NatsClient:
        """The service's NATS connection (raises before the service has started)."""
        if self.nc is None:
            raise RuntimeError(f"{self.name}: NATS is not connected yet (the service has not started)")
        return self.nc

    @property
    def jetstream(self) -> JetStreamContext:
        if self.js is None:
            raise RuntimeError(f"{self.name}: JetStream is not available yet (the service has not started)")
        return self.js

    def wake_relay(self) -> None:
        if self.relay is not None:
            self.relay.wake()

    def spawn(self, coro: Awaitable[Any], *, name: str) -> None:
        """Run a background loop for the life of the service (cancelled at stop)."""
        self.tasks.append(asyncio.ensure_future(coro))
        self.tasks[-1].set_name(name)


# Event consumers are durable JetStream pull consumers driven by our own loop: a fetched batch is
# applied one event after the other, in stream order, each acked after its transaction committed; the
# event whose handler raised is nak'ed with the rest of its batch (redelivered in order). FastStream's
# pull subscriber would handle a batch concurrently (out of order), or, in batch mode, wait up to its
# timeout to fill the batch; its default ack policy for NATS drops a message whose handler raised.
EVENT_BATCH = 64
EVENT_FETCH_TIMEOUT_S = 1.0
DEAD_LETTERED_MESSAGE = "event dead-lettered: the consumer gave up on it"
# How often an idle consumer asks the server whether its durable still exists: a fetch on a deleted consumer
# only times out, as an idle one does.
CONSUMER_CHECK_S = 5.0
CONSUMER_GONE_MESSAGE = "event consumer disappeared; re-creating it to replay its stream from the first sequence"
CONSUMER_CAUGHT_UP_MESSAGE = "re-created event consumer caught up"
# Server-side deliveries, as a multiple of the limit, after which a failing event is dead-lettered even
# if this process saw fewer failures (it restarted, or the event was nak'ed behind others).
RESTART_SLACK = 4

# Factories and hooks take the service's Ctx: what its ``wire`` built once.
RouteFactory = Callable[[Any], Callable[[Any], Awaitable[BaseModel]]]
Hook = Callable[[Any], Awaitable[None]]


@dataclass(frozen=True)
class Route:
    """One request/reply subject: its request model and, once built, the handler factory."""

    rpc: Rpc
    model: type[Request]
    factory: RouteFactory | None = None

    @property
    def scope_of(self) -> Callable[[Any], str | None] | None:
        """What the body must name on this route's scoped subject: its tenant (public routes) or its
        node (agent routes); None for a route served on its base subject only."""
        if self.rpc in TENANT_SCOPED:
            return lambda request: getattr(request, "tenant", None)
        if self.rpc in NODE_SCOPED:
            return lambda request: getattr(request, "node", None)
        return None


@dataclass(frozen=True)
class Consumer:
    """A durable, explicit-ack, idempotent consumer of one context's events, in stream order.

    ``on`` maps event names to handler factories; each handler is called as
    ``handler(uow=..., event=envelope, payload=<the contract model of that event>)`` inside the
    transaction that records the event as processed. Events of other names are acknowledged and
    skipped. One consumer per context keeps the context's order (a node lost, then recovered).

    ``together=True`` applies each fetched batch in one transaction (one commit for many events, for a
    consumer on a hot path). Each event's effects still happen once (the inbox), but a handler may then
    run more than once for one event: when a later event of its batch fails, the batch rolls back and
    the events before the failing one are applied again. Only for handlers whose work is their
    transaction (no effect outside it that must not repeat).
    """

    context: Context
    durable: str
    on: Mapping[str, Callable[[Any], TypedEventHandler]]
    together: bool = False
    # Events of a handled name that this consumer has nothing to do with, told by their payload alone (a
    # request's KV hold for a consumer of replicas): acknowledged with no transaction and no inbox row.
    skip: Callable[[Any], bool] | None = None


DRAIN_TIMEOUT_S = 5
"""How long a stopping service waits for its background tasks to end, then for its NATS subscriptions and
publishes to drain."""


@dataclass(frozen=True)
class Loop:
    """A background loop for the life of the service (a sweeper, a detector)."""

    name: str
    factory: Callable[[Any], Callable[[], Awaitable[None]]]


@dataclass(frozen=True)
class Listen:
    """A core-NATS subject the service listens on (fire and forget: heartbeats). Each message is parsed as
    ``model``; one that does not parse, or (``node_scoped``) names another node than the subject it came on
    (the one its agent's credential may publish on), is dropped. ``on`` builds the handler from the Ctx."""

    subject: Callable[[Subjects], str]
    model: type[BaseModel]
    on: Callable[[Any], Callable[[Any], Awaitable[None]]]
    node_scoped: bool = True


@dataclass(frozen=True)
class ServiceDefinition:
    name: str
    health: Rpc
    schema: str
    routes: tuple[Route, ...] = ()
    on_start: tuple[Hook, ...] = ()
    on_stop: tuple[Hook, ...] = ()
    consumers: tuple[Consumer, ...] = ()
    loops: tuple[Loop, ...] = ()
    # Builds the service's objects once per app; every factory and hook then receives what it returns.
    wire: Callable[[Runtime], Any] = lambda runtime: runtime
    # The read side (``shared.infra.follow``): the contexts it follows into memory, with their folds.
    follows: tuple[Follow, ...] = ()
    # How old a follower's last applied event may be while more wait before health says it is behind.
    stale_after_ms: Callable[[Settings], float] = lambda _settings: DEFAULT_STALE_AFTER_MS
    # Core-NATS subjects it listens on (heartbeats).
    listens: tuple[Listen, ...] = ()
    # Extra health checks (name -> "ok" or why not).
    checks: Callable[[Any], Mapping[str, str]] | None = None
    # What its NATS identity may do beyond serving its routes, consuming its consumers' events, following
    # its follows and listening on its listens (shared.contracts.permissions): the other services'
    # subjects it calls.
    calls: tuple[Rpc, ...] = ()

    @property
    def reads(self) -> tuple[Context, ...]:
        """The contexts it follows with ordered (ephemeral) consumers: its NATS read permissions."""
        return tuple(follow.context for follow in self.follows)


def grant_of(definition: ServiceDefinition, settings: Settings) -> ServiceGrant:
    """What ``definition`` does on the bus under ``settings``: the input of its NATS permissions."""
    subjects = Subjects(settings.kit.subject_prefix)
    return ServiceGrant(
        name=definition.name,
        identity=service_identity(definition.schema),
        serves=(definition.health, *(route.rpc for route in definition.routes)),
        consumes=tuple(
            (consumer.context, durable_name(settings, definition.schema, consumer.durable))
            for consumer in definition.consumers
        ),
        reads=definition.reads,
        calls=definition.calls,
        listens=tuple(listen.subject(subjects) for listen in definition.listens),
    )


def _not_implemented(service: str, rpc: Rpc) -> Callable[[Any], Awaitable[BaseModel]]:
    async def handler(_request: Any) -> BaseModel:
        return rejected(ErrorCode.NOT_IMPLEMENTED, f"{rpc.value} is not built yet in {service}")

    return handler


def _workers_check(requests: RequestServer, *, after_s: float) -> str:
    """`ok`, or which subjects have had every worker busy for longer than ``after_s`` (callers wait)."""
    saturated = requests.saturated(after_s=after_s)
    if not saturated:
        return "ok"
    worst = ", ".join(f"{subject} for {seconds:.1f} s" for subject, seconds in sorted(saturated.items()))
    return f"saturated: every worker busy ({worst})"


HEALTH_PROBE_TIMEOUT_S = 1.0


def health_probes(calls: tuple[Rpc, ...]) -> dict[str, Rpc]:
    """The dependencies a service may probe: context (``reservation``) -> its health subject, for each
    health subject among the subjects the service calls (its NATS permissions allow just those)."""
    return {rpc.value.split(".", 1)[0]: rpc for rpc in calls if rpc.value.endswith(".health")}


async def _probe(runtime: Runtime, probes: Mapping[str, Rpc]) -> None:
    """Ask the health of each dependency whose latest call got no answer: one that answers is back (the
    call stats record the answer), so health does not wait for the next real call to say so."""
    failing = [probes[context] for context in runtime.rpc.stats.failing() if context in probes]

    async def one(rpc: Rpc) -> None:
        with contextlib.suppress(Exception):  # no answer: recorded as such, still failing
            await runtime.rpc.call(rpc, HealthRequest(), timeout_s=HEALTH_PROBE_TIMEOUT_S)

    await asyncio.gather(*(one(rpc) for rpc in failing))


def _health(
    runtime: Runtime,
    extra: Callable[[], Mapping[str, str]] | None,
    requests: RequestServer | None = None,
    *,
    probes: Mapping[str, Rpc] | None = None,
) -> Callable[[HealthRequest], Awaitable[BaseModel]]:
    async def handler(_request: HealthRequest) -> BaseModel:
        checks: dict[str, str] = {}
        slow_s = runtime.settings.kit.dependency_slow_ms / 1000
        if runtime.uses_database:
            started = time.monotonic()
            try:
                async with runtime.engine.connect() as conn:
                    await asyncio.wait_for(conn.execute(text("SELECT 1")), timeout=2)
                took = time.monotonic() - started
                checks["postgres"] = "ok" if took <= slow_s else f"slow: SELECT 1 took {took * 1000:.0f} ms"
            except Exception as exc:
                checks["postgres"] = f"error: {type(exc).__name__}"
        checks["nats"] = "ok" if runtime.nc is not None and runtime.nc.is_connected else "error: disconnected"
        if requests is not None:
            checks["workers"] = _workers_check(requests, after_s=runtime.settings.kit.request_saturated_ms / 1000)
        if probes:
            await _probe(runtime, probes)
        slow = runtime.rpc.stats.slow(slow_s=slow_s)
        checks["dependencies"] = (
            "ok" if not slow else "slow: " + "; ".join(f"{k}: {v}" for k, v in sorted(slow.items()))
        )
        loops = getattr(runtime, "consumers", None)  # a test's stand-in runtime may have none
        if loops:
            checks["consumers"] = consumers_check(loops)
        read_side = getattr(runtime, "read_side", None)  # a test's stand-in runtime may have none
        if read_side is not None:
            checks.update(read_side.checks())
        if extra is not None:
            checks.update(extra())
        healthy = all(v == "ok" for v in checks.values())
        return HealthReply(
            status="ok" if healthy else "degraded",
            service=runtime.name,
            version=hetsched_version(),
            checks=checks,
            metrics_url=getattr(getattr(runtime, "metrics", None), "url", None),
        )

    return handler


def _describe_slow(slow: Mapping[str, str]) -> str:
    return "slow: " + "; ".join(f"{context}: {why}" for context, why in sorted(slow.items()))


def durable_name(settings: Settings, schema: str, name: str) -> str:
    """A consumer's durable name on the server: unique per deployment (subject prefix) and service."""
    return f"{settings.kit.subject_prefix}-{schema}-{name}"


def _durable(runtime: Runtime, name: str) -> str:
    return durable_name(runtime.settings, runtime.schema, name)


def _stop_if_cancelled() -> None:
    """Re-raise a cancellation a library swallowed (its task is being cancelled: a stopping service), so a
    loop that retries on timeouts does not keep the process alive after shutdown."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


@dataclass
class _EventLoop:
    """One durable consumer: what it reads, how each event is applied, and when it gives up on one.

    An event whose handler raises is nak'ed with the rest of its batch after a delay that doubles
    with each failure (``HETSCHED_EVENT_REDELIVERY_BACKOFF_MS``, capped), and the loop waits out that
    delay before fetching again so the redelivery comes before newer events. After
    ``max_deliveries`` failures, or at once for a message ``consume`` calls unappliable, the event is
    dead-lettered (``DEADLETTER`` stream) and acknowledged: the consumer moves on. Logs: the first
    failure with its stack, each later one on one line, the dead letter on one ERROR line.

    A durable deleted under it (by whoever holds the operator's key, or lost with a server's storage) is
    re-created with its own config, so from the stream's first sequence: its ack floor went with it, and
    events it had applied are skipped by the inbox, so nothing is lost even when several processes share
    the durable. Until it has caught up again (nothing pending), and for ``CONSUMER_CHECK_S`` at least,
    health check ``consumers`` says so.
    """

    subject: str
    stream: str
    durable: str
    apply: Callable[..., Awaitable[None]]  # (data, subject, session=None): ``bus.consume``'s handler
    together: bool = False  # ``Consumer.together``
    deadletter_subject: str = ""
    max_deliveries: int = 5
    backoff_s: float = 0.5
    backoff_max_s: float = 10.0
    # Failures per stream sequence (this process): a batch's later events are nak'ed behind a failing
    # one, which raises their server-side delivery count without them having failed.
    failures: dict[int, int] = field(default_factory=dict)
    # Counters the metrics endpoint exports.
    redelivered: int = 0
    dead_lettered: int = 0
    # A re-created durable replaying its stream: how many events it had pending last (None: not known yet).
    recovering: bool = False
    pending: int | None = None
    recreated: int = 0
    recreated_at: float = 0.0
    checked_at: float = 0.0

    async def run(self, runtime: Runtime) -> None:
        subscription = await self._subscribe(runtime)
        self.checked_at = time.monotonic()
        try:
            while True:
                try:
                    messages = await subscription.fetch(batch=EVENT_BATCH, timeout=EVENT_FETCH_TIMEOUT_S)
                except TimeoutError:
                    _stop_if_cancelled()  # nats-py may turn a cancellation inside fetch into a timeout
                    subscription = await self._check(runtime, subscription)  # nothing new, or no consumer
                    continue
                except (ConnectionClosedError, ServiceUnavailableError, NoRespondersError):
                    _stop_if_cancelled()
                    await asyncio.sleep(EVENT_FETCH_TIMEOUT_S)  # NATS is restarting: unacked events come again
                    # ... or the consumer is gone: a pull on a deleted one is answered 503 (no responders)
                    subscription = await self._check(runtime, subscription)
                    continue
                await self.apply_in_order(runtime, messages)
                if self.recovering and messages:
                    self.pending = messages[-1].metadata.num_pending
        finally:
            # The durable consumer stays on the server; only this process's interest ends (so a drain
            # at shutdown does not wait for a pull request that will never be answered).
            with contextlib.suppress(Exception):
                await subscription.unsubscribe()

    async def _check(self, runtime: Runtime, subscription: Any) -> Any:
        """After a fetch that timed out or found no responder: is the durable still there (asked every
        ``CONSUMER_CHECK_S``, and each time while recovering)? A missing one is re-created (logged once,
        naming the consumer and its stream); a re-created one with nothing pending has caught up. Returns
        the subscription to fetch from next."""
        now = time.monotonic()
        if not self.recovering and now - self.checked_at < CONSUMER_CHECK_S:
            return subscription
        self.checked_at = now
        try:
            info = await runtime.jetstream.consumer_info(self.stream, self.durable)
        except NotFoundError:
            self.recovering, self.pending, self.recreated = True, None, self.recreated + 1
            self.recreated_at = now
            runtime.log.warning(CONSUMER_GONE_MESSAGE, extra={"durable": self.durable, "stream": self.stream})
            with contextlib.suppress(Exception):  # its server-side consumer is gone already
                await subscription.unsubscribe()
            return await self._subscribe(runtime)
        except Exception:  # NATS away or electing a leader: ask again at the next check
            _stop_if_cancelled()
            return subscription
        if self.recovering:
            self.pending = info.num_pending
            # caught up, and degraded for one check interval at least, so a health poller sees it happened
            if info.num_pending == 0 and info.num_ack_pending == 0 and now - self.recreated_at >= CONSUMER_CHECK_S:
                self.recovering = False
                runtime.log.info(
                    CONSUMER_CAUGHT_UP_MESSAGE,
                    extra={"durable": self.durable, "stream": self.stream, "sequence": info.delivered.stream_seq},
                )
        return subscription

    async def _subscribe(self, runtime: Runtime) -> Any:
        """The durable pull subscription, once its stream exists (its owner or the operator creates it:
        a service started before them waits, saying so once)."""
        said = False
        while True:
            try:
                return await runtime.jetstream.pull_subscribe(
                    self.subject,
                    durable=self.durable,
                    stream=self.stream,
                    config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL),
                )
            except (NotFoundError, NatsTimeoutError, ServiceUnavailableError, NoRespondersError) as exc:
                _stop_if_cancelled()
                if not said:
                    runtime.log.warning(
                        "waiting for a stream to consume",
                        extra={"stream": self.stream, "durable": self.durable, "error": type(exc).__name__},
                    )
                    said = True
                await asyncio.sleep(EVENT_FETCH_TIMEOUT_S)

    async def apply_in_order(self, runtime: Runtime, messages: list[Msg]) -> None:
        """Apply a fetched batch in order: together in one transaction while that works, else one by one."""
        position = 0
        while position < len(messages):
            if self.together and len(messages) - position > 1:
                applied, failure = await self._apply_together(runtime, messages[position:])
                position += applied
                if failure is not None:  # messages[position] failed, its handler having run once
                    if not await self._failed(runtime, messages, position, failure):
                        return
                    position += 1
                    continue
                if applied:
                    continue
                # the transaction itself failed: this event goes alone
            message = messages[position]
            try:
                await self.apply(message.data, message.subject)
            except Exception as exc:
                if not await self._failed(runtime, messages, position, exc):
                    return
            else:
                self.failures.pop(message.metadata.sequence.stream, None)
                with contextlib.suppress(Exception):  # NATS away: redelivered after the ack wait, the inbox skips it
                    await message.ack()
            position += 1

    async def _failed(self, runtime: Runtime, messages: list[Msg], position: int, exc: Exception) -> bool:
        """``messages[position]`` raised ``exc`` (its handler ran once): dead-letter it (True: go on with the
        next) or nak it with the rest of the batch and wait the backoff out (False: stop this batch)."""
        message = messages[position]
        sequence = message.metadata.sequence.stream
        if isinstance(exc, UnappliableEvent):
            if not await self._dead_letter(runtime, message, str(exc)):
                await self._retry_later(messages[position:], failures=self.failures.get(sequence, 1))
                return False
            return True
        failures = self.failures.get(sequence, 0) + 1
        self.failures[sequence] = failures
        error = f"{type(exc).__name__}: {exc}"
        # The server's count bounds it across restarts (this process's count starts again at 0).
        server_deliveries = message.metadata.num_delivered or 0
        if failures >= self.max_deliveries or server_deliveries >= self.max_deliveries * RESTART_SLACK:
            if await self._dead_letter(runtime, message, error):
                return True
            await self._retry_later(messages[position:], failures=failures)
            return False
        delay = redelivery_delay_s(failures, base_s=self.backoff_s, max_s=self.backoff_max_s)
        extra = {"durable": self.durable, "sequence": sequence, "failures": failures, "retry_in_s": delay}
        if failures == 1:
            runtime.log.error("event handler failed; the event is redelivered", exc_info=exc, extra=extra)
        else:
            runtime.log.warning(
                "event handler failed again; the event is redelivered", extra=extra | {"error": error[:300]}
            )
        self.redelivered += 1
        await self._retry_later(messages[position:], failures=failures)
        return False

    async def _apply_together(self, runtime: Runtime, messages: list[Msg]) -> tuple[int, Exception | None]:
        """Apply ``messages`` in one transaction (each event still once, through the inbox), then ack them:
        one commit for the batch instead of one per event. Returns how many were applied and acked, and
        the exception of the event that failed after them (its handler ran once, as one by one), or None
        with 0 applied when the transaction failed otherwise (the caller then applies one by one)."""
        uow = runtime.uow
        failed_at: int | None = None
        failure: Exception | None = None
        try:
            async with uow.sessions() as session, session.begin():
                for position, message in enumerate(messages):
                    try:
                        await self.apply(message.data, message.subject, session=session)
                    except Exception as exc:
                        failed_at, failure = position, exc
                        raise
        except Exception:
            if failed_at is None or failure is None:
                return 0, None
            if failed_at == 0:
                return 0, failure
            # The events before the failing one were fine: apply them together again, then report it.
            applied, again = await self._apply_together(runtime, messages[:failed_at])
            return (applied, failure) if again is None and applied == failed_at else (0, None)
        uow.wake()
        committed_on(session)  # memory follows only what committed (a rolled-back batch changed none)
        for message in messages:
            self.failures.pop(message.metadata.sequence.stream, None)
            with contextlib.suppress(Exception):  # NATS away: redelivered after the ack wait, the inbox skips it
                await message.ack()
        return len(messages), None

    async def _retry_later(self, messages: list[Msg], *, failures: int) -> None:
        """Nak ``messages`` (the failing one first, the rest of its batch in order) and wait the delay out."""
        delay = redelivery_delay_s(failures, base_s=self.backoff_s, max_s=self.backoff_max_s)
        for message in messages:
            with contextlib.suppress(Exception):  # NATS away: the ack wait redelivers them anyway
                await message.nak(delay=delay)
        await asyncio.sleep(delay)

    async def _dead_letter(self, runtime: Runtime, message: Msg, error: str) -> bool:
        """Park ``message`` in DEADLETTER and ack it; False (nothing acked) when it could not be published."""
        sequence = message.metadata.sequence.stream
        deliveries = message.metadata.num_delivered or 1
        try:
            await dead_letter(
                runtime.jetstream,
                subject=self.deadletter_subject,
                message=message,
                consumer=self.durable,
                error=error,
                deliveries=deliveries,
            )
            await message.ack()
        except Exception as exc:
            runtime.log.warning(
                "could not dead-letter an event; it is redelivered",
                extra={"durable": self.durable, "sequence": sequence, "error": f"{type(exc).__name__}: {exc}"[:300]},
            )
            return False
        self.failures.pop(sequence, None)
        self.dead_lettered += 1
        runtime.log.error(
            DEAD_LETTERED_MESSAGE,
            extra={
                "durable": self.durable,
                "subject": message.subject,
                "sequence": sequence,
                "deliveries": deliveries,
                "error": error[:300],
            },
        )
        return True


def consumers_check(loops: list[_EventLoop]) -> str:
    """Health check ``consumers``: ``ok``, or which re-created durables are still replaying their stream."""
    recovering = [loop for loop in loops if loop.recovering]
    if not recovering:
        return "ok"
    parts = [
        f"{loop.durable} on {loop.stream} re-created, "
        + ("replaying" if loop.pending is None else f"{loop.pending} events pending")
        for loop in recovering
    ]
    return "recovering: " + "; ".join(parts)


def _event_loop(
    runtime: Runtime, *, subject: str, context: Context, durable: str, apply: Any, together: bool = False
) -> _EventLoop:
    settings = runtime.settings
    return _EventLoop(
        subject=subject,
        together=together,
        stream=stream_name(context, stream_prefix=settings.kit.stream_prefix),
        durable=durable,
        apply=apply,
        deadletter_subject=runtime.subjects.deadletter(context, durable),
        max_deliveries=settings.kit.event_max_deliveries,
        backoff_s=settings.kit.event_redelivery_backoff_ms / 1000,
        backoff_max_s=settings.kit.event_redelivery_backoff_max_ms / 1000,
    )


def _subscribe_consumer(runtime: Runtime, consumer: Consumer, ctx: Any) -> _EventLoop:
    handlers = {name: factory(ctx) for name, factory in consumer.on.items()}
    subject = runtime.subjects.events_of(consumer.context)
    if len(handlers) == 1:
        name = next(iter(handlers))
        subject = runtime.subjects.event(consumer.context, name)
        if name in NODE_SCOPED_EVENTS.get(consumer.context, ()):
            subject += ".*"  # one subject per node
    apply = consume(
        uow=runtime.uow,
        schema=runtime.schema,
        consumer=consumer.durable,
        context=consumer.context,
        handlers=handlers,
        skip=consumer.skip,
    )
    return _event_loop(
        runtime,
        subject=subject,
        context=consumer.context,
        durable=_durable(runtime, consumer.durable),
        apply=apply,
        together=consumer.together,
    )


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
    broker = NatsBroker(
        nats_servers(nats_url),  # a cluster's URL lists every node
        **broker_options,
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
    holder: list[Runtime] = []
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
            _health(runtime, extra_checks, requests, probes=health_probes(definition.calls)),
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
    event_loops = [_subscribe_consumer(runtime, consumer, ctx) for consumer in definition.consumers]
    runtime.consumers = event_loops
    listeners = [(listen, listen.on(ctx)) for listen in definition.listens]

    app = FastStream(broker, logger=log)

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
        runtime.nc = await nats.connect(
            nats_servers(nats_url),
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
    """Entry point of ``python -m services.<name>``: logs, settings, run until SIGINT/SIGTERM."""
    from shared.infra.logs import configure_logging
    from shared.infra.settings import load_settings

    settings = load_settings()
    configure_logging(service=name, level=settings.kit.log_level, fmt=settings.kit.log_format)
    app, _runtime = bootstrap(settings)
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(app.run())
    finally:
        _close_loop(loop)


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
