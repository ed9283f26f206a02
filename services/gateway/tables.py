"""Tables of the gateway: everything it owns lives in schema `gateway` — its API keys (only each secret's
hash) and the usage it counted per tenant, day, model and key, besides its outbox and inbox."""

from __future__ import annotations

from datetime import date, datetime
from typing import Any

from sqlalchemy import BigInteger, CheckConstraint, Column, Date, DateTime, Integer, PrimaryKeyConstraint, Text, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlmodel import Field, SQLModel

SCHEMA = "gateway"


class ApiKeyRow(SQLModel, table=True):
    """One API key (``shared.domain.gateway.keys``): never deleted; ``revoked_at`` set when revoked."""

    __tablename__ = "api_keys"
    __table_args__ = (
        CheckConstraint("rpm > 0", name="api_keys_rpm"),
        CheckConstraint("tpm > 0", name="api_keys_tpm"),
        {"schema": SCHEMA},
    )

    key_id: str = Field(sa_column=Column(Text, primary_key=True))
    tenant: str = Field(sa_column=Column(Text, nullable=False))
    secret_hash: str = Field(sa_column=Column(Text, nullable=False))  # sha256 hex of the secret
    name: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    priority: int = Field(default=0, sa_column=Column(Integer, nullable=False, server_default=text("0")))
    rpm: int | None = Field(default=None, sa_column=Column(Integer, nullable=True))  # requests/minute; None: unlimited
    tpm: int | None = Field(default=None, sa_column=Column(Integer, nullable=True))  # tokens/minute; None: unlimited
    # Model and model-group names the key may call; None: every one of the catalog.
    models: list[Any] | None = Field(default=None, sa_column=Column(JSONB, nullable=True))
    created_at: datetime | None = Field(
        default=None, sa_column=Column(DateTime(timezone=True), nullable=False, server_default=text("now()"))
    )
    revoked_at: datetime | None = Field(default=None, sa_column=Column(DateTime(timezone=True), nullable=True))


class UsageRow(SQLModel, table=True):
    """Requests and tokens the gateway served per tenant, day (UTC), model (as the client named it) and key."""

    __tablename__ = "usage"
    __table_args__ = (PrimaryKeyConstraint("tenant", "day", "model", "key_id", name="usage_pkey"), {"schema": SCHEMA})

    tenant: str = Field(sa_column=Column(Text, nullable=False))
    day: date = Field(sa_column=Column(Date, nullable=False))
    model: str = Field(sa_column=Column(Text, nullable=False))
    key_id: str = Field(sa_column=Column(Text, nullable=False))
    requests: int = Field(sa_column=Column(BigInteger, nullable=False))
    prompt_tokens: int = Field(sa_column=Column(BigInteger, nullable=False))
    completion_tokens: int = Field(sa_column=Column(BigInteger, nullable=False))
    updated_at: datetime | None = Field(
        default=None, sa_column=Column(DateTime(timezone=True), nullable=False, server_default=text("now()"))
    )
