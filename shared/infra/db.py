"""Async database engine and sessions (SQLAlchemy 2 / SQLModel over asyncpg)."""

from __future__ import annotations

from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

# One schema per service (DESIGN §6); only the owner writes its schema.
SCHEMAS = ("topology", "ledger", "placement", "reservation", "routing", "rebalance")


def async_url(url: str) -> str:
    """The asyncpg form of a Postgres URL (``postgresql://`` and ``postgres://`` accepted)."""
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    parsed = make_url(url)
    if parsed.drivername in ("postgresql", "postgresql+psycopg2", "postgresql+psycopg"):
        parsed = parsed.set(drivername="postgresql+asyncpg")
    return parsed.render_as_string(hide_password=False)


def plain_url(url: str) -> str:
    """The driver-less form (``postgresql://``), for asyncpg.connect and other tools."""
    parsed = make_url(async_url(url)).set(drivername="postgresql")
    return parsed.render_as_string(hide_password=False)


def make_engine(url: str, *, pool_size: int = 10) -> AsyncEngine:
    """An engine without pre-ping (it costs a round trip per checkout): a connection broken by a Postgres
    restart is invalidated on first use, and writers retry their transaction on a fresh one."""
    return create_async_engine(async_url(url), pool_size=pool_size, max_overflow=pool_size, pool_pre_ping=False)


def make_sessions(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)
