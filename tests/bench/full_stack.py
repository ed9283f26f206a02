"""Benchmark: the wire path on the full stack, as a user runs it, with the bus's own round trip beside it.

    python -m tests.bench.full_stack [--scenario place|place-slow|admit|route|all] [--rate R] [--seconds 10]
                                     [--nodes 1024] [--replicas 24] [--new-tenants] [--hold-s 1] [--json]

`python -m hetsched up --data-dir TMP --fleet TMP/fleet.yaml` starts the stack in a temporary directory:
embedded NATS (NKey authentication) and Postgres, migrations, the six services with every consumer they
run. The fleet is `placement_e2e.bench_fleet`: --nodes seeded synthetic GPU nodes (1,024: 7,218 GPUs) in
the three regions of the shipped regions file. The benchmark connects as the operator (the seed the
state file names), waits until the ledger knows every accelerator and placement can place, then offers
each run open loop (a slow answer does not slow the offer):

- place: `placement.place` at 200/s in placement_e2e's mix (fallbacks, no queue); each placed replica
  is released --hold-s after its answer (untimed), so the fleet never fills. place-slow: the same at 50/s.
- admit: --replicas llama3.1-8b replicas are placed first (TP 1, spread over the regions) and a simulated
  engine reports each one's status every second from the replica's node (as `hetsched engine-sim` does);
  then `placement.admit` of 1,000-token requests from 50 tenants, each admission released with
  `placement.release` as soon as it is answered (untimed). 200/s; `all` runs 1,000/s too. A `queued`
  answer is asked again with its request id once a second after the last answer (as a gateway collects
  it) and released once admitted, until the admission queue's TTL.
- route: `route.select` at 500/s for 50 tenants, a new session per request (`admit: false`);
  --new-tenants makes every request a new tenant as well (`all` runs both).

`all` runs the six runs above on one stack (place, place-slow, route, admit: admissions left queued are
admitted for a while after), each after the stack is at rest; --rate R runs each chosen scenario at R
instead (once).
Beside every run an echo (`tests.bench.echo`, a process that answers at once) is timed open loop at the
same rate at the same time: what the bus and two Python clients cost on this machine in that moment.
Each run prints offered and achieved rate, outcomes, p50/p99/max, the echo's p50/p99, its goal worked
out from the echo's p99, the CPU seconds of every process of the stack (the six services, nats-server,
Postgres with its backends, `hetsched up` itself; the echo, this client and the rest of the machine
apart) with the stack's CPU per operation, read at the last answer and again once the stack is back at
rest (its consumers through the run's events), and the ledger's commit counter
(`hetsched_ledger_commits_total`, read from the metrics endpoint `hetsched status --json` names) before
and after. Nothing is asserted. The stack is stopped with SIGTERM at the end, on an error and on Ctrl-C.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import pstats
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats
import nats.errors
import psutil
import yaml

from hetsched.engine_sim import EngineLoad, publish_engine_status
from hetsched.stack import wait_healthy
from shared.contracts.subjects import Rpc, Subjects
from tests.bench.loadgen import LoadResult, nearest_rank, positive, run_open_loop
from tests.bench.placement_e2e import MIX, bench_fleet, placement_ready

REGIONS = ("us-west-1", "us-east-1", "eu-west-1")  # bench_fleet's regions, all in the shipped regions file
FALLBACKS = ["kv_quantize", "pipeline", "cross_domain"]  # no queue: a queued replica would never be released
ADMIT_MODEL = "llama3.1-8b"
TENANTS = 50
ENGINE_REPORT_S = 1.0
START_TIMEOUT_S = 600.0  # how long the stack may take to start and learn the fleet before the run gives up
CALL_TIMEOUT_S = 30.0
WARM_UP = 20
COMMITS_METRIC = "hetsched_ledger_commits_total"
LEDGER = "capacity-ledger"  # the ledger's service name in `hetsched status --json`


# -- the stack ---------------------------------------------------------------------------------------


class FullStack:
    """`hetsched up` as a subprocess, the echo beside it, and an operator's NATS connection."""

    def __init__(self, workdir: Path, fleet: dict[str, Any], profile_dir: Path | None = None) -> None:
        self.workdir = workdir
        self.data_dir = workdir / "data"
        self.fleet_file = workdir / "fleet.yaml"
        self.fleet_file.write_text(yaml.safe_dump(fleet))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("HETSCHED_")}  # embedded servers
        # The admitted replicas are placed by "platform" and serve every tenant: a shared pool.
        self.env["HETSCHED_ADMIT_SHARED_OWNERS"] = "platform"
        if profile_dir is not None:  # every service profiles its whole run (HETSCHED_PROFILE_DIR)
            self.env["HETSCHED_PROFILE_DIR"] = str(profile_dir.resolve())
        self.up: subprocess.Popen[bytes] | None = None
        self.echo: subprocess.Popen[str] | None = None
        self.echo_subject = f"bench.echo.{uuid.uuid4().hex[:10]}"
        self.state: dict[str, Any] = {}
        self.metrics_urls: dict[str, str] = {}
        self.nc: Any = None
        self.subjects = Subjects("hetsched")

    async def start(self) -> None:
        log = open(self.workdir / "up.log", "wb")  # the child keeps its copy
        self.up = subprocess.Popen(
            [sys.executable, "-m", "hetsched", "up", "--data-dir", str(self.data_dir), "--fleet", str(self.fleet_file)],
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        state_file = self.data_dir / "stack.json"
        deadline = time.monotonic() + START_TIMEOUT_S
        while not state_file.exists():
            if self.up.poll() is not None:
                raise RuntimeError(f"hetsched up exited with {self.up.returncode}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"hetsched up wrote no state file:\n{self.log_tail()}")
            await asyncio.sleep(0.2)
        self.state = json.loads(state_file.read_text())
        self.subjects = Subjects(self.state["subject_prefix"])
        seed = self.state["nats_nkey_seed_file"]
        health = await wait_healthy(
            nats_url=self.state["nats_url"], subjects=self.subjects, deadline_s=START_TIMEOUT_S, nkeys_seed=seed
        )
        down = {p: r for p, r in health.items() if r.get("status") != "ok"}
        if down:
            raise RuntimeError(f"services not healthy: {down}\n{self.log_tail()}")
        self.metrics_urls = self.status_metrics_urls()
        self.nc = await nats.connect(self.state["nats_url"], nkeys_seed=seed, name="bench-full-stack")
        self.echo = subprocess.Popen(
            [sys.executable, "-m", "tests.bench.echo", self.state["nats_url"], self.echo_subject, "--seed", seed],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.echo.stdout is not None
        ready = await asyncio.to_thread(self.echo.stdout.readline)
        if ready.strip() != "ready":
            raise RuntimeError(f"the echo did not start: {ready!r}")

    def status_metrics_urls(self) -> dict[str, str]:
        """Each service's metrics endpoint, as `hetsched status --json` names it."""
        shown = subprocess.run(
            [sys.executable, "-m", "hetsched", "status", "--json", "--data-dir", str(self.data_dir)],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        report = json.loads(shown.stdout)
        return {name: r["metrics_url"] for name, r in report["services"].items() if r.get("metrics_url")}

    def log_tail(self) -> str:
        return (self.workdir / "up.log").read_text(errors="replace")[-4000:]

    async def stop(self) -> None:
        if self.nc is not None:
            await self.nc.close()
        if self.echo is not None and self.echo.poll() is None:
            self.echo.terminate()
            self.echo.wait(timeout=30)
        if self.up is not None and self.up.poll() is None:
            self.up.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(self.up.wait, 120)
            except subprocess.TimeoutExpired:
                self.up.kill()
                self.up.wait(timeout=30)

    async def call(self, rpc: Rpc, body: dict[str, Any], *, timeout: float = CALL_TIMEOUT_S) -> dict[str, Any]:
        msg = await self.nc.request(self.subjects.rpc(rpc), json.dumps(body).encode(), timeout=timeout)
        reply: dict[str, Any] = json.loads(msg.data)
        return reply

    async def echo_once(self, i: int) -> str:
        try:
            await self.nc.request(self.echo_subject, b'{"i": %d}' % i, timeout=CALL_TIMEOUT_S)
        except nats.errors.TimeoutError:
            return "timeout"
        return "answered"

    async def ledger_knows(self, accelerators: int) -> None:
        """Wait until the ledger's snapshot holds ``accelerators`` accelerators (it learnt the whole fleet)."""
        deadline = time.monotonic() + START_TIMEOUT_S
        known = 0
        while time.monotonic() < deadline:
            try:
                known, cursor = 0, None
                while True:
                    body: dict[str, Any] = {"limit": 20_000, **({"cursor": cursor} if cursor else {})}
                    page = await self.call(Rpc.LEDGER_SNAPSHOT, body, timeout=10)
                    known += len(page.get("accelerators", []))
                    cursor = page.get("next_cursor")
                    if not cursor:
                        break
                if known >= accelerators:
                    return
            except Exception:
                pass
            await asyncio.sleep(0.5)
        raise RuntimeError(f"the ledger knows {known} of {accelerators} accelerators")

    def ledger_commits(self) -> float | None:
        """The ledger's commit counter now (None when it serves no metrics)."""
        url = self.metrics_urls.get(LEDGER)
        if url is None:
            return None
        with urllib.request.urlopen(url, timeout=10) as response:
            text = response.read().decode()
        for line in text.splitlines():
            if line.startswith(COMMITS_METRIC + " "):
                return float(line.split()[1])
        return 0.0

    # -- CPU -----------------------------------------------------------------------------------

    def processes(self) -> dict[str, tuple[int, bool]]:
        """Every process to account: name -> (pid, with its children); the state file is read again, so a
        service `up` restarted is followed (its restart shows as CPU lost, and is reported)."""
        state = json.loads((self.data_dir / "stack.json").read_text())
        found = {package: (int(pid), False) for package, pid in state["services"].items()}
        servers = state.get("servers") or {}
        if servers.get("nats_pid"):
            found["nats-server"] = (int(servers["nats_pid"]), False)
        if servers.get("postgres_pid"):
            found["postgres"] = (int(servers["postgres_pid"]), True)  # its backends are its children
        assert self.up is not None
        found["hetsched up"] = (self.up.pid, False)
        return found

    def cpu_now(self) -> dict[str, tuple[int, float]]:
        """CPU seconds (user + system) of each process so far, with its pid; the echo and this client too."""
        seen = {name: (pid, cpu_seconds(pid, tree=tree)) for name, (pid, tree) in self.processes().items()}
        assert self.echo is not None
        seen["echo"] = (self.echo.pid, cpu_seconds(self.echo.pid, tree=False))
        seen["client"] = (os.getpid(), time.process_time())
        seen["machine"] = (0, machine_busy_s())
        return seen


def machine_busy_s() -> float:
    """CPU seconds every core of the machine has spent busy (user, nice, system, interrupts) since boot."""
    t = psutil.cpu_times()
    return float(t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0))


def cpu_seconds(pid: int, *, tree: bool) -> float:
    """User + system CPU seconds of ``pid``; with ``tree``, also of its children, live (their own times) and
    reaped (the parent's children times): Postgres's backends come and go under the postmaster."""
    try:
        proc = psutil.Process(pid)
        times = proc.cpu_times()
        used = times.user + times.system
        if tree:
            used += times.children_user + times.children_system
            for child in proc.children(recursive=True):
                try:
                    t = child.cpu_times()
                    used += t.user + t.system
                except psutil.NoSuchProcess:
                    pass  # reaped since: its time is in the parent's children times at the next reading
    except psutil.NoSuchProcess:
        return math.nan
    return used


STACK = (
    "topology_discovery",
    "capacity_ledger",
    "placement",
    "reservation_filler",
    "cross_region_router",
    "rebalancer",
    "nats-server",
    "postgres",
    "hetsched up",
)
"""The order processes are printed in; the stack's CPU is theirs (the echo and the client are not the stack)."""


# -- one run -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Goal:
    """A latency goal ``p99 <= max(floor_ms, factor x echo p99)`` (factor 0: the floor alone), and whether
    the rate must be held and the ledger's commit counter stand still."""

    floor_ms: float
    factor: float
    hold_rate: bool = True
    no_commit: bool = False

    def bound_ms(self, echo_p99_ms: float) -> float:
        return max(self.floor_ms, self.factor * echo_p99_ms) if self.factor else self.floor_ms

    def formula(self, echo_p99_ms: float) -> str:
        if not self.factor:
            return f"p99 <= {self.floor_ms:g} ms"
        return (
            f"p99 <= max({self.floor_ms:g} ms, {self.factor:g}x echo p99 {echo_p99_ms:.2f} ms) "
            f"= {self.bound_ms(echo_p99_ms):.1f} ms"
        )


@dataclass(frozen=True)
class CpuSpan:
    """CPU seconds each process used over ``seconds`` of wall time (``machine``: every core's busy time)."""

    cpu_s: dict[str, float]
    seconds: float

    @property
    def stack_s(self) -> float:
        return sum(v for k, v in self.cpu_s.items() if k in STACK and not math.isnan(v))

    @property
    def others_s(self) -> float:
        """CPU the rest of the machine used meanwhile: everything busy less the stack, the echo and the client."""
        ours = sum(v for k, v in self.cpu_s.items() if k != "machine" and not math.isnan(v))
        return self.cpu_s.get("machine", math.nan) - ours

    def per_op_ms(self, ops: int, rest_per_s: float | None = None) -> float:
        """The stack's CPU per operation in ms; with ``rest_per_s``, less what it uses at rest meanwhile."""
        extra = self.stack_s - (rest_per_s or 0.0) * self.seconds
        return 1000 * extra / max(1, ops)

    def lines(self, ops: int, rest_per_s: float | None) -> str:
        cpu = ", ".join(f"{k} {self.cpu_s[k]:.2f}" for k in STACK if k in self.cpu_s)
        ours = ", ".join(f"{k} {v:.2f}" for k, v in self.cpu_s.items() if k not in STACK and k != "machine")
        rest = "" if rest_per_s is None else f", {self.per_op_ms(ops, rest_per_s):.2f} above rest"
        return (
            f"{cpu}\n"
            f"             stack {self.stack_s:.2f} CPU-s = {self.per_op_ms(ops):.2f} ms per operation{rest}; "
            f"{ours}; other processes on the machine {self.others_s:.2f} "
            f"(of {os.cpu_count()} cores x {self.seconds:.1f} s = {(os.cpu_count() or 1) * self.seconds:.1f} CPU-s)"
        )

    def as_json(self, ops: int, rest_per_s: float | None) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 2),
            "cpu_s": {k: round(v, 3) for k, v in self.cpu_s.items()},
            "stack_cpu_s": round(self.stack_s, 3),
            "stack_cpu_ms_per_op": round(self.per_op_ms(ops), 3),
            "stack_cpu_ms_per_op_above_rest": round(self.per_op_ms(ops, rest_per_s), 3),
            "other_processes_cpu_s": round(self.others_s, 3),
        }


@dataclass
class Run:
    """One run's figures, printed and (``--json``) written as JSON.

    ``during``: CPU from the first request to the last answer (and the releases it started); ``to_rest``:
    from the first request until the stack was back at rest, so it holds the events its consumers were
    still working through after the last answer."""

    label: str
    subject: str
    offered_per_s: float
    seconds: float
    load: LoadResult
    echo: LoadResult
    ok_outcome: str
    goal: Goal
    during: CpuSpan
    to_rest: CpuSpan
    restarted: list[str] = field(default_factory=list)
    commits_before: float | None = None
    commits_after: float | None = None
    commits_at_rest: float | None = None
    releases_ms: list[float] = field(default_factory=list)
    release_outcomes: dict[str, int] = field(default_factory=dict)
    note: str = ""
    after: str = ""  # what the follow-up after the last answer did (untimed; in ``to_rest`` only)
    rest_cpu_per_s: float | None = None  # the stack's CPU at rest before the run, CPU-s per second
    settled: bool = True  # whether the stack was back at rest when ``to_rest`` was read

    @property
    def ok_per_s(self) -> float:
        ok = sum(n for o, n in self.load.outcomes.items() if o.startswith(self.ok_outcome))
        return ok * self.load.achieved_per_s / max(1, self.load.sent)

    @property
    def commits(self) -> float | None:
        if self.commits_before is None or self.commits_after is None:
            return None
        return self.commits_after - self.commits_before

    def verdict(self) -> tuple[bool, list[str]]:
        """Whether every part of the goal is met, and each part in words."""
        echo_p99 = self.echo.p99_ms
        bound = self.goal.bound_ms(echo_p99)
        p99_met = self.load.p99_ms <= bound
        parts = [f"{self.goal.formula(echo_p99)}: {'met' if p99_met else 'NOT met'} (p99 {self.load.p99_ms:.1f} ms)"]
        met = p99_met
        if self.goal.hold_rate:
            # Achieved rates count the tail after the last send, and the client may not send faster than the
            # machine lets it: the echo's achieved rate, timed beside, is what the bus and the client managed.
            reachable = min(self.offered_per_s, self.echo.achieved_per_s or self.offered_per_s)
            held = self.ok_per_s >= 0.98 * reachable
            parts.append(
                f"{self.offered_per_s:g}/s held: {'yes' if held else 'NO'} ({self.ok_outcome} {self.ok_per_s:.0f}/s, "
                f"echo {self.echo.achieved_per_s:.0f}/s)"
            )
            met = met and held
        if self.goal.no_commit:
            still = self.commits == 0
            parts.append(f"no ledger commit: {'yes' if still else 'NO'} ({_count(self.commits)} during the run)")
            met = met and still
        return met, parts

    def text(self) -> str:
        ops = self.load.sent
        met, parts = self.verdict()
        after = f"\n  after      {self.after}" if self.after else ""
        releases = ""
        if self.release_outcomes:
            ordered = sorted(self.releases_ms)
            releases = (
                f"\n  releases   {self.release_outcomes} (untimed in the goal): p50 "
                f"{_ms(nearest_rank(ordered, 0.5))} ms, p99 {_ms(nearest_rank(ordered, 0.99))} ms"
            )
        restarted = ""
        if self.restarted:
            restarted = f"\n  RESTARTED  {self.restarted} (their CPU before the restart is missing)"
        rest = "" if self.rest_cpu_per_s is None else f"; at rest before it {self.rest_cpu_per_s:.2f} CPU-s/s"
        back = "back at rest" if self.settled else "NOT back at rest"
        return (
            f"== {self.label}: {self.subject}, {self.offered_per_s:g}/s offered for {self.seconds:g} s"
            f"{' (' + self.note + ')' if self.note else ''} ==\n"
            f"  answered   {self.load.achieved_per_s:.0f}/s achieved, client send lag max "
            f"{self.load.send_lag_ms:.1f} ms; outcomes {dict(sorted(self.load.outcomes.items()))}\n"
            f"  latency    p50 {_ms(self.load.p50_ms)} ms, p99 {_ms(self.load.p99_ms)} ms, "
            f"max {_ms(self.load.max_ms)} ms\n"
            f"  NATS echo  p50 {_ms(self.echo.p50_ms)} ms, p99 {_ms(self.echo.p99_ms)} ms, "
            f"max {_ms(self.echo.max_ms)} ms ({self.echo.achieved_per_s:.0f}/s, {dict(self.echo.outcomes)})"
            f"{releases}\n"
            f"  ledger     commits {_count(self.commits_before)} -> {_count(self.commits_after)} "
            f"({_count(self.commits)} during the run; {_count(self.commits_at_rest)} once back at rest)\n"
            f"  CPU s      during the run ({self.during.seconds:.1f} s, {ops} operations{rest}):\n"
            f"             {self.during.lines(ops, self.rest_cpu_per_s)}\n"
            f"  CPU s      until {back} ({self.to_rest.seconds:.1f} s):\n"
            f"             {self.to_rest.lines(ops, self.rest_cpu_per_s)}{restarted}\n"
            f"  goal       {'MET' if met else 'not met'}: " + "; ".join(parts) + after
        )

    def as_json(self) -> dict[str, Any]:
        met, parts = self.verdict()
        ops = self.load.sent
        return {
            "run": self.label,
            "subject": self.subject,
            "offered_per_s": self.offered_per_s,
            "seconds": self.seconds,
            "achieved_per_s": round(self.load.achieved_per_s, 1),
            "ok_per_s": round(self.ok_per_s, 1),
            "send_lag_max_ms": round(self.load.send_lag_ms, 2),
            "outcomes": dict(self.load.outcomes),
            "p50_ms": _round(self.load.p50_ms),
            "p99_ms": _round(self.load.p99_ms),
            "max_ms": _round(self.load.max_ms),
            "echo": {
                "p50_ms": _round(self.echo.p50_ms),
                "p99_ms": _round(self.echo.p99_ms),
                "max_ms": _round(self.echo.max_ms),
                "achieved_per_s": round(self.echo.achieved_per_s, 1),
                "outcomes": dict(self.echo.outcomes),
            },
            "goal": {"p99_bound_ms": _round(self.goal.bound_ms(self.echo.p99_ms)), "met": met, "parts": parts},
            "cores": os.cpu_count(),
            "rest_cpu_per_s": self.rest_cpu_per_s,
            "cpu_during": self.during.as_json(ops, self.rest_cpu_per_s),
            "cpu_to_rest": {**self.to_rest.as_json(ops, self.rest_cpu_per_s), "settled": self.settled},
            "ledger_commits": self.commits,
            "ledger_commits_to_rest": (
                None
                if self.commits_at_rest is None or self.commits_before is None
                else self.commits_at_rest - self.commits_before
            ),
            "releases": dict(self.release_outcomes),
            "restarted": self.restarted,
            "note": self.note,
            "after": self.after,
        }


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def _round(value: float) -> float | None:
    return None if math.isnan(value) else round(value, 3)


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _span(before: dict[str, tuple[int, float]], after: dict[str, tuple[int, float]], seconds: float) -> CpuSpan:
    return CpuSpan({name: after[name][1] - before[name][1] for name in after if name in before}, seconds)


async def measure(
    stack: FullStack,
    *,
    label: str,
    subject: str,
    rate: float,
    seconds: float,
    one: Callable[[int], Awaitable[str]],
    ok_outcome: str,
    goal: Goal,
    settle: Callable[[], Awaitable[None]],
    follow_up: Callable[[], Awaitable[str]] | None = None,
    note: str = "",
) -> Run:
    """Warm up (untimed), then offer ``one`` and the echo open loop at ``rate`` at the same time. The CPU and
    the commit counter are read once everything ``one`` started has settled (``settle``: releases), and
    again once the stack is back at rest (its consumers through the run's events); ``follow_up`` (queued
    admissions collected) runs in between, so its CPU is in the second reading only."""
    await asyncio.gather(*(one(-1 - i) for i in range(WARM_UP)), *(stack.echo_once(-1 - i) for i in range(WARM_UP)))
    await settle()
    started = time.perf_counter()
    before = stack.cpu_now()
    commits_before = await asyncio.to_thread(stack.ledger_commits)
    load, echo = await asyncio.gather(
        run_open_loop(subject, rate, seconds, one, warm_up=0),
        run_open_loop("echo", rate, seconds, stack.echo_once, warm_up=0),
    )
    await settle()
    during = _span(before, stack.cpu_now(), time.perf_counter() - started)
    commits_after = await asyncio.to_thread(stack.ledger_commits)
    followed = await follow_up() if follow_up is not None else ""
    settled = await back_at_rest(stack, max_s=REST_AFTER_MAX_S)
    after = stack.cpu_now()
    to_rest = _span(before, after, time.perf_counter() - started)
    commits_at_rest = await asyncio.to_thread(stack.ledger_commits)
    restarted = [name for name in after if name in before and after[name][0] != before[name][0]]
    return Run(
        label=label,
        subject=subject,
        offered_per_s=rate,
        seconds=seconds,
        load=load,
        echo=echo,
        ok_outcome=ok_outcome,
        goal=goal,
        during=during,
        to_rest=to_rest,
        restarted=restarted,
        commits_before=commits_before,
        commits_after=commits_after,
        commits_at_rest=commits_at_rest,
        note=note,
        settled=settled,
        after=followed,
    )


class Releases:
    """Releases started in the background (untimed in a run's goal), their outcomes and latencies."""

    def __init__(self, stack: FullStack) -> None:
        self.stack = stack
        self.pending: set[asyncio.Task[None]] = set()
        self.latencies_ms: list[float] = []
        self.outcomes: dict[str, int] = {}

    def later(self, allocation_id: str, tenant: str, *, after_s: float, timed: bool) -> None:
        task = asyncio.create_task(self._release(allocation_id, tenant, after_s, timed))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def _release(self, allocation_id: str, tenant: str, after_s: float, timed: bool) -> None:
        if after_s > 0:
            await asyncio.sleep(after_s)
        started = time.perf_counter()
        try:
            reply = await self.stack.call(Rpc.PLACEMENT_RELEASE, {"allocation_id": allocation_id, "tenant": tenant})
            outcome = str(reply.get("status") or (reply.get("error") or {}).get("code"))
        except nats.errors.TimeoutError:
            outcome = "timeout"
        if timed:
            self.latencies_ms.append((time.perf_counter() - started) * 1000)
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    async def settle(self) -> None:
        while self.pending:
            await asyncio.gather(*list(self.pending))

    def reset(self) -> None:
        self.latencies_ms = []
        self.outcomes = {}


def outcome_of(reply: dict[str, Any]) -> str:
    status = str(reply.get("status", "?"))
    error = (reply.get("error") or {}).get("code")
    return f"{status}:{error}" if error else status


async def guarded(call: Awaitable[dict[str, Any]]) -> dict[str, Any] | str:
    """The reply, or the outcome of a call that was not answered."""
    try:
        return await call
    except nats.errors.TimeoutError:
        return "timeout"
    except Exception as exc:  # every other failure is an outcome to count, not a reason to stop
        return f"error:{type(exc).__name__}"


async def place_run(stack: FullStack, *, label: str, rate: float, seconds: float, hold_s: float, goal: Goal) -> Run:
    rng = random.Random(200)
    releases = Releases(stack)

    async def one(i: int) -> str:
        model, dtype, context, concurrency = rng.choice(MIX)
        body = {
            "request_id": f"{label}-{i}",
            "tenant": "bench",
            "model": model,
            "dtype": dtype,
            "context_tokens": context,
            "concurrency": concurrency,
            "backend": "gpu",
            "fallbacks": FALLBACKS,
        }
        reply = await guarded(stack.call(Rpc.PLACEMENT_PLACE, body))
        if isinstance(reply, str):
            return reply
        if reply.get("status") == "placed":
            releases.later(reply["allocation_id"], "bench", after_s=hold_s, timed=i >= 0)
        return outcome_of(reply)

    async def settle() -> None:
        await releases.settle()

    run = await measure(
        stack,
        label=label,
        subject="placement.place",
        rate=rate,
        seconds=seconds,
        one=one,
        ok_outcome="placed",
        goal=goal,
        settle=settle,
        note=f"each placed replica released {hold_s:g} s after its answer",
    )
    run.releases_ms, run.release_outcomes = releases.latencies_ms, releases.outcomes
    return run


class Engines:
    """The replicas the admit and route runs use, and a simulated engine reporting each one's status."""

    def __init__(self, stack: FullStack) -> None:
        self.stack = stack
        self.replicas: list[tuple[str, str, str]] = []  # (allocation id, node, region)
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self, count: int) -> None:
        for i in range(count):
            region = REGIONS[i % len(REGIONS)]
            body = {
                "request_id": f"replica-{i}",
                "tenant": "platform",
                "model": ADMIT_MODEL,
                "context_tokens": 8192,
                "concurrency": 16,
                "region": region,
                "tp": 1,
            }
            placed = await self.stack.call(Rpc.PLACEMENT_PLACE, body)
            if placed.get("status") != "placed":
                raise RuntimeError(f"replica {i} was not placed: {placed}")
            self.replicas.append((placed["allocation_id"], placed["placements"][0]["node"], region))
        js = self.stack.nc.jetstream()
        for n, (allocation_id, node, _region) in enumerate(self.replicas):
            self.tasks.append(asyncio.create_task(self._report(js, allocation_id, node, n / len(self.replicas))))
        # Admission takes a replica once its engine has reported: wait until each region admits.
        for region in {r for _, _, r in self.replicas}:
            deadline = time.monotonic() + 60
            while True:
                probe = {
                    "request_id": f"probe-{uuid.uuid4().hex[:8]}",
                    "tenant": "probe",
                    "model": ADMIT_MODEL,
                    "input_tokens": 100,
                    "output_tokens": 10,
                    "region": region,
                    "lease_s": 60,
                }
                reply = await self.stack.call(Rpc.PLACEMENT_ADMIT, probe)
                if reply.get("status") == "admitted":
                    await self.stack.call(
                        Rpc.PLACEMENT_RELEASE, {"allocation_id": reply["allocation_id"], "tenant": "probe"}
                    )
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"admission never admitted in {region}: {reply}")
                await asyncio.sleep(0.5)

    async def _report(self, js: Any, allocation_id: str, node: str, offset_s: float) -> None:
        rng = random.Random(allocation_id)
        load = EngineLoad(queue_depth=0, kv_used=0.1, jitter=0)
        await asyncio.sleep(offset_s * ENGINE_REPORT_S)  # spread over the second, as independent engines are
        while True:
            try:
                await publish_engine_status(
                    js, self.stack.subjects, load.status(replica_id=allocation_id, node=node, rng=rng)
                )
            except Exception as exc:  # a report lost under load is what an engine's sidecar would see too
                print(f"engine report for {allocation_id} failed: {type(exc).__name__}", file=sys.stderr)
            await asyncio.sleep(ENGINE_REPORT_S)

    def stop(self) -> None:
        for task in self.tasks:
            task.cancel()


QUEUE_TTL_S = 30.0
"""The admission queue's default TTL (``HETSCHED_ADMIT_QUEUE_TTL_S``): a queued request asked again after it
is dropped would start over, so it is asked no longer."""


async def admit_run(stack: FullStack, *, label: str, rate: float, seconds: float, goal: Goal) -> Run:
    releases = Releases(stack)
    queued: dict[str, tuple[float, dict[str, Any]]] = {}  # request id -> (when answered, its body)

    async def one(i: int) -> str:
        tenant = f"t{i % TENANTS}"
        body = {
            "request_id": f"{label}-{i}",
            "tenant": tenant,
            "model": ADMIT_MODEL,
            "input_tokens": 1000,
            "output_tokens": 256,
            "region": REGIONS[i % len(REGIONS)],
            "lease_s": 60,
        }
        reply = await guarded(stack.call(Rpc.PLACEMENT_ADMIT, body))
        if isinstance(reply, str):
            return reply
        if reply.get("status") == "admitted":
            releases.later(reply["allocation_id"], tenant, after_s=0, timed=i >= 0)
        elif reply.get("status") == "queued":
            queued[body["request_id"]] = (time.monotonic(), body)
        return outcome_of(reply)

    run = await measure(
        stack,
        label=label,
        subject="placement.admit",
        rate=rate,
        seconds=seconds,
        one=one,
        ok_outcome="admitted",
        goal=goal,
        settle=releases.settle,
        follow_up=lambda: follow_queued(stack, queued, releases),
        note=f"{TENANTS} tenants, each admission released when answered",
    )
    run.releases_ms, run.release_outcomes = releases.latencies_ms, releases.outcomes
    return run


async def follow_queued(stack: FullStack, queued: dict[str, tuple[float, dict[str, Any]]], releases: Releases) -> str:
    """After the run's last answer (untimed; in its CPU until back at rest, not during): ask each queued
    admission again with its request id once a second, as a gateway collects it, until it is admitted (then
    release it) or refused, or its time in the queue (``QUEUE_TTL_S``) is over; so few holds outlive the run.
    One line of what became of them (empty when none was queued)."""
    if not queued:
        return ""
    started = time.monotonic()
    waiting = dict(queued)
    outcomes: dict[str, int] = {}
    slots = asyncio.Semaphore(32)

    async def ask(request_id: str, body: dict[str, Any]) -> None:
        async with slots:
            reply = await guarded(stack.call(Rpc.PLACEMENT_ADMIT, body))
        outcome = reply if isinstance(reply, str) else outcome_of(reply)
        if outcome == "queued":
            return
        del waiting[request_id]
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        if isinstance(reply, dict) and reply.get("status") == "admitted":
            releases.later(reply["allocation_id"], body["tenant"], after_s=0, timed=False)

    while waiting:
        now = time.monotonic()
        for request_id in [r for r, (at, _) in waiting.items() if now - at > QUEUE_TTL_S - 1]:
            del waiting[request_id]
            outcomes["dropped from the queue (TTL)"] = outcomes.get("dropped from the queue (TTL)", 0) + 1
        await asyncio.gather(*(ask(r, b) for r, (_, b) in list(waiting.items())))
        await asyncio.sleep(1.0)
    await releases.settle()
    return (
        f"the {len(queued)} queued, asked again once a second with their request ids for "
        f"{time.monotonic() - started:.0f} s: {outcomes} (admitted ones released)"
    )


async def route_run(stack: FullStack, *, label: str, rate: float, seconds: float, new_tenants: bool, goal: Goal) -> Run:
    async def one(i: int) -> str:
        body = {
            "request_id": f"{label}-{i}",
            "tenant": f"{label}-t{i}" if new_tenants else f"t{i % TENANTS}",
            "session_id": f"{label}-s{i}",
            "origin_region": REGIONS[i % len(REGIONS)],
            "model": ADMIT_MODEL,
            "input_tokens": 1000,
            "output_tokens": 256,
            "admit": False,
        }
        reply = await guarded(stack.call(Rpc.ROUTE_SELECT, body))
        return reply if isinstance(reply, str) else outcome_of(reply)

    async def nothing() -> None:
        return None

    who = "a new tenant and session per request" if new_tenants else f"{TENANTS} tenants, a new session per request"
    return await measure(
        stack,
        label=label,
        subject="route.select",
        rate=rate,
        seconds=seconds,
        one=one,
        ok_outcome="routed",
        goal=goal,
        settle=nothing,
        note=who,
    )


# -- the plan ----------------------------------------------------------------------------------------

PLACE_GOAL = Goal(floor_ms=10, factor=10)
PLACE_SLOW_GOAL = Goal(floor_ms=5, factor=0)
ADMIT_GOAL = Goal(floor_ms=5, factor=5, no_commit=True)
ROUTE_GOAL = Goal(floor_ms=5, factor=5)


@dataclass(frozen=True)
class Planned:
    scenario: str
    rate: float
    new_tenants: bool = False

    @property
    def label(self) -> str:
        return f"{self.scenario}-{self.rate:g}{'-new-tenants' if self.new_tenants else ''}"


def plan(scenario: str, rate: float | None, new_tenants: bool) -> list[Planned]:
    """The runs one invocation makes, in the order that keeps each run's fleet as it expects: placements
    (released as they go) first, then the replicas the route and admit runs need; admit last, since
    admissions left queued at a rate the replicas cannot take are admitted (and held) for a while after."""
    chosen = ["place", "place-slow", "route", "admit"] if scenario == "all" else [scenario]
    if rate is not None:
        return [Planned(s, rate, new_tenants and s == "route") for s in chosen]
    defaults: dict[str, list[Planned]] = {
        "place": [Planned("place", 200)],
        "place-slow": [Planned("place-slow", 50)],
        "admit": [Planned("admit", 200), Planned("admit", 1000)] if scenario == "all" else [Planned("admit", 200)],
        "route": [Planned("route", 500, new_tenants)]
        if scenario != "all"
        else [Planned("route", 500), Planned("route", 500, True)],
    }
    return [p for s in chosen for p in defaults[s]]


async def bench(args: argparse.Namespace) -> list[Run]:
    fleet, gpus = bench_fleet(args.nodes)
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="hetsched-full-stack-") as tmp:
        stack = FullStack(Path(tmp), fleet, profile_dir=args.profile)
        engines = Engines(stack)
        try:
            started = time.monotonic()
            say(f"starting hetsched up: {args.nodes} nodes ({gpus} GPUs) in {tmp}")
            await stack.start()
            await stack.ledger_knows(gpus)
            await placement_ready(stack, deadline_s=START_TIMEOUT_S)
            say(f"stack ready in {time.monotonic() - started:.0f} s; metrics at {stack.metrics_urls.get(LEDGER)}")
            for planned in plan(args.scenario, args.rate, args.new_tenants):
                if planned.scenario in ("admit", "route") and not engines.replicas:
                    say(f"placing {args.replicas} {ADMIT_MODEL} replicas and starting their engines")
                    await engines.start(args.replicas)
                idle, rest = await rest_rate(stack)
                say(idle)
                say(f"run {planned.label} ({args.seconds:g} s)")
                run = await one_run(stack, planned, args)
                run.rest_cpu_per_s = rest
                if planned.scenario == "admit":
                    run.note += f", {len(engines.replicas)} replicas reporting every {ENGINE_REPORT_S:g} s"
                runs.append(run)
                if not args.json:
                    print(run.text(), flush=True)
        finally:
            engines.stop()
            await stack.stop()
    if args.profile is not None:
        print_profiles(args.profile)
    return runs


PROFILE_TOP = 18


def print_profiles(directory: Path) -> None:
    """Each service's profile (``HETSCHED_PROFILE_DIR``: the whole run, start-up included), its functions
    with the most time of their own first."""
    for path in sorted(directory.glob("*.prof")):
        out = io.StringIO()
        stats = pstats.Stats(str(path), stream=out)
        stats.sort_stats("tottime").print_stats(PROFILE_TOP)
        body = out.getvalue()
        say(f"== profile {path.name} ==\n" + body[body.find("   ncalls") :])


REST_WINDOW_S = 2.0
REST_SETTLED = 0.35  # of a core: below this the stack is at rest (its periodic loops, about 0.2 on 1,024 nodes)
REST_BEFORE_MAX_S = 120.0  # how long a run waits for the stack to be at rest before it starts
REST_AFTER_MAX_S = 60.0  # how long a run's CPU is followed after its last answer


async def back_at_rest(stack: FullStack, *, max_s: float) -> bool:
    """Wait until the stack used under ``REST_SETTLED`` of a core over a window of ``REST_WINDOW_S``, or
    ``max_s`` passed; whether it came to rest."""
    deadline = time.monotonic() + max_s
    while True:
        before = stack.cpu_now()
        await asyncio.sleep(REST_WINDOW_S)
        after = stack.cpu_now()
        used = _span(before, after, REST_WINDOW_S).stack_s / REST_WINDOW_S
        if used < REST_SETTLED:
            return True
        if time.monotonic() > deadline:
            return False


async def rest_rate(stack: FullStack) -> tuple[str, float]:
    """Once the stack is at rest (up to ``REST_BEFORE_MAX_S``): its CPU over 5 s, one line per process and
    in CPU-s per second."""
    if not await back_at_rest(stack, max_s=REST_BEFORE_MAX_S):
        say(f"the stack did not come to rest within {REST_BEFORE_MAX_S:g} s")
    before = stack.cpu_now()
    await asyncio.sleep(5.0)
    span = _span(before, stack.cpu_now(), 5.0)
    per = ", ".join(f"{k} {v:.2f}" for k, v in span.cpu_s.items() if k in STACK)
    return f"stack at rest: {span.stack_s:.2f} CPU-s over 5 s ({per})", span.stack_s / 5.0


async def one_run(stack: FullStack, planned: Planned, args: argparse.Namespace) -> Run:
    label, rate, seconds = planned.label, planned.rate, args.seconds
    if planned.scenario in ("place", "place-slow"):
        goal = PLACE_GOAL if planned.scenario == "place" else PLACE_SLOW_GOAL
        return await place_run(stack, label=label, rate=rate, seconds=seconds, hold_s=args.hold_s, goal=goal)
    if planned.scenario == "admit":
        return await admit_run(stack, label=label, rate=rate, seconds=seconds, goal=ADMIT_GOAL)
    return await route_run(
        stack, label=label, rate=rate, seconds=seconds, new_tenants=planned.new_tenants, goal=ROUTE_GOAL
    )


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def summary(runs: list[Run]) -> str:
    rows = [
        "| run | offered | achieved (ok) | p50 ms | p99 ms | echo p99 ms | goal p99 ms | met "
        "| stack CPU ms/op (to rest) | commits |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        met, _ = r.verdict()
        rows.append(
            f"| {r.label} | {r.offered_per_s:g}/s | {r.load.achieved_per_s:.0f}/s ({r.ok_per_s:.0f}/s) | "
            f"{_ms(r.load.p50_ms)} | {_ms(r.load.p99_ms)} | {_ms(r.echo.p99_ms)} | "
            f"{r.goal.bound_ms(r.echo.p99_ms):.1f} | {'yes' if met else 'no'} | "
            f"{r.during.per_op_ms(r.load.sent):.2f} / {r.to_rest.per_op_ms(r.load.sent):.2f} | {_count(r.commits)} |"
        )
    return "\n".join(rows)


async def _main(args: argparse.Namespace) -> None:
    task = asyncio.current_task()
    if task is not None:  # SIGTERM unwinds like Ctrl-C: the stack is stopped and its directory removed
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    runs = await bench(args)
    if args.json:
        print(json.dumps({"nodes": args.nodes, "runs": [r.as_json() for r in runs]}, indent=2))
    else:
        print(summary(runs))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", choices=["place", "place-slow", "admit", "route", "all"], default="all")
    parser.add_argument("--rate", type=positive, default=None, help="offered per second (default: each run's own)")
    parser.add_argument("--seconds", type=positive, default=10, help="how long each run offers")
    parser.add_argument("--nodes", type=int, default=1024, help="synthetic fleet size")
    parser.add_argument("--replicas", type=int, default=24, help="replicas the admit and route runs use")
    parser.add_argument("--new-tenants", action="store_true", help="route: a new tenant per request")
    parser.add_argument("--hold-s", type=positive, default=1.0, help="place: seconds before a replica is released")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON document")
    parser.add_argument(
        "--profile", type=Path, default=None, help="profile every service into this directory and print the top"
    )
    try:
        asyncio.run(_main(parser.parse_args()))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted: the stack is stopped and its directory removed", file=sys.stderr)
        sys.exit(130)
