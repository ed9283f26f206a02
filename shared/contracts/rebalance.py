"""Rebalancer contracts (`hetsched.rebalance.status`)."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from shared.contracts.base import Contract, Request


class RebalanceStatusRequest(Request):
    """Empty: `{}`."""


class RebalanceStatusReply(Contract):
    status: str = Field(default="ok", description="`ok`.", examples=["ok"])
    plans: list[dict[str, Any]] = Field(default_factory=list, description="Migration plans in flight.")
