"""Async database engine and sessions (SQLAlchemy 2 / SQLModel over asyncpg)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine

if TYPE_CHECKING:
    from shared.infra.settings import Settings

# One schema per service (DESIGN §6); only the owner reads or writes its schema.
SCHEMAS = ("topology", "ledger", "placement", "reservation", "routing", "rebalance")
DEFAULT_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/hetsched"


def role_of(schema: str) -> str:
    """The Postgres role a service connects as: rights on its own schema only (migration 0005)."""
    return f"hetsched_{schema}"


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


def service_database_url(settings: Settings, schema: str) -> str:
    """The URL a service connects with: the configured server and database, as the service's own role
    (unless ``HETSCHED_DATABASE_ROLES`` is off), so a read of another service's schema fails loudly."""
    url = settings.database_url or DEFAULT_DATABASE_URL
    if not settings.database_roles:
        return url
    parsed = make_url(url).set(username=role_of(schema))
    password = settings.database_role_password.get_secret_value() if settings.database_role_password else None
    parsed = parsed.set(password=password)
    return parsed.render_as_string(hide_password=False)
