"""TopologyHandlers with fakes: an in-memory store, a unit of work that records its events, a fake
monotonic clock. No servers; each test runs in milliseconds."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from services.topology_discovery.handlers import INVENTORY_SOURCE, TopologyHandlers
from services.topology_discovery.metrics import TopologyMetrics
from services.topology_discovery.store import (
    AcceleratorRecord,
    FleetPage,
    NodeRecord,
    StoredNode,
    TopologyStore,
)
from shared.contracts.base import Rejected
from shared.contracts.envelope import EventEnvelope, new_event
from shared.contracts.fleet import FleetDescribeRequest, FleetGetReply, FleetGetRequest
from shared.contracts.ledger import AllocationEvent, ShareOut
from shared.contracts.topology import (
    Heartbeat,
    NodeProfileEvent,
    NodeStateEvent,
    ProfileError,
    TopologyReportReply,
    TopologyReportRequest,
)
from shared.domain.fleet import Accelerator, Domain, Fleet, NodeProfile, Rack, TpuPod
from shared.domain.inventory import InventoryError
from shared.domain.liveness import Liveness, LivenessTracker
from shared.domain.topology import LinkMatrix
from shared.domain.topology.tpu import TpuType
from shared.infra.catalog import demo_fleet_path, load_skus
from shared.infra.metrics import ServiceMetrics
from shared.infra.profiles import profile_to_payload
from tests.fakes import NOW, FakeUnitOfWork

pytestmark = pytest.mark.asyncio

GB = 10**9
HEARTBEAT_MS = 1000.0
SKUS = load_skus()
MISSED = 3


# -- builders --------------------------------------------------------------------------------


def node(name: str, *, gpus: int = 2, source: str = "nvml", hbm: int = 80 * GB, region: str = "r1") -> NodeProfile:
    codes = [["X" if i == j else "NV18" for j in range(gpus)] for i in range(gpus)]
    return NodeProfile(
        name=name,
        region=region,
        cluster="c1",
        rack="k1",
        sku="H100-SXM-80GB",
        accelerators=tuple(Accelerator(index=i, sku="H100-SXM-80GB", hbm_bytes=hbm) for i in range(gpus)),
        links=LinkMatrix.from_codes(codes),
        source=source,
    )


def report(profile: NodeProfile) -> TopologyReportRequest:
    return TopologyReportRequest(node=profile.name, profile=profile_to_payload(profile))


def envelope() -> EventEnvelope:
    return new_event(type="ledger.x", source="test", payload={}, occurred_at=NOW)


def allocation(allocation_id: str, shares: Mapping[str, int], *, counts: bool = True) -> AllocationEvent:
    return AllocationEvent(
        allocation_id=allocation_id,
        request_id="r-1",
        tenant="acme",
        kind="replica" if counts else "request",
        counts_against_hbm=counts,
        shares=[
            ShareOut(
                accelerator_id=a, weights_bytes=b, kv_bytes=0, activation_bytes=0, workspace_bytes=0, total_bytes=b
            )
            for a, b in shares.items()
        ],
    )


# -- fakes -----------------------------------------------------------------------------------


class FakeClock:
    """Monotonic milliseconds that move only when the test says so."""

    def __init__(self) -> None:
        self.ms = 0.0

    def __call__(self) -> float:
        return self.ms


class FakeStore(TopologyStore):
    """The topology tables in dicts; the session argument is ignored."""

    def __init__(self) -> None:
        self.profiles_: dict[str, NodeProfile] = {}
        self.state: dict[str, Liveness] = {}
        self.domains: list[Domain] = []
        self.racks: list[Rack] = []
        self.pods: list[TpuPod] = []
        self.sources: dict[str, str] = {}
        self.reserved: dict[str, int] = {}
        self.shares: dict[tuple[str, str], tuple[int, bool]] = {}  # (allocation, accelerator) -> (bytes, ended)
        self.fail_liveness = 0  # how many set_liveness calls fail before they work

    async def nodes(self, *, session: Any) -> dict[str, StoredNode]:
        return {n: self._stored(p) for n, p in self.profiles_.items()}

    def _stored(self, p: NodeProfile) -> StoredNode:
        return StoredNode(p.name, p.region, p.source, p.fingerprint(), self.state[p.name])

    async def node(self, *, session: Any, name: str) -> StoredNode | None:
        p = self.profiles_.get(name)
        return self._stored(p) if p else None

    async def profiles(self, *, session: Any) -> list[NodeProfile]:
        return list(self.profiles_.values())

    async def node_profile(self, *, session: Any, name: str) -> Any:
        p = self.profiles_.get(name)
        return profile_to_payload(p) if p else None

    async def upsert_nodes(self, *, session: Any, nodes: Sequence[NodeProfile], now: datetime) -> None:
        for n in nodes:
            self.profiles_[n.name] = n
            self.state.setdefault(n.name, Liveness.UP)

    async def delete_nodes(self, *, session: Any, names: Iterable[str]) -> None:
        for name in names:
            self.profiles_.pop(name, None)
            self.state.pop(name, None)

    async def replace_domains(self, *, session: Any, domains: Sequence[Domain]) -> None:
        self.domains = list(domains)

    async def replace_static(self, *, session: Any, racks: Sequence[Rack], tpu_pods: Sequence[TpuPod]) -> None:
        self.racks, self.pods = list(racks), list(tpu_pods)

    async def source_fingerprint(self, *, session: Any, name: str) -> str | None:
        return self.sources.get(name)

    async def record_source(self, *, session: Any, name: str, fingerprint: str, now: datetime) -> None:
        self.sources[name] = fingerprint

    async def set_liveness(self, *, session: Any, node: str, expected: Liveness, to: Liveness) -> str | None:
        if self.fail_liveness:
            self.fail_liveness -= 1
            raise ConnectionError("database went away")
        if self.state.get(node) is not expected:
            return None
        self.state[node] = to
        return self.profiles_[node].region

    async def accelerator_ids(self, *, session: Any, nodes: Sequence[str]) -> dict[str, list[str]]:
        return {n: [self.profiles_[n].accelerator_id(a.index) for a in self.profiles_[n].accelerators] for n in nodes}

    async def reserve_shares(self, *, session: Any, allocation_id: str, shares: Mapping[str, int]) -> None:
        for acc, size in shares.items():
            if (allocation_id, acc) not in self.shares:
                self.shares[(allocation_id, acc)] = (size, False)
                self.reserved[acc] = self.reserved.get(acc, 0) + size

    async def release_shares(self, *, session: Any, allocation_id: str, shares: Mapping[str, int]) -> None:
        for acc, size in shares.items():
            held, ended = self.shares.get((allocation_id, acc), (size, None))
            self.shares[(allocation_id, acc)] = (held, True)
            if ended is False:
                self.reserved[acc] -= held

    async def fleet_page(
        self,
        *,
        session: Any,
        region: str | None = None,
        node: str | None = None,
        after: str | None = None,
        limit: int | None = None,
        profiles: bool = False,
    ) -> FleetPage:
        names = sorted(n for n, p in self.profiles_.items() if (not region or p.region == region))
        names = [n for n in names if (node is None or n == node) and (not after or n > after)]
        page = names[:limit] if limit else names
        members = {d.id: d for d in self.domains}
        domain_of = {m: d.id for d in self.domains for m in d.members}
        accelerators = [
            AcceleratorRecord(
                id=(acc_id := self.profiles_[n].accelerator_id(a.index)),
                node=n,
                index=a.index,
                hbm_bytes=a.hbm_bytes,
                domain=domain_of.get(acc_id),
                reserved_bytes=self.reserved.get(acc_id, 0),
            )
            for n in page
            for a in self.profiles_[n].accelerators
        ]
        p = self.profiles_
        return FleetPage(
            nodes=[
                NodeRecord(
                    n,
                    p[n].region,
                    p[n].cluster,
                    p[n].rack,
                    p[n].sku,
                    p[n].topology.kind.value,
                    self.state[n].value,
                    p[n].source,
                    profile=profile_to_payload(p[n]) if profiles else None,
                )
                for n in page
            ],
            accelerators=accelerators,
            domains=[members[d] for d in sorted({a.domain for a in accelerators if a.domain})],
            tpu_pods=self.pods if not after and node is None else [],
            racks=self.racks if not after and node is None else [],
            total_nodes=len(names)
            if not after
            else len([n for n in self.profiles_ if not region or self.profiles_[n].region == region]),
            more=bool(limit) and len(names) > (limit or 0),
        )


class World:
    def __init__(
        self, *, max_payload: int = 1 << 20, inventory: Path | None = None, metrics: TopologyMetrics | None = None
    ) -> None:
        self.clock = FakeClock()
        self.uow = FakeUnitOfWork(source="topology-discovery")
        self.store = FakeStore()
        self.tracker = LivenessTracker(interval_ms=HEARTBEAT_MS, missed_beats=MISSED)
        self.handlers = TopologyHandlers(
            uow=self.uow,  # type: ignore[arg-type]
            monotonic_ms=self.clock,
            skus=SKUS,
            tracker=self.tracker,
            log=logging.getLogger("test.topology"),
            store=self.store,
            max_payload=lambda: max_payload,
            inventory=inventory,
            metrics=metrics,
        )

    def payloads(self, name: str) -> list[dict[str, Any]]:
        return [e.payload for e in self.uow.events if e.type.endswith(f".{name}")]


# -- reports ---------------------------------------------------------------------------------


async def test_a_new_profile_is_stored_and_announced_as_profiled() -> None:
    w = World()
    reply = await w.handlers.report(report(node("a1")))
    assert isinstance(reply, TopologyReportReply) and reply.status == "accepted"
    assert w.uow.names() == ["node_profiled"]
    event = NodeProfileEvent.model_validate(w.payloads("node_profiled")[0])
    assert event.node == "a1" and event.previous_fingerprint is None
    assert [d.members for d in event.domains] == [["a1/gpu0", "a1/gpu1"]]
    assert w.tracker.state("a1") is Liveness.UP  # the first report starts the watch


async def test_an_unchanged_profile_emits_nothing() -> None:
    w = World()
    await w.handlers.report(report(node("a1")))
    reply = await w.handlers.report(report(node("a1")))
    assert isinstance(reply, TopologyReportReply) and reply.status == "unchanged"
    assert w.uow.names() == ["node_profiled"]


async def test_a_changed_profile_is_announced_with_its_previous_fingerprint() -> None:
    w = World()
    before = node("a1")
    await w.handlers.report(report(before))
    after = node("a1", gpus=4)
    reply = await w.handlers.report(report(after))
    assert isinstance(reply, TopologyReportReply) and reply.fingerprint == after.fingerprint()
    assert w.uow.names() == ["node_profiled", "node_changed"]
    changed = NodeProfileEvent.model_validate(w.payloads("node_changed")[0])
    assert changed.previous_fingerprint == before.fingerprint() and len(changed.profile.accelerators) == 4


@pytest.mark.parametrize(
    ("request_for", "code"),
    [
        ("other", "invalid_request"),  # the profile names another node
        ("inventory-source", "invalid_request"),  # agents never report as the inventory
        ("inventory-owned", "conflict"),  # the inventory defines this node
    ],
)
async def test_bad_reports_are_refused_and_change_nothing(request_for: str, code: str) -> None:
    w = World()
    await w.handlers.sync_inventory(Fleet(nodes=(node("inv1", source=INVENTORY_SOURCE),)), "f1")
    events = list(w.uow.events)
    request = {
        "other": TopologyReportRequest(node="zzz", profile=profile_to_payload(node("a1"))),
        "inventory-source": report(node("a1", source=INVENTORY_SOURCE)),
        "inventory-owned": report(node("inv1")),
    }[request_for]
    reply = await w.handlers.report(request)
    assert isinstance(reply, Rejected) and reply.error.code == code
    assert w.uow.events == events and w.tracker.state("a1") is None


async def test_a_profiling_failure_is_published_and_the_profile_stays() -> None:
    w = World()
    await w.handlers.report(report(node("a1")))
    error = ProfileError(message="line 5: expected 8 link cells", line=5, provider="nvidia-smi")
    reply = await w.handlers.report(TopologyReportRequest(node="a1", error=error))
    assert isinstance(reply, TopologyReportReply) and reply.status == "accepted"
    assert w.uow.names() == ["node_profiled", "node_profile_failed"]
    assert w.payloads("node_profile_failed")[0]["error"]["line"] == 5
    assert w.store.profiles_["a1"] == node("a1")


async def test_a_failing_node_stays_unconfirmed_through_its_beats_until_a_profile_parses_again() -> None:
    registry = ServiceMetrics("topology-discovery")
    wall = [NOW.timestamp()]
    w = World(metrics=TopologyMetrics(registry, clock=lambda: datetime.fromtimestamp(wall[0], tz=NOW.tzinfo)))

    def confirmed() -> float | None:
        return registry.registry.get_sample_value("hetsched_node_last_profile_timestamp_seconds", {"node": "a1"})

    await w.handlers.report(report(node("a1")))
    assert confirmed() == NOW.timestamp()
    error = ProfileError(message="line 5: expected 8 link cells", line=5, provider="nvidia-smi")
    await w.handlers.report(TopologyReportRequest(node="a1", error=error))
    wall[0] += 60
    await w.handlers.heartbeat(Heartbeat(node="a1"))
    assert confirmed() == NOW.timestamp()  # it beats, but its profile is not current
    assert registry.registry.get_sample_value("hetsched_node_profile_failures_total", {"node": "a1"}) == 1

    reply = await w.handlers.report(report(node("a1")))  # parses again, unchanged
    assert isinstance(reply, TopologyReportReply) and reply.status == "unchanged"
    assert confirmed() == wall[0]
    wall[0] += 60
    await w.handlers.heartbeat(Heartbeat(node="a1"))
    assert confirmed() == wall[0]

    await w.handlers.liveness_tick()
    assert registry.registry.get_sample_value("hetsched_nodes", {"state": "up"}) == 1
    w.clock.ms = HEARTBEAT_MS * MISSED + 1
    await w.handlers.liveness_tick()
    assert registry.registry.get_sample_value("hetsched_nodes", {"state": "up"}) == 0
    assert registry.registry.get_sample_value("hetsched_nodes", {"state": "lost"}) == 1


# -- inventory -------------------------------------------------------------------------------


async def test_inventory_sync_announces_new_unchanged_and_removed_nodes() -> None:
    w = World()
    first = Fleet(nodes=(node("i1", source=INVENTORY_SOURCE), node("i2", source=INVENTORY_SOURCE, region="r2")))
    counts = await w.handlers.sync_inventory(first, "f1")
    assert (counts.new, counts.changed, counts.unchanged, counts.removed) == (2, 0, 0, 0)
    assert w.uow.names() == ["node_profiled", "node_profiled"]

    counts = await w.handlers.sync_inventory(Fleet(nodes=(node("i1", source=INVENTORY_SOURCE),)), "f2")
    assert (counts.new, counts.changed, counts.unchanged, counts.removed) == (0, 0, 1, 1)
    assert w.uow.names()[2:] == ["node_removed"]
    removed = NodeStateEvent.model_validate(w.payloads("node_removed")[0])
    assert (removed.node, removed.region, removed.accelerators) == ("i2", "r2", ["i2/gpu0", "i2/gpu1"])
    assert "i2" not in w.store.profiles_ and w.store.sources[INVENTORY_SOURCE] == "f2"


async def test_the_configured_inventory_loads_once_and_not_again_when_unchanged() -> None:
    w = World(inventory=demo_fleet_path())
    await w.handlers.load_inventory()
    assert w.uow.names().count("node_profiled") == len(w.store.profiles_) == 13
    assert w.uow.names().count("tpu_pod_profiled") == 2
    loaded = len(w.uow.events)
    await w.handlers.load_inventory()  # a restart with the same file
    assert len(w.uow.events) == loaded


async def test_inventory_may_not_claim_a_node_an_agent_reported() -> None:
    w = World()
    await w.handlers.report(report(node("a1")))
    with pytest.raises(InventoryError, match="already reported by agents"):
        await w.handlers.sync_inventory(Fleet(nodes=(node("a1", source=INVENTORY_SOURCE),)), "f1")
    assert w.uow.names() == ["node_profiled"]  # the whole load was rolled back


async def test_a_removed_node_leaves_the_liveness_watch() -> None:
    w = World()
    await w.handlers.sync_inventory(Fleet(nodes=(node("i1", source=INVENTORY_SOURCE),)), "f1")
    w.tracker.watch("i1", now_ms=0)  # as if it had been watched
    await w.handlers.sync_inventory(Fleet(), "f2")
    assert w.tracker.state("i1") is None
    w.clock.ms = 10 * HEARTBEAT_MS
    assert await w.handlers.liveness_tick() == []


async def test_tpu_pods_are_announced_with_their_sku() -> None:
    w = World()
    pod = TpuPod(name="v5e-1", region="r1", type=TpuType.V5E, shape=(2, 2))
    await w.handlers.sync_inventory(Fleet(tpu_pods=(pod,)), "f1")
    [event] = w.payloads("tpu_pod_profiled")
    assert (event["sku"], event["hbm_per_chip"]) == ("TPU-V5E", SKUS["TPU-V5E"].hbm_bytes)


# -- liveness --------------------------------------------------------------------------------


async def test_a_node_is_lost_after_the_missed_beats_and_recovers_on_the_next_beat() -> None:
    w = World()
    await w.handlers.report(report(node("a1")))
    deadline = HEARTBEAT_MS * MISSED  # 3 beats of 1 s: silent for more than 3,000 ms is lost

    w.clock.ms = deadline
    assert await w.handlers.liveness_tick() == []  # exactly at the deadline: not yet
    w.clock.ms = deadline + 1
    [lost] = await w.handlers.liveness_tick()
    assert lost.to is Liveness.LOST and w.store.state["a1"] is Liveness.LOST
    event = NodeStateEvent.model_validate(w.payloads("node_lost")[0])
    assert event.accelerators == ["a1/gpu0", "a1/gpu1"] and event.last_seen_ms_ago == deadline + 1
    assert await w.handlers.liveness_tick() == []  # lost once per episode

    w.clock.ms = deadline + 500
    await w.handlers.heartbeat(Heartbeat(node="a1"))
    assert w.uow.names() == ["node_profiled", "node_lost", "node_recovered"]
    assert w.store.state["a1"] is Liveness.UP


async def test_beats_keep_a_node_up_and_unknown_nodes_are_ignored() -> None:
    w = World()
    await w.handlers.report(report(node("a1")))
    for beat in range(1, 10):
        w.clock.ms = beat * HEARTBEAT_MS
        await w.handlers.heartbeat(Heartbeat(node="a1"))
        await w.handlers.heartbeat(Heartbeat(node="stranger"))
        assert await w.handlers.liveness_tick() == []
    assert w.tracker.state("stranger") is None
    assert w.uow.names() == ["node_profiled"]


async def test_a_lost_node_that_could_not_be_recorded_is_tried_again() -> None:
    w = World()
    await w.handlers.report(report(node("a1")))
    w.store.fail_liveness = 1
    w.clock.ms = HEARTBEAT_MS * MISSED + 1
    assert await w.handlers.liveness_tick() == []  # the database failed: nothing recorded, nothing emitted
    assert w.store.state["a1"] is Liveness.UP and "node_lost" not in w.uow.names()
    [lost] = await w.handlers.liveness_tick()
    assert lost.node == "a1" and w.uow.names().count("node_lost") == 1


async def test_agents_stored_before_a_restart_are_watched_in_their_stored_state() -> None:
    w = World()
    await w.handlers.report(report(node("a1")))
    await w.handlers.report(report(node("a2")))
    await w.handlers.sync_inventory(Fleet(nodes=(node("i1", source=INVENTORY_SOURCE),)), "f1")
    w.store.state["a2"] = Liveness.LOST
    restarted = World()
    restarted.store = w.store
    restarted.handlers._store = w.store  # the same tables, a fresh process
    await restarted.handlers.watch_agents()
    assert restarted.tracker.state("a1") is Liveness.UP
    assert restarted.tracker.state("a2") is Liveness.LOST
    assert restarted.tracker.state("i1") is None  # inventory nodes send no heartbeats


# -- reserved bytes from LEDGER events -------------------------------------------------------


async def test_reserved_read_model_applies_ledger_events() -> None:
    w = World()
    await w.handlers.report(report(node("a1")))
    g0, g1 = "a1/gpu0", "a1/gpu1"
    unit = w.uow.unit()  # the consumer's transaction
    held = allocation("al-1", {g0: 5 * GB, g1: 7 * GB})
    await w.handlers.on_allocation_committed(uow=unit, event=envelope(), payload=held)
    await w.handlers.on_allocation_committed(uow=unit, event=envelope(), payload=allocation("al-2", {g1: 3 * GB}))
    await w.handlers.on_allocation_committed(
        uow=unit, event=envelope(), payload=allocation("rq-1", {g1: 1 * GB}, counts=False)
    )
    assert w.store.reserved == {g0: 5 * GB, g1: 10 * GB}  # a KV-pool request moves nothing

    await w.handlers.on_allocation_ended(uow=unit, event=envelope(), payload=held)
    assert w.store.reserved == {g0: 0, g1: 3 * GB}

    reply = await w.handlers.fleet_get(FleetGetRequest())
    assert isinstance(reply, FleetGetReply)
    [acc0, acc1] = reply.nodes[0].accelerators
    assert (acc0.hbm_reserved_bytes, acc0.hbm_total_bytes, acc1.hbm_reserved_bytes) == (0, 80 * GB, 3 * GB)
    assert {"hbm_reserved", "hbm_total"}.isdisjoint(reply.model_dump()["nodes"][0]["accelerators"][0])
    assert unit.events == []  # the read model emits nothing


@pytest.mark.parametrize("order", ["commit, release", "release, commit", "commit, commit, release, release"])
async def test_an_allocation_moves_reserved_bytes_once_whatever_the_order(order: str) -> None:
    """Events of one batch are applied concurrently: a release may be seen before its commit."""
    w = World()
    unit = w.uow.unit()
    held = allocation("al-1", {"a1/gpu0": 5 * GB})
    apply = {"commit": w.handlers.on_allocation_committed, "release": w.handlers.on_allocation_ended}
    for step in order.split(", "):
        await apply[step](uow=unit, event=envelope(), payload=held)
    assert w.store.reserved.get("a1/gpu0", 0) == 0
    await w.handlers.on_allocation_committed(uow=unit, event=envelope(), payload=allocation("al-2", {"a1/gpu0": 2}))
    assert w.store.reserved["a1/gpu0"] == 2


# -- fleet.get and fleet.describe ------------------------------------------------------------


async def test_a_page_that_would_not_fit_one_message_is_halved() -> None:
    w = World(max_payload=4000)
    for i in range(8):
        await w.handlers.report(report(node(f"n{i}")))
    reply = await w.handlers.fleet_get(FleetGetRequest())
    assert isinstance(reply, FleetGetReply)
    assert 1 <= len(reply.nodes) < 8 and reply.next_cursor == reply.nodes[-1].name
    assert len(reply.model_dump_json()) <= 4000 * 0.9 or len(reply.nodes) == 1


async def test_fleet_get_sends_whole_profiles_only_when_asked() -> None:
    w = World()
    await w.handlers.report(report(node("a1")))
    plain = await w.handlers.fleet_get(FleetGetRequest())
    full = await w.handlers.fleet_get(FleetGetRequest(profiles=True))
    assert isinstance(plain, FleetGetReply) and isinstance(full, FleetGetReply)
    assert plain.nodes[0].profile is None
    assert full.nodes[0].profile == profile_to_payload(node("a1"))


async def test_describe_answers_one_node_or_not_found() -> None:
    w = World()
    await w.handlers.report(report(node("a1")))
    reply = await w.handlers.fleet_describe(FleetDescribeRequest(node="a1"))
    assert not isinstance(reply, Rejected)
    assert reply.model_dump()["node"]["name"] == "a1"
    assert reply.model_dump()["profile"]["links"][0] == ["X", "NV18"]
    missing = await w.handlers.fleet_describe(FleetDescribeRequest(node="nope"))
    assert isinstance(missing, Rejected) and missing.error.code == "not_found"
