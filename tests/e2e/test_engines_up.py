"""`hetsched up --engines sim` as a newcomer runs it: a replica placed from the shell starts a real engine
process on the chosen node's agent, with the binding's devices; `hetsched replicas` shows it loading, then
ready with an endpoint that answers health, metrics (vLLM's names) and an OpenAI completion (the official
client); SIGKILLed it comes back, killed again and again it is `failed` and admission stops choosing it;
released, its process is gone and its endpoint refuses within the grace."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest

from hetsched.stack import wait_healthy
from shared.contracts.base import Rejected
from shared.contracts.placement import AdmitReply, AdmitRequest, ReplicasReply, ReplicasRequest
from shared.contracts.subjects import Rpc, Subjects
from shared.infra.rpc import RpcClient
from tests.waiting import wait_for_sync

pytestmark = pytest.mark.e2e

START_TIMEOUT_S = 180.0
GRACE_S = 5.0
AGENT_ENV = {
    "HETSCHED_AGENT_SIM_SPEEDUP": "1",  # an 8B model's weights load in ~3 s (16 GB over a 5 GB/s link): seen
    "HETSCHED_AGENT_RECONCILE_S": "0.5",
    "HETSCHED_AGENT_STATUS_S": "1",
    "HETSCHED_AGENT_STOP_GRACE_S": str(GRACE_S),
    "HETSCHED_AGENT_RESTART_BACKOFF_S": "0.5",
    "HETSCHED_AGENT_MAX_CRASHES": "3",
}


def cli(data_dir: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hetsched.cli", *args, "--data-dir", str(data_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def engine_process(replica_id: str) -> psutil.Process | None:
    """The engine process started for ``replica_id`` (its environment names it)."""
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if "hetsched.engines.sim_server" in " ".join(proc.info["cmdline"] or ()) and (
                proc.environ().get("HETSCHED_REPLICA_ID") == replica_id
            ):
                return proc
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def refuses(url: str) -> bool:
    host, port = url.removeprefix("http://").split(":")
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((host, int(port))) != 0


class Operator:
    """The operator's RPC client on the stack's NATS (what the CLI uses), for polling."""

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = state

    async def _call(self, rpc: Rpc, request: Any) -> Any:
        client = await RpcClient.connect(
            self.state["nats_url"], Subjects("hetsched"), timeout_s=10, nkeys_seed=self.state["nats_nkey_seed_file"]
        )
        try:
            return await client.call(rpc, request)
        finally:
            await client.close()

    def replica(self, replica_id: str) -> dict[str, Any] | None:
        reply = asyncio.run(self._call(Rpc.PLACEMENT_REPLICAS, ReplicasRequest(tenant="acme")))
        assert isinstance(reply, ReplicasReply), reply
        for row in reply.replicas:
            if row.replica_id == replica_id:
                return row.model_dump(mode="json")
        return None

    def admit(self, request_id: str) -> Any:
        request = AdmitRequest(
            request_id=request_id, tenant="acme", model="llama3-8b", input_tokens=64, output_tokens=16
        )
        return asyncio.run(self._call(Rpc.PLACEMENT_ADMIT, request))


@pytest.mark.timeout(900)  # a whole stack with 13 agents, then a dozen engine starts: minutes on a loaded machine
def test_a_placed_replica_runs_a_real_engine_from_start_to_release(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSCHED_")} | AGENT_ENV
    started = time.monotonic()
    up = subprocess.Popen(
        [sys.executable, "-m", "hetsched.cli", "up", "--engines", "sim", "--data-dir", str(data_dir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    state_file = data_dir / "stack.json"
    try:

        def launched() -> bool:
            assert up.poll() is None, f"hetsched up exited early:\n{up.stdout.read() if up.stdout else ''}"
            return state_file.exists()

        wait_for_sync(launched, START_TIMEOUT_S, what="stack.json appears")
        state = json.loads(state_file.read_text())
        assert len(state["agents"]) == 13  # one per GPU node of the demo fleet
        health = asyncio.run(
            wait_healthy(
                nats_url=state["nats_url"],
                subjects=Subjects("hetsched"),
                deadline_s=START_TIMEOUT_S,
                nkeys_seed=state["nats_nkey_seed_file"],
            )
        )
        assert all(r["status"] == "ok" for r in health.values()), health
        print(f"\nhetsched up --engines sim: healthy after {time.monotonic() - started:.1f}s")
        operator = Operator(state)

        placed = cli(
            data_dir, env, "place", "--model", "llama3-8b", "--tenant", "acme", "--context-tokens", "8192",
            "--concurrency", "8", "--backend", "gpu", "--request-id", "eng-1", "--json",
        )  # fmt: skip
        assert placed.returncode == 0, placed.stdout + placed.stderr
        reply = json.loads(placed.stdout)
        replica_id, binding = reply["allocation_id"], reply["binding"][0]
        clock = time.monotonic()

        # The engine process starts on the chosen node's agent, with the binding's devices.
        engine = wait_for_sync(lambda: engine_process(replica_id), 30, what="the engine process")
        assert engine.environ()["CUDA_VISIBLE_DEVICES"] == binding["cuda_visible_devices"]
        assert engine.environ()["HETSCHED_NODE"] == binding["node"]
        seen: list[str] = []

        def state_is(wanted: str) -> dict[str, Any] | None:
            row = operator.replica(replica_id)
            if row is not None and (not seen or seen[-1] != row["state"]):
                seen.append(row["state"])
            return row if row is not None and row["state"] == wanted else None

        ready = wait_for_sync(lambda: state_is("ready"), 60, interval_s=0.2, what="the replica ready")
        print(f"placed -> ready in {time.monotonic() - clock:.1f}s; states seen: {seen}")
        assert "loading" in seen and seen.index("loading") < seen.index("ready")
        endpoint = ready["endpoint"]
        assert endpoint and endpoint.startswith("http://127.0.0.1:")
        shown = cli(data_dir, {**env, "COLUMNS": "250"}, "replicas", "--wide")
        assert shown.returncode == 0 and "ready" in shown.stdout and endpoint in shown.stdout, shown.stdout

        with urllib.request.urlopen(f"{endpoint}/health", timeout=5) as answer:
            assert answer.status == 200
        with urllib.request.urlopen(f"{endpoint}/metrics", timeout=5) as answer:
            metrics = answer.read().decode()
        assert "vllm:num_requests_running" in metrics and "vllm:time_to_first_token_seconds_bucket" in metrics
        client = openai.OpenAI(base_url=f"{endpoint}/v1", api_key="none")
        completion = client.completions.create(model="llama3-8b", prompt="Hello there", max_tokens=8)
        assert completion.choices[0].text and completion.usage is not None and completion.usage.completion_tokens == 8
        admitted = operator.admit("adm-1")
        assert isinstance(admitted, AdmitReply) and admitted.endpoint == endpoint, admitted

        # SIGKILL the engine: the agent restarts it and the replica is ready again.
        first_pid = engine.pid
        os.kill(first_pid, signal.SIGKILL)
        wait_for_sync(
            lambda: (p := engine_process(replica_id)) is not None and p.pid != first_pid and p, 30, what="restarted"
        )
        seen.clear()
        wait_for_sync(lambda: state_is("ready"), 60, interval_s=0.2, what="ready again")

        # Released: the process is gone and the endpoint refuses within the grace.
        released = cli(data_dir, env, "release", replica_id, "--tenant", "acme")
        assert released.returncode == 0, released.stdout + released.stderr
        gone_by = time.monotonic() + GRACE_S + 5  # the grace, and a reconcile pass or two
        wait_for_sync(lambda: engine_process(replica_id) is None and refuses(endpoint), GRACE_S + 10, what="gone")
        assert time.monotonic() <= gone_by

        # Another replica whose engine is killed again and again: failed, and admission does not choose it.
        other = cli(
            data_dir, env, "place", "--model", "llama3-8b", "--tenant", "acme", "--context-tokens", "8192",
            "--concurrency", "8", "--backend", "gpu", "--request-id", "eng-2", "--json",
        )  # fmt: skip
        assert other.returncode == 0, other.stdout + other.stderr
        crashing = json.loads(other.stdout)["allocation_id"]
        killed: set[int] = set()
        for _ in range(3):
            victim = wait_for_sync(
                lambda: (p := engine_process(crashing)) is not None and p.pid not in killed and p, 60, what="started"
            )
            killed.add(victim.pid)
            os.kill(victim.pid, signal.SIGKILL)
        replica_id = crashing
        seen.clear()
        failed = wait_for_sync(lambda: state_is("failed"), 30, interval_s=0.2, what="failed")
        assert failed["endpoint"] is None
        refused = operator.admit("adm-2")
        # Its only replica failed: admission has nothing to send it to (refused, or queued for no replica).
        assert isinstance(refused, Rejected) or getattr(refused, "replica_id", None) != crashing, refused
        assert cli(data_dir, env, "release", crashing, "--tenant", "acme").returncode == 0
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=120)
        except subprocess.TimeoutExpired:
            up.kill()
    assert engine_process(crashing) is None  # no engine outlives the stack
