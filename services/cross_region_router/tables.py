"""Tables of the cross-region-router service: everything it owns lives in schema `routing` — each tenant's
region and when it last switched (damping), each session's region, each tenant's routed requests per region
and day (affinity), each region's operator state, besides its outbox and inbox."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import BigInteger, Column, DateTime, Integer, PrimaryKeyConstraint, Text, text
from sqlmodel import Field, SQLModel

SCHEMA = "routing"


class TenantRouteRow(SQLModel, table=True):
    __tablename__ = "tenants"
    __table_args__ = {"schema": SCHEMA}

    tenant: str = Field(sa_column=Column(Text, primary_key=True))
    region: str = Field(sa_column=Column(Text, nullable=False))
    switched_at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))


class SessionRouteRow(SQLModel, table=True):
    __tablename__ = "sessions"
    __table_args__ = (PrimaryKeyConstraint("tenant", "session_id", name="sessions_pkey"), {"schema": SCHEMA})

    tenant: str = Field(sa_column=Column(Text, nullable=False))
    session_id: str = Field(sa_column=Column(Text, nullable=False))
    region: str = Field(sa_column=Column(Text, nullable=False))
    updated_at: datetime = Field(
        sa_column=Column(DateTime(timezone=True), nullable=False, server_default=text("now()"), index=True)
    )


class TrafficRow(SQLModel, table=True):
    """Requests routed per tenant, region and day (``floor(epoch seconds / 86400)``)."""

    __tablename__ = "traffic"
    __table_args__ = (PrimaryKeyConstraint("tenant", "region", "day", name="traffic_pkey"), {"schema": SCHEMA})

    tenant: str = Field(sa_column=Column(Text, nullable=False))
    region: str = Field(sa_column=Column(Text, nullable=False))
    day: int = Field(sa_column=Column(Integer, nullable=False))
    requests: int = Field(sa_column=Column(BigInteger, nullable=False))


class RegionStateRow(SQLModel, table=True):
    __tablename__ = "regions"
    __table_args__ = {"schema": SCHEMA}

    region: str = Field(sa_column=Column(Text, primary_key=True))
    state: str = Field(sa_column=Column(Text, nullable=False))  # up | drain | down
    changed_at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))


class ReplicaRow(SQLModel, table=True):
    """A replica placement announced (PLACEMENT `placement_decided`): where requests for its model can go.
    Gone when placement releases it or the ledger ends its allocation."""

    __tablename__ = "replicas"
    __table_args__ = {"schema": SCHEMA}

    allocation_id: str = Field(sa_column=Column(Text, primary_key=True))
    region: str = Field(sa_column=Column(Text, nullable=False))
    model: str = Field(sa_column=Column(Text, nullable=False))
    sku: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
