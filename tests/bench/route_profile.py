"""Profile: the router's CPU per `route.select`, in one process, on a real Postgres.

    python -m tests.bench.route_profile [--requests 5000] [--rate 500] [--replicas 24] [--tenants 50]
                                        [--scenario echo|sessions|new-tenants|steady|all]
                                        [--profile N] [--sort cumulative|tottime]

The cross-region router's handlers as its ``wire`` builds them (the shipped regions and models files,
the default route policy, its metrics), over a fresh migrated database of the servers tests use, with
--replicas llama3.1-8b replicas spread over the three regions the full-stack benchmark uses (seeded in
``routing.replicas``, as placement's events leave them). Each request is served the way the request
server serves one from NATS: its deadline header read, the trace context extracted, the body parsed and
validated, the handler run, the reply encoded; requests are offered open loop at --rate (a slow answer
does not slow the offer), so the router's group commit groups what it would group on the wire. The NATS
round trip is not in it: this measures what the router's own process spends per request. Beside the
requests run what runs in the service: the outbox relay (woken by commits that emitted events, else
polling) and the traffic flush loop.

Scenarios, as in `tests.bench.full_stack --scenario route`:

- sessions: --tenants tenants, a new session per request (each request writes its session's region);
- new-tenants: a new tenant and session per request (each writes the tenant's region too);
- steady: --tenants tenants, requests on sessions already routed (nothing to write);
- echo: the sessions scenario's requests answered at once by a handler of its own: what the request
  server's wrapper (deadline, parse, validation, reply) and this harness cost, to subtract.

Prints, per scenario, the process CPU per request (``time.process_time``: this harness's own share is
in it, which the echo scenario shows), the in-process latency p50/p99, the rows written and in how many
write transactions. ``--profile N`` prints the N costliest functions of a cProfile run of each scenario
(by ``--sort``; profiling slows everything, so its run is separate from the timed one). Settings come from
the environment as the service's do (``HETSCHED_ROUTE_WRITE_SPACING_MS=0`` compares write spacings).
Asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import nats
from pydantic import SecretStr
from sqlalchemy import text

from services.cross_region_router.handlers import RoutingHandlers
from services.cross_region_router.metrics import RouterMetrics
from services.cross_region_router.store import RoutingStore, StoredReplica
from services.cross_region_router.tables import SCHEMA
from shared.contracts.routing import RouteSelectReply, RouteSelectRequest
from shared.contracts.subjects import Subjects
from shared.domain.routing import AffinityRule, RoutePolicy
from shared.infra import deadline
from shared.infra.bus import ensure_streams
from shared.infra.catalog import load_model_groups, load_models, load_regions
from shared.infra.clock import system_clock
from shared.infra.db import application_name, make_engine, make_sessions, service_database_url
from shared.infra.metrics import ServiceMetrics
from shared.infra.migrate import upgrade
from shared.infra.outbox import OutboxRelay
from shared.infra.requests import Endpoint, RequestServer
from shared.infra.retention import stream_specs_for
from shared.infra.rpc import RpcClient
from shared.infra.settings import Settings
from shared.infra.uow import UnitOfWork, UnitOfWorkFactory
from tests.servers import ROLE_PASSWORD, find_servers

REGIONS = ("us-west-1", "us-east-1", "eu-west-1")  # tests.bench.full_stack's
MODEL = "llama3.1-8b"


class _Msg:
    """What the request server reads of a NATS message, and where its reply goes."""

    __slots__ = ("data", "done", "headers", "reply", "subject")

    def __init__(self, subject: str, data: bytes, headers: dict[str, str], done: asyncio.Future[bytes]) -> None:
        self.subject, self.data, self.headers, self.reply, self.done = subject, data, headers, "_INBOX.x", done

    async def respond(self, data: bytes) -> None:
        self.done.set_result(data)


ECHOED = RouteSelectReply(status="routed", region=REGIONS[0], tier="affinity", rtt_ms=0.0, explanation="echo")


async def _echo(_request: RouteSelectRequest) -> RouteSelectReply:
    return ECHOED


class _Connection:
    max_payload = 1024 * 1024


@dataclass
class Figures:
    scenario: str
    requests: int
    seconds: float
    cpu_ms_per_request: float
    p50_ms: float
    p99_ms: float
    tenants_written: int
    sessions_written: int
    write_transactions: int
    outcomes: dict[str, int]

    def line(self) -> str:
        return (
            f"{self.scenario:<12} {self.requests} requests in {self.seconds:.1f} s: "
            f"CPU {self.cpu_ms_per_request:.3f} ms/request, p50 {self.p50_ms:.2f} ms, p99 {self.p99_ms:.2f} ms "
            f"(in process); rows written: {self.tenants_written} tenants, {self.sessions_written} sessions "
            f"in {self.write_transactions} transactions; "
            f"{self.outcomes}"
        )


class Harness:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.engine = make_engine(
            service_database_url(settings, SCHEMA),
            pool_size=settings.kit.db_pool_size,
            application_name=application_name(SCHEMA),
        )
        self.sessions = make_sessions(self.engine)
        self.relay: OutboxRelay | None = None  # once NATS is connected (``start``)
        self.uow = UnitOfWorkFactory(
            sessions=self.sessions,
            schema=SCHEMA,
            source="cross-region-router",
            subjects=Subjects(settings.kit.subject_prefix),
            wake=lambda: self.relay.wake() if self.relay is not None else None,
        )
        self.handlers = self._handlers()
        self.server = RequestServer(default_deadline_ms=settings.kit.request_deadline_ms)
        endpoint = Endpoint(
            "bench.route.select", "q", RouteSelectRequest, self.handlers.select, settings.kit.request_workers
        )
        self.server.add(endpoint)
        self.on_message = self.server._callback(endpoint, _Connection())  # type: ignore[arg-type]
        echo = Endpoint("bench.echo", "q", RouteSelectRequest, _echo, settings.kit.request_workers)
        self.server.add(echo)
        self.echo = self.server._callback(echo, _Connection())  # type: ignore[arg-type]
        self.tasks: list[asyncio.Task[None]] = []

    async def start(self, nc: Any) -> None:
        """What runs beside the requests in the service: the outbox relay (woken by commits that emitted
        events, else polling) and the traffic flush loop."""
        js = nc.jetstream()
        await ensure_streams(js, stream_specs_for(self.settings, subjects=self.uow.subjects))
        self.relay = OutboxRelay(
            sessions=self.sessions,
            js=js,
            schema=SCHEMA,
            batch=self.settings.kit.outbox_batch,
            poll_ms=self.settings.kit.outbox_poll_ms,
        )
        self.tasks = [asyncio.create_task(self.relay.run()), asyncio.create_task(self.handlers.flush())]

    async def stop(self) -> None:
        if self.relay is not None:
            self.relay.stop()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.engine.dispose()

    def _handlers(self) -> RoutingHandlers:
        settings = self.settings
        models = load_models(settings.kit.model_catalog)
        policy = RoutePolicy(
            weights=settings.routing.weights,
            damping_s=settings.routing.damping_s,
            affinity=AffinityRule(window_days=settings.routing.affinity_days),
        )

        def no_nats() -> Any:
            raise RuntimeError("the profile sends admit: false")

        return RoutingHandlers(
            uow=self.uow,
            rpc=RpcClient(no_nats, self.uow.subjects),
            store=RoutingStore(),
            clock=system_clock,
            regions=load_regions(settings.kit.regions_file),
            models=models,
            groups=load_model_groups(settings.kit.model_groups, models),
            policy=policy,
            flush_s=settings.routing.flush_ms / 1000,
            metrics=RouterMetrics(ServiceMetrics("cross-region-router")),
            write_spacing_s=settings.routing.write_spacing_ms / 1000,
        )

    async def seed(self, replicas: int) -> None:
        store = RoutingStore()

        async def add(uow: UnitOfWork) -> None:
            for i in range(replicas):
                replica = StoredReplica(f"replica-{i}", REGIONS[i % len(REGIONS)], MODEL, "H100-SXM-80GB")
                await store.add_replica(session=uow.session, replica=replica)

        await self.uow.run(add)
        await self.handlers.start()

    async def counts(self) -> tuple[int, int]:
        async with self.sessions() as session:
            tenants = (await session.execute(text("SELECT count(*) FROM routing.tenants"))).scalar_one()
            sessions = (await session.execute(text("SELECT count(*) FROM routing.sessions"))).scalar_one()
        return int(tenants), int(sessions)

    async def offer(
        self, bodies: list[bytes], rate: float, *, echo: bool = False
    ) -> tuple[list[float], dict[str, int]]:
        """Every body served open loop at ``rate`` (by the router, else ``echo``: by a handler that
        answers at once); each one's latency (ms) and the outcomes."""
        serve = self.echo if echo else self.on_message
        loop = asyncio.get_running_loop()
        latencies: list[float] = []
        outcomes: dict[str, int] = {}

        async def one(body: bytes) -> None:
            started = time.perf_counter()
            done: asyncio.Future[bytes] = loop.create_future()
            headers = {deadline.HEADER: str(int(deadline.now_ms() + 10_000))}
            await serve(_Msg("bench.echo" if echo else "bench.route.select", body, headers, done))
            reply = json.loads(await done)
            latencies.append((time.perf_counter() - started) * 1000)
            outcome = reply.get("status") if reply.get("status") != "rejected" else reply["error"]["code"]
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

        tasks = []
        started = time.perf_counter()
        for i, body in enumerate(bodies):
            wait = started + i / rate - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(body)))
        await asyncio.gather(*tasks)
        return latencies, outcomes

    async def run(self, scenario: str, bodies: list[bytes], rate: float) -> Figures:
        before = await self.counts()
        groups = self.handlers.write_groups
        await self.handlers.flush_once()
        cpu, wall = time.process_time(), time.perf_counter()
        latencies, outcomes = await self.offer(bodies, rate, echo=scenario == "echo")
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        await self.handlers.flush_once()
        after = await self.counts()
        latencies.sort()
        return Figures(
            scenario=scenario,
            requests=len(bodies),
            seconds=wall,
            cpu_ms_per_request=cpu * 1000 / len(bodies),
            p50_ms=statistics.median(latencies),
            p99_ms=latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
            tenants_written=after[0] - before[0],
            sessions_written=after[1] - before[1],
            write_transactions=self.handlers.write_groups - groups,
            outcomes=outcomes,
        )


def bodies_of(scenario: str, label: str, count: int, tenants: int) -> list[bytes]:
    """Request bodies as tests.bench.full_stack's route run sends them."""

    def body(i: int) -> bytes:
        tenant = f"{label}-t{i}" if scenario == "new-tenants" else f"t{i % tenants}"
        session = f"steady-s{i % (tenants * 20)}" if scenario == "steady" else f"{label}-s{i}"
        return json.dumps(
            {
                "request_id": f"{label}-{i}",
                "tenant": tenant,
                "session_id": session,
                "origin_region": REGIONS[i % len(REGIONS)],
                "model": MODEL,
                "input_tokens": 1000,
                "output_tokens": 256,
                "admit": False,
            }
        ).encode()

    return [body(i) for i in range(count)]


def print_profile(profile: cProfile.Profile, top: int, sort: str) -> None:
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats(sort).print_stats(top)
    print(out.getvalue())


async def measure(
    harness: Harness, scenarios: list[str], *, requests: int, rate: float, tenants: int, top: int, sort: str
) -> None:
    # The steady state's sessions, routed once beforehand (untimed), and a warm-up of every code path.
    await harness.offer(bodies_of("steady", "warm", tenants * 20, tenants), rate)
    await harness.offer(bodies_of("new-tenants", "warm-new", 200, tenants), rate)
    for n, scenario in enumerate(scenarios):
        figures = await harness.run(scenario, bodies_of(scenario, f"{scenario}-{n}", requests, tenants), rate)
        print(figures.line(), flush=True)
        if top:
            profile = cProfile.Profile()
            bodies = bodies_of(scenario, f"{scenario}-{n}-profiled", min(requests, 2000), tenants)
            profile.enable()
            await harness.offer(bodies, rate, echo=scenario == "echo")
            profile.disable()
            print_profile(profile, top, sort)


async def _main(args: argparse.Namespace) -> None:
    scenarios = ["echo", "sessions", "new-tenants", "steady"] if args.scenario == "all" else [args.scenario]
    with tempfile.TemporaryDirectory() as tmp:
        servers = await find_servers(Path(tmp))
        name = f"hetsched_bench_{servers.run_id}"
        url = await servers.create_database(name)
        try:
            await asyncio.to_thread(upgrade, url, role_password=SecretStr(ROLE_PASSWORD))
            settings = Settings(
                kit={
                    "database_url": url,
                    "database_role_password": SecretStr(ROLE_PASSWORD),
                    "subject_prefix": servers.subject_prefix,
                    "stream_prefix": servers.stream_prefix,
                    "data_dir": Path(tmp),
                }
            )
            harness = Harness(settings)
            nc = await nats.connect(servers.nats_url)
            try:
                await harness.seed(args.replicas)
                await harness.start(nc)
                await measure(
                    harness,
                    scenarios,
                    requests=args.requests,
                    rate=args.rate,
                    tenants=args.tenants,
                    top=args.profile,
                    sort=args.sort,
                )
            finally:
                await harness.stop()
                await nc.close()
        finally:
            await servers.delete_streams()
            await servers.drop_database(name)
            await servers.drop_created_roles()
            servers.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=5000)
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--replicas", type=int, default=24)
    parser.add_argument("--tenants", type=int, default=50)
    parser.add_argument("--scenario", choices=["echo", "sessions", "new-tenants", "steady", "all"], default="all")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print the N costliest functions")
    parser.add_argument("--sort", choices=["cumulative", "tottime"], default="cumulative")
    asyncio.run(_main(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
