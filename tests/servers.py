"""Real NATS and Postgres for the tests: the ones named by the environment, else the local default
ports, else embedded servers started here. Each run isolates itself with a fresh database and a
unique subject/stream prefix."""

from __future__ import annotations

import asyncio
import os
import socket
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import nats

from hetsched.embedded import EmbeddedNats, EmbeddedPostgres
from shared.infra.db import plain_url


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


async def _nats_has_jetstream(url: str) -> bool:
    try:
        nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0, allow_reconnect=False)
    except Exception:
        return False
    try:
        await nc.jetstream().account_info()
        return True
    except Exception:
        return False
    finally:
        await nc.close()


async def _postgres_ok(url: str) -> bool:
    try:
        conn = await asyncpg.connect(plain_url(url), timeout=3)
    except Exception:
        return False
    await conn.close()
    return True


@dataclass
class RealServers:
    nats_url: str
    admin_url: str  # a Postgres URL with the right to CREATE DATABASE
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:10])
    started: list[EmbeddedNats | EmbeddedPostgres] = field(default_factory=list)

    @property
    def subject_prefix(self) -> str:
        return f"t{self.run_id}"

    @property
    def stream_prefix(self) -> str:
        return f"T{self.run_id.upper()}_"

    def database_url(self, database: str) -> str:
        base = plain_url(self.admin_url)
        return base.rsplit("/", 1)[0] + f"/{database}"

    async def create_database(self, name: str) -> str:
        conn = await asyncpg.connect(plain_url(self.admin_url))
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()
        return self.database_url(name)

    async def drop_database(self, name: str) -> None:
        conn = await asyncpg.connect(plain_url(self.admin_url))
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    async def delete_streams(self) -> None:
        nc = await nats.connect(self.nats_url)
        try:
            js = nc.jetstream()
            for info in await js.streams_info():
                if info.config.name and info.config.name.startswith(self.stream_prefix):
                    await js.delete_stream(info.config.name)
        finally:
            await nc.close()

    def stop(self) -> None:
        for server in reversed(self.started):
            server.stop()


async def find_servers(tmp: Path) -> RealServers:
    """Environment first (HETSCHED_NATS_URL / HETSCHED_DATABASE_URL), then default ports, then embedded."""
    started: list[EmbeddedNats | EmbeddedPostgres] = []
    nats_url = os.environ.get("HETSCHED_NATS_URL")
    if not nats_url and _listening("127.0.0.1", 4222) and await _nats_has_jetstream("nats://127.0.0.1:4222"):
        nats_url = "nats://127.0.0.1:4222"
    if not nats_url:
        embedded_nats = await asyncio.to_thread(EmbeddedNats(store_dir=tmp / "nats").start)
        started.append(embedded_nats)
        nats_url = embedded_nats.url
    admin_url = os.environ.get("HETSCHED_DATABASE_URL")
    default_pg = "postgresql://postgres@127.0.0.1:5432/postgres"
    if not admin_url and _listening("127.0.0.1", 5432) and await _postgres_ok(default_pg):
        admin_url = default_pg
    if not admin_url:
        embedded_pg = await asyncio.to_thread(EmbeddedPostgres(pgdata=tmp / "pg").start)
        started.append(embedded_pg)
        admin_url = embedded_pg.url()
    return RealServers(nats_url=nats_url, admin_url=admin_url, started=started)
