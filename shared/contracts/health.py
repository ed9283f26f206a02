"""`hetsched.<service>.health`."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from shared.contracts.base import Contract, Request


class HealthRequest(Request):
    """Empty: `{}`."""


class HealthReply(Contract):
    status: Literal["ok", "degraded"] = Field(description="`ok` when every dependency answers.", examples=["ok"])
    service: str = Field(description="Service name.", examples=["capacity-ledger"])
    version: str = Field(description="hetsched version.", examples=["0.1.0"])
    checks: dict[str, str] = Field(
        default_factory=dict,
        description="Per-dependency state (`ok` or an error).",
        examples=[{"postgres": "ok", "nats": "ok"}],
    )
    metrics_url: str | None = Field(
        default=None, description="Its Prometheus metrics endpoint.", examples=["http://127.0.0.1:9464/metrics"]
    )
    http_url: str | None = Field(
        default=None,
        description="The HTTP front door it serves, for a service that serves one (the gateway's base URL).",
        examples=[None],
    )
