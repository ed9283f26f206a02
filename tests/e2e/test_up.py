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
import nats
import psutil
import pytest

from hetsched.embedded import role_password_file
from hetsched.stack import wait_healthy
from services.registry import SERVICES
from shared.contracts.base import Rejected
from shared.contracts.placement import PlaceRequest
from shared.contracts.subjects import Rpc, Subjects
from shared.infra.db import application_name, role_of, without_password
from shared.infra.rpc import RpcClient
from tests.waiting import wait_for_sync

pytestmark = pytest.mark.e2e

START_TIMEOUT_S = 180.0  # how long to wait before calling a start failed (the time taken is printed, not asserted)


async def _database_users(url: str) -> set[tuple[str, str]]:
    """Who is connected to the stack's database: (role, application_name)."""
    conn = await asyncpg.connect(url)
    try:
        rows = await conn.fetch(
            "SELECT DISTINCT usename, application_name FROM pg_stat_activity WHERE datname = current_database()"
        )
        return {(r["usename"], r["application_name"]) for r in rows if r["usename"]}
    finally:
        await conn.close()


async def _refused_without_password(url: str) -> bool:
    try:
        conn = await asyncpg.connect(without_password(url))
    except asyncpg.InvalidPasswordError:
        return True
    await conn.close()
    return False


async def _cross_schema_read(url: str, *, role: str, password: str, table: str) -> str:
    """What a service role gets when it reads another service's table."""
    conn = await asyncpg.connect(url, user=role, password=password)
    try:
        await conn.fetch(f"SELECT 1 FROM {table} LIMIT 1")
        return "read"
    except asyncpg.InsufficientPrivilegeError as exc:
        return str(exc)
    finally:
        await conn.close()


async def _anonymous_refused(url: str) -> bool:
    try:
        nc = await nats.connect(url, max_reconnect_attempts=0, allow_reconnect=False, connect_timeout=5)
    except Exception as exc:
        return "Authorization Violation" in str(exc)
    await nc.close()
    return False


async def _as_gateway(url: str, seed: Path, inbox: str) -> dict[str, str]:
    """One placement per tenant through a gateway's client (public calls go on the tenant's subject)."""
    rpc = await RpcClient.connect(
        url, Subjects("hetsched"), timeout_s=10, scope_by_tenant=True, nkeys_seed=str(seed), inbox_prefix=inbox
    )
    answers = {}
    try:
        for tenant in ("acme", "globex"):
            request = PlaceRequest(request_id=f"gw-{tenant}", tenant=tenant, model="llama3-8b", context_tokens=4096)
            if tenant == "globex":  # its own subject is not the gateway's to use: name acme's, body globex
                reply = await rpc.call(Rpc.PLACEMENT_PLACE, request, scope="acme")
            else:
                reply = await rpc.call(Rpc.PLACEMENT_PLACE, request)
            answers[tenant] = reply.error.code if isinstance(reply, Rejected) else getattr(reply, "status", "?")
    finally:
        await rpc.close()
    return answers


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
        # NATS admits NKeys only: an anonymous client is refused; the operator's seed is where API.md says.
        seed = data_dir / "nats" / "admin.nk"
        assert state["nats_nkey_seed_file"] == str(seed) and seed.stat().st_mode & 0o777 == 0o600
        assert asyncio.run(_anonymous_refused(state["nats_url"]))
        health = asyncio.run(
            wait_healthy(
                nats_url=state["nats_url"],
                subjects=Subjects("hetsched"),
                deadline_s=START_TIMEOUT_S,
                nkeys_seed=str(seed),
            )
        )
        print(f"\nhetsched up: six services healthy after {time.monotonic() - started:.1f}s (first start, embedded)")
        assert {p: r["status"] for p, r in health.items()} == {p: "ok" for p in SERVICES}

        # Migrations ran as the embedded superuser; each service connects as its own role, named by its
        # application_name, with its own password, and cannot read another service's schema.
        roles = {(role_of(d.schema), application_name(d.schema)) for d in SERVICES.values()}
        wait_for_sync(
            lambda: roles <= asyncio.run(_database_users(state["database_url"])),
            30,
            interval_s=0.2,
            what=f"every service connects as its own role ({sorted(roles)})",
        )
        placement = role_password_file(data_dir, role_of("placement"))
        refused = asyncio.run(
            _cross_schema_read(
                state["database_url"],
                role=role_of("placement"),
                password=placement.read_text().strip(),
                table="ledger.outbox",
            )
        )
        assert "permission denied" in refused
        # Password auth: the state file carries the superuser's URL with its password, so it is 0600 like
        # every password file; the same URL without it is refused.
        assert asyncio.run(_refused_without_password(state["database_url"]))
        secrets = [state_file, data_dir / "pg.password", *(role_password_file(data_dir, r) for r, _ in roles)]
        assert {str(p): p.stat().st_mode & 0o777 for p in secrets} == {str(p): 0o600 for p in secrets}

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
        assert all(a["hbm_total_bytes"] > 0 for n in fleet["nodes"] for a in n["accelerators"])
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

        # A gateway credential for acme places for acme and is refused for anyone else.
        gateway = tmp_path / "acme-gw.nk"
        issued = subprocess.run(
            [
                *(sys.executable, "-m", "hetsched.cli", "credentials", "issue"),
                *("--tenant", "acme", "--out", str(gateway), "--json", "--data-dir", str(data_dir)),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert issued.returncode == 0, issued.stdout + issued.stderr
        credential = json.loads(issued.stdout)
        answers = asyncio.run(_as_gateway(state["nats_url"], gateway, credential["inbox_prefix"]))
        assert answers == {"acme": "placed", "globex": "forbidden"}, answers

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
