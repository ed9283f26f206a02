"""The whole state of a reservation as every RESERVATION event carries it (``ReservationState``), with its
borrowers, backoff and preemptions; ``shared.contracts.reservation`` re-exports every name here."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import Field

from shared.contracts.base import Contract, Int
from shared.domain.reservations.model import Policy

PolicyName = Policy  # the domain's definition, under the contracts' name
MIN_SPOT_EVICTION_S = 5
MAX_SPOT_EVICTION_S = 30
"""The brief: a spot reservation's borrower yields within 5-30 s."""


class BorrowView(Contract):
    allocation_id: str = Field(description="The borrower's allocation.", examples=["al-..."])
    tenant: str = Field(description="The borrower.", examples=["globex"])
    accelerators: list[str] = Field(description="Of the reservation's, those it holds.")
    bytes: dict[str, Int] = Field(default_factory=dict, description="HBM bytes it holds per accelerator.")
    lent_at: datetime = Field(description="When it landed (reclaim takes the latest first).")


class BackoffView(Contract):
    accelerator: str = Field(description="Accelerator.", examples=["dgx-h100-01/gpu0"])
    until: datetime = Field(description="Not lent again before this.")
    strikes: Int = Field(description="Reclaims in a row (each doubles the wait).", examples=[1])
    last: datetime = Field(description="The last reclaim.")


class PreemptionView(Contract):
    allocation_id: str = Field(description="The borrower's allocation.", examples=["al-..."])
    tenant: str = Field(description="The borrower.", examples=["globex"])
    reservation_id: str = Field(description="Reservation.", examples=["res-1"])
    deadline_at: datetime = Field(description="The ledger frees the allocation then at the latest.")
    issued_at: datetime = Field(description="When the owner asked.")
    done: bool = Field(default=False, description="The ledger has acknowledged it.")
    request_id: str | None = Field(default=None, description="The owner's placement it makes room for.")


class ReservationState(Contract):
    """A reservation's whole state, as every RESERVATION event carries it."""

    reservation_id: str = Field(description="Reservation id.", examples=["res-1"])
    tenant: str = Field(description="Owner.", examples=["acme"])
    policy: PolicyName = Field(description="Policy.", examples=["soft"])
    sku: str | None = Field(default=None, description="SKU (when all its accelerators share one).")
    region: str | None = Field(default=None, description="Region (when all share one).")
    accelerators: list[str] = Field(description="Reserved accelerators.")
    spot_eviction_s: Int = Field(default=MAX_SPOT_EVICTION_S, description="Spot: borrower's notice.")
    created_at: datetime = Field(description="Created.")
    state: Literal["active", "cancelled"] = Field(default="active", description="State.")
    offered: list[str] = Field(default_factory=list, description="Accelerators open to borrowers now.")
    borrowers: list[BorrowView] = Field(default_factory=list, description="Borrowers on it, oldest first.")
    backoff: list[BackoffView] = Field(default_factory=list, description="Accelerators not lent again yet.")
    preemptions: list[PreemptionView] = Field(default_factory=list, description="Preemptions not yet done.")
    version: Int = Field(default=1, description="Bumped by every change.")
