"""Schema `placement`: every intent and decision (so that the same request id answers the same way twice),
the ledger's allocations of placement's, as LEDGER events told them (for the reconciler), and the
requests waiting in the queue for capacity."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Column,
    DateTime,
    Identity,
    Index,
    Integer,
    PrimaryKeyConstraint,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlmodel import Field, SQLModel

SCHEMA = "placement"


class DecisionRow(SQLModel, table=True):
    __tablename__ = "decisions"
    __table_args__ = (
        PrimaryKeyConstraint("tenant", "request_id", name="decisions_pkey"),
        # `placement.replicas` pages through the placed ones in (tenant, request id) order.
        Index("ix_placement_decisions_placed", "tenant", "request_id", postgresql_where=text("status = 'placed'")),
        {"schema": SCHEMA},
    )

    tenant: str = Field(sa_column=Column(Text, nullable=False))
    request_id: str = Field(sa_column=Column(Text, nullable=False))
    # committing | placed | rejected | abandoned | expired | released | queued | timed_out
    # (shared.domain.placement.ownership)
    status: str = Field(sa_column=Column(Text, nullable=False))
    allocation_id: str | None = Field(default=None, sa_column=Column(Text, nullable=True, index=True))
    # placed: the reply; committing: the decision being committed (no allocation id yet)
    reply: dict[str, Any] | None = Field(default=None, sa_column=Column(JSONB, nullable=True))
    created_at: datetime = Field(
        sa_column=Column(DateTime(timezone=True), nullable=False, server_default=text("now()"))
    )
    body_hash: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    # Bumped by each attempt that takes the intent over: a write of an older attempt changes nothing.
    attempt: int = Field(default=0, sa_column=Column(Integer, nullable=False, server_default=text("0")))
    claimed_until: datetime | None = Field(default=None, sa_column=Column(DateTime(timezone=True), nullable=True))
    # The last ledger commit sent (or about to be): what a retry asks the ledger again.
    ledger_commit: dict[str, Any] | None = Field(default=None, sa_column=Column(JSONB, nullable=True))
    updated_at: datetime = Field(
        sa_column=Column(DateTime(timezone=True), nullable=False, server_default=text("now()"))
    )
    # placed: when its lease ends unless renewed (the ledger's answer to the commit, then to each renewal)
    lease_expires_at: datetime | None = Field(default=None, sa_column=Column(DateTime(timezone=True), nullable=True))
    # placed with a short first lease: the lease its caller asked for, until a renew or its engine's first
    # report extends the allocation to it (then null)
    lease_s: int | None = Field(default=None, sa_column=Column(Integer, nullable=True))


class LedgerAllocationRow(SQLModel, table=True):
    """A `replica` allocation the ledger committed for `placement/<request_id>` (from LEDGER events)."""

    __tablename__ = "ledger_allocations"
    __table_args__ = {"schema": SCHEMA}

    allocation_id: str = Field(sa_column=Column(Text, primary_key=True))
    tenant: str = Field(sa_column=Column(Text, nullable=False))
    request_id: str = Field(sa_column=Column(Text, nullable=False, index=True))  # placement's, unprefixed
    state: str = Field(sa_column=Column(Text, nullable=False))  # active | expired | released
    seen_at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))
    ended_at: datetime | None = Field(default=None, sa_column=Column(DateTime(timezone=True), nullable=True))


class QueueRow(SQLModel, table=True):
    """A request waiting for capacity (its decision row is `queued`), served in `seq` order; gone once
    placed, rejected or timed out. It reserves nothing."""

    __tablename__ = "queue"
    __table_args__ = (UniqueConstraint("tenant", "request_id", name="queue_tenant_request_id_key"), {"schema": SCHEMA})

    seq: int | None = Field(default=None, sa_column=Column(BigInteger, Identity(always=True), primary_key=True))
    tenant: str = Field(sa_column=Column(Text, nullable=False))
    request_id: str = Field(sa_column=Column(Text, nullable=False))
    request: dict[str, Any] = Field(sa_column=Column(JSONB, nullable=False))  # the PlaceRequest
    enqueued_at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))
    deadline_at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))
