"""The request path on real NATS and Postgres: topology, the ledger, placement (with admission) and the
cross-region router as processes; replicas placed through `placement.place`, engines reporting their status
as `hetsched engine-sim` does. A 64k-token request goes to the SSM replica, a stale replica leaves rotation,
admission counts requests in memory (the ledger sees none of them), 100 in-flight sessions keep their region
while prices move under them and move at once when it goes down, a tenant whose home region is full takes
the cheaper region at the price of the SKU serving there (and stays home while it has room), bad input is
refused on both subjects."""

from __future__ import annotations

import asyncio
import copy
import json
import random
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import nats
import pytest
import pytest_asyncio
import yaml
from nats.aio.client import Client

from hetsched.engine_sim import EngineLoad, publish_engine_status
from hetsched.stack import wait_healthy
from shared.contracts.base import Rejected
from shared.contracts.fleet import FleetGetReply
from shared.contracts.ledger import SnapshotReply, SnapshotRequest
from shared.contracts.placement import (
    AdmitReply,
    AdmitRequest,
    PlaceReply,
    PlaceRequest,
    ReleaseReply,
    ReleaseRequest,
    RenewReply,
    RenewRequest,
)
from shared.contracts.routing import RouteRegionReply, RouteRegionRequest, RouteSelectReply, RouteSelectRequest
from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context, Rpc, Subjects
from shared.domain.routing import parse_regions
from shared.infra.catalog import demo_fleet_path, packaged_file
from shared.infra.rpc import RpcClient
from shared.infra.settings import Settings
from tests.conftest import ServiceProcesses, service_env
from tests.jetstream import read_all
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

STALE_S = 2.0


def _regions(path: Path, *, us_west_factor: float) -> None:
    """The shipped regions with eu-west-1 close to both US regions (so a price move can change a new
    tenant's region) and us-west-1's prices scaled."""
    doc = yaml.safe_load(packaged_file("regions.yaml").read_text())
    regions = copy.deepcopy(doc["regions"])
    regions["eu-west-1"]["rtt_ms"] = {"us-west-1": 70, "us-east-1": 60}
    regions["us-west-1"]["rtt_ms"]["eu-west-1"] = 70
    regions["us-east-1"]["rtt_ms"]["eu-west-1"] = 60
    east = regions["us-east-1"]["price_usd_per_hour"]
    regions["us-west-1"]["price_usd_per_hour"] = {sku: round(p * us_west_factor, 4) for sku, p in east.items()}
    path.write_text(yaml.safe_dump({"regions": regions}))


class Stack:
    def __init__(self, rpc: RpcClient, nc: Client, settings: Settings, regions_file: Path) -> None:
        self.rpc = rpc
        self.nc = nc
        self.settings = settings
        self.regions_file = regions_file
        self.replicas: dict[str, tuple[str, str]] = {}  # name -> (allocation id, node)
        self.skus: dict[str, str | None] = {}  # name -> the SKU placement chose

    async def place(self, name: str, model: str, region: str) -> None:
        reply = await self.rpc.ask(
            Rpc.PLACEMENT_PLACE,
            PlaceRequest(
                request_id=f"rp-{name}",
                tenant="platform",
                model=model,
                context_tokens=65536,
                concurrency=8,
                region=region,
                backend="gpu",
            ),
            PlaceReply,
        )
        assert isinstance(reply, PlaceReply) and reply.status == "placed", reply
        assert reply.allocation_id is not None
        self.replicas[name] = (reply.allocation_id, reply.placements[0].node)
        self.skus[name] = reply.sku

    async def report(self, name: str, **load: Any) -> None:
        allocation_id, node = self.replicas[name]
        status = EngineLoad(jitter=0, **load).status(replica_id=allocation_id, node=node, rng=random.Random(0))
        await publish_engine_status(self.nc.jetstream(), Subjects(self.settings.kit.subject_prefix), status)

    async def admit(self, **fields: Any) -> AdmitReply | Rejected:
        body = {"tenant": "acme", "output_tokens": 256, "region": "us-west-1", **fields}
        return await self.rpc.ask(Rpc.PLACEMENT_ADMIT, AdmitRequest(**body), AdmitReply)

    async def route(self, **fields: Any) -> RouteSelectReply | Rejected:
        body = {"model": "chat-long", "input_tokens": 1000, "output_tokens": 256, "admit": False, **fields}
        return await self.rpc.ask(Rpc.ROUTE_SELECT, RouteSelectRequest(**body), RouteSelectReply)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    service_processes: ServiceProcesses, settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    regions_file = tmp_path_factory.mktemp("regions") / "regions.yaml"
    _regions(regions_file, us_west_factor=2.0)
    service_processes.start(
        "topology_discovery", name="rq_topology", HETSCHED_TOPOLOGY_INVENTORY=str(demo_fleet_path())
    )
    service_processes.start("capacity_ledger", name="rq_ledger")
    service_processes.start(
        "placement",
        name="rq_placement",
        HETSCHED_ENGINE_STALE_S=str(STALE_S),
        HETSCHED_ADMIT_SHARED_OWNERS="platform",  # the replicas below are a shared pool: every tenant uses them
    )
    service_processes.start(
        "cross_region_router",
        name="rq_router",
        HETSCHED_REGIONS_FILE=str(regions_file),
        HETSCHED_ROUTE_FLUSH_MS="100",
    )
    health = await wait_healthy(
        nats_url=settings.kit.nats_url or "",
        subjects=Subjects(settings.kit.subject_prefix),
        deadline_s=60,
        only={"topology_discovery", "capacity_ledger", "placement", "cross_region_router"},
    )
    assert all(h["status"] == "ok" for h in health.values()), health
    rpc = await RpcClient.connect(settings.kit.nats_url or "", Subjects(settings.kit.subject_prefix), timeout_s=10)
    nc = await nats.connect(settings.kit.nats_url or "")
    s = Stack(rpc, nc, settings, regions_file)

    async def placed_ssm() -> bool:
        try:
            await s.place("ssm", "mamba2-2.7b", "us-west-1")
        except AssertionError:
            return False
        return True

    await wait_for(placed_ssm, 30, what="placement sees the demo fleet")
    await s.place("tf", "llama3.1-8b", "us-west-1")
    await s.place("east", "llama3.1-8b", "us-east-1")
    seen = iter(range(10_000))

    async def router_sees_east() -> bool:  # placement_decided reaches the router through its consumer
        n = next(seen)
        reply = await s.route(request_id=f"sees-east-{n}", tenant=f"sees-east-{n}", origin_region="eu-west-1")
        return isinstance(reply, RouteSelectReply) and reply.region == "us-east-1"

    await wait_for(router_sees_east, 30, what="the router knows the replica in us-east-1")
    yield s
    # The session's database is shared with later modules: give back what this one placed (its
    # admissions' holds end with their replicas).
    for allocation_id, _node in s.replicas.values():
        reply = await rpc.ask(
            Rpc.PLACEMENT_RELEASE, ReleaseRequest(allocation_id=allocation_id, tenant="platform"), ReleaseReply
        )
        assert getattr(reply, "status", None) == "released", reply
    await rpc.close()
    await nc.close()
    for name in ("rq_router", "rq_placement", "rq_ledger", "rq_topology"):
        service_processes.stop(name)


async def ledger_events(stack: Stack) -> list[dict[str, Any]]:
    """Every event of the LEDGER stream so far: each commit, release and expiry the ledger made durable."""
    return await read_all(
        stack.nc.jetstream(),
        stream=stream_name(Context.LEDGER, stream_prefix=stack.settings.kit.stream_prefix),
        subject=Subjects(stack.settings.kit.subject_prefix).events_of(Context.LEDGER),
    )


async def _admitted_to(stack: Stack, rid: str, **fields: Any) -> AdmitReply:
    reply = await stack.admit(request_id=rid, **fields)
    assert isinstance(reply, AdmitReply) and reply.status == "admitted", reply
    return reply


async def test_a_64k_request_goes_to_the_ssm_replica_and_is_counted_until_released(stack: Stack) -> None:
    await stack.report("ssm", queue_depth=4, base_latency_ms=150)
    await stack.report("tf", queue_depth=0, base_latency_ms=40)  # faster, emptier: only the rule sends it away

    async def long_one() -> AdmitReply | None:
        reply = await stack.admit(request_id="long-1", model="chat-long", input_tokens=64_000)
        return reply if isinstance(reply, AdmitReply) and reply.status == "admitted" else None

    reply = await wait_for(long_one, 15, what="the replicas are in rotation")
    assert reply is not None
    assert (reply.replica_id, reply.engine) == (stack.replicas["ssm"][0], "ssm")
    assert reply.allocation_id and reply.kv_bytes
    assert reply.sku is not None and reply.sku == stack.skus["ssm"]
    before = await ledger_events(stack)
    ledger_ids = {e["payload"].get("allocation_id") for e in before}
    assert reply.allocation_id not in ledger_ids  # counted in placement's memory, not a ledger allocation
    # No hold inside any of this module's replicas (the session's LEDGER stream also carries other modules'
    # events, such as the ledger test's request row written as it was before the retirement).
    ours = {allocation for allocation, _node in stack.replicas.values()}
    assert not any(e["payload"].get("kind") == "request" and e["payload"].get("parent_id") in ours for e in before), (
        "an admission is not a ledger allocation"
    )
    # A long generation renews its hold (the requester is not the replica's owner: placement renews it for it).
    renewed = await stack.rpc.ask(
        Rpc.PLACEMENT_RENEW, RenewRequest(allocation_id=reply.allocation_id, tenant="acme", lease_s=600), RenewReply
    )
    assert isinstance(renewed, RenewReply) and renewed.status == "renewed", renewed
    forbidden = await stack.rpc.ask(
        Rpc.PLACEMENT_RELEASE, ReleaseRequest(allocation_id=reply.allocation_id, tenant="mallory"), ReleaseReply
    )
    assert isinstance(forbidden, Rejected) and forbidden.error.code.value == "not_found", forbidden
    released = await stack.rpc.ask(
        Rpc.PLACEMENT_RELEASE, ReleaseRequest(allocation_id=reply.allocation_id, tenant="acme"), ReleaseReply
    )
    assert isinstance(released, ReleaseReply) and released.status == "released", released
    again = await stack.rpc.ask(
        Rpc.PLACEMENT_RELEASE, ReleaseRequest(allocation_id=reply.allocation_id, tenant="acme"), ReleaseReply
    )
    assert isinstance(again, Rejected) and again.error.code.value == "not_found", again  # released once

    short = await _admitted_to(stack, "short-1", model="chat-long", input_tokens=500)
    assert short.replica_id == stack.replicas["tf"][0]  # least cost: the idle, fast transformer


async def test_an_admit_run_makes_no_durable_work_in_the_ledger(stack: Stack) -> None:
    """Admissions and their releases write nothing in the ledger: its stream of commits, releases and
    expiries does not move while 40 requests are admitted and released."""
    await stack.report("ssm", queue_depth=0, base_latency_ms=150)
    await stack.report("tf", queue_depth=0, base_latency_ms=40)
    await _admitted_to(stack, "warm-1", model="chat-long", input_tokens=500)  # the replicas are in rotation
    before = len(await ledger_events(stack))
    for i in range(40):  # one after another (the engines report nothing new meanwhile: each is released)
        reply = await _admitted_to(stack, f"run-{i}", model="chat-long", input_tokens=500)
        released = await stack.rpc.ask(
            Rpc.PLACEMENT_RELEASE, ReleaseRequest(allocation_id=reply.allocation_id or "", tenant="acme"), ReleaseReply
        )
        assert isinstance(released, ReleaseReply) and released.status == "released", released
    await asyncio.sleep(1.0)  # a commit's event would be relayed within milliseconds
    assert len(await ledger_events(stack)) == before


async def test_a_stale_replica_is_never_chosen_and_a_failed_one_is_passed_over(stack: Stack) -> None:
    await stack.report("ssm", queue_depth=0, base_latency_ms=100)
    await stack.report("tf", queue_depth=0, base_latency_ms=40)
    first = await _admitted_to(stack, "st-1", model="chat-long", input_tokens=64_000)
    assert first.replica_id == stack.replicas["ssm"][0]
    # The gateway says the SSM engine failed this request: the retry fails over at once.
    over = await _admitted_to(
        stack, "st-1b", model="chat-long", input_tokens=64_000, failed_replica_id=first.replica_id
    )
    assert over.replica_id == stack.replicas["tf"][0] and over.engine == "transformer"

    await stack.report("ssm", queue_depth=0, base_latency_ms=100)  # back in rotation
    await asyncio.sleep(STALE_S + 0.5)  # ... and silent since: stale
    await stack.report("tf", queue_depth=0, base_latency_ms=40)
    for i in range(5):
        reply = await _admitted_to(stack, f"st-2-{i}", model="chat-long", input_tokens=64_000)
        assert reply.replica_id == stack.replicas["tf"][0], reply


async def test_route_select_routes_and_admits_in_the_chosen_region(stack: Stack) -> None:
    await stack.report("tf", queue_depth=0, base_latency_ms=40)
    await stack.report("ssm", queue_depth=0, base_latency_ms=100)
    reply = await stack.route(
        request_id="r-1", tenant="west-co", origin_region="us-west-1", session_id="s-1", admit=True
    )
    assert isinstance(reply, RouteSelectReply) and reply.status == "routed", reply
    assert (reply.region, reply.tier) == ("us-west-1", "affinity")
    assert reply.cost is not None and reply.cost.weights == {"rtt": 0.4, "price": 0.3, "power": 0.1, "affinity": 0.2}
    assert reply.admission is not None and reply.admission.status == "admitted"
    assert reply.admission.region == "us-west-1"


async def _release_admission(stack: Stack, reply: RouteSelectReply, tenant: str) -> None:
    if reply.admission is not None and reply.admission.allocation_id is not None:
        done = await stack.rpc.ask(
            Rpc.PLACEMENT_RELEASE,
            ReleaseRequest(allocation_id=reply.admission.allocation_id, tenant=tenant),
            ReleaseReply,
        )
        assert isinstance(done, ReleaseReply) and done.status == "released", done


async def _admission_in(stack: Stack, region: str, *, admitted: bool) -> None:
    """Wait until placement's admission in ``region`` answers as the engines' last reports say: admitted
    (the admission released at once), or no_capacity."""
    probes = iter(range(10_000))

    async def answers() -> bool:
        n = next(probes)
        reply = await stack.admit(request_id=f"probe-{region}-{n}", model="chat-long", input_tokens=500, region=region)
        if isinstance(reply, AdmitReply) and reply.status == "admitted" and reply.allocation_id is not None:
            done = await stack.rpc.ask(
                Rpc.PLACEMENT_RELEASE, ReleaseRequest(allocation_id=reply.allocation_id, tenant="acme"), ReleaseReply
            )
            assert isinstance(done, ReleaseReply) and done.status == "released", done
            return admitted
        return not admitted and isinstance(reply, Rejected) and reply.error.code.value == "no_capacity"

    await wait_for(answers, 10, what=f"admission in {region} {'admits' if admitted else 'answers no_capacity'}")


async def _from_home(stack: Stack, tenant: str, rid: str, *, home_full: bool) -> RouteSelectReply:
    """A tenant whose traffic goes to us-east-1 (its first request from eu-west-1 lands there, the nearest
    region serving the group) asks again from eu-west-1, admitted for real: us-east-1's engine reports
    itself unhealthy (``home_full``: its admission answers no_capacity) or idle; us-west-1's are idle. The
    admission made is released."""
    first = await stack.route(request_id=f"{rid}-home", tenant=tenant, origin_region="eu-west-1")
    assert isinstance(first, RouteSelectReply) and (first.region, first.tier) == ("us-east-1", "affinity"), first
    await stack.report("east", queue_depth=0, healthy=not home_full)
    await _admission_in(stack, "us-east-1", admitted=not home_full)
    await stack.report("tf", queue_depth=0, base_latency_ms=40)
    await stack.report("ssm", queue_depth=0, base_latency_ms=100)
    await _admission_in(stack, "us-west-1", admitted=True)
    reply = await stack.route(request_id=rid, tenant=tenant, origin_region="eu-west-1", admit=True)
    assert isinstance(reply, RouteSelectReply) and reply.status == "routed", reply
    await _release_admission(stack, reply, tenant)
    return reply


async def test_a_tenant_whose_home_is_full_takes_the_cost_tier_at_its_serving_skus_price(stack: Stack) -> None:
    # us-west-1 (70 ms from eu-west-1, within us-east-1's 60 + 20) sells the SKUs its replicas of the group
    # run on at half the price of us-east-1's SKU, and every other SKU at twice us-east-1's: by the regions'
    # means it is dearer, by what serves the request there it is 50% cheaper.
    east_sku, west_skus = stack.skus["east"], {stack.skus["tf"], stack.skus["ssm"]}
    assert east_sku is not None and None not in west_skus
    doc = yaml.safe_load(stack.regions_file.read_text())
    east_prices = doc["regions"]["us-east-1"]["price_usd_per_hour"]
    cheap = round(0.5 * east_prices[east_sku], 2)
    west_prices = {sku: round(2.0 * price, 4) for sku, price in east_prices.items()} | dict.fromkeys(west_skus, cheap)
    doc["regions"]["us-west-1"]["price_usd_per_hour"] = west_prices
    regions = parse_regions(doc)
    assert regions["us-west-1"].mean_price() > regions["us-east-1"].mean_price()
    stack.regions_file.write_text(yaml.safe_dump(doc))
    try:
        probes = iter(range(1000))

        async def moved() -> RouteSelectReply | None:  # the fallback tier until the router reloads the file
            n = next(probes)
            reply = await _from_home(stack, f"full-home-{n}", f"fh-{n}", home_full=True)
            return reply if reply.tier == "cost" else None

        reply = await wait_for(moved, 15, what="the cost tier once us-east-1 is full")
        assert reply is not None and reply.region == "us-west-1" and reply.relaxed_ttft_ms is None
        assert reply.cost is not None and reply.cost.price_usd_per_hour == cheap  # not us-west-1's mean
        assert "affinity region us-east-1 is full" in (reply.explanation or "")
        assert reply.admission is not None and (reply.admission.status, reply.admission.region) == (
            "admitted",
            "us-west-1",
        )

        # While us-east-1 has room the tenant stays there, though us-west-1 is still 50% cheaper.
        home = await _from_home(stack, "roomy-home", "rh-1", home_full=False)
        assert (home.region, home.tier, home.switched) == ("us-east-1", "affinity", False)
        assert home.cost is not None and home.cost.price_usd_per_hour == east_prices[east_sku]
        assert home.admission is not None and home.admission.status == "admitted"
    finally:
        _regions(stack.regions_file, us_west_factor=2.0)


async def test_in_flight_sessions_keep_their_region_while_prices_move_and_move_when_it_goes_down(
    stack: Stack,
) -> None:
    sessions = [(f"tenant-{i % 10}", f"sess-{i}") for i in range(100)]

    async def route(tenant: str, session: str, rid: str, *, in_flight: bool) -> RouteSelectReply:
        reply = await stack.route(
            request_id=rid, tenant=tenant, session_id=session, origin_region="eu-west-1", in_flight=in_flight
        )
        assert isinstance(reply, RouteSelectReply) and reply.status == "routed", reply
        return reply

    # No history: every session starts in us-east-1, the nearest region to eu-west-1 that serves the group.
    first = await asyncio.gather(*(route(t, s, f"{s}-0", in_flight=False) for t, s in sessions))
    assert {r.region for r in first} == {"us-east-1"}

    # Prices move under them (us-west-1 now 30% of us-east-1) while 100 sessions stream concurrently.
    async def stream(rounds: int) -> list[str]:
        regions: list[str] = []
        for n in range(rounds):
            replies = await asyncio.gather(*(route(t, s, f"{s}-f{n}", in_flight=True) for t, s in sessions))
            regions += [r.region or "" for r in replies]
            assert not any(r.switched for r in replies)
        return regions

    streaming = asyncio.create_task(stream(6))
    await asyncio.sleep(0.2)
    _regions(stack.regions_file, us_west_factor=0.3)

    probes = iter(range(1000))

    async def new_tenants_go_west() -> bool:  # the move is real: a tenant whose home is full takes the cost tier
        n = next(probes)
        reply = await _from_home(stack, f"newcomer-{n}", f"new-r-{n}", home_full=True)
        return reply.region == "us-west-1" and reply.tier == "cost"

    await wait_for(new_tenants_go_west, 10, what="the router reloads the new prices")
    assert set(await streaming) == {"us-east-1"}
    held = await asyncio.gather(*(route(t, s, f"{s}-after", in_flight=True) for t, s in sessions))
    assert {r.region for r in held} == {"us-east-1"}

    # us-east-1 goes down: in-flight sessions move at once (their stream is gone with it).
    down = await stack.rpc.ask(Rpc.ROUTE_REGION, RouteRegionRequest(region="us-east-1", state="down"), RouteRegionReply)
    assert isinstance(down, RouteRegionReply) and (down.state, down.previous) == ("down", "up")
    moved = await asyncio.gather(*(route(t, s, f"{s}-down", in_flight=True) for t, s in sessions))
    assert {r.region for r in moved} == {"us-west-1"}
    await stack.rpc.ask(Rpc.ROUTE_REGION, RouteRegionRequest(region="us-east-1", state="up"), RouteRegionReply)

    async def switched_events() -> list[dict[str, Any]]:
        events = await read_all(
            stack.nc.jetstream(),
            stream=stream_name(Context.ROUTING, stream_prefix=stack.settings.kit.stream_prefix),
            subject=Subjects(stack.settings.kit.subject_prefix).events_of(Context.ROUTING),
        )
        return [e for e in events if e["type"].endswith("route_switched")]

    async def every_tenant_switched() -> bool:  # the outbox relay publishes them after the routes' commit
        return {e["payload"]["tenant"] for e in await switched_events()} >= {f"tenant-{i}" for i in range(10)}

    await wait_for(every_tenant_switched, 10, what="route_switched for every tenant that moved")
    switched = await switched_events()
    ours = [e["payload"] for e in switched if e["payload"]["tenant"].startswith("tenant-")]
    assert all(payload["from_region"] == "us-east-1" for payload in ours)


async def test_bad_input_on_both_subjects_gets_typed_errors_and_changes_nothing(stack: Stack) -> None:
    async def raw(rpc: Rpc, body: bytes) -> dict[str, Any]:
        msg = await stack.nc.request(Subjects(stack.settings.kit.subject_prefix).rpc(rpc), body, timeout=10)
        return dict(json.loads(msg.data))

    holds = len(await ledger_events(stack))
    snap = await stack.rpc.ask(Rpc.LEDGER_SNAPSHOT, SnapshotRequest(), SnapshotReply)
    assert isinstance(snap, SnapshotReply)
    reserved = {a.id: (a.hbm_reserved_bytes, tuple(a.allocations)) for a in snap.accelerators}
    for rpc in (Rpc.PLACEMENT_ADMIT, Rpc.ROUTE_SELECT):
        for body in (
            b"not json",
            b"[]",
            b'{"request_id": "x"}',
            b'{"request_id": "x", "tenant": "t", "model": "chat-long", "input_tokens": -5, "output_tokens": 1,'
            b' "origin_region": "us-west-1"}',
            b'{"request_id": "x", "tenant": "t", "model": "chat-long", "input_tokens": 5, "output_tokens": 1,'
            b' "origin_region": "us-west-1", "hint": "quantum"}',
        ):
            reply = await raw(rpc, body)
            assert reply["status"] == "rejected" and reply["error"]["code"] == "invalid_request", (rpc, body, reply)
    unknown = await stack.admit(request_id="u", model="gpt-17", input_tokens=10)
    assert isinstance(unknown, Rejected) and unknown.error.code == "unknown_model"
    origin = await stack.route(request_id="u", tenant="t", origin_region="mars-1")
    assert isinstance(origin, Rejected) and origin.error.code == "invalid_request"
    region = await stack.rpc.ask(Rpc.ROUTE_REGION, RouteRegionRequest(region="mars-1", state="down"), RouteRegionReply)
    assert isinstance(region, Rejected) and region.error.code == "not_found"
    after = await stack.rpc.ask(Rpc.LEDGER_SNAPSHOT, SnapshotRequest(), SnapshotReply)
    assert isinstance(after, SnapshotReply)
    assert {a.id: (a.hbm_reserved_bytes, tuple(a.allocations)) for a in after.accelerators} == reserved
    assert len(await ledger_events(stack)) == holds


async def test_the_cli_runs_the_request_path_with_a_simulated_engine(stack: Stack) -> None:
    """`hetsched engine-sim` reports a replica, `hetsched admit` and `hetsched route` take requests."""
    env = service_env(stack.settings)

    async def cli(*args: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "hetsched",
            *args,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        out, _ = await proc.communicate()
        return proc.returncode or 0, out.decode()

    allocation_id, node = stack.replicas["east"]
    code, out = await cli(
        "engine-sim", "--replica", allocation_id, "--node", node, "--count", "1", "--queue-depth", "0"
    )
    assert code == 0 and "1 engine status report(s) sent" in out, out

    async def admitted() -> dict[str, Any] | None:
        code, out = await cli(
            "admit",
            "--model",
            "llama3.1-8b",
            "--tenant",
            "cli-co",
            "--input-tokens",
            "900",
            "--region",
            "us-east-1",
            "--json",
        )
        reply = json.loads(out[out.index("{") :]) if "{" in out else {}
        return reply if code == 0 and reply.get("status") == "admitted" else None

    async def engine_reporting() -> None:
        # A running engine reports every 200 ms; a report goes stale after STALE_S (2 s), less than the CLI may
        # take to start on a loaded machine: the engine keeps reporting (the report engine-sim sent) meanwhile.
        while True:
            await stack.report("east", queue_depth=0)
            await asyncio.sleep(0.5)

    reporting = asyncio.ensure_future(engine_reporting())
    try:
        reply = await wait_for(admitted, 20, what="the CLI admits onto the simulated engine's replica")
    finally:
        reporting.cancel()
    assert reply["replica_id"] == allocation_id and reply["engine"] == "transformer"

    code, out = await cli(
        "route", "--model", "llama3.1-8b", "--tenant", "cli-co", "--origin", "us-east-1", "--no-admit", "--json"
    )
    routed = json.loads(out[out.index("{") :])
    assert code == 0 and (routed["status"], routed["region"]) == ("routed", "us-east-1"), out
    code, out = await cli("route", "--model", "llama3.1-8b", "--tenant", "cli-co", "--origin", "atlantis", "--json")
    # Bad input the service refuses (invalid_request) takes the CLI's one bad-input path: one line, exit 2.
    assert code == 2 and out.strip() == (
        "error: invalid_request: unknown origin_region 'atlantis'; known: eu-west-1, us-east-1, us-west-1"
    ), out


async def cli_run(stack: Stack, *args: str) -> tuple[int, str, str]:
    """`hetsched ARGS` against the stack: exit status, stdout, stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "hetsched",
        *args,
        env=service_env(stack.settings),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    return proc.returncode or 0, out.decode(), err.decode()


async def test_engine_sim_says_what_it_reports_and_refuses_a_node_its_replica_is_not_on(stack: Stack) -> None:
    """`hetsched engine-sim` prints a start line, one line per report and a count; without --node it reports
    for the replica's node in the ledger; another node, or a replica the ledger does not hold, is refused
    (exit 2, one line) before anything is reported."""
    allocation_id, node = stack.replicas["east"]
    code, out, err = await cli_run(
        stack, "engine-sim", "--replica", allocation_id, "--count", "2", "--interval-s", "0.1"
    )
    lines = out.splitlines()
    assert code == 0 and err == "", out + err
    assert lines[0] == f"engine-sim: reporting replica {allocation_id} on {node} every 0.1 s, 2 report(s)", out
    assert [line.split(":")[0] for line in lines[1:3]] == ["report 1", "report 2"], out
    assert all(" of 40.0 GB, TTFT p50 " in line and line.endswith("healthy") for line in lines[1:3]), out
    assert lines[3:] == [f"2 engine status report(s) sent for {allocation_id} on {node}"], out

    _west_id, west_node = stack.replicas["tf"]
    elsewhere = next(n for n in ("dgx-h100-01", "hgx-h200-01", west_node) if n != node)
    code, out, err = await cli_run(stack, "engine-sim", "--replica", allocation_id, "--node", elsewhere, "--count", "1")
    assert code == 2 and out == "" and len(err.splitlines()) == 1, out + err
    assert err.startswith(f"error: replica {allocation_id} is not placed on {elsewhere!r}") and err.rstrip().endswith(
        f"it is on {node}"
    ), err
    code, out, err = await cli_run(stack, "engine-sim", "--replica", "al-nobody", "--count", "1")
    assert code == 2 and out == "" and "replica 'al-nobody' holds no accelerator in the ledger" in err, out + err


async def test_unknown_names_are_refused_with_the_known_ones(stack: Stack) -> None:
    """An unknown model (place, explain, admit, route), SKU or region (place, explain, admit, route's origin): a typed
    refusal whose message lists the known names, the closest first; an unknown region is `invalid_request`
    naming the fleet's regions, not `no_capacity`."""

    asked = iter(range(100))

    async def place(rpc: Rpc, **fields: Any) -> Rejected | PlaceReply:
        # A request id is kept with its body even when refused: a fresh one per request.
        body = {"request_id": f"unknown-{next(asked)}", "tenant": "acme", "model": "llama3-8b", "context_tokens": 4096}
        return await stack.rpc.ask(rpc, PlaceRequest(**{**body, **fields}), PlaceReply)

    for rpc in (Rpc.PLACEMENT_PLACE, Rpc.PLACEMENT_EXPLAIN):
        model = await place(rpc, model="llama3-7b")
        assert isinstance(model, Rejected) and model.error.code == "unknown_model", model
        assert model.error.message.startswith("unknown model 'llama3-7b' (did you mean "), model
        assert all(name in model.error.message for name in ("llama3-8b", "llama3-70b", "mamba2-2.7b", "mixtral-8x7b"))
        sku = await place(rpc, skus=["H200"])
        assert isinstance(sku, Rejected) and sku.error.code == "unknown_sku", sku
        assert sku.error.message.startswith(
            "unknown SKU 'H200' (did you mean 'H200-SXM-141GB'?); known: H200-SXM-141GB"
        )
        assert all(name in sku.error.message for name in ("H100-SXM-80GB", "L40S-48GB", "TPU-V5E")), sku
        region = await place(rpc, region="us-west-2")
        assert isinstance(region, Rejected) and region.error.code == "invalid_request", region
        head = "unknown region 'us-west-2' (did you mean 'us-west-1'?); known: "
        assert region.error.message.startswith(head + "us-west-1, "), region
        # The regions placement knows are its fleet's (the session's database may hold other modules' nodes).
        fleet = await stack.rpc.fleet()
        assert isinstance(fleet, FleetGetReply)
        known = {n.region for n in fleet.nodes} | {p.region for p in fleet.tpu_pods}
        assert set(region.error.message.removeprefix(head).split(", ")) == known, (region, known)
    far = await stack.admit(request_id="unknown-admit-region", model="chat-long", input_tokens=10, region="us-west-2")
    assert isinstance(far, Rejected) and far.error.code == "invalid_request", far
    assert far.error.message.startswith(head + "us-west-1, "), far
    assert set(far.error.message.removeprefix(head).split(", ")) == known, (far, known)
    admitted = await stack.admit(request_id="unknown-admit", model="chat-lnog", input_tokens=10)
    assert isinstance(admitted, Rejected) and admitted.error.code == "unknown_model", admitted
    assert admitted.error.message.startswith("no model or model group 'chat-lnog' (did you mean 'chat-long'?); known:")
    assert "chat-large" in admitted.error.message and "llama3.1-8b" in admitted.error.message
    routed = await stack.route(request_id="unknown-route", tenant="t", origin_region="us-west-1", model="mixtral-8x7")
    assert isinstance(routed, Rejected) and routed.error.code == "unknown_model", routed
    assert routed.error.message.startswith("no model or model group 'mixtral-8x7' (did you mean 'mixtral-8x7b'?)")
    origin = await stack.route(request_id="unknown-origin", tenant="t", origin_region="eu-west-2")
    assert isinstance(origin, Rejected) and origin.error.code == "invalid_request", origin
    assert origin.error.message == (
        "unknown origin_region 'eu-west-2' (did you mean 'eu-west-1'?); known: eu-west-1, us-west-1, us-east-1"
    )
