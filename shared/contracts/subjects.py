"""Subject names, defined once.

Every subject is ``<prefix>.<name>`` where the prefix is ``hetsched`` unless a deployment (or a
test run) isolates itself with another. Code refers to the names below, never to literal strings.
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from enum import StrEnum

DEFAULT_PREFIX = "hetsched"


class Rpc(StrEnum):
    """Request/reply subjects (core NATS), without the prefix."""

    TOPOLOGY_HEALTH = "topology.health"
    TOPOLOGY_AGENT_HEALTH = "topology.agent.health"
    LEDGER_HEALTH = "ledger.health"
    PLACEMENT_HEALTH = "placement.health"
    RESERVATION_HEALTH = "reservation.health"
    ROUTE_HEALTH = "route.health"
    REBALANCE_HEALTH = "rebalance.health"
    GATEWAY_HEALTH = "gateway.health"

    FLEET_GET = "fleet.get"
    FLEET_DESCRIBE = "fleet.describe"
    TOPOLOGY_REPORT = "topology.report"
    LEDGER_COMMIT = "ledger.commit"
    LEDGER_COMMIT_BATCH = "ledger.commit_batch"
    LEDGER_RELEASE = "ledger.release"
    LEDGER_RENEW = "ledger.renew"
    LEDGER_SNAPSHOT = "ledger.snapshot"
    LEDGER_PREEMPT = "ledger.preempt"
    PLACEMENT_PLACE = "placement.place"
    PLACEMENT_EXPLAIN = "placement.explain"
    PLACEMENT_RELEASE = "placement.release"
    PLACEMENT_RENEW = "placement.renew"
    PLACEMENT_ADMIT = "placement.admit"
    PLACEMENT_REPLICAS = "placement.replicas"
    PLACEMENT_ASSIGNMENTS = "placement.assignments"
    RESERVATION_CREATE = "reservation.create"
    RESERVATION_CANCEL = "reservation.cancel"
    RESERVATION_STATUS = "reservation.status"
    RESERVATION_REPORT = "reservation.report"
    RESERVATION_RECLAIM = "reservation.reclaim"
    ROUTE_SELECT = "route.select"
    ROUTE_REGION = "route.region"
    REBALANCE_STATUS = "rebalance.status"


TENANT_SCOPED: frozenset[Rpc] = frozenset(
    {
        Rpc.PLACEMENT_PLACE,
        Rpc.PLACEMENT_EXPLAIN,
        Rpc.PLACEMENT_RELEASE,
        Rpc.PLACEMENT_RENEW,
        Rpc.PLACEMENT_ADMIT,
        Rpc.PLACEMENT_REPLICAS,
        Rpc.RESERVATION_CREATE,
        Rpc.RESERVATION_CANCEL,
        Rpc.RESERVATION_STATUS,
        Rpc.ROUTE_SELECT,
    }
)
"""Public subjects that act for a tenant named in the body. Each is also served as
``<subject>.<tenant token>``: a gateway's credential may publish only on its own tenants' subjects, and
the service refuses (``forbidden``) a body naming another tenant than its subject (docs/SECURITY.md)."""

NODE_SCOPED: frozenset[Rpc] = frozenset({Rpc.TOPOLOGY_REPORT, Rpc.PLACEMENT_ASSIGNMENTS})
"""Agent subjects served as ``<subject>.<node token>``: an agent's credential reaches only its own node's."""

PUBLIC: frozenset[Rpc] = TENANT_SCOPED | {Rpc.FLEET_GET}
"""What a gateway credential may call (API.md "Operations")."""

_TOKEN_SAFE = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def token(name: str) -> str:
    """``name`` as one subject token: itself when it is plain (letters, digits, ``_``, ``-``), else ``=``
    and its UTF-8 in lower-case base32 without padding. Reversible and collision-free (a plain name
    never starts with ``=``), so a permission on ``...<token>`` binds exactly one tenant or node."""
    if _TOKEN_SAFE.match(name):
        return name
    return "=" + base64.b32encode(name.encode()).decode().rstrip("=").lower()


def untoken(value: str) -> str:
    """The name a ``token`` stands for (``ValueError`` when it is not one)."""
    if not value.startswith("="):
        if not _TOKEN_SAFE.match(value):
            raise ValueError(f"not a subject token: {value[:64]!r}")
        return value
    body = value[1:].upper()
    return base64.b32decode(body + "=" * (-len(body) % 8)).decode()


def names_scope(subject: str, name: str) -> bool:
    """Whether ``subject``'s last token is exactly ``name``'s ``token``: how a node-scoped message (an agent's
    heartbeat, GPU telemetry, engine status) is held to the node its body names. Whole tokens compare
    exactly, so node ``dgx-0`` never speaks for ``dgx-02``."""
    return subject.rpartition(".")[2] == token(name)


class Context(StrEnum):
    """Bounded contexts; each has one event stream named after it in upper case."""

    TOPOLOGY = "topology"
    LEDGER = "ledger"
    PLACEMENT = "placement"
    RESERVATION = "reservation"
    ROUTING = "routing"
    REBALANCE = "rebalance"
    TELEMETRY = "telemetry"
    GATEWAY = "gateway"


@dataclass(frozen=True, slots=True)
class Subjects:
    """Resolves names to full subjects under one prefix."""

    prefix: str = DEFAULT_PREFIX

    def rpc(self, name: Rpc) -> str:
        return f"{self.prefix}.{name.value}"

    def scoped(self, name: Rpc, scope: str) -> str:
        """``<prefix>.<name>.<token(scope)>``: a tenant's (``TENANT_SCOPED``) or a node's (``NODE_SCOPED``)
        form of a request subject, the one a gateway's or an agent's permissions allow."""
        return f"{self.rpc(name)}.{token(scope)}"

    def heartbeat(self, node: str) -> str:
        """Core-NATS subject of one node's heartbeats (not persisted: only their absence matters)."""
        return f"{self.prefix}.topology.heartbeat.{token(node)}"

    def heartbeats(self) -> str:
        """Every node's heartbeats (what the fleet-mode topology service subscribes to)."""
        return f"{self.prefix}.topology.heartbeat.*"

    def event(self, context: Context, event: str, *, node: str | None = None) -> str:
        """``<prefix>.events.<context>.<event>``, the subject an event of that type is published on; a
        node-scoped event (GPU telemetry, engine status) adds ``.<token(node)>`` so permissions can bind an
        agent to its own node."""
        subject = f"{self.prefix}.events.{context.value}.{event}"
        return f"{subject}.{token(node)}" if node is not None else subject

    def events_of(self, context: Context) -> str:
        """Wildcard covering every event of one context (a stream's subject filter)."""
        return f"{self.prefix}.events.{context.value}.>"

    def deadletter(self, context: Context, durable: str) -> str:
        """``<prefix>.deadletter.<context>.<durable>``: where a consumer parks an event it cannot apply."""
        return f"{self.prefix}.deadletter.{context.value}.{durable}"

    def deadletters(self) -> str:
        """Wildcard covering every dead letter (the DEADLETTER stream's subject filter)."""
        return f"{self.prefix}.deadletter.>"
