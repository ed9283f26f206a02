"""The HBM automation on `hetsched up --engines sim`: the agents publish their GPUs' simulated telemetry (a
preallocating engine's GPU reads 0 while it starts, half its share while it loads, all of it once ready), and
the ledger and the rebalancer judge the replicas on it and on the engines' own reports:

(a) a replica whose engine loads for ~30 s raises no `drift_detected`, no `drift_alarm`, no plan and no
    firing target;
(b) a tightly packed replica (its GPU reads ~0.87 used) whose engine is idle is not replicated over a window
    several times the hot window;
(c) a replica whose engine's KV cache is kept over 0.85 by long requests is replicated once,
    and the copy, ready and idle, is not replicated in turn.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from hetsched.stack import wait_healthy
from shared.contracts.rebalance import PlanView, RebalanceStatusReply, RebalanceStatusRequest
from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context, Rpc, Subjects
from shared.domain.engines.simulated_gpus import flag_value
from shared.infra.rpc import RpcClient
from tests.e2e.test_engines_up import Operator, cli
from tests.jetstream import read_all
from tests.waiting import wait_for_sync

pytestmark = pytest.mark.e2e

START_TIMEOUT_S = 180.0
NODE = "h100-01"
HBM = 80 * 2**30  # H100-SXM-80GB, as the SKU catalog has it
HOT_WINDOW_S = 3.0
GRACE_S = (
    10.0  # after a state change: the agent's telemetry and lifecycle reports arrive apart (1 s each, more when busy)
)
FLEET = f"""
regions:
  - name: us-west-1
    clusters:
      - name: c1
        racks:
          - name: r1
            power_kw: 40
            nodes:
              - name: {NODE}
                sku: H100-SXM-80GB
                gpus: 4
                topology: nvswitch-8
"""
ENV = {
    "HETSCHED_AGENT_SIM_SPEEDUP": "0.1",  # an 8B model's weights load in ~3 s modelled: ~30 s here
    "HETSCHED_AGENT_RECONCILE_S": "0.5",
    "HETSCHED_AGENT_STATUS_S": "1",
    "HETSCHED_AGENT_STOP_GRACE_S": "3",
    "HETSCHED_TELEMETRY_INTERVAL_S": "1",
    "HETSCHED_REBALANCE_HOT_WINDOW_S": str(HOT_WINDOW_S),
    "HETSCHED_REBALANCE_DRIFT_WINDOW_S": "3",
    "HETSCHED_REBALANCE_DRIFT_CHECK_S": "1",
    "HETSCHED_REBALANCE_STATE_GRACE_S": str(GRACE_S),
    "HETSCHED_REBALANCE_COLD_WINDOW_S": "3600",  # a node of idle replicas is cold: not what this test shows
    # The ledger follows telemetry only: its grace runs from the commit, so it covers the ~30 s load.
    "HETSCHED_LEDGER_DRIFT_GRACE_S": "60",
    "HETSCHED_DRIFT_CONSECUTIVE": "2",
}


class Watcher(Operator):
    def status(self) -> RebalanceStatusReply:
        reply = asyncio.run(self._call(Rpc.REBALANCE_STATUS, RebalanceStatusRequest()))
        assert isinstance(reply, RebalanceStatusReply), reply
        return reply

    def quiet(self, ids: set[str], what: str) -> None:
        """No plan, and no detector firing, about ``ids`` (or the node)."""
        status = self.status()
        plans = [(p.kind, p.target) for p in status.plans if p.target in ids or p.target == NODE]
        assert plans == [], (what, plans)
        firing = [(d.name, t.key) for d in status.detectors for t in d.targets if t.key in ids and t.phase == "firing"]
        assert firing == [], (what, firing)

    def events(self, context: Context, name: str) -> list[dict[str, Any]]:
        async def read() -> list[dict[str, Any]]:
            client = await RpcClient.connect(
                self.state["nats_url"], Subjects("hetsched"), nkeys_seed=self.state["nats_nkey_seed_file"]
            )
            try:
                events = await read_all(
                    client.nc.jetstream(), stream=stream_name(context), subject=Subjects("hetsched").events_of(context)
                )
            finally:
                await client.close()
            return [e for e in events if e["type"].endswith(f".{name}")]

        return asyncio.run(read())

    def said_drift(self) -> list[dict[str, Any]]:
        return self.events(Context.LEDGER, "drift_detected") + self.events(Context.REBALANCE, "drift_alarm")


def place(data_dir: Path, env: dict[str, str], request_id: str, context: int, concurrency: int) -> dict[str, Any]:
    placed = cli(
        data_dir, env, "place", "--model", "llama3-8b", "--tenant", "acme", "--context-tokens", str(context),
        "--concurrency", str(concurrency), "--backend", "gpu", "--request-id", request_id, "--json",
    )  # fmt: skip
    assert placed.returncode == 0, placed.stdout + placed.stderr
    return dict(json.loads(placed.stdout))


def gpu_used(watcher: Watcher, index: int) -> list[int]:
    """Every memory-used reading of the node's GPU ``index`` so far, in order."""
    return [
        gpu["memory_used_bytes"]
        for e in watcher.events(Context.TELEMETRY, "gpu")
        if e["payload"]["node"] == NODE
        for gpu in e["payload"]["gpus"]
        if gpu["index"] == index
    ]


class Load:
    """Requests kept running through one endpoint, as many as its batch, each long enough that together they
    hold most of its KV cache: a ~3,500-token prompt and 400 tokens more (the replica is placed for 2 x 4,096)."""

    def __init__(self, endpoint: str, streams: int) -> None:
        self.endpoint, self.stop = endpoint, threading.Event()
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(streams)]
        for thread in self.threads:
            thread.start()

    def _loop(self) -> None:
        body = json.dumps({"model": "llama3-8b", "prompt": "fill the cache " * 933, "max_tokens": 400}).encode()
        while not self.stop.is_set():
            request = urllib.request.Request(
                f"{self.endpoint}/v1/completions", data=body, headers={"Content-Type": "application/json"}
            )
            try:
                with urllib.request.urlopen(request, timeout=600) as answer:
                    answer.read()
            except OSError:
                time.sleep(0.5)

    def end(self) -> None:
        self.stop.set()


@pytest.mark.timeout(900)
def test_loading_idle_and_busy_sim_engines_drive_the_hbm_automation_as_real_ones(tmp_path: Path) -> None:
    data_dir, fleet = tmp_path / "data", tmp_path / "fleet.yaml"
    fleet.write_text(FLEET)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSCHED_")} | ENV
    up = subprocess.Popen(
        [sys.executable, "-m", "hetsched.cli", "up", "--engines", "sim", "--fleet", str(fleet), "--data-dir",
         str(data_dir)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    state_file = data_dir / "stack.json"
    load: Load | None = None
    try:

        def launched() -> bool:
            assert up.poll() is None, f"hetsched up exited early:\n{up.stdout.read() if up.stdout else ''}"
            return state_file.exists()

        wait_for_sync(launched, START_TIMEOUT_S, what="stack.json appears")
        state = json.loads(state_file.read_text())
        health = asyncio.run(
            wait_healthy(
                nats_url=state["nats_url"],
                subjects=Subjects("hetsched"),
                deadline_s=START_TIMEOUT_S,
                nkeys_seed=state["nats_nkey_seed_file"],
            )
        )
        assert all(r["status"] == "ok" for r in health.values()), health
        watcher = Watcher(state)

        # (a) A tightly packed replica loads for ~30 s: nothing is said or planned about it meanwhile.
        packed_reply = place(data_dir, env, "auto-packed", context=8192, concurrency=53)
        packed = packed_reply["allocation_id"]
        fraction = float(flag_value(packed_reply["launch"]["vllm"], "--gpu-memory-utilization") or 0)
        assert fraction > 0.85, packed_reply["launch"]
        (gpu,) = [int(i) for i in packed_reply["binding"][0]["cuda_visible_devices"].split(",")]
        placed_at = time.monotonic()
        loading_since: float | None = None
        while (row := watcher.replica(packed)) is None or row["state"] != "ready":
            assert time.monotonic() - placed_at < 120, row
            if row is not None and row["state"] == "loading" and loading_since is None:
                loading_since = time.monotonic()
            watcher.quiet({packed}, "while its engine loads")
            time.sleep(1)
        assert loading_since is not None, "never seen loading"
        loaded_for = time.monotonic() - loading_since
        print(f"\npacked replica (gpu-memory-utilization {fraction}) loading for {loaded_for:.0f} s")
        assert loaded_for >= 15
        assert watcher.said_drift() == []
        share, half = int(fraction * HBM), int(fraction * HBM * 0.5)
        readings = gpu_used(watcher, gpu)  # 0 while it starts, half its share while it loads, all once ready
        assert readings[0] == 0 and half in readings and share in readings, readings
        assert readings.index(half) < readings.index(share), readings

        # (b) Ready, idle, packed (its GPU reads ~0.87 used): not replicated.
        watch_until = time.monotonic() + GRACE_S + 5 * HOT_WINDOW_S
        while time.monotonic() < watch_until:
            watcher.quiet({packed}, "ready, its engine idle")
            time.sleep(1)
        assert gpu_used(watcher, gpu)[-1] == share

        # (c) A small replica whose KV cache long requests keep over 0.85: replicated once.
        busy_reply = place(data_dir, env, "auto-busy", context=4096, concurrency=2)
        busy = busy_reply["allocation_id"]

        def busy_ready() -> dict[str, Any] | None:
            row = watcher.replica(busy)
            return row if row is not None and row["state"] == "ready" else None

        ready = wait_for_sync(busy_ready, 120, what="busy ready")
        assert ready is not None
        load = Load(ready["endpoint"], streams=2)  # its batch: nothing waits, its KV cache is ~0.89 to 1.0 full

        def copied() -> PlanView | None:
            plans = [p for p in watcher.status().plans if p.kind == "replicate" and p.target == busy]
            return plans[0] if plans and plans[0].steps[0].state == "done" else None

        plan = wait_for_sync(copied, 90, interval_s=1, what="the busy replica is replicated")
        load.end()
        assert plan is not None
        print(f"busy replica replicated: {plan.reason}")
        kv = [
            e["payload"]["kv_usage"]
            for e in watcher.events(Context.TELEMETRY, "engine_status")
            if e["payload"]["replica_id"] == busy and e["payload"].get("kv_usage") is not None
        ]
        assert kv and max(kv) > 0.85, kv  # its engine's own KV use is what made it hot
        copy = plan.steps[0].new_allocation_id
        assert copy is not None
        wait_for_sync(
            lambda: (r := watcher.replica(copy)) is not None and r["state"] == "ready", 120, what="the copy ready"
        )
        watch_until = time.monotonic() + GRACE_S + 5 * HOT_WINDOW_S
        while time.monotonic() < watch_until:
            watcher.quiet({copy, packed}, "the copy, ready and idle")
            time.sleep(1)
        plans = [(p.kind, p.target) for p in watcher.status().plans]
        assert plans == [("replicate", busy)], plans
        assert watcher.said_drift() == []
    finally:
        if load is not None:
            load.end()
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=120)
        except subprocess.TimeoutExpired:
            up.kill()
