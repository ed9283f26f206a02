"""Tables of the reservation-filler service: everything it owns lives in schema `reservation`.

- ``reservations``: each reservation's whole state (the ``ReservationState`` its events carry), with the
  columns the filler looks it up by;
- ``holds``: one row per reserved accelerator (its primary key is what keeps two reservations off one
  accelerator, whatever races);
- ``inventory``: the GPUs the topology announced (what a ``count`` + ``sku`` + ``region`` reservation is
  chosen from and checked against);
- ``uses``: the live allocations the ledger announced, with their tenant and bytes per accelerator (who
  uses a reserved accelerator: the owner, or a borrower).
Besides its outbox and inbox.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Boolean, Column, DateTime, Index, Text, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlmodel import Field, SQLModel

SCHEMA = "reservation"


class ReservationRow(SQLModel, table=True):
    __tablename__ = "reservations"
    __table_args__ = (
        Index(
            "ux_reservation_reservations_request",
            "tenant",
            "request_id",
            unique=True,
            postgresql_where=text("request_id IS NOT NULL"),
        ),
        {"schema": SCHEMA},
    )

    reservation_id: str = Field(sa_column=Column(Text, primary_key=True))
    tenant: str = Field(sa_column=Column(Text, nullable=False, index=True))
    request_id: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    state: str = Field(sa_column=Column(Text, nullable=False))  # active | cancelled
    version: int = Field(sa_column=Column(BigInteger, nullable=False))
    body: dict[str, Any] = Field(sa_column=Column(JSONB, nullable=False))  # ReservationState
    updated_at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))


class HoldRow(SQLModel, table=True):
    __tablename__ = "holds"
    __table_args__ = {"schema": SCHEMA}

    accelerator: str = Field(sa_column=Column(Text, primary_key=True))
    reservation_id: str = Field(sa_column=Column(Text, nullable=False, index=True))


class InventoryRow(SQLModel, table=True):
    __tablename__ = "inventory"
    __table_args__ = {"schema": SCHEMA}

    accelerator: str = Field(sa_column=Column(Text, primary_key=True))
    node: str = Field(sa_column=Column(Text, nullable=False, index=True))
    sku: str = Field(sa_column=Column(Text, nullable=False))
    region: str = Field(sa_column=Column(Text, nullable=False))
    cluster: str = Field(sa_column=Column(Text, nullable=False))


class UseRow(SQLModel, table=True):
    __tablename__ = "uses"
    __table_args__ = (
        Index("ix_reservation_uses_accelerators", "bytes", postgresql_using="gin"),
        {"schema": SCHEMA},
    )

    allocation_id: str = Field(sa_column=Column(Text, primary_key=True))
    tenant: str = Field(sa_column=Column(Text, nullable=False))
    preemptible: bool = Field(sa_column=Column(Boolean, nullable=False))
    bytes: dict[str, Any] = Field(sa_column=Column(JSONB, nullable=False))  # accelerator -> bytes
    since: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))
