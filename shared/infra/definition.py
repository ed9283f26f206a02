"""What a service declares (``ServiceDefinition``): its routes, durable consumers, follows, listens, loops
and hooks, and what its NATS identity may do (``grant_of``). ``shared.infra.service.build_app`` wires it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from shared.contracts.base import Request
from shared.contracts.permissions import ServiceGrant, service_identity
from shared.contracts.subjects import NODE_SCOPED, TENANT_SCOPED, Context, Rpc, Subjects
from shared.infra.bus import TypedEventHandler
from shared.infra.follow import Follow
from shared.infra.runtime import Runtime
from shared.infra.settings import Settings

DEFAULT_STALE_AFTER_MS = 5000.0

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
    transaction that records the event as processed. The durable filters exactly those names (one filter
    subject per name where the server takes several, NATS >= 2.10), so the server delivers no other event
    of the context; on an older server, events of other names are acknowledged and skipped. One consumer
    per context keeps the context's order (a node lost, then recovered).

    ``together=True`` applies each fetched batch in one transaction (one commit for many events, and one
    inbox statement claiming them, for a consumer on a hot path). Each event's effects still happen once
    (the inbox), but a handler may then
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


def durable_name(settings: Settings, schema: str, name: str) -> str:
    """A consumer's durable name on the server: unique per deployment (subject prefix) and service."""
    return f"{settings.kit.subject_prefix}-{schema}-{name}"
