"""Profile: the CPU one `placement.admit` and the `placement.release` of its admission cost in placement.

    python -m tests.bench.admit_profile [--rate 1000] [--calls 5000] [--rounds 5] [--profile] [--top 25]
    python -m tests.bench.admit_profile --wire [--rate 1000] [--seconds 10] [--profile]

The state is the full-stack benchmark's admit run (``tests.bench.full_stack``): 24 llama3.1-8b replicas
(TP 1, one per node, spread over three regions), each with its engine's report (``hetsched engine-sim``'s
figures, renewed every second), placement's default admission policy, fair queueing and KV guarantees;
1,000-token requests (256 output) from 50 tenants, in turn over the regions, each admission released as
soon as it is answered. The bodies are the benchmark's, byte for byte.

Without ``--wire``: each call goes through the request path's typed ``dispatch`` (the JSON body parsed
and checked, the contract validated, the handler, the reply serialised) in this process, with no bus,
the admission queue's loop running beside it; placement's clock moves 1/``--rate`` s per admission (the
tenants' buckets and the engines' reports see that rate, however fast the loop runs: under cProfile or
valgrind too). It prints the process CPU per admit and per release (the best of ``--rounds`` and the
median), and with ``--profile`` cProfile's heaviest functions. ``--wire``: the same handlers behind the
kit's ``RequestServer`` on the NATS at ``--nats`` (127.0.0.1:4222 by default; a prefix of its own),
offered open loop at ``--rate`` by a client in another process (plain JSON, as the benchmark's); it
prints this process's CPU per call (admits and releases together: everything the service does for them,
the bus client's work included) and the client's p50/p99. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import logging
import pstats
import random
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from hetsched.engine_sim import EngineLoad
from services.placement.admission import AdmissionHandlers, Fairness
from services.placement.lifecycle import Lifecycle
from services.placement.replicas import Replica, ReplicaBook
from shared.contracts.placement import AdmitRequest, ReleaseRequest
from shared.contracts.subjects import Rpc, Subjects
from shared.domain.admission import AdmitPolicy, Tenancy, engine_of, request_kv_bytes
from shared.infra.bus import dispatch
from shared.infra.catalog import load_model_groups, load_models
from shared.infra.clock import monotonic_ms
from shared.infra.settings import Settings
from tests.bench.loadgen import nearest_rank, positive

MODEL = "llama3.1-8b"
REGIONS = ("us-west-1", "us-east-1", "eu-west-1")
REPLICAS = 24
TENANTS = 50
REPLICA_CONTEXT, REPLICA_CONCURRENCY = 8192, 16  # what the benchmark places each replica for


def _body(i: int, label: str = "p") -> bytes:
    """The full-stack benchmark's admit body for its i-th request."""
    body = {
        "request_id": f"{label}-{i}",
        "tenant": f"t{i % TENANTS}",
        "model": MODEL,
        "input_tokens": 1000,
        "output_tokens": 256,
        "region": REGIONS[i % len(REGIONS)],
        "lease_s": 60,
    }
    return json.dumps(body).encode()


@dataclass
class Placement:
    """Placement's admission and release handlers over the benchmark's replicas, as ``app.wire`` builds them."""

    admission: AdmissionHandlers
    lifecycle: Lifecycle
    replicas: list[Replica]
    rng: random.Random

    @classmethod
    def build(cls, timer: Callable[[], float] = monotonic_ms) -> Placement:
        settings = Settings()
        p = settings.placement
        models = load_models(settings.kit.model_catalog)
        spec = models[MODEL]
        kv = request_kv_bytes(spec, input_tokens=REPLICA_CONTEXT, output_tokens=0, tp=1) * REPLICA_CONCURRENCY
        replicas = [
            Replica(
                replica_id=str(uuid.UUID(int=i + 1)),
                owner="platform",
                model=MODEL,
                engine=engine_of(spec),
                node=f"{REGIONS[i % 3]}-node-{i:03d}",
                region=REGIONS[i % 3],
                tp=1,
                kv_pool={f"{REGIONS[i % 3]}-node-{i:03d}/gpu0": kv},
            )
            for i in range(REPLICAS)
        ]
        book = ReplicaBook(models=models, kv_shares=(p.admit_kv_guarantees or None))
        for replica in replicas:
            book.add(replica)
        admission = AdmissionHandlers(
            book=book,
            rpc=None,  # type: ignore[arg-type]  # admission calls no other service
            models=models,
            groups=load_model_groups(settings.kit.model_groups, models),
            policy=AdmitPolicy(
                stale_ms=p.engine_stale_s * 1000,
                max_queue_depth=p.admit_max_queue_depth,
                long_context_tokens=p.admit_long_context_tokens,
                strict_ttft_ms=p.admit_strict_ttft_ms,
            ),
            fairness=Fairness(
                rate_per_s=p.admit_tenant_rate,
                burst=p.admit_tenant_burst,
                ttl_s=p.admit_queue_ttl_s,
                weights=p.admit_tenant_weights,
            ),
            timer=timer,
            log=logging.getLogger("admit-profile"),
            # The replicas above are "platform"'s, a shared pool that serves the 50 tenants.
            tenancy=Tenancy.of(p.admit_tenancy, (*p.admit_shared_owners, "platform")),
        )
        # The release of an admission never reaches the store, the ledger or the tally.
        lifecycle = Lifecycle(
            store=None,  # type: ignore[arg-type]
            uow=None,  # type: ignore[arg-type]
            rpc=None,  # type: ignore[arg-type]
            tally=None,  # type: ignore[arg-type]
            admission=admission,
            freed=lambda: None,
        )
        placement = cls(admission, lifecycle, replicas, random.Random(7))
        placement.report()
        return placement

    def report(self) -> None:
        """Every engine's report (``engine-sim``'s figures for the benchmark: 10% of its KV, queue 0)."""
        load = EngineLoad(queue_depth=0, kv_used=0.1, jitter=0)
        for replica in self.replicas:
            self.admission.on_engine_status(load.status(replica_id=replica.replica_id, node=replica.node, rng=self.rng))


async def _admit(placement: Placement, raw: bytes) -> bytes:
    return await dispatch(raw, AdmitRequest, placement.admission.admit)


async def _release(placement: Placement, raw: bytes) -> bytes:
    return await dispatch(raw, ReleaseRequest, placement.lifecycle.release)


def _release_body(reply: bytes, i: int) -> bytes:
    answer = json.loads(reply)
    if answer.get("status") != "admitted":
        raise RuntimeError(f"request {i} was not admitted: {answer}")
    return json.dumps({"allocation_id": answer["allocation_id"], "tenant": f"t{i % TENANTS}"}).encode()


class SimulatedClock:
    """Placement's monotonic clock in the in-process runs: it moves 1/rate s per admission, so the tenants'
    token buckets, the engines' reports (every simulated second) and the leases see the offered rate
    whatever the speed of the loop (a run under cProfile or valgrind is the same run)."""

    def __init__(self) -> None:
        self.ms = 1_000_000.0

    def __call__(self) -> float:
        return self.ms


async def handler_run(calls: int, rounds: int, rate: float, *, profile: bool, top: int) -> None:
    clock = SimulatedClock()
    placement = Placement.build(timer=clock)
    looping = asyncio.create_task(placement.admission.serve_queue())  # the service's admission-queue loop
    step_ms = 1000 / rate
    next_report = clock.ms + 1000

    def tick() -> None:
        nonlocal next_report
        clock.ms += step_ms
        if clock.ms >= next_report:  # the engines report every second
            placement.report()
            next_report += 1000

    for i in range(200):  # warm up: caches, first-call costs
        tick()
        await _release(placement, _release_body(await _admit(placement, _body(i, "warm")), i))
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:
        profiler.enable()
    admits: list[float] = []
    releases: list[float] = []
    for r in range(rounds):
        admit_s = release_s = 0.0
        for i in range(r * calls, (r + 1) * calls):
            tick()
            raw = _body(i)
            started = time.process_time()
            reply = await _admit(placement, raw)
            between = time.process_time()
            release = _release_body(reply, i)  # the caller's work: not counted
            between_release = time.process_time()
            released = await _release(placement, release)
            await asyncio.sleep(0)  # what the release woke (the admission queue's loop) runs: counted too
            ended = time.process_time()
            admit_s += between - started
            release_s += ended - between_release
            if b'"released"' not in released:
                raise RuntimeError(f"release {i} failed: {released!r}")
        admits.append(admit_s / calls * 1e6)
        releases.append(release_s / calls * 1e6)
    if profiler is not None:
        profiler.disable()
    looping.cancel()
    print(
        f"handler path (dispatch + handler, no bus), {rounds} rounds of {calls:,} admits and releases at "
        f"{rate:g}/s of placement's clock, CPU per call, best round (median):\n"
        f"  admit {min(admits):.1f} us ({statistics.median(admits):.1f}), "
        f"release {min(releases):.1f} us ({statistics.median(releases):.1f})"
        f"{' (under cProfile: inflated)' if profiler is not None else ''}"
    )
    if profiler is not None:
        _print_profile(profiler, top)


def _print_profile(profiler: cProfile.Profile, top: int) -> None:
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).strip_dirs().sort_stats(key).print_stats(top)
        print(f"-- by {key} --")
        print("\n".join(line for line in out.getvalue().splitlines() if line.strip())[:12_000])


# -- over NATS -----------------------------------------------------------------------------------------


async def wire_run(url: str, rate: float, seconds: float, *, profile: bool, top: int) -> None:
    import nats

    from shared.infra.requests import Endpoint, RequestServer

    placement = Placement.build()
    subjects = Subjects(f"prof{uuid.uuid4().hex[:8]}")
    server = RequestServer()
    queue = f"{subjects.prefix}.placement"
    server.add(Endpoint(subjects.rpc(Rpc.PLACEMENT_ADMIT), queue, AdmitRequest, placement.admission.admit, 64))
    server.add(Endpoint(subjects.rpc(Rpc.PLACEMENT_RELEASE), queue, ReleaseRequest, placement.lifecycle.release, 64))
    nc = await nats.connect(url, name="admit-profile-server")
    await server.start(nc)

    async def engines() -> None:
        while True:
            await asyncio.sleep(1.0)
            placement.report()

    reporting = asyncio.create_task(engines())
    looping = asyncio.create_task(placement.admission.serve_queue())  # the service's admission-queue loop
    client = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.bench.admit_profile",
        "--client",
        "--nats",
        url,
        "--prefix",
        subjects.prefix,
        "--rate",
        str(rate),
        "--seconds",
        str(seconds),
        stdout=subprocess.PIPE,
    )
    assert client.stdout is not None
    ready = await client.stdout.readline()  # the client warmed up: measure from here
    if ready.strip() != b"go":
        raise RuntimeError(f"the client did not start: {ready!r}")
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:
        profiler.enable()
    started = time.process_time()
    served_before = sum(load.served for load in server.loads.values())
    result = json.loads(await client.stdout.readline())
    cpu = time.process_time() - started
    served = sum(load.served for load in server.loads.values()) - served_before
    if profiler is not None:
        profiler.disable()
    await client.wait()
    reporting.cancel()
    looping.cancel()
    await server.stop()
    await nc.close()
    print(
        f"over NATS at {rate:g}/s for {seconds:g} s: {result['admits']:,} admits {result['outcomes']}, "
        f"{served:,} calls served; admit p50 {result['p50_ms']:.2f} ms, p99 {result['p99_ms']:.2f} ms "
        f"(client send lag at most {result['lag_ms']:.1f} ms)\n"
        f"  placement side: {cpu:.2f} CPU-s = {cpu / max(1, served) * 1e6:.0f} us per call (admit or release), "
        f"{cpu / max(1, result['admits']) * 1e6:.0f} us per admission (admit + release)"
        f"{' (under cProfile: inflated)' if profiler is not None else ''}\n"
        f"  client side: {result['cpu_s']:.2f} CPU-s = {result['cpu_s'] / max(1, served) * 1e6:.0f} us per call"
    )
    if profiler is not None:
        _print_profile(profiler, top)


async def client_run(url: str, prefix: str, rate: float, seconds: float) -> None:
    """The benchmark's client, alone in its process: admit open loop, release each admission when answered."""
    import nats

    subjects = Subjects(prefix)
    admit, release = subjects.rpc(Rpc.PLACEMENT_ADMIT), subjects.rpc(Rpc.PLACEMENT_RELEASE)
    nc = await nats.connect(url, name="admit-profile-client")
    latencies: list[float] = []
    outcomes: dict[str, int] = {}
    pending: set[asyncio.Task[None]] = set()

    async def one(i: int, timed: bool) -> None:
        started = time.perf_counter()
        msg = await nc.request(admit, _body(i, "w" if timed else "warm"), timeout=30)
        if timed:
            latencies.append((time.perf_counter() - started) * 1000)
        reply = json.loads(msg.data)
        status = str(reply.get("status"))
        if timed:
            outcomes[status] = outcomes.get(status, 0) + 1
        if status == "admitted":
            body = json.dumps({"allocation_id": reply["allocation_id"], "tenant": f"t{i % TENANTS}"}).encode()
            await nc.request(release, body, timeout=30)

    await asyncio.gather(*(one(i, False) for i in range(200)))
    print("go", flush=True)
    cpu = time.process_time()
    total = int(rate * seconds)
    begin = time.perf_counter()
    lag = 0.0
    for i in range(total):
        slot = begin + i / rate
        delay = slot - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        lag = max(lag, (time.perf_counter() - slot) * 1000)
        task = asyncio.create_task(one(i, True))
        pending.add(task)
        task.add_done_callback(pending.discard)
    while pending:
        await asyncio.gather(*list(pending))
    ordered = sorted(latencies)
    print(
        json.dumps(
            {
                "admits": total,
                "outcomes": outcomes,
                "p50_ms": nearest_rank(ordered, 0.5),
                "p99_ms": nearest_rank(ordered, 0.99),
                "lag_ms": lag,
                "cpu_s": time.process_time() - cpu,
            }
        ),
        flush=True,
    )
    await nc.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--calls", type=int, default=5_000, help="admits (each then released) per round, without --wire"
    )
    parser.add_argument(
        "--rounds", type=int, default=5, help="rounds without --wire (the best and the median are shown)"
    )
    parser.add_argument("--profile", action="store_true", help="print cProfile's heaviest functions")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--wire", action="store_true", help="behind the request server, over NATS")
    parser.add_argument("--nats", default="nats://127.0.0.1:4222")
    parser.add_argument("--rate", type=positive, default=1000.0)
    parser.add_argument("--seconds", type=positive, default=10.0)
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--prefix", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        asyncio.run(client_run(args.nats, args.prefix, args.rate, args.seconds))
    elif args.wire:
        asyncio.run(wire_run(args.nats, args.rate, args.seconds, profile=args.profile, top=args.top))
    else:
        asyncio.run(handler_run(args.calls, args.rounds, args.rate, profile=args.profile, top=args.top))


if __name__ == "__main__":
    main()
