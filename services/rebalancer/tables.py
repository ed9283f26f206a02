"""Tables of the rebalancer service: everything it owns lives in schema `rebalance`.

- ``replicas``: each placed replica as PLACEMENT announced it (the request it was placed with, where);
- ``allocations``: live ledger allocations (bytes per accelerator, read by the drift check);
- ``nodes`` / ``pods``: the fleet as TOPOLOGY announced it (GPUs, NVLink cliques; TPU pod shapes);
- ``plans``: every plan with its steps (``PlanView``), resumed after a restart;
- ``actions``: what the rebalancer did, newest last (``rebalance.status`` shows the last ones);
- ``throttles``: nodes whose cold starts it has throttled (ended when it restarts: its windows restart).
Besides its outbox and inbox.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Column, DateTime, Identity, Index, Text
from sqlalchemy.dialects.postgresql import JSONB
from sqlmodel import Field, SQLModel

SCHEMA = "rebalance"


class ReplicaRow(SQLModel, table=True):
    __tablename__ = "replicas"
    __table_args__ = {"schema": SCHEMA}

    allocation_id: str = Field(sa_column=Column(Text, primary_key=True))
    tenant: str = Field(sa_column=Column(Text, nullable=False))
    body: dict[str, Any] = Field(sa_column=Column(JSONB, nullable=False))  # PlacementEvent


class AllocationRow(SQLModel, table=True):
    __tablename__ = "allocations"
    __table_args__ = (Index("ix_rebalance_allocations_parent_id", "parent_id"), {"schema": SCHEMA})

    allocation_id: str = Field(sa_column=Column(Text, primary_key=True))
    kind: str = Field(sa_column=Column(Text, nullable=False))
    parent_id: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    bytes: dict[str, Any] = Field(sa_column=Column(JSONB, nullable=False))  # accelerator -> bytes


class NodeRow(SQLModel, table=True):
    __tablename__ = "nodes"
    __table_args__ = {"schema": SCHEMA}

    name: str = Field(sa_column=Column(Text, primary_key=True))
    body: dict[str, Any] = Field(sa_column=Column(JSONB, nullable=False))  # NodeProfileEvent


class PodRow(SQLModel, table=True):
    __tablename__ = "pods"
    __table_args__ = {"schema": SCHEMA}

    name: str = Field(sa_column=Column(Text, primary_key=True))
    body: dict[str, Any] = Field(sa_column=Column(JSONB, nullable=False))  # TpuPodEvent


class PlanRow(SQLModel, table=True):
    __tablename__ = "plans"
    __table_args__ = (Index("ix_rebalance_plans_state", "state"), {"schema": SCHEMA})

    plan_id: str = Field(sa_column=Column(Text, primary_key=True))
    state: str = Field(sa_column=Column(Text, nullable=False))
    body: dict[str, Any] = Field(sa_column=Column(JSONB, nullable=False))  # PlanView
    created_at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))
    updated_at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))


class ActionRow(SQLModel, table=True):
    __tablename__ = "actions"
    __table_args__ = {"schema": SCHEMA}

    id: int | None = Field(default=None, sa_column=Column(BigInteger, Identity(), primary_key=True))
    at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))
    plan_id: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    what: str = Field(sa_column=Column(Text, nullable=False))


class ThrottleRow(SQLModel, table=True):
    __tablename__ = "throttles"
    __table_args__ = {"schema": SCHEMA}

    node: str = Field(sa_column=Column(Text, primary_key=True))
    since: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))
