"""Every service serves its Prometheus metrics: the six services as processes (names ``mt_*``, the demo
fleet), a TP=2 replica placed, a reservation made and a request routed; then each service's ``/metrics``
(the URL its health reply names) parses as the text exposition format and holds the catalogue metrics
it owns (``shared.infra.metrics.CATALOGUE``) with values that follow from what was done."""

from __future__ import annotations

import itertools
import math
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from hetsched.stack import probe_health, wait_healthy
from shared.contracts.placement import PlaceReply, PlaceRequest, ReleaseReply, ReleaseRequest
from shared.contracts.reservation import (
    ReservationCancelReply,
    ReservationCancelRequest,
    ReservationCreateReply,
    ReservationCreateRequest,
)
from shared.contracts.routing import RouteSelectReply, RouteSelectRequest
from shared.contracts.subjects import Rpc, Subjects
from shared.infra.catalog import demo_fleet_path
from shared.infra.metrics import CATALOGUE, EVERY_SERVICE
from shared.infra.rpc import RpcClient
from shared.infra.settings import Settings
from tests.conftest import ServiceProcesses
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

SERVICES = (
    "topology_discovery",
    "capacity_ledger",
    "placement",
    "reservation_filler",
    "cross_region_router",
    "rebalancer",
)
OWNER = {  # package -> the service name the catalogue names as owner
    "topology_discovery": "topology-discovery",
    "capacity_ledger": "capacity-ledger",
    "placement": "placement",
    "reservation_filler": "reservation-filler",
    "cross_region_router": "cross-region-router",
    "rebalancer": "rebalancer",
}
SKU = "A100-SXM-80GB"  # us-west-1: dgx-a100-01, 8 NVLinked GPUs
RESERVED_SKU = "L40S-48GB"  # us-west-1: two nodes of them
REGION = "us-west-1"
TENANT = "mt-acme"
OWNER_TENANT = "mt-owner"

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass
class Stack:
    rpc: RpcClient
    subjects: Subjects
    allocation_id: str
    reservation_id: str


def _exposition(url: str) -> tuple[dict[str, str], Samples]:
    """The exposition at ``url`` (it must parse): each family's type, and every sample by name and labels.
    A labelled family shows its HELP and TYPE even before its first sample."""
    with urllib.request.urlopen(url, timeout=5) as reply:
        text = reply.read().decode()
    families: dict[str, str] = {}
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        families[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return families, samples


def _scrape(url: str) -> Samples:
    return _exposition(url)[1]


def _named(samples: Samples, name: str, **labels: str) -> list[float]:
    """Values of the samples called ``name`` whose labels include ``labels``."""
    return [v for (n, got), v in samples.items() if n == name and set(labels.items()) <= set(got)]


async def _metrics_url(stack: Stack, package: str) -> str:
    health = await probe_health(stack.rpc, package)
    url = health.get("metrics_url")
    assert isinstance(url, str) and url.startswith("http://"), health
    return url


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(service_processes: ServiceProcesses, settings: Settings) -> AsyncIterator[Stack]:
    service_processes.start(
        "topology_discovery", name="mt_topology_discovery", HETSCHED_TOPOLOGY_INVENTORY=str(demo_fleet_path())
    )
    for package in SERVICES[1:]:
        extra = {"HETSCHED_RESERVATION_TICK_S": "0.2"} if package == "reservation_filler" else {}
        service_processes.start(package, name=f"mt_{package}", **extra)
    subjects = Subjects(settings.kit.subject_prefix)
    health = await wait_healthy(
        nats_url=settings.kit.nats_url or "", subjects=subjects, deadline_s=60, only=set(SERVICES)
    )
    assert all(h["status"] == "ok" for h in health.values()), health
    rpc = await RpcClient.connect(settings.kit.nats_url or "", subjects, timeout_s=10)
    tries = itertools.count()

    async def placed() -> PlaceReply | None:  # once placement's view holds the demo fleet
        reply = await rpc.ask(
            Rpc.PLACEMENT_PLACE,
            PlaceRequest(
                request_id=f"mt-replica-{next(tries)}",  # a refused id answers its refusal again
                tenant=TENANT,
                model="llama3.1-8b",
                context_tokens=8192,
                tp=2,
                region=REGION,
                skus=[SKU],
                backend="gpu",
            ),
            PlaceReply,
        )
        return reply if isinstance(reply, PlaceReply) and reply.status == "placed" else None

    replica = await wait_for(placed, 30, interval_s=0.2, what="a TP=2 replica placed on the demo fleet")
    assert replica.allocation_id is not None

    async def reserved() -> ReservationCreateReply | None:  # once the filler knows the fleet
        reply = await rpc.ask(
            Rpc.RESERVATION_CREATE,
            ReservationCreateRequest(
                tenant=OWNER_TENANT,
                policy="soft",
                count=1,
                sku=RESERVED_SKU,
                region=REGION,
                request_id=f"mt-res-{next(tries)}",
            ),
            ReservationCreateReply,
        )
        return reply if isinstance(reply, ReservationCreateReply) and reply.status == "created" else None

    reservation = await wait_for(reserved, 30, interval_s=0.2, what="a reservation made")
    assert reservation.reservation_id is not None
    yield Stack(rpc, subjects, replica.allocation_id, reservation.reservation_id)
    # The session's database and streams are shared with later modules: give back what this one took.
    released = await rpc.ask(
        Rpc.PLACEMENT_RELEASE, ReleaseRequest(allocation_id=replica.allocation_id, tenant=TENANT), ReleaseReply
    )
    assert isinstance(released, ReleaseReply) and released.status == "released", released
    cancelled = await rpc.ask(
        Rpc.RESERVATION_CANCEL,
        ReservationCancelRequest(reservation_id=reservation.reservation_id, tenant=OWNER_TENANT),
        ReservationCancelReply,
    )
    assert isinstance(cancelled, ReservationCancelReply) and cancelled.status == "cancelled", cancelled
    await rpc.close()
    for package in reversed(SERVICES):
        service_processes.stop(f"mt_{package}")


async def _scraped_when(stack: Stack, package: str, ready: Any, what: str) -> Samples:
    """The service's samples once ``ready(samples)`` holds (gauges are refreshed by loops)."""
    url = await _metrics_url(stack, package)
    last: list[Samples] = []

    async def scraped() -> bool:
        last[:] = [_scrape(url)]
        return bool(ready(last[0]))

    await wait_for(scraped, 30, interval_s=0.5, what=what)
    return last[0]


@pytest.mark.parametrize("package", SERVICES)
async def test_each_service_serves_the_catalogue_metrics_it_owns(stack: Stack, package: str) -> None:
    families, samples = _exposition(await _metrics_url(stack, package))
    names = {name for name, _labels in samples}
    assert "process_cpu_seconds_total" in names and "process_resident_memory_bytes" in names
    owned = {spec.name: spec for spec in CATALOGUE.values() if spec.owner in (OWNER[package], EVERY_SERVICE)}
    assert owned, package
    for name, spec in owned.items():
        family = name.removesuffix("_total") if spec.kind == "counter" else name
        assert families.get(family) == spec.kind, (package, name, families.get(family))
    others = {s.name for s in CATALOGUE.values() if s.owner not in (OWNER[package], EVERY_SERVICE)}
    assert not {n.removesuffix("_total") for n in others} & families.keys(), package


async def test_the_ledger_shows_the_commit_the_hbm_it_holds_and_the_nvlinked_tp_group(stack: Stack) -> None:
    samples = await _scraped_when(
        stack,
        "capacity_ledger",
        # Refreshed every few seconds: wait for a pass that saw the replica (not merely a first pass).
        lambda s: (
            any(v > 0 for v in _named(s, "hetsched_hbm_utilization_ratio", sku=SKU))
            and _named(s, "hetsched_tp_groups", degree="2", nvlinked="true")
        ),
        "the ledger's gauges refreshed",
    )
    assert _named(samples, "hetsched_ledger_commits_total")[0] >= 1
    (sku_util,) = _named(samples, "hetsched_hbm_utilization_ratio", sku=SKU)
    assert 0 < sku_util <= 1
    # Two of dgx-a100-01's GPUs hold the replica: each above 0, and what is free there is below usable.
    busy = [v for v in _named(samples, "hetsched_accelerator_hbm_utilization_ratio", sku=SKU) if v > 0]
    assert len(busy) >= 2 and all(0 < v <= 1 for v in busy)
    assert all(v >= 0 for v in _named(samples, "hetsched_hbm_free_bytes"))
    assert _named(samples, "hetsched_tp_groups", degree="2", nvlinked="true")[0] >= 1
    assert _named(samples, "hetsched_nvlink_cross_island_bytes_per_second") == [0.0]


async def test_placement_timed_and_counted_the_decision_and_shows_the_view(stack: Stack) -> None:
    samples = await _scraped_when(
        stack,
        "placement",
        lambda s: _named(s, "hetsched_placement_decision_seconds_count"),
        "placement's decision histogram",
    )
    assert _named(samples, "hetsched_placement_decision_seconds_count")[0] >= 1
    assert _named(samples, "hetsched_placement_decision_seconds_sum")[0] > 0
    assert _named(samples, "hetsched_placements_total")[0] >= 1
    # The demo fleet has TPU pods: a fragmentation figure for each, in [0, 1].
    fragmentation = await _scraped_when(
        stack, "placement", lambda s: _named(s, "hetsched_tpu_fragmentation_ratio"), "TPU fragmentation per pod"
    )
    assert all(0 <= v <= 1 for v in _named(fragmentation, "hetsched_tpu_fragmentation_ratio"))


async def test_the_filler_shows_the_reservations_fill_rate_and_idle_cost(stack: Stack) -> None:
    samples = await _scraped_when(
        stack,
        "reservation_filler",
        lambda s: _named(s, "hetsched_reservation_fill_rate", tenant=OWNER_TENANT),
        "the filler's figures worked out (every 10 s)",
    )
    # One L40S reserved and nobody on it: filled 0, idle at its hourly price.
    (fill,) = _named(samples, "hetsched_reservation_fill_rate", tenant=OWNER_TENANT)
    assert fill == 0.0
    (overall,) = _named(samples, "hetsched_reservation_fill_rate_overall")
    assert not math.isnan(overall) and 0 <= overall <= 1
    (idle,) = _named(samples, "hetsched_reservation_idle_cost_usd_per_hour", tenant=OWNER_TENANT)
    assert idle > 0


async def test_the_router_times_a_routed_request(stack: Stack) -> None:
    async def routed() -> bool:  # once the router has heard of the replica (PLACEMENT events)
        reply = await stack.rpc.ask(
            Rpc.ROUTE_SELECT,
            RouteSelectRequest(
                request_id="mt-route",
                tenant=TENANT,
                origin_region=REGION,
                model="llama3.1-8b",
                input_tokens=100,
                output_tokens=10,
                admit=False,
            ),
            RouteSelectReply,
        )
        return isinstance(reply, RouteSelectReply) and reply.status == "routed"

    await wait_for(routed, 30, interval_s=0.2, what="a request routed")
    samples = _scrape(await _metrics_url(stack, "cross_region_router"))
    assert _named(samples, "hetsched_route_rtt_seconds_count")[0] >= 1
    assert _named(samples, "hetsched_route_switches_total") == [0.0]


async def test_topology_shows_when_the_map_was_refreshed_and_the_rebalancer_its_detectors(stack: Stack) -> None:
    topology = _scrape(await _metrics_url(stack, "topology_discovery"))
    # The inventory was loaded (or found current) at start: the map's refresh time is a real unix time.
    (refreshed,) = _named(topology, "hetsched_topology_last_profile_timestamp_seconds")
    assert refreshed > 1.7e9
    assert _named(topology, "hetsched_topology_drift_total") == [0.0]
    rebalancer = await _scraped_when(
        stack,
        "rebalancer",
        lambda s: _named(s, "hetsched_rebalance_detectors_firing", detector="hbm_hot"),
        "the rebalancer's detectors",
    )
    assert len(_named(rebalancer, "hetsched_rebalance_detectors_firing")) == 6
