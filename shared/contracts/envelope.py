"""The event envelope every JetStream event travels in (DESIGN §5)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from pydantic import Field

from shared.contracts.base import Contract, Int


class EventEnvelope(Contract):
    """One event. ``event_id`` is also the ``Nats-Msg-Id`` header, so JetStream drops re-sends."""

    event_id: uuid.UUID = Field(
        description="Unique id; the JetStream de-duplication key.",
        examples=["0b8e2c4e-3f57-4c8e-a1a3-6d2f1b4c9e10"],
    )
    type: str = Field(description="Event type, `<context>.<event>`.", examples=["ledger.allocation_committed"])
    version: Int = Field(default=1, description="Version of this event type's payload.", examples=[1])
    occurred_at: datetime = Field(description="When the state change happened (UTC).")
    source: str = Field(description="Service that produced it.", examples=["capacity-ledger"])
    correlation_id: str | None = Field(
        default=None, description="Id shared by everything caused by one outside request.", examples=["req-42"]
    )
    causation_id: str | None = Field(
        default=None, description="Id of the message that directly caused this event.", examples=[None]
    )
    tenant: str | None = Field(default=None, description="Tenant concerned, if any.", examples=["acme"])
    payload: dict[str, Any] = Field(description="The event's own fields; see the AsyncAPI document.")
    traceparent: str | None = Field(
        default=None,
        max_length=128,  # 55 characters in version 00
        description=(
            "W3C trace context of the work that emitted the event (also sent as the `traceparent` header): "
            "its consumers continue that trace."
        ),
        examples=["00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"],
    )


def new_event(
    *,
    type: str,
    source: str,
    payload: dict[str, Any],
    occurred_at: datetime,
    event_id: uuid.UUID | None = None,
    correlation_id: str | None = None,
    causation_id: str | None = None,
    tenant: str | None = None,
    traceparent: str | None = None,
) -> EventEnvelope:
    """Build an envelope; the id is random unless given (time is always handed in)."""
    return EventEnvelope(
        event_id=event_id or uuid.uuid4(),
        type=type,
        occurred_at=occurred_at,
        source=source,
        correlation_id=correlation_id,
        causation_id=causation_id,
        tenant=tenant,
        payload=payload,
        traceparent=traceparent,
    )
