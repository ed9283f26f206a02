"""Soak: `placement.place` and `placement.release` over NATS for minutes, open loop, with the services'
memory and the latency percentiles sampled every minute.

    python -m tests.bench.placement_soak [--rate 100] [--minutes 10] [--nodes 1024] [--hold-s S]
                                         [--timeout-s 10] [--sample-s 60]

Placements are offered evenly spaced at --rate (open loop: a slow answer does not slow the offer), in
the shapes of `placement_e2e`'s mix. Each placed replica is released after a hold drawn from an
exponential distribution (mean --hold-s, capped at ten means), so place and release both run the whole
time. By Little's law about rate x hold replicas are live at once; the default hold is sized from the
fleet so that about 30 % of its accelerators are reserved in the steady state: rejections then say
something about the service, not about a full fleet. Every replica asks for a lease a little longer
than the longest hold, so one whose answer timed out here (and is never released) expires on its own.
Requests carry the deadline header a real client sends. The queue fallback is left out: a queued
replica's allocation would arrive later, unseen by this client, and never be released.

Each row (one per --sample-s seconds) covers what was answered in that window: offered and answered
placements per second, place and release latency p50/p99/max in ms (of answered requests; timeouts are
counted apart), outcomes, the replicas this client holds when it closes and their share of the fleet's
GPUs, the share the ledger reserves (all allocations, also those placed after their caller timed out),
the RSS of the placement and ledger processes (VmRSS of /proc/<pid>/status), and the CPU use of
placement, ledger and this client (% of one core: a client near 100 cannot offer the rate).
When the offer stops the run drains: answers in flight are awaited, every live replica is released,
and the ledger is asked what is still reserved. The summary prints RSS growth first -> last row, the
p99 trend and a verdict. Nothing is asserted. Services, servers and temporary directories are cleaned
up on an error, on Ctrl-C and on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.errors

from shared.contracts.subjects import Rpc
from shared.domain.synthetic import synthetic_inventory
from shared.infra import deadline
from tests.bench.ledger_harness import INVARIANT_SQL, LedgerHarness
from tests.bench.loadgen import positive
from tests.bench.placement_e2e import MIX, placement_ready

TENANT = "soak"
TARGET_FILL = 0.3  # share of the fleet's accelerators the default hold keeps reserved
HOLD_CAP_MEANS = 10  # a hold never exceeds ten means, so the lease can outlast every hold
LEASE_MARGIN_S = 60
FALLBACKS = ["kv_quantize", "pipeline", "cross_domain"]
DRAIN_CONCURRENCY = 16  # releases at once while draining: a burst of all of them would only time out
RSS_TOLERANCE_MIB = 4.0  # allocator noise: a smaller change first -> last row is "no growth"
SERVICES = {"placement": "placement", "ledger": "capacity_ledger"}  # column -> harness package


def quantiles(values: list[float]) -> tuple[float, float, float]:
    """p50, p99 (nearest rank) and max of ``values``; NaN for each when there are none."""
    if not values:
        return math.nan, math.nan, math.nan
    ordered = sorted(values)

    def rank(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(len(ordered) * q))]

    return rank(0.5), rank(0.99), ordered[-1]


def rss_mib(pid: int) -> float | None:
    """The process's resident set size (VmRSS) in MiB; None when the process is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024  # the kernel reports kB
    return None


def cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) the process has used; None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime in clock ticks


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (minute, value) points, per minute; NaN with fewer than two finite points."""
    finite = [(x, y) for x, y in points if not math.isnan(y)]
    if len(finite) < 2:
        return math.nan
    mean_x = sum(x for x, _ in finite) / len(finite)
    mean_y = sum(y for _, y in finite) / len(finite)
    spread = sum((x - mean_x) ** 2 for x, _ in finite)
    return sum((x - mean_x) * (y - mean_y) for x, y in finite) / spread if spread else math.nan


def gpus_of(reply: dict[str, Any]) -> int:
    """Accelerators a placed reply holds, over all its nodes."""
    return sum(len(p.get("accelerators") or []) for p in reply.get("placements") or [])


def _ms(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.1f}"


def _triple(values: list[float]) -> str:
    return "/".join(_ms(v) for v in quantiles(values))


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


@dataclass
class Window:
    """What one sampling window saw: offers made in it, answers (and timeouts) that arrived in it."""

    offered: int = 0
    place_ms: list[float] = field(default_factory=list)
    place: Counter[str] = field(default_factory=Counter)
    release_ms: list[float] = field(default_factory=list)
    release: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class Row:
    """One printed sample: the window that closed at ``end_s`` seconds into the run and the state then.
    ``cpu_pct`` is each process's CPU use over the window (100 = one core busy)."""

    label: str
    end_s: float
    seconds: float
    window: Window
    rss: dict[str, float | None]
    cpu_pct: dict[str, float | None]
    live: int
    live_gpus: int
    ledger_reserved: int | None = None


HEADER = (
    f"{'min':>5} {'off/s':>6} {'ans/s':>6} {'placed':>6} {'place p50/p99/max ms':>22} {'rel':>5} "
    f"{'release p50/p99/max ms':>22} {'live':>5} {'GPU%':>5} {'ldgGPU%':>7} {'placeRSS':>8} {'ledgRSS':>8} "
    f"{'CPU% p/l/c':>11}  other outcomes"
)


class Soak:
    """One soak run against a started harness with placement: offer, sample, drain, summarise."""

    def __init__(
        self, h: LedgerHarness, *, rate: float, hold_s: float, timeout_s: float, fleet_gpus: int, seed: int = 13
    ) -> None:
        self.h = h
        self.rate = rate
        self.hold_s = hold_s
        self.timeout_s = timeout_s
        self.fleet_gpus = fleet_gpus
        self.lease_s = math.ceil(hold_s * HOLD_CAP_MEANS + timeout_s + LEASE_MARGIN_S)
        self.rng = random.Random(seed)
        self.window = Window()
        self.live: dict[str, int] = {}  # allocation id -> accelerators it holds
        self.pending: set[asyncio.Task[None]] = set()
        self.rows: list[Row] = []
        self.totals = Window()
        self.drain_now = asyncio.Event()
        self.drain_slots = asyncio.Semaphore(DRAIN_CONCURRENCY)
        self.pids = {column: h.procs[package].pid for column, package in SERVICES.items()}
        self.cpu_mark = (time.perf_counter(), self.cpu_now())

    # -- requests ------------------------------------------------------------------------------

    def body(self, request_id: str, shape: tuple[str, str, int, int]) -> dict[str, Any]:
        model, dtype, context, concurrency = shape
        return {
            "request_id": request_id,
            "tenant": TENANT,
            "model": model,
            "dtype": dtype,
            "context_tokens": context,
            "concurrency": concurrency,
            "backend": "gpu",
            "lease_s": self.lease_s,
            "fallbacks": FALLBACKS,
        }

    async def call(self, rpc: Rpc, body: dict[str, Any]) -> tuple[str, float | None, dict[str, Any]]:
        """One request with a deadline header; (outcome, latency in ms or None when unanswered, reply)."""
        headers = {deadline.HEADER: str(int(deadline.now_ms() + self.timeout_s * 1000))}
        started = time.perf_counter()
        try:
            msg = await self.h.nc.request(
                self.h.subjects.rpc(rpc), json.dumps(body).encode(), timeout=self.timeout_s, headers=headers
            )
            reply: dict[str, Any] = json.loads(msg.data)
        except nats.errors.TimeoutError:
            return "timeout", None, {}
        except Exception as exc:  # every other failure is an outcome to count, not a reason to stop
            return f"error:{type(exc).__name__}", None, {}
        elapsed_ms = (time.perf_counter() - started) * 1000
        outcome = str(reply.get("status", "?"))
        if outcome == "rejected":
            outcome = f"rejected:{(reply.get('error') or {}).get('code')}"
        return outcome, elapsed_ms, reply

    async def replica(self, request_id: str, shape: tuple[str, str, int, int], hold_s: float) -> None:
        """Place one replica, hold it (or less, once draining), release it; count both in the open window."""
        outcome, elapsed_ms, reply = await self.call(Rpc.PLACEMENT_PLACE, self.body(request_id, shape))
        self.window.place[outcome] += 1
        if elapsed_ms is not None:
            self.window.place_ms.append(elapsed_ms)
        allocation = reply.get("allocation_id")
        if outcome != "placed" or not allocation:
            return
        self.live[allocation] = gpus_of(reply)
        try:
            await asyncio.wait_for(self.drain_now.wait(), timeout=hold_s)
        except TimeoutError:
            pass
        if self.drain_now.is_set():
            async with self.drain_slots:
                await self.release(allocation)
        else:
            await self.release(allocation)

    async def release(self, allocation: str) -> None:
        outcome, elapsed_ms, _reply = await self.call(
            Rpc.PLACEMENT_RELEASE, {"allocation_id": allocation, "tenant": TENANT}
        )
        self.window.release[outcome] += 1
        if elapsed_ms is not None:
            self.window.release_ms.append(elapsed_ms)
        if outcome != "timeout":  # a timed-out release may still have happened: it stays counted as live
            self.live.pop(allocation, None)

    def spawn(self, request_id: str, shape: tuple[str, str, int, int], hold_s: float) -> None:
        task = asyncio.create_task(self.replica(request_id, shape, hold_s))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    # -- phases --------------------------------------------------------------------------------

    async def warm_up(self, count: int = 20) -> None:
        """Place and release a few replicas (connections, caches), then forget them."""
        await asyncio.gather(*(self.replica(f"soak-warm-{i}", self.rng.choice(MIX), 0.0) for i in range(count)))
        self.window = Window()

    async def offer(self, begin: float, seconds: float) -> None:
        """Open loop: spawn placements evenly spaced at the rate, whatever the answers do."""
        for i in range(round(self.rate * seconds)):
            delay = begin + i / self.rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            hold_s = min(self.rng.expovariate(1 / self.hold_s), HOLD_CAP_MEANS * self.hold_s)
            self.window.offered += 1
            self.spawn(f"soak-{i}", self.rng.choice(MIX), hold_s)

    def cpu_now(self) -> dict[str, float | None]:
        """CPU seconds used so far by the services and by this client."""
        return {**{column: cpu_s(pid) for column, pid in self.pids.items()}, "client": time.process_time()}

    def cpu_pct(self) -> dict[str, float | None]:
        """Each process's CPU use since the last call, in % of one core."""
        (before_at, before), now_at, now = self.cpu_mark, time.perf_counter(), self.cpu_now()
        self.cpu_mark = (now_at, now)
        span = max(now_at - before_at, 1e-9)
        return {
            k: None if v is None or before.get(k) is None else 100 * (v - (before[k] or 0.0)) / span
            for k, v in now.items()
        }

    async def close(self, label: str, end_s: float, seconds: float) -> Row:
        """Close the open window into a printed row; the ledger's count of reserved accelerators is asked
        after the cut, so the window's edge is exact."""
        row = self.cut(label, end_s, seconds)
        row = dataclasses.replace(row, ledger_reserved=await self.ledger_reserved())
        print(self.format(row), flush=True)
        return row

    def cut(self, label: str, end_s: float, seconds: float) -> Row:
        """Close the open window into a row (with the processes' RSS and CPU now) and open the next one."""
        closed, self.window = self.window, Window()
        for outcome, n in closed.place.items():
            self.totals.place[outcome] += n
        for outcome, n in closed.release.items():
            self.totals.release[outcome] += n
        self.totals.offered += closed.offered
        rss = {column: rss_mib(pid) for column, pid in self.pids.items()}
        return Row(label, end_s, seconds, closed, rss, self.cpu_pct(), len(self.live), sum(self.live.values()))

    async def sample(self, begin: float, seconds: float, sample_s: float) -> None:
        previous = 0.0
        for k in range(1, math.ceil(seconds / sample_s) + 1):
            end = min(seconds, k * sample_s)
            await asyncio.sleep(max(0.0, begin + end - time.perf_counter()))
            self.rows.append(await self.close(f"{end / 60:.2f}", end, end - previous))
            previous = end

    async def drain(self) -> None:
        """Stop holding: await every answer in flight, release every live replica, ask the ledger what is left."""
        self.drain_now.set()
        started = time.perf_counter()
        await asyncio.gather(*list(self.pending))
        drained = await self.close("drain", math.nan, time.perf_counter() - started)
        violations = await self.ledger_violations()
        unknown = self.totals.place["timeout"] + sum(n for o, n in self.totals.place.items() if o.startswith("error"))
        print(
            f"after drain: {len(self.live)} replicas this client still holds (release timed out), "
            f"{_pct(drained.ledger_reserved)} accelerators the ledger still reserves, "
            f"{violations} ledger invariant violations "
            f"({unknown} placements went unanswered here; any of them placed after all holds its lease "
            f"of {self.lease_s} s)",
            flush=True,
        )

    async def ledger_reserved(self) -> int | None:
        """Accelerators the ledger holds HBM on (all tenants, also allocations this client never heard
        of); None when the snapshot does not answer in time."""
        reserved = 0
        cursor: str | None = None
        try:
            while True:
                body: dict[str, Any] = {"limit": 20_000, **({"cursor": cursor} if cursor else {})}
                page = await self.h.call(Rpc.LEDGER_SNAPSHOT, body, timeout=self.timeout_s)
                reserved += sum(1 for a in page.get("accelerators", []) if a.get("hbm_reserved_bytes"))
                cursor = page.get("next_cursor")
                if not cursor:
                    return reserved
        except Exception:  # a busy ledger costs this column one sample, never the run
            return None

    async def ledger_violations(self) -> int:
        """Rows breaking the ledger's capacity invariant (reserved = sum of active shares <= usable)."""
        conn = await self.h.db()
        try:
            return int(await conn.fetchval(INVARIANT_SQL))
        finally:
            await conn.close()

    async def run(self, *, seconds: float, sample_s: float) -> None:
        await self.warm_up()
        self.cpu_mark = (time.perf_counter(), self.cpu_now())  # the first row's CPU leaves the warm-up out
        print(
            f"soak: {self.rate:g} placements/s for {seconds / 60:g} min on {self.fleet_gpus} GPUs; hold exponential "
            f"mean {self.hold_s:.1f} s (cap {HOLD_CAP_MEANS * self.hold_s:.0f} s), lease {self.lease_s} s, "
            f"timeout {self.timeout_s:g} s; expect ~{self.rate * self.hold_s:.0f} live replicas",
            flush=True,
        )
        baseline = {column: rss_mib(pid) for column, pid in self.pids.items()}
        print(f"RSS before the run (after warm-up): {', '.join(f'{c} {_mib(v)} MiB' for c, v in baseline.items())}")
        print(HEADER, flush=True)
        begin = time.perf_counter()
        try:
            await asyncio.gather(self.offer(begin, seconds), self.sample(begin, seconds, sample_s))
            await self.drain()
        finally:
            for task in self.pending:
                task.cancel()
            await asyncio.gather(*list(self.pending), return_exceptions=True)
            print(self.summary(seconds), flush=True)

    # -- output --------------------------------------------------------------------------------

    def format(self, row: Row) -> str:
        w = row.window
        answered = sum(n for o, n in w.place.items() if o != "timeout" and not o.startswith("error"))
        per_s = max(row.seconds, 1e-9)
        others = [f"{o}={n}" for o, n in sorted(w.place.items()) if o != "placed"]
        others += [f"release {o}={n}" for o, n in sorted(w.release.items()) if o != "released"]
        return (
            f"{row.label:>5} {w.offered / per_s:6.1f} {answered / per_s:6.1f} {w.place['placed']:6d} "
            f"{_triple(w.place_ms):>22} {w.release['released']:5d} {_triple(w.release_ms):>22} "
            f"{row.live:5d} {self.share(row.live_gpus):>5} {self.share(row.ledger_reserved):>7} "
            f"{_mib(row.rss['placement']):>8} {_mib(row.rss['ledger']):>8} "
            f"{'/'.join(_pct(row.cpu_pct[k]) for k in ('placement', 'ledger', 'client')):>11}  "
            f"{' '.join(others) or '-'}"
        )

    def share(self, gpus: int | None) -> str:
        """``gpus`` as a percentage of the fleet."""
        return "-" if gpus is None else f"{100 * gpus / max(self.fleet_gpus, 1):.1f}"

    def summary(self, seconds: float) -> str:
        rows = self.rows
        if not rows:
            return "summary: no row was sampled"
        lines = [
            f"summary over {len(rows)} rows ({rows[-1].end_s / 60:.4g} of {seconds / 60:g} min): "
            f"offered {self.totals.offered}, place {dict(sorted(self.totals.place.items()))}, "
            f"release {dict(sorted(self.totals.release.items()))}"
        ]
        verdicts = []
        for column in SERVICES:
            values = [(r.end_s / 60, r.rss[column]) for r in rows]
            known = [(x, v) for x, v in values if v is not None]
            if len(known) < 2:
                lines.append(f"  {column} RSS: fewer than two samples, no trend")
                verdicts.append(f"{column} too short to judge")
                continue
            first, last = known[0][1], known[-1][1]
            growth = last - first
            lines.append(
                f"  {column} RSS: {first:.1f} -> {last:.1f} MiB ({growth:+.1f} MiB first -> last row, "
                f"peak {max(v for _, v in known):.1f}, slope {slope_per_min(known):+.2f} MiB/min)"
            )
            verdicts.append(
                f"{column} no growth ({growth:+.1f} MiB, tolerance {RSS_TOLERANCE_MIB:g})"
                if growth <= RSS_TOLERANCE_MIB
                else f"{column} grew by {growth:.1f} MiB"
            )
        reserved = [r.ledger_reserved for r in rows if r.ledger_reserved is not None]
        if reserved:
            lines.append(
                f"  ledger reserves: {self.share(reserved[0])} -> {self.share(reserved[-1])} % of the GPUs "
                f"first -> last row (this client held {self.share(rows[-1].live_gpus)} % at the end)"
            )
        for name, pick in (("place", "place_ms"), ("release", "release_ms")):
            p99s = [(r.end_s / 60, quantiles(getattr(r.window, pick))[1]) for r in rows]
            finite = [v for _, v in p99s if not math.isnan(v)]
            trend = f"{_ms(p99s[0][1])} -> {_ms(p99s[-1][1])} ms first -> last row"
            worst = f"worst row {max(finite):.1f} ms" if finite else "no answers"
            lines.append(f"  {name} p99: {trend}, slope {_ms(slope_per_min(p99s))} ms/min, {worst}")
        lines.append(f"verdict: {'; '.join(verdicts)}")
        return "\n".join(lines)


async def auto_hold_s(h: LedgerHarness, *, rate: float, fleet_gpus: int) -> float:
    """The mean hold that keeps ``TARGET_FILL`` of the fleet reserved at ``rate``, from the GPUs each shape
    of the mix takes on the empty fleet (a dry-run `explain` per shape)."""
    sizes = []
    for i, (model, dtype, context, concurrency) in enumerate(MIX):
        body = {
            "request_id": f"soak-size-{i}",
            "tenant": TENANT,
            "model": model,
            "dtype": dtype,
            "context_tokens": context,
            "concurrency": concurrency,
            "backend": "gpu",
            "fallbacks": FALLBACKS,
        }
        reply = await h.call(Rpc.PLACEMENT_EXPLAIN, body, timeout=10)
        if reply.get("status") == "placed":
            sizes.append(gpus_of(reply))
    per_replica = sum(sizes) / len(sizes) if sizes else 1.0
    hold_s = TARGET_FILL * fleet_gpus / (rate * per_replica)
    print(f"hold sized for {TARGET_FILL:.0%} of {fleet_gpus} GPUs at {rate:g}/s, {per_replica:.2f} GPUs per replica")
    return hold_s


async def _main(args: argparse.Namespace) -> None:
    from tests.servers import find_servers

    task = asyncio.current_task()
    if task is not None:  # SIGTERM unwinds like Ctrl-C: the harness stops services and drops its database
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, task.cancel)
    fleet = synthetic_inventory(nodes=args.nodes, rng=random.Random(7), tpu_pods=0)
    gpus = sum(n["gpus"] for r in fleet["regions"] for c in r["clusters"] for k in c["racks"] for n in k["nodes"])
    with tempfile.TemporaryDirectory() as tmp:
        servers = await find_servers(Path(tmp))
        try:
            async with LedgerHarness(
                servers, Path(tmp), fleet=fleet, services=("placement",), want_accelerators=gpus
            ) as h:
                await placement_ready(h)
                hold_s = args.hold_s or await auto_hold_s(h, rate=args.rate, fleet_gpus=gpus)
                soak = Soak(h, rate=args.rate, hold_s=hold_s, timeout_s=args.timeout_s, fleet_gpus=gpus)
                await soak.run(seconds=args.minutes * 60, sample_s=args.sample_s)
        finally:
            servers.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=positive, default=100, help="placements offered per second")
    parser.add_argument("--minutes", type=positive, default=10, help="how long placements are offered")
    parser.add_argument("--nodes", type=int, default=1024, help="synthetic fleet size")
    parser.add_argument(
        "--hold-s",
        type=positive,
        default=None,
        help=f"mean hold in s; default: {100 * TARGET_FILL:.0f} %% of the fleet reserved",
    )
    parser.add_argument("--timeout-s", type=positive, default=10, help="client timeout of one request")
    parser.add_argument("--sample-s", type=positive, default=60, help="seconds per row")
    try:
        asyncio.run(_main(parser.parse_args()))
    except (KeyboardInterrupt, asyncio.CancelledError):
        print("interrupted: services stopped, database dropped, servers and temporary directories removed")
        sys.exit(130)
