"""Reservation contracts (`hetsched.reservation.*`) and the events of the RESERVATION stream.

Every RESERVATION event carries the reservation's whole state after the change (``reservation``), so a
reader rebuilds every reservation by folding the stream from its first sequence
(``shared.domain.reservations.ReservationBook``); the other fields say what changed.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import Field, StringConstraints, model_validator

from shared.contracts.base import ID_MAX, NAME_MAX, Contract, ErrorBody, Float, Int, Request
from shared.contracts.reservation_state import (
    MAX_SPOT_EVICTION_S,
    MIN_SPOT_EVICTION_S,
    BackoffView,
    BorrowView,
    PolicyName,
    PreemptionView,
    ReservationState,
)

__all__ = [  # the state's models, defined in reservation_state, are this module's names too
    "MAX_SPOT_EVICTION_S",
    "MIN_SPOT_EVICTION_S",
    "AccId",
    "BackoffView",
    "BorrowView",
    "PolicyName",
    "PreemptionView",
    "ReservationCancelReply",
    "ReservationCancelRequest",
    "ReservationCreateReply",
    "ReservationCreateRequest",
    "ReservationEvent",
    "ReservationEventName",
    "ReservationReclaimReply",
    "ReservationReclaimRequest",
    "ReservationReportReply",
    "ReservationReportRequest",
    "ReservationState",
    "ReservationStatusReply",
    "ReservationStatusRequest",
    "ReservationStatusView",
]


class ReservationEventName(StrEnum):
    """Event names of the RESERVATION stream (`<prefix>.events.reservation.<name>`)."""

    CREATED = "created"
    CANCELLED = "cancelled"
    OFFERED = "offered"  # the accelerators open to borrowers changed
    LENT = "lent"  # a borrower's allocation landed on the reservation's accelerators
    RECLAIMED = "reclaimed"  # a borrower's allocation left them (preempted, released or expired)
    PREEMPTED = "preempted"  # a borrower is told to leave by `deadline_at`
    # the whole state again, unchanged (its version too), so a fold from the stream's first sequence finds every
    # live reservation inside the stream's max age (docs/RETENTION.md)
    RESTATED = "restated"


AccId = Annotated[str, StringConstraints(min_length=1, max_length=ID_MAX)]


class ReservationCreateRequest(Request):
    request_id: str | None = Field(
        default=None,
        max_length=ID_MAX,
        description="Idempotency key: the same id creates once and answers the same reservation.",
        examples=["res-req-1"],
    )
    tenant: str = Field(min_length=1, max_length=NAME_MAX, description="Tenant.", examples=["acme"])
    policy: PolicyName = Field(description="Reservation policy.", examples=["hard"])
    accelerators: list[AccId] | None = Field(
        default=None, max_length=4096, description="Explicit accelerators.", examples=[None]
    )
    count: Int | None = Field(default=None, gt=0, le=100_000, description="How many accelerators.", examples=[8])
    sku: str | None = Field(
        default=None, max_length=NAME_MAX, description="SKU, with count.", examples=["H100-SXM-80GB"]
    )
    region: str | None = Field(
        default=None, max_length=NAME_MAX, description="Region, with count.", examples=["us-west-1"]
    )
    spot_eviction_s: Int = Field(
        default=MAX_SPOT_EVICTION_S,
        ge=MIN_SPOT_EVICTION_S,
        le=MAX_SPOT_EVICTION_S,
        description="Spot only: how long a borrower has to leave once the owner wants its capacity back.",
        examples=[30],
    )

    @model_validator(mode="after")
    def _either_list_or_count(self) -> ReservationCreateRequest:
        if self.accelerators and self.count is not None:
            raise ValueError("give `accelerators`, or `count` + `sku` + `region`, not both")
        if not self.accelerators and (self.count is None or not self.sku or not self.region):
            raise ValueError("give `accelerators`, or `count` + `sku` + `region`")
        if self.accelerators and len(set(self.accelerators)) != len(self.accelerators):
            raise ValueError("`accelerators` names an accelerator twice")
        return self


class ReservationCreateReply(Contract):
    # "rejected": deprecated, accepted for one release; refusals come as `Rejected` (docs/API.md, "Refusals").
    status: Literal["created", "rejected"] = Field(description="`created` or `rejected`.", examples=["created"])
    reservation_id: str | None = Field(default=None, description="Reservation id.", examples=["res-1"])
    accelerators: list[str] = Field(default_factory=list, description="The accelerators reserved.")
    duplicate: bool = Field(default=False, description="True when this request id had created it before.")
    error: ErrorBody | None = Field(default=None, description="Null, or why.")


class ReservationCancelRequest(Request):
    reservation_id: str = Field(min_length=1, max_length=ID_MAX, description="Reservation id.", examples=["res-1"])
    tenant: str = Field(min_length=1, max_length=NAME_MAX, description="Tenant.", examples=["acme"])


class ReservationCancelReply(Contract):
    # "rejected": deprecated, accepted for one release; refusals come as `Rejected` (docs/API.md, "Refusals").
    status: Literal["cancelled", "rejected"] = Field(description="Outcome.", examples=["cancelled"])
    reservation_id: str | None = Field(default=None, description="Reservation id.", examples=["res-1"])
    already: bool = Field(default=False, description="It had been cancelled before.")
    error: ErrorBody | None = Field(default=None, description="Null, or why.")


class ReservationStatusRequest(Request):
    tenant: str = Field(min_length=1, max_length=NAME_MAX, description="Tenant.", examples=["acme"])
    reservation_id: str | None = Field(
        default=None, max_length=ID_MAX, description="Only this one (it must be the tenant's).", examples=[None]
    )


class ReservationEvent(Contract):
    """Payload of every RESERVATION event."""

    reservation: ReservationState = Field(description="The reservation after the change.")
    accelerators: list[str] = Field(default_factory=list, description="What the change was about.")
    allocation_id: str | None = Field(default=None, description="lent / reclaimed / preempted: the borrower's.")
    tenant: str | None = Field(default=None, description="lent / reclaimed / preempted: the borrower.")
    reservation_id: str | None = Field(default=None, description="Reservation id (as in `reservation`).")
    deadline_at: datetime | None = Field(default=None, description="preempted: leave by then.")
    reason: str | None = Field(default=None, description="Why (e.g. `owner_demand`, `released`, `filled`).")


class ReservationStatusView(Contract):
    reservation_id: str = Field(description="Reservation id.", examples=["res-1"])
    tenant: str = Field(description="Owner.", examples=["acme"])
    policy: PolicyName = Field(description="Policy.", examples=["soft"])
    sku: str | None = Field(default=None, description="SKU.")
    region: str | None = Field(default=None, description="Region.")
    accelerators: list[str] = Field(description="Reserved accelerators.")
    owner_used: Int = Field(description="Accelerators the owner uses.", examples=[60])
    lent: Int = Field(description="Accelerators borrowers use.", examples=[30])
    idle: Int = Field(description="Accelerators nobody uses.", examples=[10])
    offered: Int = Field(default=0, description="Accelerators open to borrowers now.", examples=[10])
    fill_rate: Float = Field(description="(owner_used + lent) / reserved.", examples=[0.9])
    idle_cost_usd_per_hour: Float = Field(description="What the idle ones cost per hour.", examples=[32.0])
    borrowers: list[BorrowView] = Field(default_factory=list, description="Who borrows, oldest first.")
    preemptions: list[PreemptionView] = Field(default_factory=list, description="Preemptions in progress.")


class ReservationStatusReply(Contract):
    status: Literal["ok"] = Field(default="ok", description="`ok`.", examples=["ok"])
    reservations: list[ReservationStatusView] = Field(default_factory=list, description="With fill rate and lent.")
    fill_rate: Float | None = Field(default=None, description="The tenant's, over all its reservations.")
    idle_cost_usd_per_hour: Float = Field(default=0.0, description="The tenant's idle reserved capacity, per hour.")


class ReservationReportRequest(Request):
    pass


class ReservationReportReply(Contract):
    status: Literal["ok"] = Field(default="ok", description="`ok`.", examples=["ok"])
    fill_rate: Float | None = Field(default=None, description="Overall (None: nothing reserved).", examples=[0.9])
    by_tenant: dict[str, Float] = Field(default_factory=dict, description="Fill rate per tenant.")
    by_cluster: dict[str, Float] = Field(default_factory=dict, description="Fill rate per `<region>/<cluster>`.")
    reserved: Int = Field(default=0, description="Accelerators reserved.", examples=[100])
    owner_used: Int = Field(default=0, description="Used by their owners.", examples=[60])
    lent: Int = Field(default=0, description="Used by borrowers.", examples=[30])
    idle_cost_usd_per_hour: Float = Field(default=0.0, description="Idle reserved capacity, per hour.")


class ReservationReclaimRequest(Request):
    """Placement, for an owner whose placement needs capacity its reservations lent: preempt these
    borrowers' allocations (internal: only placement calls it)."""

    request_id: str = Field(min_length=1, max_length=ID_MAX, description="The owner's placement request id.")
    tenant: str = Field(min_length=1, max_length=NAME_MAX, description="The owner.", examples=["acme"])
    allocation_ids: list[AccId] = Field(min_length=1, max_length=4096, description="Borrowers' allocations.")


class ReservationReclaimReply(Contract):
    # "rejected": deprecated, accepted for one release; refusals come as `Rejected` (docs/API.md, "Refusals").
    status: Literal["preempted", "rejected"] = Field(description="Outcome.", examples=["preempted"])
    preemptions: list[PreemptionView] = Field(default_factory=list, description="One per allocation.")
    error: ErrorBody | None = Field(default=None, description="Null, or why.")
