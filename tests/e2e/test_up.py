"""`hetsched up` as a user runs it: embedded servers, six healthy services, nothing left after SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import asyncpg
import psutil
import pytest

from hetsched.stack import wait_healthy
from services.registry import SERVICES
from shared.contracts.subjects import Subjects
from shared.infra.db import role_of
from tests.waiting import wait_for_sync

pytestmark = pytest.mark.e2e

START_TIMEOUT_S = 180.0  # how long to wait before calling a start failed (the time taken is printed, not asserted)


async def _database_users(url: str) -> set[str]:
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch("SELECT DISTINCT usename FROM pg_stat_activity WHERE datname = current_database()")
        return {r["usename"] for r in rows if r["usename"]}
    finally:
        await conn.close()


async def _cross_schema_read(url: str, *, role: str, table: str) -> str:
    """What a service role gets when it reads another service's table."""
    conn = await asyncpg.connect(url, user=role)
    try:
        await conn.fetch(f"SELECT 1 FROM {table} LIMIT 1")
        return "read"
    except asyncpg.InsufficientPrivilegeError as exc:
        return str(exc)
    finally:
        await conn.close()


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def test_up_reaches_six_healthy_services_and_sigterm_leaves_nothing(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSCHED_")}  # no URLs: embedded servers
    started = time.monotonic()
    up = subprocess.Popen(
        [sys.executable, "-m", "hetsched.cli", "up", "--data-dir", str(data_dir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    state_file = data_dir / "stack.json"
    tree: list[psutil.Process] = []
    try:

        def launched() -> bool:
            assert up.poll() is None, f"hetsched up exited early:\n{up.stdout.read() if up.stdout else ''}"
            return state_file.exists()

        wait_for_sync(launched, START_TIMEOUT_S, what="stack.json appears")
        state = json.loads(state_file.read_text())
        assert state["embedded"] == {"nats": True, "postgres": True}
        health = asyncio.run(
            wait_healthy(nats_url=state["nats_url"], subjects=Subjects("hetsched"), deadline_s=START_TIMEOUT_S)
        )
        print(f"\nhetsched up: six services healthy after {time.monotonic() - started:.1f}s (first start, embedded)")
        assert {p: r["status"] for p, r in health.items()} == {p: "ok" for p in SERVICES}

        # Migrations ran as the embedded superuser; each service connects as its own role, which cannot
        # read another service's schema.
        roles = {role_of(d.schema) for d in SERVICES.values()}
        wait_for_sync(
            lambda: roles <= asyncio.run(_database_users(state["database_url"])),
            30,
            interval_s=0.2,
            what=f"every service connects as its own role ({sorted(roles)})",
        )
        refused = asyncio.run(
            _cross_schema_read(state["database_url"], role=role_of("placement"), table="ledger.outbox")
        )
        assert "permission denied" in refused

        status = subprocess.run(
            [sys.executable, "-m", "hetsched.cli", "status", "--json", "--data-dir", str(data_dir)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert status.returncode == 0, status.stdout + status.stderr
        report = json.loads(status.stdout)
        assert report["nats_url"] == state["nats_url"]
        assert all(s["status"] == "ok" for s in report["services"].values())

        # The demo fleet is loaded: `hetsched fleet` shows its NVLink domains, HBM and TPU pods.
        shown = subprocess.run(
            [sys.executable, "-m", "hetsched.cli", "fleet", "--json", "--data-dir", str(data_dir)],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert shown.returncode == 0, shown.stdout + shown.stderr
        fleet = json.loads(shown.stdout)
        assert len(fleet["nodes"]) == 13 and fleet["next_cursor"] is None
        assert {"fully_connected", "pair", "single", "multi_node"} <= {d["kind"] for d in fleet["domains"]}
        assert all(a["hbm_total"] > 0 for n in fleet["nodes"] for a in n["accelerators"])
        assert {p["type"] for p in fleet["tpu_pods"]} == {"v5e", "v5p"}
        table = subprocess.run(
            [sys.executable, "-m", "hetsched.cli", "fleet", "--data-dir", str(data_dir)],
            env={**env, "COLUMNS": "200"},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert "hgx-h100-4x4-01" in table.stdout and "v5e-pod-1" in table.stdout

        # And a replica is placed from the shell, reserved through the ledger.
        place = [
            sys.executable,
            "-m",
            "hetsched.cli",
            "place",
            "--model",
            "llama3-70b",
            "--dtype",
            "fp8",
            "--tenant",
            "acme",
            "--context-tokens",
            "8192",
            "--concurrency",
            "16",
            "--backend",
            "gpu",
            "--request-id",
            "e2e-1",
            "--json",
            "--data-dir",
            str(data_dir),
        ]
        # The ledger learns the fleet from topology events a moment after health.
        runs: list[subprocess.CompletedProcess[str]] = []

        def place_once() -> subprocess.CompletedProcess[str] | None:
            runs.append(subprocess.run(place, env=env, capture_output=True, text=True, timeout=60))
            return runs[-1] if runs[-1].returncode == 0 else None

        try:
            placed = wait_for_sync(place_once, 60, interval_s=0.5, what="hetsched place succeeds")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{runs[-1].stdout}{runs[-1].stderr}") from exc
        assert placed is not None
        reply = json.loads(placed.stdout)
        assert reply["status"] == "placed" and reply["allocation_id"] and reply["placements"]

        tree = _descendants(up.pid)
        pids = {p.pid for p in tree}
        assert state["servers"]["nats_pid"] in pids and state["servers"]["postgres_pid"] in pids
        assert set(state["services"].values()) <= pids
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            out, _ = up.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            up.kill()
            raise
    assert up.returncode == 0, out
    _gone, alive = psutil.wait_procs(tree, timeout=10)
    assert not alive, f"left running after SIGTERM: {[(p.pid, p.name()) for p in alive]}"
    assert not state_file.exists()
