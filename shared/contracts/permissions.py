"""Who may publish and subscribe on which subject: the NATS permissions of every identity, as data.

Four kinds of identity connect to NATS (docs/SECURITY.md): a **service** (one NKey per service), an
**agent** (one per node: its reports, heartbeats, GPU telemetry and engine status, each on a subject
that names the node), a **gateway** (a platform team's caller: the public subjects of its tenants
only) and the **operator** (everything; the CLI and operators' tools). What a service may do follows
from its definition (routes, consumers, calls) and from who owns which context:

- only a context's owner publishes its events (``EVENT_PUBLISHERS``) and creates or updates its stream;
- only the services that call the ledger reach ``ledger.*``; only a route's service subscribes to it;
- only the operator reaches the JetStream API beyond what a service's own consumers need (no purge,
  no delete, no other service's consumer): a service reads (``CONSUMER.INFO``, ``MSG.NEXT``, acks) only
  its own durables, each by its exact name; creates only those and, on the streams it follows, ordered
  consumers under names of its own choosing in the subject that names them, never another service's
  durable (denied by name); and deletes none (``consumer_grants``).

The server enforces these (``shared.infra.identity`` renders them into its ``authorization`` block);
services check what the bus cannot: that a scoped subject's body names the same tenant or node, and
that an event's ``source`` is its context's publisher.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from shared.contracts.streams import deadletter_stream_name, stream_name
from shared.contracts.subjects import NODE_SCOPED, PUBLIC, TENANT_SCOPED, Context, Rpc, Subjects, token

TOPOLOGY = "topology-discovery"
LEDGER = "capacity-ledger"
PLACEMENT = "placement"
RESERVATION = "reservation-filler"
ROUTER = "cross-region-router"
REBALANCER = "rebalancer"
AGENT = "topology-agent"
GATEWAY = "gateway"

STREAM_OWNERS: dict[Context, str] = {
    Context.TOPOLOGY: TOPOLOGY,
    Context.TELEMETRY: TOPOLOGY,  # agents publish into it; the fleet service owns the stream
    Context.LEDGER: LEDGER,
    Context.PLACEMENT: PLACEMENT,
    Context.RESERVATION: RESERVATION,
    Context.ROUTING: ROUTER,
    Context.REBALANCE: REBALANCER,
    Context.GATEWAY: GATEWAY,
}
"""The service that creates and updates each context's stream."""


def owned_streams(service: str) -> tuple[Context, ...]:
    """The contexts whose streams ``service`` creates and updates."""
    return tuple(context for context, owner in STREAM_OWNERS.items() if owner == service)


EVENT_PUBLISHERS: dict[Context, str] = STREAM_OWNERS | {Context.TELEMETRY: AGENT}
"""The ``source`` every event of a context must carry: its only publisher. Engines report their status
through their node's agent identity, so TELEMETRY events come from agents alone."""

NODE_SCOPED_EVENTS: dict[Context, tuple[str, ...]] = {Context.TELEMETRY: ("gpu", "engine_status", "replica_state")}
"""Events published on ``<event subject>.<node token>``: an agent publishes only its own node's."""

INBOX = "_INBOX"


def inbox_prefix(identity: str) -> str:
    """The reply-subject prefix of one identity (``_INBOX_<identity>``): it may receive replies only there,
    so no caller reads another's answers."""
    return f"{INBOX}_{token(identity)}"


@dataclass(frozen=True)
class Permissions:
    """Subjects one identity may publish and subscribe to; ``allow_responses`` lets it answer requests
    it received (one reply to each reply subject) without a publish grant on ``_INBOX.>``."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = False
    # Subjects refused even where ``publish`` allows them (nats-server: deny wins over allow).
    deny_publish: tuple[str, ...] = ()

    @property
    def everything(self) -> bool:
        return self.publish == (">",) and self.subscribe == (">",)


@dataclass(frozen=True)
class ServiceGrant:
    """What one service does on the bus, as its definition and settings say (``grant_of``)."""

    name: str
    identity: str
    serves: tuple[Rpc, ...]
    consumes: tuple[tuple[Context, str], ...] = ()  # (context, full durable name)
    reads: tuple[Context, ...] = ()  # ordered (ephemeral) consumers
    calls: tuple[Rpc, ...] = ()
    listens: tuple[str, ...] = ()
    extra_publish: tuple[str, ...] = field(default=())


def _unique(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


def _js(verb: str) -> str:
    return f"$JS.API.{verb}"


def service_permissions(
    grant: ServiceGrant, subjects: Subjects, *, others: Iterable[ServiceGrant], stream_prefix: str = ""
) -> Permissions:
    """The permissions of one service identity; ``others`` are the other services' grants (their durables
    are denied to it by name)."""
    publish: list[str] = [_js("INFO")]
    subscribe: list[str] = [f"{inbox_prefix(grant.identity)}.>"]
    for context in owned_streams(grant.name):
        stream = stream_name(context, stream_prefix=stream_prefix)
        publish += [_js(f"STREAM.INFO.{stream}"), _js(f"STREAM.CREATE.{stream}"), _js(f"STREAM.UPDATE.{stream}")]
    for context, publisher in EVENT_PUBLISHERS.items():
        if publisher == grant.name:
            publish.append(subjects.events_of(context))
    deadletters = deadletter_stream_name(stream_prefix=stream_prefix)
    if grant.consumes:
        publish += [_js(f"STREAM.INFO.{deadletters}"), _js(f"STREAM.CREATE.{deadletters}")]
    consumers, deny = consumer_grants(grant, subjects, others=others, stream_prefix=stream_prefix)
    publish += consumers
    for context, durable in grant.consumes:
        publish.append(subjects.deadletter(context, durable))
    publish += [subjects.rpc(rpc) for rpc in grant.calls]
    publish += grant.extra_publish
    for rpc in grant.serves:
        subscribe.append(subjects.rpc(rpc))
        if rpc in TENANT_SCOPED or rpc in NODE_SCOPED:
            subscribe.append(f"{subjects.rpc(rpc)}.*")
    subscribe += grant.listens
    return Permissions(
        publish=_unique(publish), subscribe=_unique(subscribe), allow_responses=True, deny_publish=_unique(deny)
    )


def consumer_grants(
    grant: ServiceGrant, subjects: Subjects, *, others: Iterable[ServiceGrant], stream_prefix: str = ""
) -> tuple[list[str], list[str]]:
    """The JetStream consumer API of one service: (allowed, denied) publish subjects.

    Its durables by their exact names (they carry its schema, ``<prefix>-<schema>-<name>``): info, create
    (every form nats-py uses), next and ack. Its ordered consumers (``reads``): created only through
    ``CONSUMER.CREATE.<stream>.<name>.<filter>`` with the filter it follows, under a random name
    (``shared.infra.bus.follow``): the server takes the consumer's name from that subject, so the other
    services' durables on the stream can be denied by name. The legacy ``CONSUMER.CREATE.<stream>`` takes
    the name from the body (it would update anyone's consumer: pause it, make it expire) and is not
    granted. No INFO, NEXT or DELETE on any other name, so no service reads, drains or deletes another's
    consumer, durable or ephemeral (the server drops an ephemeral consumer once nobody listens), nor lists
    them (``CONSUMER.LIST``/``NAMES``) to learn an ephemeral one's name."""
    allow: list[str] = []
    for context, durable in grant.consumes:
        stream = stream_name(context, stream_prefix=stream_prefix)
        allow += [
            _js(f"STREAM.INFO.{stream}"),
            _js(f"CONSUMER.INFO.{stream}.{durable}"),
            _js(f"CONSUMER.CREATE.{stream}.{durable}"),
            _js(f"CONSUMER.CREATE.{stream}.{durable}.>"),
            _js(f"CONSUMER.DURABLE.CREATE.{stream}.{durable}"),
            _js(f"CONSUMER.MSG.NEXT.{stream}.{durable}"),
            f"$JS.ACK.{stream}.{durable}.>",
        ]
    own = set(grant.consumes)
    foreign = [consumed for other in others if other.name != grant.name for consumed in other.consumes]
    deny: list[str] = []
    for context in grant.reads:
        stream = stream_name(context, stream_prefix=stream_prefix)
        allow += [
            _js(f"STREAM.INFO.{stream}"),
            _js(f"CONSUMER.CREATE.{stream}.*.{subjects.events_of(context)}"),
            f"$JS.FC.{stream}.>",  # flow-control replies of its ordered consumers
        ]
        deny += [
            _js(f"CONSUMER.CREATE.{stream}.{durable}.>")
            for consumed, durable in foreign
            if consumed is context and (consumed, durable) not in own
        ]
    return allow, deny


def agent_permissions(node: str, subjects: Subjects, *, health: Rpc = Rpc.TOPOLOGY_AGENT_HEALTH) -> Permissions:
    """One node's agent: its report, heartbeats, GPU telemetry, engine status and replica states, and the
    question which replica parts its node runs (``placement.assignments``), all on subjects naming the node;
    replies under its own inbox; it answers its own health subject."""
    publish = [
        subjects.scoped(Rpc.TOPOLOGY_REPORT, node),
        subjects.scoped(Rpc.PLACEMENT_ASSIGNMENTS, node),
        subjects.heartbeat(node),
        *(subjects.event(context, name, node=node) for context, names in NODE_SCOPED_EVENTS.items() for name in names),
    ]
    subscribe = [f"{inbox_prefix(agent_identity(node))}.>", subjects.rpc(health), subjects.scoped(health, node)]
    return Permissions(publish=_unique(publish), subscribe=_unique(subscribe), allow_responses=True)


def gateway_permissions(identity: str, tenants: Iterable[str], subjects: Subjects) -> Permissions:
    """A gateway: the public subjects for its tenants only (``<subject>.<tenant token>``), ``fleet.get``,
    and the health of the services it calls; replies under its own inbox. No events: they name tenants."""
    publish: list[str] = []
    for tenant in tenants:
        publish += [subjects.scoped(rpc, tenant) for rpc in sorted(TENANT_SCOPED)]
    publish += [subjects.rpc(rpc) for rpc in sorted(PUBLIC - TENANT_SCOPED)]
    publish += [subjects.rpc(rpc) for rpc in (Rpc.PLACEMENT_HEALTH, Rpc.ROUTE_HEALTH, Rpc.RESERVATION_HEALTH)]
    return Permissions(publish=_unique(publish), subscribe=(f"{inbox_prefix(identity)}.>",))


def operator_permissions() -> Permissions:
    """The administrator: every subject, every tenant, the whole JetStream API."""
    return Permissions(publish=(">",), subscribe=(">",))


def agent_identity(node: str) -> str:
    return f"agent_{token(node)}"


def service_identity(schema: str) -> str:
    return f"svc_{schema}"


def gateway_identity(name: str) -> str:
    return f"gw_{token(name)}"
