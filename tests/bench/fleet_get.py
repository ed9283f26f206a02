"""Benchmark: `hetsched.fleet.get` for a 1,024-node inventory after a service restart (no rescan).

    python -m tests.bench.fleet_get [--nodes 1024] [--calls 50]

Measures and prints; asserts nothing about time. Uses the servers tests use (environment, default
ports, else embedded), in a fresh database and its own subject/stream prefix.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
import yaml
from pydantic import SecretStr

from shared.contracts.base import Rejected
from shared.contracts.fleet import FleetGetReply, FleetGetRequest
from shared.contracts.subjects import Rpc, Subjects
from shared.domain.synthetic import synthetic_inventory
from shared.infra.migrate import upgrade
from shared.infra.rpc import RpcClient
from tests.servers import ROLE_PASSWORD, RealServers, find_servers


@dataclass
class FleetGetFigures:
    nodes: int
    accelerators: int
    initial_load_s: float  # start with the inventory -> fleet.get shows every node
    restart_to_answer_s: float  # restart WITHOUT the inventory -> first full answer (process start included)
    first_answer_ms: float  # the first fleet.get after the restart
    p50_ms: float
    p99_ms: float
    reply_bytes: int
    pages: int

    def report(self) -> str:
        return (
            f"fleet.get, {self.nodes} nodes / {self.accelerators} GPUs: "
            f"initial inventory load {self.initial_load_s:.2f} s; "
            f"after restart without rescan: process start -> full answer {self.restart_to_answer_s:.2f} s, "
            f"first answer {self.first_answer_ms:.0f} ms, then p50 {self.p50_ms:.0f} ms / p99 {self.p99_ms:.0f} ms "
            f"(the whole fleet, {self.reply_bytes / 1e6:.1f} MB of JSON over {self.pages} pages)"
        )


def _env(servers: RealServers, database_url: str, inventory: Path | None, data_dir: Path) -> dict[str, str]:
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSCHED_")}
    env.update(
        HETSCHED_NATS_URL=servers.nats_url,
        HETSCHED_DATABASE_URL=database_url,
        HETSCHED_DATABASE_ROLE_PASSWORD=ROLE_PASSWORD,
        HETSCHED_SUBJECT_PREFIX=servers.subject_prefix,
        HETSCHED_STREAM_PREFIX=servers.stream_prefix,
        HETSCHED_DATA_DIR=str(data_dir),
        HETSCHED_LOG_LEVEL="WARNING",
    )
    if inventory is not None:
        env["HETSCHED_TOPOLOGY_INVENTORY"] = str(inventory)
    return env


async def _ask(nc: Any, subjects: Subjects) -> tuple[dict[str, Any], float, int]:
    """The whole fleet (every page, validated against its contract), the time it took and its JSON size."""
    started = time.perf_counter()
    reply = await RpcClient(nc, subjects, timeout_s=30).fleet()
    elapsed = (time.perf_counter() - started) * 1000
    if isinstance(reply, Rejected):
        raise RuntimeError(f"fleet.get rejected: {reply.error.message}")
    return reply.model_dump(mode="json"), elapsed, len(reply.model_dump_json())


async def _wait_full(nc: Any, subject: Subjects, nodes: int, deadline_s: float) -> tuple[dict[str, Any], float]:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            reply, elapsed, _ = await _ask(nc, subject)
            if len(reply.get("nodes", [])) == nodes:
                return reply, elapsed
        except Exception:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"fleet.get never showed {nodes} nodes")
        await asyncio.sleep(0.05)


async def measure(
    servers: RealServers, database_url: str, *, nodes: int = 1024, calls: int = 50, workdir: Path
) -> FleetGetFigures:
    inventory = workdir / "fleet.yaml"
    inventory.write_text(yaml.safe_dump(synthetic_inventory(nodes=nodes, rng=random.Random(1024))))
    subject = Subjects(servers.subject_prefix)
    nc = await nats.connect(servers.nats_url)
    log = open(workdir / "topology.log", "ab")
    cmd = [sys.executable, "-m", "services.topology_discovery"]
    try:
        started = time.monotonic()
        proc = subprocess.Popen(cmd, env=_env(servers, database_url, inventory, workdir), stdout=log, stderr=log)
        try:
            reply, _ = await _wait_full(nc, subject, nodes, 300)
            initial = time.monotonic() - started
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        started = time.monotonic()
        proc = subprocess.Popen(cmd, env=_env(servers, database_url, None, workdir), stdout=log, stderr=log)
        try:
            reply, first_ms = await _wait_full(nc, subject, nodes, 120)
            restart = time.monotonic() - started
            page = await RpcClient(nc, subject, timeout_s=30).ask(Rpc.FLEET_GET, FleetGetRequest(), FleetGetReply)
            assert isinstance(page, FleetGetReply), page
            pages = -(-page.total_nodes // len(page.nodes))
            latencies, size = [], 0
            for _ in range(calls):
                reply, elapsed, size = await _ask(nc, subject)
                latencies.append(elapsed)
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    finally:
        await nc.close()
        log.close()
    latencies.sort()
    return FleetGetFigures(
        nodes=len(reply["nodes"]),
        accelerators=sum(len(n["accelerators"]) for n in reply["nodes"]),
        initial_load_s=initial,
        restart_to_answer_s=restart,
        first_answer_ms=first_ms,
        p50_ms=statistics.median(latencies),
        p99_ms=latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
        reply_bytes=size,
        pages=pages,
    )


async def _main(nodes: int, calls: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        servers = await find_servers(Path(tmp))
        name = f"hetsched_bench_{servers.run_id}"
        url = await servers.create_database(name)
        try:
            await asyncio.to_thread(upgrade, url, role_password=SecretStr(ROLE_PASSWORD))
            figures = await measure(servers, url, nodes=nodes, calls=calls, workdir=Path(tmp))
            print(figures.report())
        finally:
            await servers.drop_database(name)
            await servers.delete_streams()
            servers.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args()
    asyncio.run(_main(args.nodes, args.calls))
