"""Events of the PLACEMENT stream: every decision with its explanation."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field

from shared.contracts.base import Contract, Float, Int
from shared.contracts.placement import PlaceReply, PlaceRequest


class PlacementEventName(StrEnum):
    """Event names of the PLACEMENT stream (subject `<prefix>.events.placement.<name>`)."""

    PLACEMENT_DECIDED = "placement_decided"
    PLACEMENT_REJECTED = "placement_rejected"
    PLACEMENT_RELEASED = "placement_released"


PLACEMENT_DECIDED = PlacementEventName.PLACEMENT_DECIDED
PLACEMENT_REJECTED = PlacementEventName.PLACEMENT_REJECTED
PLACEMENT_RELEASED = PlacementEventName.PLACEMENT_RELEASED


class PlacementEvent(Contract):
    """Payload of `placement_decided` / `placement_rejected`: the reply the caller got."""

    request_id: str = Field(description="The request.", examples=["req-42"])
    tenant: str = Field(description="Tenant.", examples=["acme"])
    model: str = Field(description="Model.", examples=["llama3-70b"])
    reply: PlaceReply = Field(description="The `placement.place` reply, explanation included.")
    decision_ms: Float = Field(description="Time the decision took.", examples=[0.4])
    attempts: Int = Field(default=1, description="Ledger commits tried (conflicts retry).", examples=[1])
    request: PlaceRequest | None = Field(
        default=None, description="What was asked (the rebalancer asks it again, with a new id, to move it)."
    )


class PlacementReleasedEvent(Contract):
    """Payload of `placement_released`: a replica placement ended (released by its tenant, or its lease
    expired in the ledger)."""

    allocation_id: str = Field(description="Allocation.", examples=["al-..."])
    tenant: str = Field(description="Tenant.", examples=["acme"])
    reason: str = Field(default="released", description="`released` or `expired`.", examples=["released"])
