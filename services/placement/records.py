"""What placement's store reads and writes, as records: an attempt's hold on an intent (``Turn``), a stored
intent, an allocation the ledger told of, a queued request, a placed decision's accelerators."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ValidationError

from shared.contracts.ledger import CommitRequest
from shared.contracts.placement import PlaceReply, PlaceRequest
from shared.domain.placement.listing import Position
from shared.domain.placement.ownership import Intent


@dataclass(frozen=True, slots=True)
class Turn:
    """One attempt's hold on an intent: the writes of an attempt apply only while it is still this one's."""

    tenant: str
    request_id: str
    attempt: int


@dataclass(frozen=True, slots=True)
class StoredIntent:
    """An intent with what it carries: the last commit sent and the reply (pending or final)."""

    intent: Intent
    commit: CommitRequest | None
    reply: PlaceReply | None


@dataclass(frozen=True, slots=True)
class SeenAllocation:
    """A ledger allocation of placement's (as LEDGER events told it) and its intent, if any."""

    allocation_id: str
    tenant: str
    request_id: str
    seen_at: datetime
    intent: Intent | None


@dataclass(frozen=True, slots=True)
class QueuedRequest:
    """A request waiting in the queue: its place (``seq``, lower first) and when it gives up. ``body`` is
    the request as stored; ``request`` parses it (a pass reads every queued row, and decides few)."""

    seq: int
    tenant: str
    request_id: str
    body: Mapping[str, Any]
    enqueued_at: datetime
    deadline_at: datetime

    @property
    def request(self) -> PlaceRequest:
        return PlaceRequest.model_validate(self.body)

    @property
    def shape(self) -> str:
        """What it asks, but for its id and how long it waits: two requests of one shape fit alike."""
        return json.dumps(
            {k: v for k, v in self.body.items() if k not in _NOT_SHAPE}, sort_keys=True, separators=(",", ":")
        )


# Fields that do not change whether a request fits (the tenant stays: what it may use depends on it).
_NOT_SHAPE = frozenset({"request_id", "queue_timeout_s", "lease_s", "version"})


@dataclass(frozen=True, slots=True)
class PlacedAllocation:
    """A placed decision's allocation and the accelerators its commit reserved (for the quotas' tally)."""

    allocation_id: str
    tenant: str
    accelerators: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ReplicaFilter:
    """Which placed replicas a listing keeps: by tenant, model, node (or TPU pod), and by id (``only``: these
    and no others, None for no such limit; ``excluding``: not these), as the state filter says."""

    tenant: str | None = None
    model: str | None = None
    node: str | None = None
    only: frozenset[str] | None = None
    excluding: frozenset[str] = frozenset()

    @property
    def empty(self) -> bool:
        """Nothing can match (a state no replica is in)."""
        return self.only is not None and not self.only


@dataclass(frozen=True, slots=True)
class PlacedReplica:
    """A placed decision as the listing reads it: its reply (as stored), lease end and when it was placed."""

    tenant: str
    request_id: str
    allocation_id: str
    reply: Mapping[str, Any]
    lease_expires_at: datetime | None
    placed_at: datetime

    @property
    def position(self) -> Position:
        """Its place in the listing order (where the next page starts)."""
        return Position(self.tenant, self.request_id)


class PlacementRecord(BaseModel):
    """What a direct placement keeps with its ledger commit (``CommitRequest.record``): the request, the reply
    it gave (without the allocation id, which the ledger assigns), the lease asked for (the commit holds a
    short first lease), how long deciding took and in how many attempts. A repeat of the commit returns it;
    ``allocation_committed`` carries it, and placement's records follow from it."""

    request: PlaceRequest
    reply: PlaceReply
    lease_s: int
    decision_ms: float = 0.0
    attempts: int = 1  # the attempt whose commit this is (each conflict decides again)

    @classmethod
    def read(cls, data: Mapping[str, Any] | None) -> PlacementRecord | None:
        """The record a commit kept, or None when it kept none (or one this version cannot read)."""
        if not data:
            return None
        try:
            return cls.model_validate(data)
        except ValidationError:
            return None
