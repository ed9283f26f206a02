"""Subject names, defined once.

Every subject is ``<prefix>.<name>`` where the prefix is ``hetsched`` unless a deployment (or a
test run) isolates itself with another. Code refers to the names below, never to literal strings.
"""

from __future__ import annotations

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

    FLEET_GET = "fleet.get"
    FLEET_DESCRIBE = "fleet.describe"
    TOPOLOGY_REPORT = "topology.report"
    LEDGER_COMMIT = "ledger.commit"
    LEDGER_COMMIT_BATCH = "ledger.commit_batch"
    LEDGER_RELEASE = "ledger.release"
    LEDGER_RENEW = "ledger.renew"
    LEDGER_SNAPSHOT = "ledger.snapshot"
    PLACEMENT_PLACE = "placement.place"
    PLACEMENT_EXPLAIN = "placement.explain"
    PLACEMENT_RELEASE = "placement.release"
    PLACEMENT_RENEW = "placement.renew"
    PLACEMENT_ADMIT = "placement.admit"
    RESERVATION_CREATE = "reservation.create"
    RESERVATION_CANCEL = "reservation.cancel"
    RESERVATION_STATUS = "reservation.status"
    ROUTE_SELECT = "route.select"
    REBALANCE_STATUS = "rebalance.status"


class Context(StrEnum):
    """Bounded contexts; each has one event stream named after it in upper case."""

    TOPOLOGY = "topology"
    LEDGER = "ledger"
    PLACEMENT = "placement"
    RESERVATION = "reservation"
    ROUTING = "routing"
    REBALANCE = "rebalance"
    TELEMETRY = "telemetry"


@dataclass(frozen=True, slots=True)
class Subjects:
    """Resolves names to full subjects under one prefix."""

    prefix: str = DEFAULT_PREFIX

    def rpc(self, name: Rpc) -> str:
        return f"{self.prefix}.{name.value}"

    def heartbeat(self) -> str:
        """Core-NATS subject of node heartbeats (not persisted: only their absence matters)."""
        return f"{self.prefix}.topology.heartbeat"

    def event(self, context: Context, event: str) -> str:
        """``<prefix>.events.<context>.<event>``, the subject an event of that type is published on."""
        return f"{self.prefix}.events.{context.value}.{event}"

    def events_of(self, context: Context) -> str:
        """Wildcard covering every event of one context (a stream's subject filter)."""
        return f"{self.prefix}.events.{context.value}.>"

    def deadletter(self, context: Context, durable: str) -> str:
        """``<prefix>.deadletter.<context>.<durable>``: where a consumer parks an event it cannot apply."""
        return f"{self.prefix}.deadletter.{context.value}.{durable}"

    def deadletters(self) -> str:
        """Wildcard covering every dead letter (the DEADLETTER stream's subject filter)."""
        return f"{self.prefix}.deadletter.>"
