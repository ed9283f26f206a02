"""Routing contracts (`hetsched.route.select`, `hetsched.route.region`) and the events of the ROUTING stream."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import Field

from shared.contracts.base import NAME_MAX, Contract, ErrorBody, Float, Int, Request
from shared.contracts.placement import MAX_ADMIT_TOKENS, AdmitReply, EngineHint, Slo


class RoutingEventName(StrEnum):
    """Event names of the ROUTING stream (`<prefix>.events.routing.<name>`)."""

    ROUTE_SWITCHED = "route_switched"
    REGION_STATE_CHANGED = "region_state_changed"


ROUTE_SWITCHED = RoutingEventName.ROUTE_SWITCHED
REGION_STATE_CHANGED = RoutingEventName.REGION_STATE_CHANGED

RoutingEvent = RoutingEventName  # deprecated alias (issue 24): use RoutingEventName (for one release)

RegionStateName = Literal["up", "drain", "down"]


class RouteSelectRequest(Request):
    request_id: str = Field(min_length=1, max_length=NAME_MAX, description="Request id.", examples=["r-1"])
    tenant: str = Field(min_length=1, max_length=NAME_MAX, description="Tenant.", examples=["acme"])
    session_id: str | None = Field(
        default=None, max_length=NAME_MAX, description="Session for affinity.", examples=["s-9"]
    )
    origin_region: str = Field(
        min_length=1, max_length=NAME_MAX, description="Where the request entered.", examples=["us-west-1"]
    )
    model: str = Field(
        min_length=1, max_length=NAME_MAX, description="A catalog model or model group.", examples=["llama3-70b"]
    )
    input_tokens: Int = Field(gt=0, le=MAX_ADMIT_TOKENS, description="Input tokens.", examples=[1000])
    output_tokens: Int = Field(gt=0, le=MAX_ADMIT_TOKENS, description="Output tokens.", examples=[200])
    slo: Slo | None = Field(default=None, description="Latency objectives.")
    in_flight: bool = Field(
        default=False,
        description="A message of this session is streaming: its region cannot change.",
        examples=[False],
    )
    admit: bool = Field(default=True, description="Also admit the request in the chosen region.", examples=[True])
    hint: EngineHint = Field(default="auto", description="Engine preference, passed to admission.", examples=["auto"])


class RouteCost(Contract):
    """The cost of the chosen region: normalised terms (0..1 over the candidate regions), their weights and
    the total alpha*rtt + beta*price + gamma*power - delta*affinity (lower is better)."""

    rtt: Float = Field(description="Normalised RTT from the origin.", examples=[0.4])
    price: Float = Field(description="Normalised price per accelerator-hour.", examples=[0.8])
    power: Float = Field(description="Normalised power cost (power x PUE x $/kWh).", examples=[0.7])
    affinity: Float = Field(description="The tenant's affinity to the region (0.1..1, 0: no history).", examples=[1.0])
    total: Float = Field(description="Weighted total.", examples=[0.3])
    weights: dict[str, Float] = Field(
        description="alpha, beta, gamma, delta as `rtt`, `price`, `power`, `affinity`.",
        examples=[{"rtt": 0.4, "price": 0.3, "power": 0.1, "affinity": 0.2}],
    )
    rtt_ms: Float = Field(description="RTT origin -> region.", examples=[62.0])
    price_usd_per_hour: Float = Field(description="Accelerator-hour price there.", examples=[2.9])
    power_usd_per_hour: Float = Field(description="Power cost of one accelerator-hour there.", examples=[0.06])


class RouteSelectReply(Contract):
    # "rejected": deprecated, accepted for one release; refusals come as `Rejected` (docs/API.md, "Refusals").
    status: Literal["routed", "rejected"] = Field(description="`routed` or `rejected`.", examples=["routed"])
    region: str | None = Field(default=None, description="Chosen region.", examples=["us-east-1"])
    tier: Literal["affinity", "cost", "fallback"] | None = Field(default=None, description="Why that region.")
    rtt_ms: Float | None = Field(default=None, description="RTT origin->region.", examples=[62.0])
    cost: RouteCost | None = Field(default=None, description="The cost terms of the chosen region.")
    switched: bool = Field(default=False, description="The tenant's region changed with this request.")
    relaxed_ttft_ms: Float | None = Field(
        default=None, description="Fallback tier: the TTFT SLO admission was asked with.", examples=[None]
    )
    explanation: str | None = Field(default=None, description="Why this region, for a human.")
    admission: AdmitReply | None = Field(default=None, description="The `placement.admit` reply, or null.")
    error: ErrorBody | None = Field(default=None, description="Null, or why.")


class RouteRegionRequest(Request):
    """Operators: drain or down a region (or bring it back up)."""

    region: str = Field(min_length=1, max_length=NAME_MAX, description="Region.", examples=["us-east-1"])
    state: RegionStateName = Field(description="`up`, `drain` or `down`.", examples=["drain"])


class RouteRegionReply(Contract):
    # "rejected": deprecated, accepted for one release; refusals come as `Rejected` (docs/API.md, "Refusals").
    status: Literal["ok", "rejected"] = Field(description="Outcome.", examples=["ok"])
    region: str | None = Field(default=None, description="Region.", examples=["us-east-1"])
    state: RegionStateName | None = Field(default=None, description="Its state now.", examples=["drain"])
    previous: RegionStateName | None = Field(default=None, description="Its state before.", examples=["up"])
    error: ErrorBody | None = Field(default=None, description="Null, or why.")


class RouteSwitchedEvent(Contract):
    """Payload of `route_switched`: a tenant's region changed."""

    tenant: str = Field(description="Tenant.", examples=["acme"])
    request_id: str = Field(description="The request that switched it.", examples=["r-1"])
    session_id: str | None = Field(default=None, description="Its session.", examples=["s-9"])
    from_region: str = Field(description="Region before.", examples=["us-west-1"])
    to_region: str = Field(description="Region now.", examples=["us-east-1"])
    tier: Literal["affinity", "cost", "fallback"] = Field(description="Tier of the new region.", examples=["cost"])
    reason: str = Field(description="Why, for a human.", examples=["us-west-1 is down"])
    cost: RouteCost = Field(description="Cost terms of the new region.")


class RegionStateEvent(Contract):
    """Payload of `region_state_changed`."""

    region: str = Field(description="Region.", examples=["us-east-1"])
    state: RegionStateName = Field(description="State now.", examples=["drain"])
    previous: RegionStateName = Field(description="State before.", examples=["up"])
