"""Schema `ledger`: accelerators with usable/reserved HBM, allocations, shares, an append-only journal.

The invariant lives in the database (migration 0003): a trigger on `shares` keeps
`accelerators.reserved` equal to the sum of active counted shares and refuses any change that would
push it over `hbm_usable` (or onto an unavailable accelerator); `journal` refuses UPDATE and DELETE.
Migration 0010 adds exclusivity: another trigger on `shares` refuses a replica's share on an
accelerator that a replica it may not sit with holds (an exclusive one, or any when it is exclusive).
Migration 0015 makes `hbm_usable` the database's: a trigger on `accelerators` sets it from `hbm_total` and
`ceiling` (never below `reserved`), whatever a statement wrote.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlmodel import Field, SQLModel

SCHEMA = "ledger"


class LedgerAccelerator(SQLModel, table=True):
    __tablename__ = "accelerators"
    __table_args__ = (
        CheckConstraint("reserved >= 0", name="reserved_not_negative"),
        CheckConstraint("ceiling > 0 AND ceiling <= 1", name="accelerators_ceiling"),
        CheckConstraint("hbm_total >= 0", name="accelerators_hbm_total"),
        {"schema": SCHEMA},
    )

    id: str = Field(sa_column=Column(Text, primary_key=True))
    node: str = Field(sa_column=Column(Text, nullable=False, index=True))
    sku: str = Field(sa_column=Column(Text, nullable=False))
    hbm_total: int = Field(sa_column=Column(BigInteger, nullable=False))
    ceiling: float = Field(sa_column=Column(Float, nullable=False))
    # Written by the `capacity_apply` trigger alone (migration 0015): floor(hbm_total x ceiling), never below
    # `reserved`; the ledger role may not write it.
    hbm_usable: int = Field(sa_column=Column(BigInteger, nullable=False))
    reserved: int = Field(sa_column=Column(BigInteger, nullable=False, server_default=text("0")))
    available: bool = Field(sa_column=Column(Boolean, nullable=False, server_default=text("true")))
    updated_at: datetime = Field(
        sa_column=Column(DateTime(timezone=True), nullable=False, server_default=text("now()"))
    )
    cluster: str | None = Field(default=None, sa_column=Column(Text, nullable=True))  # from topology events


class Allocation(SQLModel, table=True):
    __tablename__ = "allocations"
    __table_args__ = (
        UniqueConstraint("tenant", "request_id", name="allocations_tenant_request_key"),
        CheckConstraint("kind IN ('replica', 'request')", name="allocations_kind"),
        CheckConstraint("state IN ('active', 'released', 'expired')", name="allocations_state"),
        CheckConstraint("sharing IN ('exclusive', 'shared')", name="allocations_sharing"),
        CheckConstraint("cross_domain_bytes_per_s >= 0", name="allocations_cross_domain"),
        Index("ix_ledger_allocations_lease", "lease_expires_at", postgresql_where=text("state = 'active'")),
        Index(
            "ix_ledger_allocations_cross_domain",
            "cluster",
            postgresql_where=text("state = 'active' AND cross_domain_bytes_per_s > 0"),
        ),
        {"schema": SCHEMA},
    )

    id: str = Field(sa_column=Column(Text, primary_key=True))
    request_id: str = Field(sa_column=Column(Text, nullable=False))
    tenant: str = Field(sa_column=Column(Text, nullable=False))
    kind: str = Field(sa_column=Column(Text, nullable=False))
    parent_id: str | None = Field(
        default=None, sa_column=Column(Text, ForeignKey(f"{SCHEMA}.allocations.id"), nullable=True, index=True)
    )
    state: str = Field(sa_column=Column(Text, nullable=False))
    preemptible: bool = Field(sa_column=Column(Boolean, nullable=False))
    priority: int = Field(sa_column=Column(Integer, nullable=False))
    lease_expires_at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))
    flagged: bool = Field(sa_column=Column(Boolean, nullable=False, server_default=text("false")))
    created_at: datetime = Field(
        sa_column=Column(DateTime(timezone=True), nullable=False, server_default=text("now()"))
    )
    ended_at: datetime | None = Field(default=None, sa_column=Column(DateTime(timezone=True), nullable=True))
    sharing: str = Field(sa_column=Column(Text, nullable=False, server_default=text("'exclusive'")))
    cross_domain_bytes_per_s: int = Field(sa_column=Column(BigInteger, nullable=False, server_default=text("0")))
    cluster: str | None = Field(default=None, sa_column=Column(Text, nullable=True))  # of its accelerators
    # The caller's record of what it decided (placement: its request and reply), returned by a repeat.
    record: dict[str, Any] | None = Field(default=None, sa_column=Column(JSONB, nullable=True))
    # The caller's hash of its request: a repeat with another hash is refused.
    body_hash: str | None = Field(default=None, sa_column=Column(Text, nullable=True))


class Share(SQLModel, table=True):
    __tablename__ = "shares"
    __table_args__ = (
        CheckConstraint(
            "weights >= 0 AND kv >= 0 AND activation >= 0 AND workspace >= 0 "
            "AND total = weights + kv + activation + workspace",
            name="shares_bytes",
        ),
        Index("ix_ledger_shares_active", "accelerator_id", postgresql_where=text("active")),
        {"schema": SCHEMA},
    )

    allocation_id: str = Field(
        sa_column=Column(Text, ForeignKey(f"{SCHEMA}.allocations.id", ondelete="CASCADE"), primary_key=True)
    )
    accelerator_id: str = Field(sa_column=Column(Text, ForeignKey(f"{SCHEMA}.accelerators.id"), primary_key=True))
    weights: int = Field(sa_column=Column(BigInteger, nullable=False))
    kv: int = Field(sa_column=Column(BigInteger, nullable=False))
    activation: int = Field(sa_column=Column(BigInteger, nullable=False))
    workspace: int = Field(sa_column=Column(BigInteger, nullable=False))
    total: int = Field(sa_column=Column(BigInteger, nullable=False))
    counts: bool = Field(sa_column=Column(Boolean, nullable=False))  # false: inside a replica's KV pool
    active: bool = Field(sa_column=Column(Boolean, nullable=False))


class Journal(SQLModel, table=True):
    __tablename__ = "journal"
    __table_args__ = {"schema": SCHEMA}

    seq: int | None = Field(default=None, sa_column=Column(BigInteger, Identity(always=True), primary_key=True))
    at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False, server_default=text("now()")))
    op: str = Field(sa_column=Column(Text, nullable=False))
    allocation_id: str | None = Field(default=None, sa_column=Column(Text, nullable=True, index=True))
    accelerator_id: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    delta: int = Field(sa_column=Column(BigInteger, nullable=False, server_default=text("0")))
    details: dict[str, Any] = Field(sa_column=Column(JSONB, nullable=False, server_default=text("'{}'::jsonb")))
