"""Routing contracts (`hetsched.route.select`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from shared.contracts.base import NAME_MAX, Contract, ErrorBody, Request
from shared.contracts.placement import Slo


class RouteSelectRequest(Request):
    request_id: str = Field(min_length=1, max_length=NAME_MAX, description="Request id.", examples=["r-1"])
    tenant: str = Field(min_length=1, max_length=NAME_MAX, description="Tenant.", examples=["acme"])
    session_id: str | None = Field(
        default=None, max_length=NAME_MAX, description="Session for affinity.", examples=["s-9"]
    )
    origin_region: str = Field(
        min_length=1, max_length=NAME_MAX, description="Where the request entered.", examples=["us-west-1"]
    )
    model: str = Field(min_length=1, max_length=NAME_MAX, description="Model.", examples=["llama3-70b"])
    input_tokens: int = Field(gt=0, description="Input tokens.", examples=[1000])
    output_tokens: int = Field(gt=0, description="Output tokens.", examples=[200])
    slo: Slo | None = Field(default=None, description="Latency objectives.")


class RouteSelectReply(Contract):
    status: str = Field(description="`routed` or `rejected`.", examples=["routed"])
    region: str | None = Field(default=None, description="Chosen region.", examples=["us-east-1"])
    tier: Literal["affinity", "cost", "fallback"] | None = Field(default=None, description="Why that region.")
    rtt_ms: float | None = Field(default=None, description="RTT origin->region.", examples=[62.0])
    admission: dict[str, Any] | None = Field(default=None, description="The admission result.")
    error: ErrorBody | None = Field(default=None, description="Null, or why.")
