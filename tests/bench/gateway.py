"""Benchmark: what the gateway adds to a request, on the stack `hetsched up --engines sim` runs.

    python -m tests.bench.gateway [--rate 200] [--seconds 10] [--rounds 2] [--big-kb 200] [--big-n 20]
                                  [--speedup 20] [--json]

`hetsched up --engines sim` starts in a temporary directory on a one-node fleet (one H100 node, so one
agent), the gateway on a free port. One API key is issued with the CLI and one llama3.1-8b replica is
placed (64k context) for its tenant; its simulated engine (`--speedup`: the modelled times divided by it)
becomes ready. Then, in one run, the same open-loop load goes to the engine's endpoint directly and through
the gateway: streamed chat completions with short prompts (about 30 tokens, 16 out) at --rate for
--seconds, the two arms alternating --rounds times; beside each arm a NATS echo (``tests.bench.echo``) is
timed open loop at the same rate (the bus and two Python clients on this machine at that moment). Then
--big-n requests with a --big-kb prompt, alternating direct and through the gateway, one at a time.

Each arm prints TTFT (send to the first content chunk) and end-to-end p50/p99/max and its errors; the
gateway's added latency is the gateway arm's quantile minus the direct arm's. The gateway's own histogram
(``hetsched_gateway_added_seconds``: arrival to the engine request, routing and admission included) is
read from its /metrics. Admission's per-replica queue limit and the tenant's token bucket are raised
(HETSCHED_ADMIT_MAX_QUEUE_DEPTH, HETSCHED_ADMIT_TENANT_RATE) so that one replica takes the whole rate:
the benchmark measures the gateway, not those policies. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import nats
import psutil

from hetsched.stack import wait_healthy
from shared.contracts.subjects import Subjects
from tests.bench.full_stack import cpu_seconds, machine_busy_s
from tests.bench.loadgen import nearest_rank, positive

START_TIMEOUT_S = 240.0
FLEET = """
regions:
  - name: us-west-1
    clusters:
      - name: c1
        racks:
          - name: r1
            power_kw: 20
            nodes:
              - name: bench-h100-01
                sku: H100-SXM-80GB
                gpus: 8
                topology: nvswitch-8
"""
SHORT_PROMPT = "Summarise the benefits of tensor parallelism within one NVLink domain in a sentence."
MODEL = "llama3.1-8b"
BIG_MODEL = "mamba2-2.7b"  # an SSM: a 200 KB prompt (about 51k tokens) costs it no KV


async def place_ready(data_dir: Path, env: dict[str, str], model: str, context: int, concurrency: int) -> str:
    """Place a replica for the bench tenant; its endpoint once ready."""
    placed = cli(
        data_dir, env, "place", "--model", model, "--tenant", "bench", "--context-tokens", str(context),
        "--concurrency", str(concurrency), "--backend", "gpu", "--request-id", f"bench-{uuid.uuid4().hex[:8]}",
        "--json",
    )  # fmt: skip
    if placed.returncode != 0:
        raise RuntimeError(f"place failed: {placed.stdout} {placed.stderr}")
    replica_id = json.loads(placed.stdout)["allocation_id"]
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        shown = cli(data_dir, env, "replicas", "--json")
        for row in json.loads(shown.stdout)["replicas"] if shown.returncode == 0 else []:
            if row.get("replica_id") == replica_id and row.get("state") == "ready" and row.get("endpoint"):
                return str(row["endpoint"])
        await asyncio.sleep(0.5)
    raise RuntimeError(f"the {model} replica did not become ready")


@dataclass
class Arm:
    name: str
    ttft_ms: list[float] = field(default_factory=list)
    e2e_ms: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)
    sent: int = 0

    def q(self, which: str, quantile: float) -> float:
        return nearest_rank(sorted(getattr(self, which)), quantile)

    def line(self) -> str:
        return (
            f"{self.name:<28} n={len(self.ttft_ms):>5}/{self.sent:<5} errors={self.errors or 0}  "
            f"TTFT p50 {self.q('ttft_ms', 0.5):7.2f}  p99 {self.q('ttft_ms', 0.99):7.2f}  "
            f"max {max(self.ttft_ms, default=float('nan')):7.2f} ms   "
            f"e2e p50 {self.q('e2e_ms', 0.5):7.2f}  p99 {self.q('e2e_ms', 0.99):7.2f} ms"
        )

    def merge(self, other: Arm) -> None:
        self.ttft_ms += other.ttft_ms
        self.e2e_ms += other.e2e_ms
        self.sent += other.sent
        for k, v in other.errors.items():
            self.errors[k] = self.errors.get(k, 0) + v


def cpu_by_part(state: dict[str, Any], engine_pid: int | None) -> dict[str, float]:
    """CPU seconds so far of the parts a request touches: the gateway, router, placement, the engine, NATS,
    Postgres (with its backends), this client, and the whole machine (every core, busy)."""
    services = state.get("services", {})
    pids = {
        "gateway": services.get("gateway"),
        "router": services.get("cross_region_router"),
        "placement": services.get("placement"),
        "engine": engine_pid,
        "nats": state.get("servers", {}).get("nats_pid"),
        "postgres": state.get("servers", {}).get("postgres_pid"),
        "client": os.getpid(),
    }
    out = {name: cpu_seconds(pid, tree=name == "postgres") for name, pid in pids.items() if pid}
    out["machine"] = machine_busy_s()
    return out


def engine_pid_of(endpoint: str) -> int | None:
    port = int(endpoint.rsplit(":", 1)[1])
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = proc.info["cmdline"] or []
        if "hetsched.engines.sim_server" in " ".join(cmdline) and str(port) in cmdline:
            return int(proc.pid)
    return None


def cli(data_dir: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hetsched.cli", *args, "--data-dir", str(data_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


async def one_stream(session: aiohttp.ClientSession, url: str, headers: dict[str, str], body: bytes, arm: Arm) -> None:
    started = time.perf_counter()
    first: float | None = None
    try:
        async with session.post(url, data=body, headers=headers) as reply:
            if reply.status != 200:
                key = f"http {reply.status}"
                arm.errors[key] = arm.errors.get(key, 0) + 1
                await reply.read()
                return
            async for line in reply.content:
                if (
                    first is None
                    and line.startswith(b"data:")
                    and b'"content"' in line
                    and b'"content": ""' not in line
                ):
                    first = time.perf_counter()
    except (aiohttp.ClientError, TimeoutError) as exc:
        key = type(exc).__name__
        arm.errors[key] = arm.errors.get(key, 0) + 1
        return
    done = time.perf_counter()
    if first is None:
        arm.errors["no token"] = arm.errors.get("no token", 0) + 1
        return
    arm.ttft_ms.append((first - started) * 1000)
    arm.e2e_ms.append((done - started) * 1000)


async def open_loop(rate: float, seconds: float, fire: Any) -> None:
    tasks: list[asyncio.Task[None]] = []
    begin = time.perf_counter()
    for i in range(int(rate * seconds)):
        delay = begin + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(fire()))
    await asyncio.gather(*tasks)


async def echo_loop(nc: Any, subject: str, rate: float, seconds: float, arm: Arm) -> None:
    async def once() -> None:
        arm.sent += 1
        started = time.perf_counter()
        try:
            await nc.request(subject, b"x" * 64, timeout=5)
        except Exception as exc:
            arm.errors[type(exc).__name__] = arm.errors.get(type(exc).__name__, 0) + 1
            return
        ms = (time.perf_counter() - started) * 1000
        arm.ttft_ms.append(ms)
        arm.e2e_ms.append(ms)

    await open_loop(rate, seconds, once)


def added_histogram(metrics: str) -> dict[str, float]:
    """p50/p99 of hetsched_gateway_added_seconds from the exposition text, interpolated within buckets (as
    Prometheus's histogram_quantile does)."""
    buckets: list[tuple[float, float]] = []
    for line in metrics.splitlines():
        found = re.match(r'hetsched_gateway_added_seconds_bucket\{le="([^"]+)"\} (\S+)', line)
        if found:
            buckets.append((float(found.group(1)), float(found.group(2))))
    if not buckets or buckets[-1][1] == 0:
        return {}
    total = buckets[-1][1]
    out: dict[str, float] = {"count": total}
    for q in (0.5, 0.99):
        rank = q * total
        low_le, low_count = 0.0, 0.0
        for le, count in buckets:
            if count >= rank:
                inside = (rank - low_count) / (count - low_count) if count > low_count else 1.0
                value = le if le == float("inf") else low_le + (le - low_le) * inside
                out[f"p{int(q * 100)}_ms"] = round(value * 1000, 3)
                break
            low_le, low_count = le, count
    return out


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="hetsched-bench-gateway-"))
    data_dir = workdir / "data"
    fleet = workdir / "fleet.yaml"
    fleet.write_text(FLEET)
    env = {k: v for k, v in os.environ.items() if not k.startswith("HETSCHED_")}
    env |= {
        "HETSCHED_GATEWAY_PORT": "0",
        "HETSCHED_AGENT_SIM_SPEEDUP": str(args.speedup),
        "HETSCHED_AGENT_STATUS_S": "1",
        "HETSCHED_AGENT_RECONCILE_S": "0.5",
        "HETSCHED_ADMIT_MAX_QUEUE_DEPTH": "100000",
        "HETSCHED_ADMIT_TENANT_RATE": "100000",
        "HETSCHED_ADMIT_TENANT_BURST": "100000",
    }
    if args.profile:  # every service profiles its whole run (HETSCHED_PROFILE_DIR); printed at the end
        env["HETSCHED_PROFILE_DIR"] = str((workdir / "profiles").resolve())
    log = open(workdir / "up.log", "wb")
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
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    echo: subprocess.Popen[str] | None = None
    nc: Any = None
    try:
        state_file = data_dir / "stack.json"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not state_file.exists():
            if up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"hetsched up did not start; see {workdir / 'up.log'}")
            await asyncio.sleep(0.2)
        state = json.loads(state_file.read_text())
        seed = state["nats_nkey_seed_file"]
        health = await wait_healthy(
            nats_url=state["nats_url"], subjects=Subjects("hetsched"), deadline_s=START_TIMEOUT_S, nkeys_seed=seed
        )
        if any(r.get("status") != "ok" for r in health.values()):
            raise RuntimeError(f"not healthy: {health}")
        gateway_url = health["gateway"]["http_url"]
        issued = cli(data_dir, env, "credentials", "issue", "--tenant", "bench", "--api-key")
        key = re.search(r"^api_key=(\S+)$", issued.stdout, re.MULTILINE)
        if key is None:
            raise RuntimeError(f"no key: {issued.stdout} {issued.stderr}")
        endpoints = {}
        for model, context, concurrency in ((MODEL, 4096, 64), (BIG_MODEL, 65536, 8)):
            endpoints[model] = await place_ready(data_dir, env, model, context, concurrency)
        endpoint, big_endpoint = endpoints[MODEL], endpoints[BIG_MODEL]
        await asyncio.sleep(2.0)  # its first status report
        echo_subject = f"bench.echo.{uuid.uuid4().hex[:10]}"
        echo = subprocess.Popen(
            [sys.executable, "-m", "tests.bench.echo", state["nats_url"], echo_subject, "--seed", seed],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert echo.stdout is not None
        await asyncio.to_thread(echo.stdout.readline)
        nc = await nats.connect(state["nats_url"], nkeys_seed=seed, name="bench-gateway")

        direct_url = f"{endpoint}/v1/chat/completions"
        gateway_chat = f"{gateway_url}/v1/chat/completions"
        plain = {"Content-Type": "application/json"}
        authed = plain | {"Authorization": f"Bearer {key.group(1)}"}

        def body(prompt: str, max_tokens: int, model: str = MODEL) -> bytes:
            return json.dumps(
                {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                 "stream": True}
            ).encode()  # fmt: skip

        short = body(SHORT_PROMPT, 16)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=120)) as session:
            for _ in range(20):  # warm: connections, caches
                await one_stream(session, direct_url, plain, short, Arm("warm"))
                await one_stream(session, gateway_chat, authed, short, Arm("warm"))
            direct, through, echo_d, echo_g = (
                Arm("direct"),
                Arm("through the gateway"),
                Arm("echo (direct arm)"),
                Arm("echo (gateway arm)"),
            )
            cpu: dict[str, dict[str, float]] = {direct.name: {}, through.name: {}}
            engine_pid = engine_pid_of(endpoint)
            for _ in range(args.rounds):
                for arm, url, headers, echo_arm in (
                    (direct, direct_url, plain, echo_d),
                    (through, gateway_chat, authed, echo_g),
                ):
                    part = Arm(arm.name)

                    async def fire(url: str = url, headers: dict[str, str] = headers, part: Arm = part) -> None:
                        part.sent += 1
                        await one_stream(session, url, headers, short, part)

                    before = cpu_by_part(state, engine_pid)
                    await asyncio.gather(
                        open_loop(args.rate, args.seconds, fire),
                        echo_loop(nc, echo_subject, args.rate, args.seconds, echo_arm),
                    )
                    after = cpu_by_part(state, engine_pid)
                    for name in after:
                        cpu[arm.name][name] = cpu[arm.name].get(name, 0.0) + after[name] - before.get(name, 0.0)
                    arm.merge(part)
                    await asyncio.sleep(1.0)
            big_prompt = ("lorem ipsum dolor sit amet " * (args.big_kb * 1024 // 27 + 1))[: args.big_kb * 1024]
            big = body(big_prompt, 4, BIG_MODEL)
            big_direct_url = f"{big_endpoint}/v1/chat/completions"
            big_direct, big_through = Arm(f"{args.big_kb} KB direct"), Arm(f"{args.big_kb} KB through the gateway")
            for _ in range(args.big_n):
                for arm, url, headers in ((big_direct, big_direct_url, plain), (big_through, gateway_chat, authed)):
                    arm.sent += 1
                    await one_stream(session, url, headers, big, arm)
        with urllib.request.urlopen(f"{gateway_url}/metrics", timeout=5) as answer:
            own = added_histogram(answer.read().decode())
        arms = [direct, through, echo_d, echo_g, big_direct, big_through]
        result: dict[str, Any] = {
            "rate": args.rate,
            "seconds": args.seconds,
            "rounds": args.rounds,
            "speedup": args.speedup,
            "arms": {
                a.name: {
                    "n": len(a.ttft_ms),
                    "sent": a.sent,
                    "errors": a.errors,
                    **{f"ttft_p{int(q * 100)}_ms": round(a.q("ttft_ms", q), 3) for q in (0.5, 0.99)},
                    **{f"e2e_p{int(q * 100)}_ms": round(a.q("e2e_ms", q), 3) for q in (0.5, 0.99)},
                }
                for a in arms
            },
            "added_ms": {
                "ttft_p50": round(through.q("ttft_ms", 0.5) - direct.q("ttft_ms", 0.5), 3),
                "ttft_p99": round(through.q("ttft_ms", 0.99) - direct.q("ttft_ms", 0.99), 3),
                "e2e_p50": round(through.q("e2e_ms", 0.5) - direct.q("e2e_ms", 0.5), 3),
                "e2e_p99": round(through.q("e2e_ms", 0.99) - direct.q("e2e_ms", 0.99), 3),
                "big_ttft_p50": round(big_through.q("ttft_ms", 0.5) - big_direct.q("ttft_ms", 0.5), 3),
                "big_ttft_p99": round(big_through.q("ttft_ms", 0.99) - big_direct.q("ttft_ms", 0.99), 3),
            },
            "gateway_added_histogram": own,
            "cpu_per_request_ms": {
                arm: {k: round(v * 1000 / (args.rate * args.seconds * args.rounds), 3) for k, v in parts.items()}
                for arm, parts in cpu.items()
            },
            "machine_busy_share": {
                arm: round(parts.get("machine", 0.0) / (psutil.cpu_count() * args.seconds * args.rounds), 3)
                for arm, parts in cpu.items()
            },
        }
        for a in arms:
            print(a.line())
        print(f"added by the gateway (gateway arm - direct arm): {result['added_ms']}")
        print(f"gateway's own time before the engine (its histogram): {own}")
        print(f"CPU ms per request by part (machine: all cores): {result['cpu_per_request_ms']}")
        print(f"share of the machine's cores busy during each arm: {result['machine_busy_share']}")
        return result
    finally:
        if nc is not None:
            await nc.close()
        if echo is not None:
            echo.send_signal(signal.SIGTERM)
            echo.wait(timeout=10)
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(timeout=120)
        except subprocess.TimeoutExpired:
            up.kill()
        if args.profile:
            print_profiles(workdir / "profiles")


def print_profiles(directory: Path) -> None:
    import io
    import pstats

    for path in sorted(directory.glob("*.prof")):
        if not path.name.startswith(("gateway", "cross-region-router", "placement")):
            continue
        out = io.StringIO()
        stats = pstats.Stats(str(path), stream=out)
        stats.sort_stats("tottime").print_stats(25)
        print(f"== {path.name}: total {stats.total_tt:.1f} s CPU (profiled)")  # type: ignore[attr-defined]
        print("\n".join(out.getvalue().splitlines()[6:40]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=positive, default=200.0)
    parser.add_argument("--seconds", type=positive, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--big-kb", type=int, default=200)
    parser.add_argument("--big-n", type=int, default=20)
    parser.add_argument("--speedup", type=positive, default=20.0)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="profile the services; print the gateway's, router's and placement's top functions",
    )
    args = parser.parse_args()
    result = asyncio.run(bench(args))
    if args.json:
        print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
