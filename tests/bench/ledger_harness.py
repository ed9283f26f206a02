"""A ledger of its own for stress tests and benchmarks: fresh database, own prefix, 8 nodes x 8 H100
(64 accelerators), topology-discovery and capacity-ledger as real processes that can be killed."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import asyncpg
import nats
import yaml
from pydantic import SecretStr

from shared.contracts.subjects import Rpc, Subjects
from shared.infra.db import plain_url
from shared.infra.migrate import upgrade
from tests.servers import ROLE_PASSWORD, RealServers

INVARIANT_SQL = """
SELECT count(*) FROM ledger.accelerators a
LEFT JOIN (SELECT accelerator_id, sum(total) AS s FROM ledger.shares WHERE active AND counts GROUP BY 1) x
       ON x.accelerator_id = a.id
WHERE COALESCE(x.s, 0) > a.hbm_usable OR COALESCE(x.s, 0) <> a.reserved
"""


def inventory(nodes: int = 8) -> dict[str, Any]:
    return {
        "regions": [
            {
                "name": "r1",
                "clusters": [
                    {
                        "name": "c1",
                        "racks": [
                            {
                                "name": "k1",
                                "power_kw": 200,
                                "nodes": [
                                    {"name": f"s{i:02d}", "sku": "H100-SXM-80GB", "gpus": 8, "topology": "nvswitch-8"}
                                    for i in range(nodes)
                                ],
                            }
                        ],
                    }
                ],
            }
        ]
    }


class LedgerHarness:
    def __init__(
        self,
        servers: RealServers,
        workdir: Path,
        *,
        nodes: int = 8,
        fleet: dict[str, Any] | None = None,
        services: tuple[str, ...] = (),
        want_accelerators: int | None = None,
        ready_s: float = 60,
        service_env: Mapping[str, str] | None = None,
    ) -> None:
        self.ready_s = ready_s  # how long the ledger may take to learn the fleet
        self.fleet = fleet
        self.extra_services = services
        self.service_env = dict(service_env or {})  # extra variables for the ``services`` (not the ledger's)
        self.want = want_accelerators
        self.servers = dataclasses.replace(servers, run_id=uuid.uuid4().hex[:10], started=[])
        self.workdir = workdir
        self.nodes = nodes
        self.database = f"hetsched_ledger_{self.servers.run_id}"
        self.database_url = ""
        self.subjects = Subjects(self.servers.subject_prefix)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.accelerators: list[str] = []

    def env(self, **extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("HETSCHED_")}
        env.update(
            HETSCHED_NATS_URL=self.servers.nats_url,
            HETSCHED_DATABASE_URL=self.database_url,
            HETSCHED_DATABASE_ROLE_PASSWORD=ROLE_PASSWORD,
            HETSCHED_SUBJECT_PREFIX=self.servers.subject_prefix,
            HETSCHED_STREAM_PREFIX=self.servers.stream_prefix,
            HETSCHED_DATA_DIR=str(self.workdir),
            HETSCHED_LOG_LEVEL="WARNING",
            HETSCHED_DB_POOL_SIZE="20",
            **extra,
        )
        return env

    def start(self, package: str, **extra: str) -> None:
        log = open(self.workdir / f"{package}.log", "ab")
        self.procs[package] = subprocess.Popen(
            [sys.executable, "-m", f"services.{package}"], env=self.env(**extra), stdout=log, stderr=log
        )

    def kill(self, package: str) -> None:
        proc = self.procs.pop(package)
        proc.kill()  # SIGKILL: no shutdown hook runs
        proc.wait(timeout=30)

    def stop(self, package: str) -> None:
        proc = self.procs.pop(package, None)
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                log = (self.workdir / f"{package}.log").read_text(errors="replace")[-4000:]
                proc.kill()
                proc.wait(timeout=10)
                raise RuntimeError(f"{package} did not stop within 30 s of SIGTERM; its log ends:\n{log}") from None

    async def __aenter__(self) -> LedgerHarness:
        try:
            return await self._start()
        except BaseException:
            await self.__aexit__()  # leave no service, database or stream behind
            raise

    async def snapshot_ids(self) -> list[str]:
        """Every accelerator the ledger knows, following the snapshot's pages."""
        ids: list[str] = []
        cursor: str | None = None
        while True:
            body: dict[str, Any] = {"limit": 20_000, **({"cursor": cursor} if cursor else {})}
            page = await self.call(Rpc.LEDGER_SNAPSHOT, body, timeout=5)
            ids += [a["id"] for a in page.get("accelerators", [])]
            cursor = page.get("next_cursor")
            if not cursor:
                return ids

    async def _start(self) -> LedgerHarness:
        self.database_url = await self.servers.create_database(self.database)
        await asyncio.to_thread(upgrade, self.database_url, role_password=SecretStr(ROLE_PASSWORD))
        fleet = self.workdir / "stress-fleet.yaml"
        fleet.write_text(yaml.safe_dump(self.fleet or inventory(self.nodes)))
        self.start("topology_discovery", HETSCHED_TOPOLOGY_INVENTORY=str(fleet))
        self.start("capacity_ledger")
        for package in self.extra_services:
            self.start(package, **self.service_env)
        self.nc = await nats.connect(self.servers.nats_url)
        want = self.want or self.nodes * 8
        deadline = time.monotonic() + self.ready_s
        while True:
            try:
                ids = await self.snapshot_ids()
                if len(ids) >= want:
                    self.accelerators = ids
                    return self
            except Exception:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the ledger never learnt the stress fleet")
            await asyncio.sleep(0.2)

    async def __aexit__(self, *exc: object) -> None:
        problems: list[Exception] = []
        for package in list(self.procs):
            try:
                self.stop(package)
            except RuntimeError as problem:  # it was killed; stop the others all the same
                problems.append(problem)
        if getattr(self, "nc", None) is not None:
            await self.nc.close()
        await self.servers.drop_database(self.database)
        await self.servers.delete_streams()
        if problems:
            raise problems[0]

    async def call(self, rpc: Rpc, body: dict[str, Any], *, timeout: float = 5) -> dict[str, Any]:
        msg = await self.nc.request(self.subjects.rpc(rpc), json.dumps(body).encode(), timeout=timeout)
        reply: dict[str, Any] = json.loads(msg.data)
        return reply

    async def wait_ledger_healthy(self, deadline_s: float = 60) -> None:
        deadline = time.monotonic() + deadline_s
        while time.monotonic() < deadline:
            try:
                if (await self.call(Rpc.LEDGER_HEALTH, {}, timeout=1)).get("status") == "ok":
                    return
            except Exception:
                pass
            await asyncio.sleep(0.1)
        raise RuntimeError("ledger not healthy")

    async def db(self) -> asyncpg.Connection:
        return await asyncpg.connect(plain_url(self.database_url))

    async def outbox_drained(self, deadline_s: float = 60) -> None:
        conn = await self.db()
        try:
            deadline = time.monotonic() + deadline_s
            while await conn.fetchval("SELECT count(*) FROM ledger.outbox WHERE sent_at IS NULL"):
                if time.monotonic() > deadline:
                    raise RuntimeError("the outbox did not drain")
                await asyncio.sleep(0.1)
        finally:
            await conn.close()
