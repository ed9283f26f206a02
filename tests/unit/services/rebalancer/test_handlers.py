"""RebalanceHandlers with fakes: an in-memory store, the shared ``FakeUnitOfWork`` (its events, its
after-commit changes) and ``FakeRpc`` (fleet.get, ledger.snapshot, placement.place/release). No servers:
what is checked is the handlers' part (what they fold and when, what they plan, ask and emit)."""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from datetime import timedelta

import pytest

from services.rebalancer.config import RebalanceConfig
from services.rebalancer.handlers import RebalanceHandlers
from services.rebalancer.readmodel import Allocation
from shared.contracts.engines import EngineState, ReplicaStateEvent
from shared.contracts.envelope import EventEnvelope, new_event
from shared.contracts.fleet import FleetGetReply, NodeView
from shared.contracts.ledger import AcceleratorLedgerView, AllocationEvent, ShareOut, SnapshotReply
from shared.contracts.placement import (
    AcceleratorShare,
    NodePlacement,
    PlacementEvent,
    PlacementReleasedEvent,
    PlaceReply,
    PlaceRequest,
    ReleaseReply,
)
from shared.contracts.rebalance import RebalanceStatusReply, RebalanceStatusRequest
from shared.contracts.subjects import Rpc
from shared.contracts.topology import EngineStatusEvent, GpuSample, GpuTelemetryEvent, NodeProfileEvent
from shared.domain.fleet import Accelerator, NodeProfile
from shared.domain.rebalance.detect import Rule
from shared.domain.rebalance.ready import WaitForReady
from shared.domain.topology import LinkMatrix
from shared.infra.catalog import load_models, load_skus
from shared.infra.profiles import profile_to_payload
from shared.infra.uow import UnitOfWork
from tests.fakes import NOW, FakeRpc, FakeUnitOfWork
from tests.unit.services.rebalancer.fake_store import FakeRebalanceStore

pytestmark = pytest.mark.asyncio

GB = 10**9
H100 = "H100-SXM-80GB"
GPU_BYTES = 80 * GB
SHARE_BYTES = 20 * GB  # what each replica holds per GPU (the ledger's figure too)
SKUS = load_skus()
MODELS = load_models()
WINDOW_S = 60.0
CONFIG = RebalanceConfig(
    hot=Rule("hbm_hot", 0.85, WINDOW_S),
    cold=Rule("hbm_cold", 0.30, WINDOW_S, above=False),
    fragmentation=Rule("tpu_fragmentation", 0.3, WINDOW_S),
    pcie=Rule("pcie_hot", 0.7, WINDOW_S),
    drift_alarm=Rule("hbm_drift_alarm", 0.1, 0),
    drift=Rule("hbm_drift", 0.1, 600.0),
    migrations_per_min=60.0,
)


# -- builders ------------------------------------------------------------------------------------


def node(name: str, *, gpus: int = 2) -> NodeProfile:
    codes = [["X" if i == j else "NV18" for j in range(gpus)] for i in range(gpus)]
    return NodeProfile(
        name=name,
        region="r1",
        cluster="c1",
        rack="k1",
        sku=H100,
        accelerators=tuple(Accelerator(index=i, sku=H100, hbm_bytes=GPU_BYTES) for i in range(gpus)),
        links=LinkMatrix.from_codes(codes),
        source="inventory",
    )


def profiled(profile: NodeProfile) -> NodeProfileEvent:
    return NodeProfileEvent(
        node=profile.name, region=profile.region, kind="x", fingerprint="f", profile=profile_to_payload(profile)
    )


def request(allocation_id: str, *, tenant: str = "acme") -> PlaceRequest:
    return PlaceRequest(
        request_id=f"req-{allocation_id}",
        tenant=tenant,
        model="llama3.1-8b",
        context_tokens=8192,
        tp=1,
        region="r1",
        skus=[H100],
        backend="gpu",
        fallbacks=[],
    )


def place_reply(allocation_id: str, host: str, *gpus: int, request_id: str = "r") -> PlaceReply:
    """Placed on ``gpus`` of ``host``, ``SHARE_BYTES`` on each."""
    return PlaceReply(
        status="placed",
        request_id=request_id,
        allocation_id=allocation_id,
        region="r1",
        cluster="c1",
        backend="gpu",
        sku=H100,
        tp=len(gpus),
        placements=[NodePlacement(node=host, accelerators=[f"{host}/gpu{i}" for i in gpus])],
        hbm_per_accelerator=AcceleratorShare(
            weights_bytes=SHARE_BYTES, kv_bytes=0, activation_bytes=0, workspace_bytes=0, total_bytes=SHARE_BYTES
        ),
    )


def placed(allocation_id: str, host: str, *gpus: int, tenant: str = "acme") -> PlacementEvent:
    ask = request(allocation_id, tenant=tenant)
    reply = place_reply(allocation_id, host, *gpus, request_id=ask.request_id)
    return PlacementEvent(
        request_id=ask.request_id, tenant=tenant, model=ask.model, reply=reply, decision_ms=0.1, request=ask
    )


def committed(allocation_id: str, shares: dict[str, int], *, parent: str | None = None) -> AllocationEvent:
    return AllocationEvent(
        allocation_id=allocation_id,
        request_id=f"req-{allocation_id}",
        tenant="acme",
        kind="request" if parent else "replica",
        parent_id=parent,
        shares=[
            ShareOut(
                accelerator_id=a, weights_bytes=b, kv_bytes=0, activation_bytes=0, workspace_bytes=0, total_bytes=b
            )
            for a, b in shares.items()
        ],
    )


def sample(host: str, used: dict[int, float], *, gpus: int = 2, pcie: float = 0.0) -> GpuTelemetryEvent:
    """HBM used per GPU index, a fraction (others 2%); PCIe traffic as a fraction of a Gen5 x16 link."""
    link = 4.0e9 * 16
    return GpuTelemetryEvent(
        node=host,
        gpus=[
            GpuSample(
                index=i,
                memory_used_bytes=int(GPU_BYTES * used.get(i, 0.02)),
                memory_free_bytes=GPU_BYTES - int(GPU_BYTES * used.get(i, 0.02)),
                pcie_rx_bytes_per_s=pcie * link,
                pcie_tx_bytes_per_s=0.0,
            )
            for i in range(gpus)
        ],
    )


def fleet(*profiles: NodeProfile) -> FleetGetReply:
    nodes = [
        NodeView(name=p.name, region=p.region, cluster=p.cluster, rack=p.rack, sku=p.sku, profile=profile_to_payload(p))
        for p in profiles
    ]
    return FleetGetReply(nodes=nodes, total_nodes=len(nodes))


def ledger(profiles: list[NodeProfile], held: dict[str, list[str]]) -> SnapshotReply:
    """Every GPU of ``profiles``; ``held``: accelerator -> the replicas on it (each ``SHARE_BYTES``)."""
    return SnapshotReply(
        accelerators=[
            AcceleratorLedgerView(
                id=acc,
                node=p.name,
                hbm_usable_bytes=76 * GB,
                hbm_reserved_bytes=SHARE_BYTES * len(held.get(acc, [])),
                allocations=held.get(acc, []),
            )
            for p in profiles
            for acc in (p.accelerator_id(a.index) for a in p.accelerators)
        ]
    )


def envelope() -> EventEnvelope:
    return new_event(type="x.y", source="test", payload={}, occurred_at=NOW)


class Rig:
    """The handlers with fakes, a clock the test moves, and helpers that deliver events as a consumer
    does (each in its own unit of work unless given one)."""

    def __init__(
        self, rpc: FakeRpc | None = None, store: FakeRebalanceStore | None = None, config: RebalanceConfig = CONFIG
    ) -> None:
        self.now = NOW
        self.rpc = rpc or FakeRpc()
        self.store = store or FakeRebalanceStore()
        self.uow = FakeUnitOfWork(lambda: self.now)
        self.handlers = RebalanceHandlers(
            uow=self.uow,  # type: ignore[arg-type]
            store=self.store,
            rpc=self.rpc,
            clock=lambda: self.now,
            config=config,
            skus=SKUS,
            models=MODELS,
        )
        self.view = self.handlers.view

    async def deliver(self, *handled: Callable[[UnitOfWork], Awaitable[None]]) -> None:
        """Events handled in one transaction (a consumer batch)."""

        async def work(uow: UnitOfWork) -> None:
            for handle in handled:
                await handle(uow)

        await self.uow.run(work)

    def placed(self, event: PlacementEvent) -> Callable[[UnitOfWork], Awaitable[None]]:
        return lambda uow: self.handlers.on_placement_decided(uow=uow, event=envelope(), payload=event)

    def committed(self, event: AllocationEvent) -> Callable[[UnitOfWork], Awaitable[None]]:
        return lambda uow: self.handlers.on_allocation_committed(uow=uow, event=envelope(), payload=event)

    def ended(self, event: AllocationEvent) -> Callable[[UnitOfWork], Awaitable[None]]:
        return lambda uow: self.handlers.on_allocation_ended(uow=uow, event=envelope(), payload=event)

    def profiled(self, profile: NodeProfile) -> Callable[[UnitOfWork], Awaitable[None]]:
        return lambda uow: self.handlers.on_node_profiled(uow=uow, event=envelope(), payload=profiled(profile))

    def sustained(self, telemetry: GpuTelemetryEvent) -> None:
        """The same sample now and a window later: what is over a threshold fires."""
        self.handlers.observe(telemetry, self.now)
        self.now += timedelta(seconds=WINDOW_S)
        self.handlers.observe(telemetry, self.now)


def step_names(rig: Rig) -> list[str]:
    return rig.uow.names()


# -- events fold the view only once their transaction commits -------------------------------------


async def test_a_placement_and_its_allocations_fold_into_the_view_after_commit() -> None:
    rig = Rig()
    await rig.deliver(rig.profiled(node("a")))
    await rig.deliver(rig.placed(placed("r1", "a", 0)))
    await rig.deliver(rig.committed(committed("r1", {"a/gpu0": 20 * GB})))
    await rig.deliver(rig.committed(committed("r2", {"a/gpu1": 20 * GB})))

    assert set(rig.view.replicas) == {"r1"} and rig.view.requests["r1"].request_id == "req-r1"
    assert rig.view.by_node == {"a": {"r1", "r2"}}
    assert set(rig.store.replicas) == {"r1"} and set(rig.store.allocations) == {"r1", "r2"}

    await rig.deliver(rig.ended(committed("r2", {"a/gpu1": 20 * GB})))
    assert rig.view.by_node == {"a": {"r1"}} and set(rig.view.allocations) == {"r1"}


async def test_a_consumer_batch_that_rolls_back_leaves_the_view_unchanged_and_its_rerun_folds_once() -> None:
    rig = Rig()
    batch = (
        rig.placed(placed("r1", "a", 0)),
        rig.committed(committed("r1", {"a/gpu0": 20 * GB})),
        rig.committed(committed("r2", {"a/gpu1": 20 * GB})),
    )
    rig.uow.fail_next = RuntimeError("the batch's commit failed")

    with pytest.raises(RuntimeError):
        await rig.deliver(*batch)

    assert rig.view.replicas == {} and rig.view.allocations == {} and rig.view.by_node == {}

    await rig.deliver(*batch)  # the consumer runs the batch again
    assert set(rig.view.replicas) == {"r1"} and set(rig.view.allocations) == {"r1", "r2"}
    assert rig.view.by_node == {"a": {"r1", "r2"}}


async def test_a_release_that_rolls_back_keeps_the_replica_and_its_targets() -> None:
    rig = Rig()
    await rig.deliver(rig.profiled(node("a")), rig.placed(placed("r1", "a", 0)))
    rig.sustained(sample("a", {0: 0.95}))
    assert sorted(rig.handlers.detectors.by_rule["hbm_hot"].firing()) == ["r1"]
    released = PlacementReleasedEvent(allocation_id="r1", tenant="acme")

    async def release(uow: UnitOfWork) -> None:
        await rig.handlers.on_placement_released(uow=uow, event=envelope(), payload=released)

    rig.uow.fail_next = RuntimeError("refused")
    with pytest.raises(RuntimeError):
        await rig.deliver(release)
    assert set(rig.view.replicas) == {"r1"} and set(rig.view.requests) == {"r1"}
    assert sorted(rig.handlers.detectors.by_rule["hbm_hot"].firing()) == ["r1"]

    await rig.deliver(release)
    assert rig.view.replicas == {} and rig.view.requests == {}
    assert rig.handlers.detectors.by_rule["hbm_hot"].firing() == []


async def test_start_rebuilds_the_view_from_the_tables_and_ends_the_throttles_left() -> None:
    store = FakeRebalanceStore(
        replicas={"r1": placed("r1", "a", 0)},
        allocations={"r1": Allocation("r1", "replica", None, {"a/gpu0": 20 * GB})},
        nodes={"a": profiled(node("a"))},
        throttles={"a": NOW},
    )
    rig = Rig(store=store)

    await rig.handlers.start()

    assert set(rig.view.replicas) == {"r1"} and rig.view.by_node == {"a": {"r1"}} and "a" in rig.view.profiles
    assert rig.uow.names() == ["throttle_ended"] and store.throttles == {}


# -- detectors -> plans ---------------------------------------------------------------------------


async def test_a_hot_replica_is_replicated_through_placement() -> None:
    copy = place_reply("r1-copy", "a", 1)
    rig = Rig(FakeRpc(placement_place=[copy]))
    await rig.deliver(rig.profiled(node("a")), rig.placed(placed("r1", "a", 0)))

    rig.sustained(sample("a", {0: 0.95}))  # 0.95 > 0.85 for the whole 60 s window
    await rig.handlers.tick_once()

    (ask,) = rig.rpc.requests(Rpc.PLACEMENT_PLACE)
    assert ask.model == "llama3.1-8b" and ask.tenant == "acme" and ask.request_id.endswith("/0")
    (plan,) = rig.store.plan_list()
    assert (plan.kind, plan.target, plan.state) == ("replicate", "r1", "done")
    assert plan.steps[0].new_allocation_id == "r1-copy"
    assert rig.uow.names() == ["detector_fired", "plan_created", "plan_step", "plan_finished"]
    assert rig.handlers.progress.active == set()  # finished: the target may be planned again


async def test_a_cold_node_is_consolidated_onto_a_node_in_use() -> None:
    a, b = node("a"), node("b")
    snapshot = ledger([a, b], {"a/gpu0": ["r1"], "b/gpu0": ["r2"]})
    rig = Rig(
        FakeRpc(
            fleet_get=[fleet(a, b)],
            ledger_snapshot=[snapshot],
            placement_place=[place_reply("r1-copy", "b", 1)],
            placement_release=[ReleaseReply(status="released")],
        )
    )
    await rig.deliver(
        rig.profiled(a), rig.profiled(b), rig.placed(placed("r1", "a", 0)), rig.placed(placed("r2", "b", 0))
    )

    rig.sustained(sample("a", {0: 0.05}))  # node a: 0.035 of its HBM used < 0.30 for 60 s
    await rig.handlers.tick_once()

    (plan,) = rig.store.plan_list()
    assert (plan.kind, plan.target) == ("consolidate", "a")
    (ask,) = rig.rpc.requests(Rpc.PLACEMENT_PLACE)
    assert {"a/gpu0", "a/gpu1"} <= set(ask.avoid_accelerators)  # the copy never lands on the node drained
    # Make-before-break: the copy was placed, then the old replica told draining and released.
    (release,) = rig.rpc.requests(Rpc.PLACEMENT_RELEASE)
    assert release.allocation_id == "r1"
    assert "replica_draining" in rig.uow.names() and plan.state == "done"


def engine(replica: str, host: str, *, queue: int, kv: int) -> EngineStatusEvent:
    return EngineStatusEvent(
        replica_id=replica,
        node=host,
        queue_depth=queue,
        kv_used_bytes=kv,
        kv_total_bytes=10 * GB,
        latency_p50_ms=10.0,
        latency_p99_ms=20.0,
    )


async def drain_rig(config: RebalanceConfig = CONFIG) -> Rig:
    """r1 on node a (cold) and r2 on node b: the consolidation copies r1 onto b, then drains and releases it."""
    a, b = node("a"), node("b")
    rig = Rig(
        FakeRpc(
            fleet_get=[fleet(a, b)],
            ledger_snapshot=[ledger([a, b], {"a/gpu0": ["r1"], "b/gpu0": ["r2"]})],
            placement_place=[place_reply("r1-copy", "b", 1)],
            placement_release=[ReleaseReply(status="released")],
        ),
        config=config,
    )
    await rig.deliver(
        rig.profiled(a), rig.profiled(b), rig.placed(placed("r1", "a", 0)), rig.placed(placed("r2", "b", 0))
    )
    return rig


async def test_a_replica_with_messages_in_flight_is_released_only_once_its_engine_reports_idle() -> None:
    rig = await drain_rig()
    rig.handlers.on_engine_status(engine("r1", "a", queue=0, kv=0), rig.now)  # idle, but before the drain

    rig.sustained(sample("a", {0: 0.05}))
    rig.handlers.on_engine_status(engine("r1", "a", queue=3, kv=GB), rig.now)  # requests in flight
    await rig.handlers.tick_once()
    assert rig.rpc.requests(Rpc.PLACEMENT_RELEASE) == [] and rig.uow.names().count("replica_draining") == 1

    rig.now += timedelta(seconds=5)
    rig.handlers.on_engine_status(engine("r1", "a", queue=0, kv=GB), rig.now)  # queue empty, KV still held
    await rig.handlers.tick_once()
    assert rig.rpc.requests(Rpc.PLACEMENT_RELEASE) == []

    rig.now += timedelta(seconds=5)
    rig.handlers.on_engine_status(engine("r1", "a", queue=0, kv=0), rig.now)
    await rig.handlers.tick_once()
    assert [r.allocation_id for r in rig.rpc.requests(Rpc.PLACEMENT_RELEASE)] == ["r1"]
    assert rig.uow.names().count("replica_draining") == 1  # told once


async def test_an_idle_report_older_than_the_drain_does_not_release_until_the_timeout() -> None:
    rig = await drain_rig()
    rig.sustained(sample("a", {0: 0.05}))
    rig.handlers.on_engine_status(engine("r1", "a", queue=0, kv=0), rig.now - timedelta(seconds=1))
    await rig.handlers.tick_once()
    assert rig.rpc.requests(Rpc.PLACEMENT_RELEASE) == []

    rig.now += timedelta(seconds=CONFIG.drain_timeout_s - 1)
    await rig.handlers.tick_once()
    assert rig.rpc.requests(Rpc.PLACEMENT_RELEASE) == []

    rig.now += timedelta(seconds=1)  # the engine went silent: the drain timeout releases it anyway
    await rig.handlers.tick_once()
    assert [r.allocation_id for r in rig.rpc.requests(Rpc.PLACEMENT_RELEASE)] == ["r1"]


async def test_a_replica_whose_engine_never_reported_is_released_at_once() -> None:
    rig = await drain_rig()
    rig.handlers.on_engine_status(engine("r9", "a", queue=5, kv=GB), rig.now)  # an unknown replica: left out
    assert rig.view.engines == {}
    rig.sustained(sample("a", {0: 0.05}))
    await rig.handlers.tick_once()
    assert [r.allocation_id for r in rig.rpc.requests(Rpc.PLACEMENT_RELEASE)] == ["r1"]


def lifecycle(replica: str, host: str, state: EngineState, *, reason: str | None = None) -> ReplicaStateEvent:
    return ReplicaStateEvent(replica_id=replica, node=host, state=state, engine="sim", reason=reason)


async def engines_rig(config: RebalanceConfig = CONFIG) -> Rig:
    """The drain rig where node b's agent runs engines (r2's reports ready) and the plan has placed r1's copy
    on b: the next ticks decide when r1 is drained."""
    rig = await drain_rig(config)
    rig.handlers.on_replica_state(lifecycle("r2", "b", "ready"), rig.now)
    rig.sustained(sample("a", {0: 0.05}))
    rig.handlers.on_replica_state(lifecycle("r2", "b", "ready"), rig.now)
    await rig.handlers.tick_once()
    await rig.deliver(rig.placed(placed("r1-copy", "b", 1)))  # placement's event for the copy
    return rig


def released(rig: Rig) -> list[str]:
    return [r.allocation_id for r in rig.rpc.requests(Rpc.PLACEMENT_RELEASE)]


async def test_the_old_replica_is_drained_and_released_only_once_its_copy_reports_ready() -> None:
    rig = await engines_rig()
    assert len(rig.rpc.requests(Rpc.PLACEMENT_PLACE)) == 1
    assert released(rig) == [] and "replica_draining" not in rig.uow.names()  # an agent runs engines on b

    states: tuple[EngineState, ...] = ("starting", "loading", "loading")
    for state in states:
        rig.now += timedelta(seconds=10)
        rig.handlers.on_replica_state(lifecycle("r1-copy", "b", state), rig.now)
        await rig.handlers.tick_once()
        assert released(rig) == [] and "replica_draining" not in rig.uow.names()  # r1 keeps serving

    rig.now += timedelta(seconds=10)
    rig.handlers.on_replica_state(lifecycle("r1-copy", "b", "ready"), rig.now)
    await rig.handlers.tick_once()
    assert released(rig) == ["r1"] and rig.uow.names().count("replica_draining") == 1
    (plan,) = rig.store.plan_list()
    assert plan.state == "done"
    assert rig.handlers.progress.copies == {}  # nothing waits any more


async def test_no_second_consolidation_is_planned_while_one_waits_for_its_copy() -> None:
    a, b = node("a", gpus=4), node("b")  # a has room to take back both of b's replicas
    rig = Rig(
        FakeRpc(
            fleet_get=[fleet(a, b)],
            ledger_snapshot=[ledger([a, b], {"a/gpu0": ["r1"], "b/gpu0": ["r2"]})],
            placement_place=[place_reply("r1-copy", "b", 1)],
            placement_release=[ReleaseReply(status="released")],
        )
    )
    await rig.deliver(
        rig.profiled(a), rig.profiled(b), rig.placed(placed("r1", "a", 0)), rig.placed(placed("r2", "b", 0))
    )
    rig.handlers.on_replica_state(lifecycle("r2", "b", "ready"), rig.now)
    rig.sustained(sample("a", {0: 0.05}, gpus=4))  # a drained onto b: r1's copy loads on b
    rig.handlers.on_replica_state(lifecycle("r2", "b", "ready"), rig.now)
    await rig.handlers.tick_once()
    await rig.deliver(rig.placed(placed("r1-copy", "b", 1)))
    rig.handlers.on_replica_state(lifecycle("r1-copy", "b", "loading"), rig.now)

    # b turns cold too (a, still holding r1, had room for b's two replicas): draining it would move the copy
    # back onto the node being drained.
    rig.sustained(sample("b", {0: 0.05, 1: 0.05}))
    rig.handlers.on_replica_state(lifecycle("r1-copy", "b", "loading"), rig.now)
    await rig.handlers.tick_once()
    assert [(p.kind, p.target) for p in rig.store.plan_list()] == [("consolidate", "a")]
    assert len(rig.rpc.requests(Rpc.PLACEMENT_PLACE)) == 1 and released(rig) == []


async def test_a_copy_whose_engine_fails_is_released_and_the_old_replica_keeps_serving() -> None:
    rig = await engines_rig()
    rig.now += timedelta(seconds=10)
    rig.handlers.on_replica_state(lifecycle("r1-copy", "b", "loading"), rig.now)
    await rig.handlers.tick_once()
    rig.now += timedelta(seconds=10)
    rig.handlers.on_replica_state(lifecycle("r1-copy", "b", "failed", reason="exited with code 1"), rig.now)
    await rig.handlers.tick_once()

    assert released(rig) == ["r1-copy"] and "replica_draining" not in rig.uow.names()  # r1 never drained
    (plan,) = rig.store.plan_list()
    assert plan.state == "rolled_back"
    assert [s.state for s in plan.steps] == ["rolled_back", "failed"]
    note = rig.uow.named("plan_step")[-1]["note"]
    assert "r1-copy" in note and "rank 0 failed: exited with code 1" in note and "r1 kept" in note
    assert rig.uow.named("plan_finished")[-1]["note"] == "rolled_back"


async def test_a_copy_not_ready_within_the_timeout_rolls_the_move_back() -> None:
    rig = await engines_rig()
    rig.handlers.on_replica_state(lifecycle("r1-copy", "b", "loading"), rig.now)
    rig.now += timedelta(seconds=CONFIG.ready_timeout_s - 1)  # 900 s after it was placed, less one
    await rig.handlers.tick_once()
    assert released(rig) == []

    rig.now += timedelta(seconds=1)
    await rig.handlers.tick_once()
    assert released(rig) == ["r1-copy"] and "replica_draining" not in rig.uow.names()
    (plan,) = rig.store.plan_list()
    assert plan.state == "rolled_back"
    assert "not ready within 900 s (loading)" in rig.uow.named("plan_step")[-1]["note"]


async def test_auto_without_agents_drains_as_soon_as_the_copy_is_placed_and_always_waits() -> None:
    # No replica_state from any node: the fleet runs its engines by other means (as before).
    rig = await drain_rig()
    rig.sustained(sample("a", {0: 0.05}))
    await rig.handlers.tick_once()
    assert released(rig) == ["r1"]

    # `always`: the copy is waited for even with no agent seen (and rolled back after the timeout).
    always = dataclasses.replace(CONFIG, wait_for_ready=WaitForReady.ALWAYS)
    rig = await drain_rig(always)
    rig.sustained(sample("a", {0: 0.05}))
    await rig.handlers.tick_once()
    assert released(rig) == []
    rig.now += timedelta(seconds=always.ready_timeout_s)
    await rig.handlers.tick_once()
    assert released(rig) == ["r1-copy"]

    # `never`: an agent runs engines on b and the copy loads, yet r1 is drained at once.
    rig = await engines_rig(dataclasses.replace(CONFIG, wait_for_ready=WaitForReady.NEVER))
    assert released(rig) == ["r1"]


async def test_a_copy_that_cannot_be_placed_rolls_the_plan_back_and_releases_the_copies_placed() -> None:
    a, b = node("a"), node("b", gpus=4)  # b has room for both copies when the plan is made
    refused = PlaceReply(status="rejected", request_id="x")  # ... not when it runs
    rig = Rig(
        FakeRpc(
            fleet_get=[fleet(a, b)],
            ledger_snapshot=[ledger([a, b], {"a/gpu0": ["r1"], "a/gpu1": ["r3"], "b/gpu0": ["r2"]})],
            placement_place=[place_reply("r1-copy", "b", 1), refused],
            placement_release=[ReleaseReply(status="released")],
        )
    )
    await rig.deliver(
        rig.profiled(a),
        rig.profiled(b),
        rig.placed(placed("r1", "a", 0)),
        rig.placed(placed("r3", "a", 1)),
        rig.placed(placed("r2", "b", 0)),
    )

    rig.sustained(sample("a", {0: 0.05, 1: 0.05}))
    await rig.handlers.tick_once()

    (plan,) = rig.store.plan_list()
    assert plan.kind == "consolidate" and len(rig.rpc.requests(Rpc.PLACEMENT_PLACE)) == 2
    assert [r.allocation_id for r in rig.rpc.requests(Rpc.PLACEMENT_RELEASE)] == ["r1-copy"]  # not r1, r3
    assert plan.state == "rolled_back"
    assert rig.uow.named("plan_finished")[-1]["note"] == "rolled_back"


async def test_a_pcie_hot_node_is_throttled_and_the_throttle_ends_when_it_clears() -> None:
    rig = Rig()
    await rig.deliver(rig.profiled(node("a")))

    rig.sustained(sample("a", {}, pcie=0.9))  # 0.9 of the link > 0.7 for 60 s
    await rig.handlers.tick_once()

    (started,) = rig.uow.named("throttle_started")
    assert started["node"] == "a" and started["value"] > 0.7
    assert rig.handlers.progress.throttled == {"a"} and set(rig.store.throttles) == {"a"}
    (plan,) = rig.store.plan_list()
    assert (plan.kind, plan.state) == ("throttle", "running")

    rig.sustained(sample("a", {}, pcie=0.1))
    await rig.handlers.tick_once()
    assert len(rig.uow.named("throttle_ended")) == 1 and rig.handlers.progress.throttled == set()
    assert rig.store.plan_list()[0].state == "done"


async def test_a_throttle_whose_transaction_fails_is_not_remembered_and_is_tried_again() -> None:
    rig = Rig()
    await rig.deliver(rig.profiled(node("a")))
    rig.sustained(sample("a", {}, pcie=0.9))
    rig.uow.fail_next = RuntimeError("the plan's transaction failed")

    with pytest.raises(RuntimeError):
        await rig.handlers.tick_once()
    assert rig.handlers.progress.throttled == set()


async def test_a_replica_holding_more_than_it_reserved_raises_a_drift_alarm_at_once() -> None:
    rig = Rig()
    await rig.deliver(rig.profiled(node("a")), rig.placed(placed("r1", "a", 0)))
    await rig.deliver(rig.committed(committed("r1", {"a/gpu0": 20 * GB})))

    rig.handlers.observe(sample("a", {0: 0.40}), rig.now)  # 32 GB used of 20 GB reserved: 0.6 > 0.1
    await rig.handlers.tick_once()

    (alarm,) = rig.uow.named("drift_alarm")
    assert alarm["allocation_id"] == "r1"
    assert (alarm["observed_bytes"], alarm["reserved_bytes"]) == (32 * GB, 20 * GB)
    assert alarm["ratio"] == pytest.approx(0.6)
    assert rig.store.plan_list() == []  # a replace only once the drift lasts its window


# -- status ---------------------------------------------------------------------------------------


async def test_status_shows_every_detector_the_plans_and_the_actions_newest_first() -> None:
    rig = Rig(FakeRpc(placement_place=[place_reply("r1-copy", "a", 1)]))
    await rig.deliver(rig.profiled(node("a")), rig.placed(placed("r1", "a", 0)))
    rig.sustained(sample("a", {0: 0.95}))
    await rig.handlers.tick_once()

    reply = await rig.handlers.status(RebalanceStatusRequest())

    assert isinstance(reply, RebalanceStatusReply)
    assert sorted(d.name for d in reply.detectors) == sorted(r.name for r in CONFIG.rules)
    hot = next(d for d in reply.detectors if d.name == "hbm_hot")
    assert [(t.key, t.phase) for t in hot.targets] == [("r1", "firing")]
    assert [(p.kind, p.state) for p in reply.plans] == [("replicate", "done")]
    assert reply.recent[0].what == "replicate done" and reply.recent[-1].what.startswith("hbm_hot fired on r1")


# -- what hot, cold and drift read, and when ------------------------------------------------------


def load_report(replica: str, host: str, *, kv_usage: float, running: int, queue: int = 0) -> EngineStatusEvent:
    """An engine's report of its own load (a preallocating engine: KV total is its whole cache)."""
    return EngineStatusEvent(
        replica_id=replica,
        node=host,
        queue_depth=queue,
        kv_used_bytes=int(kv_usage * 10 * GB),
        kv_total_bytes=10 * GB,
        latency_p50_ms=10.0,
        latency_p99_ms=20.0,
        running_requests=running,
        kv_usage=kv_usage,
    )


def run_for(rig: Rig, seconds: float, *, host: str, used: dict[int, float], reports: list[EngineStatusEvent]) -> None:
    """GPU samples and engine reports every 10 s for ``seconds`` (the first at ``rig.now``)."""
    end = rig.now + timedelta(seconds=seconds)
    while rig.now <= end:
        rig.handlers.observe(sample(host, used), rig.now)
        for report in reports:
            rig.handlers.on_engine_status(report, rig.now)
        rig.now += timedelta(seconds=10)


async def test_a_tightly_packed_replica_whose_engine_is_idle_is_never_replicated() -> None:
    no_cold = dataclasses.replace(CONFIG, cold=Rule("hbm_cold", 0.30, 10 * 3600, above=False))  # hot alone here
    rig = Rig(FakeRpc(placement_place=[place_reply("r1-copy", "a", 1)]), config=no_cold)
    await rig.deliver(rig.profiled(node("a")), rig.placed(placed("r1", "a", 0)))
    # Its engine preallocated 95% of the GPU and has nothing to do (its cache still holds old blocks).
    run_for(rig, 600, host="a", used={0: 0.95}, reports=[load_report("r1", "a", kv_usage=0.9, running=0)])
    await rig.handlers.tick_once()
    assert rig.rpc.requests(Rpc.PLACEMENT_PLACE) == [] and rig.store.plan_list() == []
    assert "hbm_hot" not in {t.rule for t in rig.handlers.detectors.pending}


async def test_once_its_engine_has_reported_a_replicas_hbm_is_not_read_for_hot() -> None:
    no_cold = dataclasses.replace(CONFIG, cold=Rule("hbm_cold", 0.30, 10 * 3600, above=False))
    rig = Rig(FakeRpc(placement_place=[place_reply("r1-copy", "a", 1)]), config=no_cold)
    await rig.deliver(rig.profiled(node("a")), rig.placed(placed("r1", "a", 0)))
    rig.handlers.on_engine_status(load_report("r1", "a", kv_usage=0.1, running=1), rig.now)
    run_for(rig, 600, host="a", used={0: 0.95}, reports=[])  # its GPU full (preallocated), no more reports
    await rig.handlers.tick_once()
    assert rig.store.plan_list() == []


async def test_a_replica_over_085_of_its_kv_is_replicated_once_and_its_copy_only_once_it_carries_load() -> None:
    rig = Rig(FakeRpc(placement_place=[place_reply("r1-copy", "a", 1), place_reply("r1-copy-2", "b", 0)]))
    await rig.deliver(rig.profiled(node("a")), rig.placed(placed("r1", "a", 0)))
    busy = load_report("r1", "a", kv_usage=0.9, running=12)
    run_for(rig, WINDOW_S, host="a", used={0: 0.95}, reports=[busy])
    await rig.handlers.tick_once()
    (plan,) = rig.store.plan_list()
    assert (plan.kind, plan.target, plan.steps[0].new_allocation_id) == ("replicate", "r1", "r1-copy")
    await rig.deliver(rig.placed(placed("r1-copy", "a", 1)))

    # The copy's engine preallocates too and reads 95% of its GPU; no request reached it yet, and r1 cooled.
    calm = load_report("r1", "a", kv_usage=0.5, running=4)
    run_for(rig, 600, host="a", used={0: 0.95, 1: 0.95}, reports=[calm])
    await rig.handlers.tick_once()
    assert len(rig.store.plan_list()) == 1  # the copy reading full HBM is no reason for another copy
    assert "r1-copy" in rig.view.unproven

    # Once it carries load it is judged as any replica: its own KV over 0.85 for the window copies it.
    run_for(
        rig,
        WINDOW_S,
        host="a",
        used={0: 0.95, 1: 0.95},
        reports=[calm, load_report("r1-copy", "a", kv_usage=0.95, running=9)],
    )
    await rig.handlers.tick_once()
    assert "r1-copy" not in rig.view.unproven
    assert [p.target for p in rig.store.plan_list()] == ["r1", "r1-copy"]


async def test_copies_of_one_tenants_model_are_capped_per_hour() -> None:
    config = dataclasses.replace(CONFIG, replicate_per_model_hour=1)
    rig = Rig(FakeRpc(placement_place=[place_reply("r1-copy", "b", 0), place_reply("r2-copy", "b", 1)]), config=config)
    await rig.deliver(rig.profiled(node("a")), rig.placed(placed("r1", "a", 0)), rig.placed(placed("r2", "a", 1)))
    hot = [load_report("r1", "a", kv_usage=0.9, running=12), load_report("r2", "a", kv_usage=0.9, running=12)]
    run_for(rig, WINDOW_S, host="a", used={0: 0.95, 1: 0.95}, reports=hot)
    await rig.handlers.tick_once()
    assert len(rig.store.plan_list()) == 1  # the same model of the same tenant: one copy this hour
    assert any("within the hour" in a.what for a in rig.store.action_rows)


async def test_a_loading_replica_is_not_judged_until_ready_and_its_grace_has_passed() -> None:
    config = dataclasses.replace(CONFIG, state_grace_s=120.0)
    rig = Rig(FakeRpc(placement_place=[place_reply("r1-copy", "a", 1)]), config=config)
    await rig.deliver(rig.profiled(node("a")), rig.placed(placed("r1", "a", 0)))
    await rig.deliver(rig.committed(committed("r1", {"a/gpu0": 20 * GB})))
    rig.handlers.on_replica_state(lifecycle("r1", "a", "loading"), rig.now)

    # Loading for 10 minutes: its GPU reads ~0 of 20 GB reserved (drift), then full (hot); the node reads cold.
    for used in (0.0, 0.95):
        for _ in range(30):
            rig.handlers.on_replica_state(lifecycle("r1", "a", "loading"), rig.now)
            rig.handlers.observe(sample("a", {0: used}), rig.now)
            rig.now += timedelta(seconds=10)
    await rig.handlers.tick_once()
    assert rig.uow.named("drift_alarm") == [] and rig.store.plan_list() == []
    assert rig.handlers.detectors.firing() == dict.fromkeys(rig.handlers.detectors.by_rule, 0)

    rig.handlers.on_replica_state(lifecycle("r1", "a", "ready"), rig.now)
    ready_at = rig.now
    while rig.now < ready_at + timedelta(seconds=110):  # within the grace: still nothing
        rig.handlers.on_replica_state(lifecycle("r1", "a", "ready"), rig.now)
        rig.handlers.observe(sample("a", {0: 0.95}), rig.now)
        rig.now += timedelta(seconds=10)
    await rig.handlers.tick_once()
    assert rig.store.plan_list() == [] and rig.uow.named("drift_alarm") == []

    # Past the grace, judged as before: HBM (its engine never reported) over 0.85 for the window.
    while rig.now < ready_at + timedelta(seconds=120 + WINDOW_S + 10):
        rig.handlers.on_replica_state(lifecycle("r1", "a", "ready"), rig.now)
        rig.handlers.observe(sample("a", {0: 0.95}), rig.now)
        rig.now += timedelta(seconds=10)
    await rig.handlers.tick_once()
    assert [p.kind for p in rig.store.plan_list()] == ["replicate"]
    assert [a["allocation_id"] for a in rig.uow.named("drift_alarm")] == ["r1"]  # 76 GB used of 20 GB


async def test_after_a_restart_copies_made_for_hot_replicas_and_the_cap_are_remembered() -> None:
    first = Rig(FakeRpc(placement_place=[place_reply("r1-copy", "a", 1)]))
    await first.deliver(first.profiled(node("a")), first.placed(placed("r1", "a", 0)))
    run_for(first, WINDOW_S, host="a", used={0: 0.95}, reports=[load_report("r1", "a", kv_usage=0.9, running=12)])
    await first.handlers.tick_once()
    await first.deliver(first.placed(placed("r1-copy", "a", 1)))
    assert [p.kind for p in first.store.plan_list()] == ["replicate"]

    # A new process on the same tables, allowed one copy of the model an hour.
    config = dataclasses.replace(CONFIG, replicate_per_model_hour=1)
    rig = Rig(FakeRpc(placement_place=[place_reply("r1-copy-2", "a", 1)]), store=first.store, config=config)
    rig.now = first.now
    await rig.handlers.start()
    assert rig.view.unproven == {"r1-copy"}
    busy = load_report("r1", "a", kv_usage=0.9, running=12)
    run_for(rig, WINDOW_S, host="a", used={0: 0.95, 1: 0.95}, reports=[busy])  # r1 hot again; the copy full
    await rig.handlers.tick_once()
    assert [p.target for p in rig.store.plan_list()] == ["r1"]  # the copy not judged, r1 capped
    assert any("within the hour" in a.what for a in rig.store.action_rows)


async def test_a_first_replica_on_a_node_whose_agent_runs_engines_waits_for_its_engine() -> None:
    # No lifecycle report has come from the node yet, but its GPU samples say its agent runs the engines:
    # ~0 used of 20 GB reserved is an engine starting, not drift.
    rig = Rig(FakeRpc())
    await rig.deliver(rig.profiled(node("a")), rig.placed(placed("r1", "a", 0)))
    await rig.deliver(rig.committed(committed("r1", {"a/gpu0": 20 * GB})))
    for _ in range(30):
        rig.handlers.observe(sample("a", {0: 0.0}).model_copy(update={"engines": True}), rig.now)
        rig.now += timedelta(seconds=10)
    assert rig.handlers.detectors.firing()["hbm_drift_alarm"] == 0
    await rig.handlers.tick_once()
    assert rig.uow.named("drift_alarm") == [] and rig.store.plan_list() == []

    # The same samples without the flag: a node whose engines run by other means is judged as before.
    other = Rig(FakeRpc())
    await other.deliver(other.profiled(node("a")), other.placed(placed("r1", "a", 0)))
    await other.deliver(other.committed(committed("r1", {"a/gpu0": 20 * GB})))
    for _ in range(30):
        other.handlers.observe(sample("a", {0: 0.0}), other.now)
        other.now += timedelta(seconds=10)
    assert other.handlers.detectors.firing()["hbm_drift_alarm"] == 1
