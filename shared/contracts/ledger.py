"""Ledger contracts (`hetsched.ledger.snapshot`; commit/release/renew come with the ledger issue)."""

from __future__ import annotations

from pydantic import Field

from shared.contracts.base import Contract, Request


class SnapshotRequest(Request):
    """Empty: `{}`."""


class AcceleratorLedgerView(Contract):
    id: str = Field(description="Accelerator id.", examples=["dgx-h100-01/gpu0"])
    node: str = Field(description="Node.", examples=["dgx-h100-01"])
    hbm_usable: int = Field(description="Usable HBM bytes (total x ceiling).", examples=[79_027_398_246])
    hbm_reserved: int = Field(description="Reserved bytes.", examples=[0])
    allocations: list[str] = Field(default_factory=list, description="Allocation ids.", examples=[["a-1"]])


class SnapshotReply(Contract):
    status: str = Field(default="ok", description="`ok`.", examples=["ok"])
    accelerators: list[AcceleratorLedgerView] = Field(default_factory=list, description="Per accelerator.")
