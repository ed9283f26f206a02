"""Session fixtures: real servers, one fresh migrated database and one subject/stream prefix per run."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import pytest_asyncio
from pydantic import SecretStr

from shared.infra.migrate import upgrade
from shared.infra.settings import Settings
from tests.servers import ROLE_PASSWORD, RealServers, find_servers

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def servers(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RealServers]:
    found = await find_servers(tmp_path_factory.mktemp("servers"))
    yield found
    try:
        await found.delete_streams()
        await found.drop_created_roles()  # after the databases that use them (fixtures that need this one)
    finally:
        found.stop()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def database_url(servers: RealServers) -> AsyncIterator[str]:
    """A fresh database for this run, migrated to head."""
    name = f"hetsched_test_{servers.run_id}"
    url = await servers.create_database(name)
    await asyncio.to_thread(upgrade, url, role_password=SecretStr(ROLE_PASSWORD))
    yield url
    await servers.drop_database(name)


@pytest.fixture(scope="session")
def settings(servers: RealServers, database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Settings:
    return Settings(
        kit={
            "nats_url": servers.nats_url,
            "database_url": database_url,
            "database_role_password": SecretStr(ROLE_PASSWORD),
            "subject_prefix": servers.subject_prefix,
            "stream_prefix": servers.stream_prefix,
            "data_dir": tmp_path_factory.mktemp("data"),
            "log_format": "text",
        }
    )


def service_env(settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSCHED_")}
    env.update(
        HETSCHED_NATS_URL=settings.kit.nats_url or "",
        HETSCHED_DATABASE_URL=settings.kit.database_url or "",
        HETSCHED_DATABASE_ROLE_PASSWORD=ROLE_PASSWORD,
        HETSCHED_SUBJECT_PREFIX=settings.kit.subject_prefix,
        HETSCHED_STREAM_PREFIX=settings.kit.stream_prefix,
        HETSCHED_DATA_DIR=str(settings.kit.data_dir),
        HETSCHED_LOG_FORMAT="json",
        HETSCHED_GATEWAY_PORT="0",  # a free port: a stack or another run may hold the default 8080
    )
    return env


class ServiceProcesses:
    """Services run as real processes (`python -m services.<name>`), as an operator runs them."""

    def __init__(self, settings: Settings, log_dir: Path) -> None:
        self.settings = settings
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, package: str, *, name: str | None = None, **env: str) -> subprocess.Popen[bytes]:
        """Start ``python -m services.<package>``; ``env`` adds HETSCHED_ settings; ``name`` keys it."""
        name = name or package
        log = open(self.log_dir / f"{name}.log", "ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", f"services.{package}"],
            env={**service_env(self.settings), **env},
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs[name] = proc
        return proc

    async def start_demo_ledger(self, *, prefix: str, sweep_ms: int) -> None:
        """The demo fleet's topology service and a ledger (as ``<prefix>topology`` and ``<prefix>ledger``),
        waited on until both answer health ok."""
        from hetsched.stack import wait_healthy
        from shared.contracts.subjects import Subjects
        from shared.infra.catalog import demo_fleet_path

        self.start("topology_discovery", name=f"{prefix}topology", HETSCHED_TOPOLOGY_INVENTORY=str(demo_fleet_path()))
        self.start("capacity_ledger", name=f"{prefix}ledger", HETSCHED_LEDGER_SWEEP_MS=str(sweep_ms))
        health = await wait_healthy(
            nats_url=self.settings.kit.nats_url or "",
            subjects=Subjects(self.settings.kit.subject_prefix),
            deadline_s=60,
            only={"topology_discovery", "capacity_ledger"},
        )
        assert all(h["status"] == "ok" for h in health.values()), health

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")

    def stop(self, name: str, *, kill: bool = False) -> None:
        proc = self.procs.pop(name)
        if kill:
            proc.kill()
        else:
            proc.terminate()
        proc.wait(timeout=30)

    def stop_all(self) -> None:
        for package in list(self.procs):
            self.stop(package)


@pytest.fixture(scope="session")
def service_processes(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcesses]:
    procs = ServiceProcesses(settings, tmp_path_factory.mktemp("service-logs"))
    yield procs
    procs.stop_all()
