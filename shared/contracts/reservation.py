"""Reservation contracts (`hetsched.reservation.*`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, model_validator

from shared.contracts.base import ID_MAX, NAME_MAX, Contract, ErrorBody, Request


class ReservationCreateRequest(Request):
    tenant: str = Field(min_length=1, max_length=NAME_MAX, description="Tenant.", examples=["acme"])
    policy: Literal["hard", "soft", "spot"] = Field(description="Reservation policy.", examples=["hard"])
    accelerators: list[Annotated[str, StringConstraints(max_length=ID_MAX)]] | None = Field(
        default=None, max_length=4096, description="Explicit accelerators.", examples=[None]
    )
    count: int | None = Field(default=None, gt=0, description="How many accelerators.", examples=[8])
    sku: str | None = Field(
        default=None, max_length=NAME_MAX, description="SKU, with count.", examples=["H100-SXM-80GB"]
    )
    region: str | None = Field(
        default=None, max_length=NAME_MAX, description="Region, with count.", examples=["us-west-1"]
    )

    @model_validator(mode="after")
    def _either_list_or_count(self) -> ReservationCreateRequest:
        if not self.accelerators and self.count is None:
            raise ValueError("give `accelerators` or `count` + `sku` + `region`")
        return self


class ReservationCreateReply(Contract):
    status: str = Field(description="`created` or `rejected`.", examples=["created"])
    reservation_id: str | None = Field(default=None, description="Reservation id.", examples=["res-1"])
    error: ErrorBody | None = Field(default=None, description="Null, or why.")


class ReservationCancelRequest(Request):
    reservation_id: str = Field(min_length=1, max_length=ID_MAX, description="Reservation id.", examples=["res-1"])
    tenant: str = Field(min_length=1, max_length=NAME_MAX, description="Tenant.", examples=["acme"])


class ReservationStatusRequest(Request):
    tenant: str = Field(min_length=1, max_length=NAME_MAX, description="Tenant.", examples=["acme"])


class ReservationStatusReply(Contract):
    status: str = Field(default="ok", description="`ok`.", examples=["ok"])
    reservations: list[dict[str, Any]] = Field(default_factory=list, description="With fill rate and lent.")
