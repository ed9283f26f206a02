"""The gateway's events (`<prefix>.events.gateway.<name>`): what billing consumes.

The gateway speaks OpenAI-compatible HTTP to applications (docs/GATEWAY.md); on NATS it is a client of
`route.select` and `placement.admit`, and it publishes `usage` events: per tenant, the requests it proxied
since the last one, each with the token counts the engine answered.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Literal

from pydantic import Field

from shared.contracts.base import Contract, Float, Int


class GatewayEventName(StrEnum):
    """Event names of the GATEWAY stream."""

    USAGE = "usage"


USAGE = GatewayEventName.USAGE

UsageOutcome = Literal["completed", "failed", "cancelled"]


class UsageRecord(Contract):
    """One request the gateway proxied to an engine, with the engine's token counts."""

    request_id: str = Field(description="The gateway's request id (`x-request-id` of the reply).", examples=["gw-1"])
    tenant: str = Field(description="The API key's tenant.", examples=["acme"])
    key_id: str = Field(description="The API key that sent it.", examples=["key-0a1b2c3d4e5f"])
    model: str = Field(description="The model or model group the client asked for.", examples=["chat-long"])
    served_model: str | None = Field(
        default=None, description="The catalog model that answered.", examples=["mamba2-2.7b"]
    )
    replica_id: str | None = Field(default=None, description="The replica that answered.", examples=["al-7"])
    node: str | None = Field(default=None, description="Its node.", examples=["dgx-h100-01"])
    region: str | None = Field(default=None, description="Its region.", examples=["us-east-1"])
    sku: str | None = Field(default=None, description="Its accelerators' SKU.", examples=["H100-SXM-80GB"])
    engine: str | None = Field(default=None, description="Its engine kind.", examples=["transformer"])
    endpoint: Literal["chat.completions", "completions"] = Field(
        description="The API called.", examples=["chat.completions"]
    )
    stream: bool = Field(description="Whether the reply was streamed.", examples=[True])
    outcome: UsageOutcome = Field(
        description="`completed`; `failed` (the engine failed after its first token, or every replica failed); "
        "`cancelled` (the client went away).",
        examples=["completed"],
    )
    prompt_tokens: Int = Field(ge=0, description="Prompt tokens, as the engine counted them.", examples=[812])
    completion_tokens: Int = Field(ge=0, description="Completion tokens, as the engine counted them.", examples=[128])
    failovers: Int = Field(default=0, ge=0, description="Replicas that failed this request before one answered.")
    ttft_ms: Float | None = Field(default=None, description="Time to first token at the gateway.", examples=[84.0])
    e2e_ms: Float = Field(description="From the request's arrival to its last byte.", examples=[2210.0])
    started_at: datetime = Field(description="When the request arrived (UTC).")


MAX_USAGE_RECORDS = 500
"""Requests in one `usage` event at most (a tenant with more in one interval gets several events)."""


class UsageEvent(Contract):
    """Payload of `usage`: a tenant's requests the gateway answered in one flush interval, and their sums."""

    tenant: str = Field(description="The tenant all its requests belong to.", examples=["acme"])
    requests: list[UsageRecord] = Field(
        max_length=MAX_USAGE_RECORDS, description="The requests, in the order they arrived."
    )
    prompt_tokens: Int = Field(ge=0, description="Their prompt tokens, summed.", examples=[8120])
    completion_tokens: Int = Field(ge=0, description="Their completion tokens, summed.", examples=[1280])
