"""Alembic environment: async runner, bound to SQLModel.metadata, one schema per service."""

from __future__ import annotations

import asyncio
import os
from logging.config import fileConfig
from typing import Any

from alembic import context
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import create_async_engine
from sqlmodel import SQLModel

from migrations.metadata import register_all_tables
from shared.infra.db import SCHEMAS, async_url, connect_args, database_tls
from shared.infra.settings import load_settings

register_all_tables()
config = context.config
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = SQLModel.metadata


def _url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("url") or config.attributes.get("url")
    url = url or os.environ.get("HETSCHED_DATABASE_URL") or config.get_main_option("sqlalchemy.url")
    if not url:
        raise RuntimeError("set HETSCHED_DATABASE_URL (or pass -x url=...) to run migrations")
    return async_url(url)


def _include_name(name: str | None, type_: str, _parent: Any) -> bool:
    # Only our schemas: never diff or drop what other applications keep in the same database.
    if type_ == "schema":
        return name in SCHEMAS
    return True


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        compare_type=True,
        compare_server_default=True,
        include_schemas=True,
        include_name=_include_name,
    )


def _run_sync(connection: Connection) -> None:
    _configure(connection)
    with context.begin_transaction():
        context.run_migrations()


def _connect_args() -> dict[str, Any]:
    # From shared.infra.migrate; the alembic CLI reads HETSCHED_DATABASE_TLS_CA_FILE (verify-full) itself.
    given: dict[str, Any] | None = config.attributes.get("connect_args")
    if given is not None:
        return given
    return connect_args(application_name="hetsched-migrate", tls=database_tls(load_settings()))


async def _run_async() -> None:
    engine = create_async_engine(_url(), connect_args=_connect_args())
    async with engine.connect() as connection:
        await connection.run_sync(_run_sync)
    await engine.dispose()


if context.is_offline_mode():
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, include_schemas=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    asyncio.run(_run_async())
