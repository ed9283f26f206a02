"""The stack on an authenticated NATS, as `hetsched up` secures it: one nats-server from the ``auth.conf``
the launcher writes (identities and permissions from ``shared.contracts.permissions``), a database of its
own migrated with the service roles, and services as real processes with their own NKeys and roles.

Tests that play an attacker (or a tenant next to another) connect as any identity with
``SecureBus.connect``; the server's refusals arrive in ``Caller.errors``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client
from pydantic import SecretStr

from hetsched.embedded import EmbeddedNats
from hetsched.stack import service_permission_map, wait_healthy
from services.registry import SERVICES
from shared.contracts.permissions import inbox_prefix, service_identity
from shared.contracts.streams import stream_name, stream_specs
from shared.contracts.subjects import Context, Subjects
from shared.infra.bus import ensure_streams
from shared.infra.identity import Registry, ensure_operator, ensure_seeded, issue, write_auth_conf
from shared.infra.migrate import upgrade
from shared.infra.settings import Settings
from tests.conftest import ServiceProcesses
from tests.servers import ROLE_PASSWORD, RealServers
from tests.waiting import wait_for


@dataclass
class Caller:
    """One identity's connection; the server's refusals arrive through ``errors``."""

    nc: Client
    errors: list[str] = field(default_factory=list)

    async def refused(self, subject: str, *, verb: str = "publish") -> None:
        await wait_for(
            # nats-py lower-cases the server's message
            lambda: any(f"violation for {verb}" in e.lower() and subject.lower() in e.lower() for e in self.errors),
            10,
            what=f"a permissions violation for {verb} to {subject} (errors: {self.errors[-5:]})",
        )

    async def publish(self, subject: str, body: bytes = b"{}") -> None:
        await self.nc.publish(subject, body)
        await self.nc.flush()

    async def request(self, subject: str, body: dict[str, Any]) -> dict[str, Any]:
        reply = await self.nc.request(subject, json.dumps(body).encode(), timeout=10)
        data: dict[str, Any] = json.loads(reply.data)
        return data


@dataclass
class SecureBus:
    url: str
    settings: Settings
    directory: Path
    seeds: dict[str, Path]
    subjects: Subjects
    callers: list[Caller] = field(default_factory=list)
    procs: ServiceProcesses | None = None

    async def connect(self, who: str) -> Caller:
        caller = Caller(nc=None)  # type: ignore[arg-type]

        async def on_error(exc: Exception) -> None:
            caller.errors.append(str(exc))

        options: dict[str, Any] = {"nkeys_seed": str(self.seeds[who]), "error_cb": on_error}
        if who != "operator":
            options["inbox_prefix"] = inbox_prefix(who)
        caller.nc = await nats.connect(self.url, name=f"test-{who}", max_reconnect_attempts=0, **options)
        self.callers.append(caller)
        return caller

    def stream(self, context: Context) -> str:
        return stream_name(context, stream_prefix=self.settings.kit.stream_prefix)


@contextlib.asynccontextmanager
async def secure_stack(
    servers: RealServers,
    settings: Settings,
    tmp: Path,
    *,
    tag: str,
    services: Sequence[str],
    gateways: Mapping[str, Sequence[str]] = {},
    agents: Sequence[str] = (),
    env: Mapping[str, str] = {},
) -> AsyncIterator[SecureBus]:
    """Start ``services`` (packages) on a NATS server of their own, each with its own NKey, and yield once
    every one answers health ``ok``. ``gateways`` maps a gateway credential's name to its tenants,
    ``agents`` lists nodes that get an agent credential, ``env`` adds HETSCHED_ settings to every service.
    ``tag`` (a letter) starts the run's own subject and stream prefixes, so the machine's NATS and this
    server never share a durable name; the database is ``hetsched_<tag>_<run>``."""
    directory = tmp / "identities"
    run = uuid.uuid4().hex[:8]
    secure = settings.updated(kit={"subject_prefix": f"{tag}{run}", "stream_prefix": f"{tag.upper()}{run.upper()}_"})
    registry = Registry(subject_prefix=secure.kit.subject_prefix, stream_prefix=secure.kit.stream_prefix)
    seeds = {"operator": ensure_operator(directory, registry)}
    for definition in SERVICES.values():
        identity = service_identity(definition.schema)
        seeds[identity] = ensure_seeded(directory, registry, id=identity, kind="service", name=definition.name)
    for name, tenants in gateways.items():
        credential = issue(registry, kind="gateway", name=name, out=directory / f"{name}.nk", tenants=list(tenants))
        seeds[credential.id] = directory / f"{name}.nk"
    for node in agents:
        credential = issue(registry, kind="agent", name=node, out=directory / f"{node}.nk")
        seeds[credential.id] = directory / f"{node}.nk"
    registry.save(directory)
    server = EmbeddedNats(
        store_dir=tmp / "js", auth_conf=write_auth_conf(directory, registry, service_permission_map(secure))
    )
    await asyncio.to_thread(server.start, log_file=tmp / "nats.log")
    database = f"hetsched_{tag}_{run}"
    url = await servers.create_database(database)
    await asyncio.to_thread(upgrade, url, role_password=SecretStr(ROLE_PASSWORD))
    secure = secure.updated(kit={"nats_url": server.url, "database_url": url, "data_dir": tmp / "data"})
    state = SecureBus(
        url=server.url, settings=secure, directory=directory, seeds=seeds, subjects=Subjects(secure.kit.subject_prefix)
    )
    procs = ServiceProcesses(secure, tmp)
    try:
        operator = await state.connect("operator")
        await ensure_streams(
            operator.nc.jetstream(), stream_specs(subjects=state.subjects, stream_prefix=secure.kit.stream_prefix)
        )
        for package in services:
            identity = service_identity(SERVICES[package].schema)
            procs.start(
                package,
                HETSCHED_NATS_NKEY_SEED_FILE=str(seeds[identity]),
                HETSCHED_NATS_INBOX_PREFIX=inbox_prefix(identity),
                **env,
            )
        health = await wait_healthy(
            nats_url=server.url,
            subjects=state.subjects,
            deadline_s=60,
            only=set(services),
            nkeys_seed=str(seeds["operator"]),
        )
        assert all(h["status"] == "ok" for h in health.values()), (health, procs.log("placement")[-3000:])
        state.procs = procs
        yield state
    finally:
        for caller in state.callers:
            with contextlib.suppress(Exception):
                await caller.nc.close()
        procs.stop_all()
        server.stop()
        await servers.drop_database(database)
