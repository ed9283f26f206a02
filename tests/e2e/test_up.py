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

import psutil
import pytest

from services.registry import SERVICES
from services.stack import wait_healthy
from shared.contracts.subjects import Subjects

pytestmark = pytest.mark.e2e

HEALTH_DEADLINE_S = 60.0  # the bound for a first start


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
        [sys.executable, "-m", "services.cli", "up", "--data-dir", str(data_dir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    state_file = data_dir / "stack.json"
    try:
        while not state_file.exists():
            assert up.poll() is None, f"hetsched up exited early:\n{up.stdout.read() if up.stdout else ''}"
            assert time.monotonic() - started < HEALTH_DEADLINE_S, "stack.json never appeared"
            time.sleep(0.2)
        state = json.loads(state_file.read_text())
        assert state["embedded"] == {"nats": True, "postgres": True}
        remaining = HEALTH_DEADLINE_S - (time.monotonic() - started)
        health = asyncio.run(
            wait_healthy(nats_url=state["nats_url"], subjects=Subjects("hetsched"), deadline_s=max(remaining, 1))
        )
        elapsed = time.monotonic() - started
        print(f"\nhetsched up: six services healthy after {elapsed:.1f}s (first start, embedded servers)")
        assert {p: r["status"] for p, r in health.items()} == {p: "ok" for p in SERVICES}
        assert elapsed < HEALTH_DEADLINE_S

        status = subprocess.run(
            [sys.executable, "-m", "services.cli", "status", "--json", "--data-dir", str(data_dir)],
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
            [sys.executable, "-m", "services.cli", "fleet", "--json", "--data-dir", str(data_dir)],
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
            [sys.executable, "-m", "services.cli", "fleet", "--data-dir", str(data_dir)],
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
            "services.cli",
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
        deadline = time.monotonic() + 30
        while True:  # the ledger learns the fleet from topology events a moment after health
            placed = subprocess.run(place, env=env, capture_output=True, text=True, timeout=60)
            if placed.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert placed.returncode == 0, placed.stdout + placed.stderr
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
