"""Schema `topology`: nodes with their profiles, accelerators, NVLink domains, racks, TPU pods, and the
reserved bytes per accelerator learnt from LEDGER events."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Boolean, Column, DateTime, Float, ForeignKey, Integer, Text, text
from sqlalchemy.dialects.postgresql import JSONB
from sqlmodel import Field, SQLModel

SCHEMA = "topology"


class NodeRow(SQLModel, table=True):
    __tablename__ = "nodes"
    __table_args__ = {"schema": SCHEMA}

    name: str = Field(sa_column=Column(Text, primary_key=True))
    region: str = Field(sa_column=Column(Text, nullable=False, index=True))
    cluster: str = Field(sa_column=Column(Text, nullable=False))
    rack: str = Field(sa_column=Column(Text, nullable=False))
    sku: str = Field(sa_column=Column(Text, nullable=False))
    source: str = Field(sa_column=Column(Text, nullable=False))  # inventory | nvml | nvidia-smi
    kind: str = Field(sa_column=Column(Text, nullable=False))  # NVLink layout of the node
    gpus: int = Field(sa_column=Column(Integer, nullable=False))
    hbm_bytes: int = Field(sa_column=Column(BigInteger, nullable=False))
    fingerprint: str = Field(sa_column=Column(Text, nullable=False))
    profile: dict[str, Any] = Field(sa_column=Column(JSONB, nullable=False))
    state: str = Field(sa_column=Column(Text, nullable=False, server_default=text("'up'")))  # up | lost
    updated_at: datetime = Field(
        sa_column=Column(DateTime(timezone=True), nullable=False, server_default=text("now()"))
    )


class AcceleratorRow(SQLModel, table=True):
    __tablename__ = "accelerators"
    __table_args__ = {"schema": SCHEMA}

    id: str = Field(sa_column=Column(Text, primary_key=True))
    node: str = Field(
        sa_column=Column(Text, ForeignKey(f"{SCHEMA}.nodes.name", ondelete="CASCADE"), nullable=False, index=True)
    )
    index: int = Field(sa_column=Column(Integer, nullable=False))
    sku: str = Field(sa_column=Column(Text, nullable=False))
    hbm_bytes: int = Field(sa_column=Column(BigInteger, nullable=False))
    uuid: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    pci_bus_id: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    numa_node: int | None = Field(default=None, sa_column=Column(Integer, nullable=True))
    domain: str | None = Field(default=None, sa_column=Column(Text, nullable=True))


class DomainRow(SQLModel, table=True):
    __tablename__ = "domains"
    __table_args__ = {"schema": SCHEMA}

    id: str = Field(sa_column=Column(Text, primary_key=True))
    kind: str = Field(sa_column=Column(Text, nullable=False))
    members: list[str] = Field(sa_column=Column(JSONB, nullable=False))
    cliques: list[list[str]] = Field(sa_column=Column(JSONB, nullable=False))


class RackRow(SQLModel, table=True):
    __tablename__ = "racks"
    __table_args__ = {"schema": SCHEMA}

    region: str = Field(sa_column=Column(Text, primary_key=True))
    cluster: str = Field(sa_column=Column(Text, primary_key=True))
    name: str = Field(sa_column=Column(Text, primary_key=True))
    power_kw: float | None = Field(default=None, sa_column=Column(Float, nullable=True))


class TpuPodRow(SQLModel, table=True):
    __tablename__ = "tpu_pods"
    __table_args__ = {"schema": SCHEMA}

    name: str = Field(sa_column=Column(Text, primary_key=True))
    region: str = Field(sa_column=Column(Text, nullable=False))
    cluster: str | None = Field(default=None, sa_column=Column(Text, nullable=True))
    type: str = Field(sa_column=Column(Text, nullable=False))
    shape: list[int] = Field(sa_column=Column(JSONB, nullable=False))


class SourceRow(SQLModel, table=True):
    """What was loaded from where: an unchanged inventory file is not loaded again after a restart."""

    __tablename__ = "sources"
    __table_args__ = {"schema": SCHEMA}

    name: str = Field(sa_column=Column(Text, primary_key=True))
    fingerprint: str = Field(sa_column=Column(Text, nullable=False))
    loaded_at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False, server_default=text("now()")))


class ReservedRow(SQLModel, table=True):
    """Reserved HBM per accelerator as the LEDGER events say (a read model; the ledger owns the truth)."""

    __tablename__ = "reserved"
    __table_args__ = {"schema": SCHEMA}

    accelerator_id: str = Field(sa_column=Column(Text, primary_key=True))
    reserved_bytes: int = Field(sa_column=Column(BigInteger, nullable=False))


class ReservedShareRow(SQLModel, table=True):
    """Each allocation share that moved ``reserved``: a commit and its release (or expiry) apply once each,
    in either order (a release seen first leaves an ended row that the late commit finds)."""

    __tablename__ = "reserved_shares"
    __table_args__ = {"schema": SCHEMA}

    allocation_id: str = Field(sa_column=Column(Text, primary_key=True))
    accelerator_id: str = Field(sa_column=Column(Text, primary_key=True))
    reserved_bytes: int = Field(sa_column=Column(BigInteger, nullable=False))
    ended: bool = Field(sa_column=Column(Boolean, nullable=False))
