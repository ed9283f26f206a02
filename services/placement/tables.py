"""Schema `placement`: every decision, so that the same request id answers the same way twice."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Column, DateTime, PrimaryKeyConstraint, Text, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlmodel import Field, SQLModel

SCHEMA = "placement"


class DecisionRow(SQLModel, table=True):
    __tablename__ = "decisions"
    __table_args__ = (PrimaryKeyConstraint("tenant", "request_id", name="decisions_pkey"), {"schema": SCHEMA})

    tenant: str = Field(sa_column=Column(Text, nullable=False))
    request_id: str = Field(sa_column=Column(Text, nullable=False))
    status: str = Field(sa_column=Column(Text, nullable=False))  # placed | released
    allocation_id: str | None = Field(default=None, sa_column=Column(Text, nullable=True, index=True))
    reply: dict[str, Any] = Field(sa_column=Column(JSONB, nullable=False))
    created_at: datetime = Field(
        sa_column=Column(DateTime(timezone=True), nullable=False, server_default=text("now()"))
    )
