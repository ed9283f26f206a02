"""The gateway as an application team meets it: `hetsched up --engines sim`, an API key from the CLI, and the
official `openai` client pointed at `gateway_url`. A chat completion, a streamed one whose chunks arrive
before its end, the models list; a bad key is 401 and a forbidden model 404 in OpenAI's shape; a 40k-token
prompt to `chat-long` lands on its SSM replica; an engine killed before its first token fails over and the
client still gets its answer; acme's key cannot use globex's replica nor see its usage; the usage reaches
the GATEWAY stream for billing."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import nats
import openai
import pytest

from hetsched.stack import wait_healthy
from shared.contracts.placement import ReplicasReply, ReplicasRequest
from shared.contracts.subjects import Rpc, Subjects
from tests.e2e.test_engines_up import AGENT_ENV, Operator, cli, engine_process
from tests.waiting import wait_for_sync

pytestmark = pytest.mark.e2e

START_TIMEOUT_S = 180.0
FLEET = """
regions:
  - name: us-west-1
    clusters:
      - name: c1
        racks:
          - name: r1
            power_kw: 40
            nodes:
              - name: h100-{i:02d}
                count: 3
                sku: H100-SXM-80GB
                gpus: 8
                topology: nvswitch-8
"""


def place(data_dir: Path, env: dict[str, str], tenant: str, model: str, request_id: str, context: int = 65536) -> str:
    placed = cli(
        data_dir, env, "place", "--model", model, "--tenant", tenant, "--context-tokens", str(context),
        "--concurrency", "2", "--backend", "gpu", "--request-id", request_id, "--json",
    )  # fmt: skip
    assert placed.returncode == 0, placed.stdout + placed.stderr
    return str(json.loads(placed.stdout)["allocation_id"])


def issue_key(data_dir: Path, env: dict[str, str], tenant: str, *extra: str) -> str:
    issued = cli(data_dir, env, "credentials", "issue", "--tenant", tenant, "--api-key", *extra)
    assert issued.returncode == 0, issued.stdout + issued.stderr
    found = re.search(r"^api_key=(\S+)$", issued.stdout, re.MULTILINE)
    assert found, issued.stdout
    return found.group(1)


def running_requests(endpoint: str) -> float:
    with urllib.request.urlopen(f"{endpoint}/metrics", timeout=2) as answer:
        text = answer.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def usage_events(state: dict[str, Any], *, tenant: str, want: int, timeout_s: float) -> list[dict[str, Any]]:
    """`usage` events of ``tenant`` on the GATEWAY stream, read as billing would (from the start)."""
    nc = await nats.connect(state["nats_url"], nkeys_seed=state["nats_nkey_seed_file"])
    try:
        js = nc.jetstream()
        sub = await js.subscribe("hetsched.events.gateway.usage", ordered_consumer=True, deliver_policy="all")
        found: list[dict[str, Any]] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and len(found) < want:
            try:
                msg = await sub.next_msg(timeout=1)
            except nats.errors.TimeoutError:
                continue
            event = json.loads(msg.data)["payload"]
            if event["tenant"] == tenant:  # one event per tenant and interval, with its requests
                assert event["completion_tokens"] == sum(r["completion_tokens"] for r in event["requests"])
                found += event["requests"]
        await sub.unsubscribe()
        return found
    finally:
        await nc.close()


@pytest.mark.timeout(900)
def test_an_openai_client_through_the_gateway(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(FLEET)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSCHED_")} | AGENT_ENV
    env |= {"HETSCHED_GATEWAY_PORT": "0", "HETSCHED_GATEWAY_FIRST_TOKEN_TIMEOUT_S": "20"}
    up = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hetsched.cli",
            "up",
            "--engines",
            "sim",
            "--fleet",
            str(fleet),
            "--data-dir",
            str(data_dir),
        ],
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
        health = asyncio.run(
            wait_healthy(
                nats_url=state["nats_url"],
                subjects=Subjects("hetsched"),
                deadline_s=START_TIMEOUT_S,
                nkeys_seed=state["nats_nkey_seed_file"],
            )
        )
        assert all(r["status"] == "ok" for r in health.values()), health
        status = cli(data_dir, env, "status", "--json")
        assert status.returncode == 0, status.stdout + status.stderr
        gateway_url = json.loads(status.stdout)["gateway_url"]
        assert gateway_url and gateway_url.startswith("http://127.0.0.1:"), status.stdout

        acme_key = issue_key(data_dir, env, "acme")
        narrow_key = issue_key(data_dir, env, "acme", "--model", "llama3.1-8b")
        globex_key = issue_key(data_dir, env, "globex")
        replicas = {
            "fast-1": place(data_dir, env, "acme", "llama3.1-8b", "gw-fast-1"),
            "fast-2": place(data_dir, env, "acme", "llama3.1-8b", "gw-fast-2"),
            "ssm": place(data_dir, env, "acme", "mamba2-2.7b", "gw-ssm"),
            "globex": place(data_dir, env, "globex", "llama3-8b", "gw-globex", context=8192),
        }
        operator = Operator(state)
        endpoints: dict[str, str] = {}
        for name, replica_id in replicas.items():

            def ready(rid: str = replica_id) -> str | None:
                reply = asyncio.run(operator._call(Rpc.PLACEMENT_REPLICAS, ReplicasRequest()))
                assert isinstance(reply, ReplicasReply), reply
                row = next((r for r in reply.replicas if r.replica_id == rid), None)
                return row.endpoint if row is not None and row.state == "ready" else None

            endpoints[name] = wait_for_sync(ready, 120, interval_s=0.5, what=f"replica {name} ready")
        time.sleep(2.5)  # each engine's first status report (admission needs it) follows its readiness

        client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=acme_key, max_retries=0, timeout=60)

        # A chat completion, and the models list.
        raw = client.chat.completions.with_raw_response.create(
            model="llama3.1-8b", messages=[{"role": "user", "content": "Hello there"}], max_tokens=8
        )
        chat = raw.parse()
        assert chat.choices[0].message.content and chat.usage is not None and chat.usage.completion_tokens == 8
        assert raw.headers["x-hetsched-replica-id"] in (replicas["fast-1"], replicas["fast-2"])
        assert raw.headers["x-hetsched-sku"] == "H100-SXM-80GB"
        ids = {m.id for m in client.models.list()}
        assert {"llama3.1-8b", "mamba2-2.7b", "chat-long", "chat-large"} <= ids

        # Streamed: the chunks arrive as they are generated, not all at the end.
        arrivals: list[float] = []
        text = ""
        for chunk in client.chat.completions.create(
            model="llama3.1-8b", messages=[{"role": "user", "content": "Count"}], max_tokens=48, stream=True
        ):
            arrivals.append(time.monotonic())
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        assert text and len(arrivals) >= 10
        assert arrivals[-1] - arrivals[0] > 0.1, "the stream came all at once"
        assert arrivals[len(arrivals) // 2] < arrivals[-1] - 0.03

        # A bad key: 401; a model the key may not use: 404; both in OpenAI's shape.
        bad = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="hsk-nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as unauthorized:
            bad.models.list()
        assert unauthorized.value.status_code == 401 and unauthorized.value.code == "invalid_api_key"
        narrow = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=narrow_key, max_retries=0)
        with pytest.raises(openai.NotFoundError) as forbidden:
            narrow.chat.completions.create(model="chat-long", messages=[{"role": "user", "content": "hi"}])
        assert forbidden.value.code == "model_not_found"
        assert {m.id for m in narrow.models.list()} == {"llama3.1-8b"}

        # 40k tokens to chat-long: its SSM replica (memory flat in the context) answers.
        long = client.chat.completions.with_raw_response.create(
            model="chat-long", messages=[{"role": "user", "content": "word " * 32_000}], max_tokens=4
        )
        assert long.headers["x-hetsched-engine"] == "ssm", dict(long.headers)
        assert long.headers["x-hetsched-replica-id"] == replicas["ssm"]
        assert long.parse().usage.prompt_tokens > 32_000  # type: ignore[union-attr]

        # Kill the chosen engine before its first token: the request fails over and the client gets an answer.
        outcome: dict[str, Any] = {}

        def slow_request() -> None:
            try:
                got = client.chat.completions.with_raw_response.create(
                    model="llama3.1-8b", messages=[{"role": "user", "content": "word " * 45_000}], max_tokens=8,
                    stream=True,
                )  # fmt: skip
                outcome["headers"] = dict(got.headers)
                outcome["text"] = "".join(c.choices[0].delta.content or "" for c in got.parse() if c.choices)
            except Exception as exc:  # reported below
                outcome["error"] = exc

        thread = threading.Thread(target=slow_request)
        thread.start()
        chosen = wait_for_sync(
            lambda: next((n for n in ("fast-1", "fast-2") if running_requests(endpoints[n]) > 0), None),
            20,
            interval_s=0.01,
            what="an engine with the request",
        )
        victim = engine_process(replicas[chosen])
        assert victim is not None
        os.kill(victim.pid, signal.SIGKILL)
        thread.join(120)
        assert "error" not in outcome, outcome
        assert outcome["text"], outcome
        other = "fast-2" if chosen == "fast-1" else "fast-1"
        assert outcome["headers"]["x-hetsched-replica-id"] == replicas[other]
        assert outcome["headers"]["x-hetsched-failovers"] == "1"

        # Isolation: acme has no llama3-8b replica; globex's is not acme's to use, nor named to it.
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(
                model="llama3-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
        assert refused.value.status_code == 503 and refused.value.code == "no_capacity"
        assert replicas["globex"] not in str(refused.value.body)
        globex = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=globex_key, max_retries=0, timeout=60)
        # Sessions are the tenant's own: the same session id from both tenants lands on each one's replica.
        session = {"x-session-id": "s-shared"}
        mine_in_session = client.chat.completions.with_raw_response.create(
            model="llama3.1-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_headers=session
        )
        assert mine_in_session.headers["x-hetsched-replica-id"] in (replicas["fast-1"], replicas["fast-2"])
        served = globex.chat.completions.with_raw_response.create(
            model="llama3-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_headers=session
        )
        assert served.headers["x-hetsched-replica-id"] == replicas["globex"]
        with pytest.raises(openai.APIStatusError):  # nor the other way round
            globex.chat.completions.create(
                model="mamba2-2.7b", messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )

        def usage_of(key: str) -> dict[str, Any]:
            request = urllib.request.Request(f"{gateway_url}/v1/usage", headers={"Authorization": f"Bearer {key}"})
            with urllib.request.urlopen(request, timeout=5) as answer:
                return json.loads(answer.read())

        mine, theirs = usage_of(acme_key), usage_of(globex_key)
        assert mine["tenant"] == "acme" and {row["model"] for row in mine["data"]} >= {"llama3.1-8b", "chat-long"}
        assert "llama3-8b" not in {row["model"] for row in mine["data"] if row["prompt_tokens"]}
        assert theirs["tenant"] == "globex" and {row["model"] for row in theirs["data"]} <= {"llama3-8b", "mamba2-2.7b"}

        # Billing's view: usage events with the engine's token counts.
        events = asyncio.run(usage_events(state, tenant="acme", want=4, timeout_s=20))
        completed = [e for e in events if e["outcome"] == "completed"]
        assert completed and all(e["completion_tokens"] > 0 and e["key_id"].startswith("key-") for e in completed)
        assert all(e["tenant"] == "acme" for e in events)

        # Request-level SLO metrics on the gateway's /metrics.
        with urllib.request.urlopen(f"{gateway_url}/metrics", timeout=5) as answer:
            metrics = answer.read().decode()
        assert 'hetsched_gateway_ttft_seconds_bucket{engine="ssm"' in metrics
        assert re.search(r'hetsched_gateway_requests_total\{model="llama3.1-8b",outcome="failed_over"', metrics)
    finally:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=120)
        except subprocess.TimeoutExpired:
            up.kill()
