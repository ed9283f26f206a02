"""`hetsched up`: the whole stack in the foreground, supervised, stopped cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hetsched.embedded import EmbeddedNats, EmbeddedPostgres, child_preexec, stop_process
from services.registry import SERVICES, module_of
from shared.contracts.base import Rejected
from shared.contracts.health import HealthReply, HealthRequest
from shared.contracts.subjects import Subjects
from shared.infra.catalog import demo_fleet_path
from shared.infra.db import plain_url
from shared.infra.migrate import upgrade
from shared.infra.rpc import RpcClient, RpcError
from shared.infra.settings import Settings

STATE_FILE = "stack.json"
DATABASE_NAME = "hetsched"
SERVER_RESTART_ATTEMPTS = 3
"""Tries to bring a dead embedded server back (same port, same data) before `up` gives up."""
SERVER_RESTART_BACKOFF_S = 1.0
"""Wait before the second try, doubled each time: a killed Postgres's backends need a moment to exit."""


class ServerDied(RuntimeError):
    """An embedded server died and could not be restarted: `up` stops everything and exits non-zero."""

    def __init__(self, server: str, message: str) -> None:
        super().__init__(message)
        self.server = server


@dataclass
class Child:
    package: str
    proc: subprocess.Popen[bytes]
    restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)


def state_path(settings: Settings) -> Path:
    return settings.data_dir / STATE_FILE


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
        reply = await rpc.ask(SERVICES[package].health, HealthRequest(), HealthReply, timeout_s=HEALTH_PROBE_TIMEOUT_S)
    except RpcError as exc:
        return {"status": "down", "error": exc.reason}
    if isinstance(reply, Rejected):
        return {"status": "down", "error": reply.error.message}
    return reply.model_dump(mode="json")


async def wait_healthy(
    *, nats_url: str, subjects: Subjects, deadline_s: float, only: set[str] | None = None
) -> dict[str, dict[str, Any]]:
    """Poll every service's (or ``only`` these packages') health subject until all answer `ok` or the
    deadline passes; each reply as its JSON, or ``{"status": "down", "error": ...}``."""
    rpc = await RpcClient.connect(nats_url, subjects, timeout_s=HEALTH_PROBE_TIMEOUT_S, name="hetsched-health")
    try:
        deadline = time.monotonic() + deadline_s
        replies: dict[str, dict[str, Any]] = {}
        packages = [p for p in SERVICES if only is None or p in only]
        while True:
            waiting = [p for p in packages if replies.get(p, {}).get("status") != "ok"]
            answers = await asyncio.gather(*(probe_health(rpc, p) for p in waiting))
            replies.update(zip(waiting, answers, strict=True))
            if all(r.get("status") == "ok" for r in replies.values()) or time.monotonic() > deadline:
                return {p: replies[p] for p in packages}
            await asyncio.sleep(0.2)
    finally:
        await rpc.close()


class Stack:
    """Embedded servers (unless URLs are configured), migrations, the six services as children."""

    def __init__(self, settings: Settings, *, echo: Any = print, fleet_file: Path | None = None) -> None:
        self.settings = settings
        self.fleet_file = fleet_file
        self.echo = echo
        self.nats: EmbeddedNats | None = None
        self.postgres: EmbeddedPostgres | None = None
        self.children: dict[str, Child] = {}
        self.nats_url = settings.nats_url or ""
        self.database_url = settings.database_url or ""
        self._stopping = False

    # -- start -------------------------------------------------------------------------------
    def start_servers(self) -> None:
        data = self.settings.data_dir
        data.mkdir(parents=True, exist_ok=True)
        logs = data / "logs"
        logs.mkdir(exist_ok=True)
        if not self.nats_url:
            self.nats = EmbeddedNats(store_dir=data / "nats").start(log_file=logs / "nats.log")
            self.nats_url = self.nats.url
        if not self.database_url:
            self.postgres = EmbeddedPostgres(pgdata=data / "pg").start(log_file=logs / "postgres.log")
            self.postgres.create_database(DATABASE_NAME)
            self.database_url = self.postgres.url(DATABASE_NAME)

    def migrate(self) -> None:
        """Migrate as the configured (or embedded super-) user; the services then connect as their roles."""
        upgrade(self.database_url, role_password=self.settings.database_role_password)

    def _child_env(self, package: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self._database_env(package))
        env.update(self._nats_env(package))
        env["HETSCHED_NATS_URL"] = self.nats_url
        env["HETSCHED_DATA_DIR"] = str(self.settings.data_dir)
        env["HETSCHED_SUBJECT_PREFIX"] = self.settings.subject_prefix
        env["HETSCHED_STREAM_PREFIX"] = self.settings.stream_prefix
        fleet = self.fleet_file or self.settings.topology_inventory or demo_fleet_path()
        env["HETSCHED_TOPOLOGY_INVENTORY"] = str(Path(fleet).resolve())
        return env

    def _database_env(self, package: str) -> dict[str, str]:
        """What one service needs to reach Postgres: the server and database, and its role's password."""
        env = {"HETSCHED_DATABASE_URL": self.database_url}
        if self.settings.database_role_password is not None:  # the roles' password, wherever settings came from
            env["HETSCHED_DATABASE_ROLE_PASSWORD"] = self.settings.database_role_password.get_secret_value()
        return env

    def _nats_env(self, package: str) -> dict[str, str]:
        """What one service needs to reach NATS as its own identity."""
        return {}

    def _spawn(self, package: str) -> subprocess.Popen[bytes]:
        with open(self.settings.data_dir / "logs" / f"{package}.log", "ab") as log:  # the child keeps its copy
            return subprocess.Popen(
                [sys.executable, "-m", module_of(package)],
                env=self._child_env(package),
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=child_preexec,
            )

    def start_services(self) -> None:
        for package in SERVICES:
            self.children[package] = Child(package=package, proc=self._spawn(package))

    def write_state(self) -> None:
        """The state file, replaced atomically: `status` and tests never read half of it."""
        state = {
            "pid": os.getpid(),
            "nats_url": self.nats_url,
            "database_url": plain_url(self.database_url),
            "subject_prefix": self.settings.subject_prefix,
            "embedded": {"nats": self.nats is not None, "postgres": self.postgres is not None},
            "servers": {
                "nats_pid": self.nats.proc.pid if self.nats and self.nats.proc else None,
                "postgres_pid": self.postgres.proc.pid if self.postgres and self.postgres.proc else None,
            },
            "services": {p: c.proc.pid for p, c in self.children.items()},
        }
        path = state_path(self.settings)
        tmp = path.with_suffix(".tmp")
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
        log = self.settings.data_dir / "logs" / ("nats.log" if name == "nats-server" else "postgres.log")
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
