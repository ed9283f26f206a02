"""`hetsched up`: the whole stack in the foreground, supervised, stopped cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr

from hetsched.embedded import (
    EmbeddedNats,
    EmbeddedPostgres,
    child_preexec,
    read_or_create_secret,
    role_password_file,
    stop_process,
)
from shared.contracts.base import Rejected
from shared.contracts.health import HealthReply, HealthRequest
from shared.contracts.permissions import (
    Permissions,
    agent_identity,
    inbox_prefix,
    service_identity,
    service_permissions,
)
from shared.contracts.subjects import Subjects
from shared.infra.bus import ensure_streams
from shared.infra.catalog import demo_fleet_path, load_inventory
from shared.infra.db import SCHEMAS, database_tls, plain_url, role_of, without_password
from shared.infra.identity import (
    Registry,
    connect_options,
    ensure_operator,
    ensure_seeded,
    nats_dir,
    write_auth_conf,
)
from shared.infra.migrate import upgrade
from shared.infra.refusal import ConnectionGuard
from shared.infra.refusal import connect as guarded_connect
from shared.infra.retention import stream_specs_for
from shared.infra.rpc import RpcClient, RpcError
from shared.infra.service import grant_of
from shared.infra.settings import Settings

STATE_FILE = "stack.json"
AGENT_CHILD = "agent:"
AGENT_PORT_BASE = 8100
AGENT_PORTS = 20
"""`up --engines`: node k's agent gives its engines ports ``AGENT_PORT_BASE + k * AGENT_PORTS`` onwards."""
DATABASE_NAME = "hetsched"
SERVER_RESTART_ATTEMPTS = 3
"""Tries to bring a dead embedded server back (same port, same data) before `up` gives up."""
SERVER_RESTART_BACKOFF_S = 1.0
"""Wait before the second try, doubled each time: a killed Postgres's backends need a moment to exit."""

if TYPE_CHECKING:
    from shared.infra.service import ServiceDefinition


def services() -> dict[str, ServiceDefinition]:
    """The services' definitions (the six and the gateway). Imported when a command starts or probes them,
    not at the CLI's start: importing every service's app costs about two seconds, which every other command
    would pay."""
    from services.registry import SERVICES

    return SERVICES


class ServerDied(RuntimeError):
    """An embedded server died and could not be restarted: `up` stops everything and exits non-zero."""

    def __init__(self, server: str, message: str) -> None:
        super().__init__(message)
        self.server = server


@dataclass
class Child:
    package: str  # a service package, or `agent:<node>` for a node's agent (`up --engines`)
    proc: subprocess.Popen[bytes]
    restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)


def state_path(settings: Settings) -> Path:
    return settings.kit.data_dir / STATE_FILE


def read_state(settings: Settings) -> dict[str, Any] | None:
    path = state_path(settings)
    if not path.exists():
        return None
    try:
        state: dict[str, Any] = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return state


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def port_free(host: str, port: int) -> bool:
    """Whether ``host:port`` can be bound now (0: any port, always)."""
    if port == 0:
        return True
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def server_liveness(state: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The embedded servers a state file names: ``{"nats": {"pid": .., "running": ..}, ...}``."""
    pids = state.get("servers") or {}
    return {
        name: {"pid": pids[f"{name}_pid"], "running": _running(int(pids[f"{name}_pid"]))}
        for name in ("nats", "postgres")
        if pids.get(f"{name}_pid")
    }


HEALTH_PROBE_TIMEOUT_S = 1.0
"""One health request's timeout while polling: a service still starting must not hold up the others."""


async def probe_health(rpc: RpcClient, package: str) -> dict[str, Any]:
    """One service's health reply as JSON (``HealthReply``), or ``{"status": "down", "error": ...}``."""
    try:
        reply = await rpc.ask(
            services()[package].health, HealthRequest(), HealthReply, timeout_s=HEALTH_PROBE_TIMEOUT_S
        )
    except RpcError as exc:
        return {"status": "down", "error": exc.reason}
    if isinstance(reply, Rejected):
        return {"status": "down", "error": reply.error.message}
    return reply.model_dump(mode="json")


async def wait_healthy(
    *, nats_url: str, subjects: Subjects, deadline_s: float, only: set[str] | None = None, **options: Any
) -> dict[str, dict[str, Any]]:
    """Poll every service's (or ``only`` these packages') health subject until all answer `ok` or the
    deadline passes; each reply as its JSON, or ``{"status": "down", "error": ...}``. ``options``: how
    to connect (``shared.infra.identity.connect_options``)."""
    rpc = await RpcClient.connect(
        nats_url, subjects, timeout_s=HEALTH_PROBE_TIMEOUT_S, name="hetsched-health", **options
    )
    try:
        deadline = time.monotonic() + deadline_s
        replies: dict[str, dict[str, Any]] = {}
        packages = [p for p in services() if only is None or p in only]
        while True:
            waiting = [p for p in packages if replies.get(p, {}).get("status") != "ok"]
            answers = await asyncio.gather(*(probe_health(rpc, p) for p in waiting))
            replies.update(zip(waiting, answers, strict=True))
            if all(r.get("status") == "ok" for r in replies.values()) or time.monotonic() > deadline:
                return {p: replies[p] for p in packages}
            await asyncio.sleep(0.2)
    finally:
        await rpc.close()


def operator_options(settings: Settings) -> dict[str, Any]:
    """How the CLI connects to NATS: the configured seed, else the one a running `hetsched up` names in
    its state file, else ``<data-dir>/nats/admin.nk`` when present (the operator's); no seed at all on
    a server without authentication."""
    state = read_state(settings) or {}
    seed = settings.kit.nats_nkey_seed_file or state.get("nats_nkey_seed_file")
    if seed:
        settings = settings.updated(kit={"nats_nkey_seed_file": Path(seed)})
    return connect_options(settings, operator_fallback=True)


@dataclass(frozen=True)
class Identities:
    auth_conf: Path
    operator_seed: Path
    service_seeds: dict[str, Path]  # by service package
    agent_seeds: dict[str, Path] = field(default_factory=dict)  # by node (`up --engines`)


def write_identities(settings: Settings, *, agents: Iterable[str] = ()) -> Identities:
    """Seeds for the operator and each service (made once, kept under ``<data-dir>/nats``), the registry,
    and the server's ``auth.conf`` with every identity's permissions (gateways and agents issued
    before keep theirs). What `hetsched up` and `hetsched credentials init` do."""
    directory = nats_dir(settings.kit.data_dir)
    registry = Registry.load(directory)
    registry.subject_prefix = settings.kit.subject_prefix
    registry.stream_prefix = settings.kit.stream_prefix
    operator_seed = ensure_operator(directory, registry)
    seeds = {
        package: ensure_seeded(
            directory, registry, id=service_identity(definition.schema), kind="service", name=definition.name
        )
        for package, definition in services().items()
    }
    agent_seeds = {
        node: ensure_seeded(directory, registry, id=agent_identity(node), kind="agent", name=node, node=node)
        for node in agents
    }
    registry.save(directory)
    auth_conf = write_auth_conf(directory, registry, service_permission_map(settings))
    return Identities(auth_conf=auth_conf, operator_seed=operator_seed, service_seeds=seeds, agent_seeds=agent_seeds)


def service_permission_map(settings: Settings) -> dict[str, Permissions]:
    """Each service's NATS permissions under ``settings``, by service name (what auth.conf grants)."""
    subjects = Subjects(settings.kit.subject_prefix)
    grants = [grant_of(definition, settings) for definition in services().values()]
    # Each service's consumers are its own: the others' durables are denied to it by name.
    return {
        grant.name: service_permissions(grant, subjects, others=grants, stream_prefix=settings.kit.stream_prefix)
        for grant in grants
    }


class Stack:
    """Embedded servers (unless URLs are configured), migrations, the six services and the gateway as children."""

    def __init__(
        self, settings: Settings, *, echo: Any = print, fleet_file: Path | None = None, engines: str = "none"
    ) -> None:
        self.settings = settings
        self.fleet_file = fleet_file
        self.engines = engines  # `sim`: one agent per GPU node of the fleet runs simulated engines
        self.agent_seeds: dict[str, Path] = {}
        self.echo = echo
        self.nats: EmbeddedNats | None = None
        self.postgres: EmbeddedPostgres | None = None
        self.children: dict[str, Child] = {}
        self.nats_url = settings.kit.nats_url or ""
        self.database_url = settings.kit.database_url or ""
        self.operator_seed: Path | None = None  # set when `up` runs NATS with authentication
        self.service_seeds: dict[str, Path] = {}
        self._stopping = False

    # -- start -------------------------------------------------------------------------------
    def start_servers(self) -> None:
        data = self.settings.kit.data_dir
        data.mkdir(parents=True, exist_ok=True)
        logs = data / "logs"
        logs.mkdir(exist_ok=True)
        if not self.nats_url:
            # Authenticated from the first start: an NKey per service, the operator's in admin.nk.
            self.nats = EmbeddedNats(store_dir=data / "nats", auth_conf=self.write_identities())
            self.nats.start(log_file=logs / "nats.log")
            self.nats_url = self.nats.url
        if not self.database_url:
            self.postgres = EmbeddedPostgres(pgdata=data / "pg").start(log_file=logs / "postgres.log", echo=self.echo)
            self.postgres.create_database(DATABASE_NAME)
            self.database_url = self.postgres.url(DATABASE_NAME)

    def migrate(self) -> None:
        """Migrate as the configured (or embedded super-) user, then give each service role its password;
        the services connect as their roles. Embedded Postgres: one generated password per role, kept in
        ``<data-dir>/pg-roles/<role>.password`` (0600, the same across restarts), unless
        ``HETSCHED_DATABASE_ROLE_PASSWORD`` sets one for all. A configured server: that setting (unset:
        the roles' passwords are left as they are, e.g. trust or peer auth)."""
        role_passwords: dict[str, SecretStr] | None = None
        if self.postgres is not None and self.settings.kit.database_role_password is None:
            files = {
                role_of(schema): role_password_file(self.settings.kit.data_dir, role_of(schema)) for schema in SCHEMAS
            }
            role_passwords = {role: SecretStr(read_or_create_secret(path)) for role, path in files.items()}
        upgrade(
            self.database_url,
            role_password=self.settings.kit.database_role_password,
            role_passwords=role_passwords,
            tls=database_tls(self.settings) if self.postgres is None else None,  # the embedded one is loopback only
        )

    def _child_env(self, package: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self._database_env(package))
        env.update(self._nats_env(package))
        env["HETSCHED_NATS_URL"] = self.nats_url
        env["HETSCHED_DATA_DIR"] = str(self.settings.kit.data_dir)
        env["HETSCHED_SUBJECT_PREFIX"] = self.settings.kit.subject_prefix
        env["HETSCHED_STREAM_PREFIX"] = self.settings.kit.stream_prefix
        env["HETSCHED_TOPOLOGY_INVENTORY"] = str(self.fleet_path())
        if package == "gateway" and "HETSCHED_GATEWAY_PORT" not in os.environ:
            gateway = self.settings.gateway
            if not port_free(gateway.host, gateway.port):  # taken: any free port (`status` names the URL)
                env["HETSCHED_GATEWAY_PORT"] = "0"
        if self.engines != "none" and "HETSCHED_REBALANCE_WAIT_FOR_READY" not in os.environ:
            # Every GPU node runs an engine agent: a move always waits for its copy's engine to be ready,
            # even on a node whose agent had no engine to report on before the copy came.
            env["HETSCHED_REBALANCE_WAIT_FOR_READY"] = "always"
        return env

    def _database_env(self, package: str) -> dict[str, str]:
        """What one service needs to reach Postgres: the server and database (without the migrating user's
        password) and its own role's password, no other. Read at each spawn: a service restarted after
        its password file changed connects with the new one (docs/SECURITY.md, rotation)."""
        if not self.settings.kit.database_roles:  # it connects as the URL's user: it needs that user's password
            return {"HETSCHED_DATABASE_URL": self.database_url}
        env = {"HETSCHED_DATABASE_URL": without_password(self.database_url)}
        own = role_password_file(self.settings.kit.data_dir, role_of(services()[package].schema))
        if self.settings.kit.database_role_password is not None:  # one for every role, wherever settings came from
            env["HETSCHED_DATABASE_ROLE_PASSWORD"] = self.settings.kit.database_role_password.get_secret_value()
        elif self.postgres is not None and own.exists():
            env["HETSCHED_DATABASE_ROLE_PASSWORD"] = own.read_text().strip()
        return env

    def write_identities(self) -> Path:
        """The identities `up` runs with (``write_identities``); the path of the server's auth.conf."""
        written = write_identities(self.settings, agents=self.agent_nodes())
        self.operator_seed = written.operator_seed
        self.service_seeds = written.service_seeds
        self.agent_seeds = written.agent_seeds
        return written.auth_conf

    def nats_options(self) -> dict[str, Any]:
        """How `up` itself (health probes, stream creation) connects: as the operator when it runs NATS."""
        if self.operator_seed is None:
            return connect_options(self.settings, operator_fallback=True)
        return connect_options(self.settings.updated(kit={"nats_nkey_seed_file": self.operator_seed}))

    def _nats_env(self, package: str) -> dict[str, str]:
        """What one service needs to reach NATS as its own identity: its seed and its inbox prefix."""
        seed = self.service_seeds.get(package)
        if seed is None:
            return {}
        return {
            "HETSCHED_NATS_NKEY_SEED_FILE": str(seed),
            "HETSCHED_NATS_INBOX_PREFIX": inbox_prefix(service_identity(services()[package].schema)),
        }

    def check_nats(self) -> None:
        """Connect once as the operator before anything is migrated or started: a server that refuses the
        credential raises ``NatsRefused`` (its one line names the setting) instead of every later step retrying."""

        async def check() -> None:
            options = self.nats_options()
            guard = ConnectionGuard.of(self.nats_url, options, operator=True)
            nc = await guarded_connect(self.nats_url, guard, name="hetsched-up", **options)
            await nc.close()

        asyncio.run(check())

    def create_streams(self) -> None:
        """Every stream, as the operator, before the services start: each service may then create or
        update only its own, and its consumers find the others."""
        if self.operator_seed is None:
            return

        async def create() -> None:
            options = self.nats_options()
            guard = ConnectionGuard.of(self.nats_url, options, operator=True)  # refused: NatsRefused, no retries
            nc = await guarded_connect(self.nats_url, guard, name="hetsched-up", **options)
            try:
                # As the operator: with the limits of the settings, DEADLETTER's included (no service may update it).
                await ensure_streams(nc.jetstream(), stream_specs_for(self.settings))
            finally:
                await nc.drain()

        asyncio.run(create())

    def _spawn(self, package: str) -> subprocess.Popen[bytes]:
        if package.startswith(AGENT_CHILD):
            node = package.removeprefix(AGENT_CHILD)
            env = {**self._child_env("topology_discovery"), **self._agent_env(node)}
            env.pop("HETSCHED_DATABASE_URL", None)  # an agent has no database
            log_name, module = f"agent-{node}", "services.topology_discovery"
        else:
            env, log_name, module = self._child_env(package), package, f"services.{package}"
        with open(self.settings.kit.data_dir / "logs" / f"{log_name}.log", "ab") as log:  # the child keeps its copy
            return subprocess.Popen(
                [sys.executable, "-m", module],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=child_preexec,
            )

    def start_services(self) -> None:
        for package in services():
            self.children[package] = Child(package=package, proc=self._spawn(package))
        for node in self.agent_nodes():
            name = f"{AGENT_CHILD}{node}"
            self.children[name] = Child(package=name, proc=self._spawn(name))

    def fleet_path(self) -> Path:
        return Path(self.fleet_file or self.settings.topology.inventory or demo_fleet_path()).resolve()

    def agent_nodes(self) -> list[str]:
        """The GPU nodes whose agents `up --engines` starts (none without it)."""
        if self.engines == "none":
            return []
        fleet, _fingerprint = load_inventory(self.fleet_path())
        return [node.name for node in fleet.nodes]

    def _agent_env(self, node: str) -> dict[str, str]:
        """A node's agent that only runs engines (its node is the inventory's): its own credential, the
        simulated engine, and ports of its own (agents of one machine never race for one)."""
        index = self.agent_nodes().index(node)
        low = AGENT_PORT_BASE + index * AGENT_PORTS
        env = {
            "HETSCHED_TOPOLOGY_MODE": "agent",
            "HETSCHED_TOPOLOGY_NODE": node,
            "HETSCHED_TOPOLOGY_PROVIDER": "none",
            "HETSCHED_AGENT_ENGINE": self.engines,
            "HETSCHED_AGENT_BIND_HOST": "127.0.0.1",
            "HETSCHED_AGENT_ADVERTISE_HOST": "127.0.0.1",
            "HETSCHED_AGENT_PORT_MIN": str(low),
            "HETSCHED_AGENT_PORT_MAX": str(low + AGENT_PORTS - 1),
        }
        seed = self.agent_seeds.get(node)
        if seed is not None:
            env["HETSCHED_NATS_NKEY_SEED_FILE"] = str(seed)
            env["HETSCHED_NATS_INBOX_PREFIX"] = inbox_prefix(agent_identity(node))
        return env

    def write_state(self) -> None:
        """The state file, replaced atomically: `status` and tests never read half of it."""
        state = {
            "pid": os.getpid(),
            "nats_url": self.nats_url,
            "database_url": plain_url(self.database_url),
            "subject_prefix": self.settings.kit.subject_prefix,
            "nats_nkey_seed_file": str(self.operator_seed) if self.operator_seed else None,
            "embedded": {"nats": self.nats is not None, "postgres": self.postgres is not None},
            "servers": {
                "nats_pid": self.nats.proc.pid if self.nats and self.nats.proc else None,
                "postgres_pid": self.postgres.proc.pid if self.postgres and self.postgres.proc else None,
            },
            "services": {p: c.proc.pid for p, c in self.children.items() if not p.startswith(AGENT_CHILD)},
            "agents": {
                p.removeprefix(AGENT_CHILD): c.proc.pid for p, c in self.children.items() if p.startswith(AGENT_CHILD)
            },
        }
        path = state_path(self.settings)
        tmp = path.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        tmp.touch(mode=0o600)  # it holds the Postgres URL with the migrating user's password
        tmp.write_text(json.dumps(state, indent=2))
        tmp.replace(path)

    # -- supervise ---------------------------------------------------------------------------
    def supervise_servers(self) -> None:
        """Restart an embedded server that died, on its port with its data (services reconnect by
        themselves); raise ``ServerDied`` naming it when it cannot be brought back. ``poll()`` reaps it."""
        servers: list[tuple[str, EmbeddedNats | EmbeddedPostgres | None]] = [
            ("nats-server", self.nats),
            ("postgres", self.postgres),
        ]
        for name, server in servers:
            if server is None or server.proc is None or self._stopping:
                continue
            code = server.proc.poll()
            if code is None:
                continue
            old_pid = server.proc.pid
            self.echo(
                f"[bold red]!!! embedded {name} (pid {old_pid}) died with exit code {code}; "
                f"restarting it on port {server.port} with the same data[/bold red]"
            )
            self._restart_server(name, server, code=code)
            assert server.proc is not None
            self.echo(f"[bold yellow]embedded {name} restarted: pid {old_pid} -> {server.proc.pid}[/bold yellow]")
            self.write_state()

    def _restart_server(self, name: str, server: EmbeddedNats | EmbeddedPostgres, *, code: int) -> None:
        log = self.settings.kit.data_dir / "logs" / ("nats.log" if name == "nats-server" else "postgres.log")
        backoff = SERVER_RESTART_BACKOFF_S
        why = ""
        for attempt in range(1, SERVER_RESTART_ATTEMPTS + 1):
            try:
                server.start(log_file=log)
                return
            except (RuntimeError, OSError) as exc:
                why = str(exc)
                self.echo(f"[red]restart {attempt}/{SERVER_RESTART_ATTEMPTS} of embedded {name} failed: {why}[/red]")
                if server.proc is not None:
                    stop_process(server.proc, sig=signal.SIGKILL, timeout_s=5)  # a half-started one, reaped
                if attempt < SERVER_RESTART_ATTEMPTS:
                    time.sleep(backoff)
                    backoff *= 2
        raise ServerDied(
            name,
            f"embedded {name} died (exit code {code}) and could not be restarted on port {server.port}: {why}",
        )

    def supervise_once(self) -> None:
        """Bring back a dead embedded server, then restart a service that died (with a backoff that grows
        with its restarts)."""
        self.supervise_servers()
        for child in self.children.values():
            code = child.proc.poll()
            if code is None or self._stopping:
                continue
            backoff = min(2**child.restarts, 30)
            if time.monotonic() - child.started_at < backoff:
                continue
            self.echo(f"service {child.package} exited with {code}; restarting (restart #{child.restarts + 1})")
            child.proc = self._spawn(child.package)
            child.restarts += 1
            child.started_at = time.monotonic()
            self.write_state()

    # -- stop --------------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop every child, then both servers; idempotent."""
        self._stopping = True
        for child in self.children.values():
            if child.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.proc.send_signal(signal.SIGTERM)
        for child in self.children.values():
            stop_process(child.proc, timeout_s=15)
        if self.nats is not None:
            self.nats.stop()
        if self.postgres is not None:
            self.postgres.stop()
        with contextlib.suppress(FileNotFoundError):
            state_path(self.settings).unlink()
