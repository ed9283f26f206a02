"""The services' Prometheus metrics without servers: each service's ``wire`` registers exactly the
catalogue metrics it owns (``shared.infra.metrics.CATALOGUE``), and each metrics object shows what its
figures say (read back from the service's own registry)."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest

from services.capacity_ledger.handlers import LedgerHandlers
from services.capacity_ledger.metrics import LedgerMetrics
from services.capacity_ledger.store import AcceleratorFigures, GroupFigures, MetricsFigures
from services.cross_region_router.metrics import RouterMetrics
from services.placement.metrics import PlacementMetrics, ViewMetrics
from services.registry import SERVICES
from services.reservation_filler.figures import Filled, fill_figures
from services.reservation_filler.metrics import ReservationMetrics
from services.topology_discovery.app import AGENT
from services.topology_discovery.metrics import TopologyMetrics
from shared.contracts.envelope import new_event
from shared.contracts.subjects import Subjects
from shared.contracts.topology import GpuSample, GpuTelemetryEvent, NodeProfileEvent
from shared.domain.capacity import AcceleratorCapacity
from shared.domain.errors import ErrorCode
from shared.domain.ledger import DriftDetector
from shared.domain.liveness import Liveness
from shared.domain.placement.listing import ReplicaState
from shared.domain.reservations import Usage
from shared.domain.topology.tpu import TpuGrid, TpuType, fragmentation
from shared.infra.metrics import CATALOGUE, EVERY_SERVICE, ServiceMetrics
from shared.infra.service import build_app
from shared.infra.settings import Settings
from shared.infra.uow import UnitOfWork, run_committed

GB = 10**9
NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
# Nothing listens there: building an app connects to nothing (that happens when it starts).
OFFLINE = Settings(
    kit={"nats_url": "nats://127.0.0.1:1", "database_url": "postgresql://x:y@127.0.0.1:1/none", "metrics_port": -1}
)


def value(metrics: ServiceMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


def catalogue_families(metrics: ServiceMetrics) -> set[str]:
    """The catalogue metrics registered, by catalogue name (a counter's family drops ``_total``)."""
    families = {family.name for family in metrics.registry.collect()}
    return {
        name
        for name, spec in CATALOGUE.items()
        if (name.removesuffix("_total") if spec.kind == "counter" else name) in families
    }


# -- what each service registers ------------------------------------------------------------------


@pytest.mark.parametrize("package", sorted(SERVICES))
def test_wire_registers_exactly_the_catalogue_metrics_the_service_owns(package: str) -> None:
    definition = SERVICES[package]
    _app, runtime = build_app(definition, OFFLINE)
    owned = {name for name, spec in CATALOGUE.items() if spec.owner in (definition.name, EVERY_SERVICE)}
    assert owned, f"the catalogue names nothing for {definition.name}"
    assert catalogue_families(runtime.metrics) == owned


def test_every_catalogue_metric_has_an_owner_among_the_services() -> None:
    assert {spec.owner for spec in CATALOGUE.values()} <= {d.name for d in SERVICES.values()} | {EVERY_SERVICE}


def test_a_topology_agent_registers_none_of_the_fleets_metrics() -> None:
    _app, runtime = build_app(AGENT, OFFLINE, database=False)
    assert catalogue_families(runtime.metrics) == set()


# -- capacity-ledger --------------------------------------------------------------------------------


def acc(acc_id: str, sku: str, *, usable_gb: int = 80, reserved_gb: int = 0) -> AcceleratorFigures:
    return AcceleratorFigures(acc_id, acc_id.partition("/")[0], sku, usable_gb * GB, reserved_gb * GB, True)


def test_the_ledger_gauges_show_hbm_per_sku_and_accelerator_and_the_tp_groups() -> None:
    metrics = ServiceMetrics("capacity-ledger")
    ledger = LedgerMetrics(metrics)
    figures = MetricsFigures(
        accelerators=[
            acc("h1/gpu0", "H100", reserved_gb=40),
            acc("h1/gpu1", "H100", reserved_gb=20),
            acc("a1/gpu0", "A100", usable_gb=40),
        ],
        groups=[
            GroupFigures(("h1/gpu0", "h1/gpu1"), 0),  # NVLinked
            GroupFigures(("h1/gpu2", "h2/gpu0"), 5 * 10**8),  # crosses domains
            GroupFigures(("h1/gpu4", "h1/gpu5"), 0),
            GroupFigures(("pod/0.0", "pod/0.1", "pod/1.0", "pod/1.1"), 0),  # a TPU slice: not a TP group of GPUs
        ],
        cross_domain_bytes_per_s=5 * 10**8,
    )
    ledger.show(figures)
    # H100: (40 + 20) GB reserved / (80 + 80) GB usable = 0.375; A100: nothing reserved.
    assert value(metrics, "hetsched_hbm_utilization_ratio", sku="H100") == 0.375
    assert value(metrics, "hetsched_hbm_utilization_ratio", sku="A100") == 0.0
    h1_gpu0 = {"accelerator": "h1/gpu0", "node": "h1", "sku": "H100"}
    assert value(metrics, "hetsched_accelerator_hbm_utilization_ratio", **h1_gpu0) == 0.5
    assert value(metrics, "hetsched_hbm_free_bytes", accelerator="h1/gpu1") == 60 * GB
    assert value(metrics, "hetsched_tp_groups", degree="2", nvlinked="true") == 2
    assert value(metrics, "hetsched_tp_groups", degree="2", nvlinked="cross_domain") == 1  # the budgeted step
    assert value(metrics, "hetsched_tp_groups", degree="2", nvlinked="false") == 0
    assert value(metrics, "hetsched_tp_groups", degree="4", nvlinked="true") is None
    assert value(metrics, "hetsched_nvlink_cross_island_bytes_per_second") == 5 * 10**8

    # The A100 node left and every group ended: their series go.
    ledger.show(MetricsFigures(accelerators=figures.accelerators[:2], groups=[], cross_domain_bytes_per_s=0))
    assert value(metrics, "hetsched_hbm_utilization_ratio", sku="A100") is None
    assert value(metrics, "hetsched_hbm_free_bytes", accelerator="a1/gpu0") is None
    assert value(metrics, "hetsched_tp_groups", degree="2", nvlinked="true") is None
    assert value(metrics, "hetsched_nvlink_cross_island_bytes_per_second") == 0


def test_a_tp_group_whose_nvlink_is_gone_in_its_nodes_current_profile_is_not_nvlinked() -> None:
    metrics = ServiceMetrics("capacity-ledger")
    ledger = LedgerMetrics(metrics, crossing_budget_bytes_per_s=256 * GB)
    assert value(metrics, "hetsched_cross_domain_budget_bytes_per_second") == 256 * GB
    groups = [
        GroupFigures(("h1/gpu0", "h1/gpu1"), 0),
        GroupFigures(("h1/gpu2", "h1/gpu3"), 0),
        GroupFigures(("h2/gpu0", "h2/gpu1"), 0),  # h2 not profiled since start: its declaration stands
    ]
    figures = MetricsFigures(accelerators=[], groups=groups, cross_domain_bytes_per_s=0)
    ledger.profiled("h1", [["h1/gpu0", "h1/gpu1", "h1/gpu2", "h1/gpu3"]])
    ledger.show(figures)
    assert value(metrics, "hetsched_tp_groups", degree="2", nvlinked="true") == 3

    # h1 re-profiled: gpu3 lost its NVLink (the domain shrank to gpu0..gpu2, gpu3 alone).
    ledger.profiled("h1", [["h1/gpu0", "h1/gpu1", "h1/gpu2"], ["h1/gpu3"]])
    ledger.show(figures)
    assert value(metrics, "hetsched_tp_groups", degree="2", nvlinked="true") == 2
    assert value(metrics, "hetsched_tp_groups", degree="2", nvlinked="false") == 1

    ledger.forget("h1")  # left the fleet: back to what placement declared
    ledger.show(figures)
    assert value(metrics, "hetsched_tp_groups", degree="2", nvlinked="false") == 0


class OneNode:
    """The one store call ``on_gpu_telemetry`` makes."""

    def __init__(self, *accelerators: AcceleratorCapacity) -> None:
        self.accelerators = accelerators

    async def node_accelerators(self, *, session: Any, node: str) -> list[AcceleratorCapacity]:
        return [a for a in self.accelerators if a.node == node]

    async def newest_replica_commits(self, *, session: Any, node: str) -> dict[str, datetime]:
        return {}  # no replica committed lately: every GPU is checked


async def test_the_drift_gauge_shows_the_difference_while_the_detector_reports_drift() -> None:
    metrics = ServiceMetrics("capacity-ledger")
    handlers = LedgerHandlers(
        uow=None,  # type: ignore[arg-type]  # telemetry is applied in the consumer's unit of work
        clock=lambda: NOW,
        batcher=None,  # type: ignore[arg-type]
        ceiling=0.92,
        default_lease_s=60,
        sweep_period_s=1,
        drift=DriftDetector(threshold=0.10, consecutive=2),
        store=OneNode(  # type: ignore[arg-type]
            AcceleratorCapacity("n/gpu0", "n", 0, "H100", 80 * GB, 0, True),
            AcceleratorCapacity("n/gpu1", "n", 1, "H100", 80 * GB, 30 * GB, True),
        ),
        metrics=LedgerMetrics(metrics),
    )
    shown: list[float | None] = []
    # gpu0 reserves nothing; the band is 10% of 80 GB = 8 GB. Drift is reported on the 2nd sample over
    # it, the 3rd stays over it (the gauge follows), the 4th is back inside (0).
    for used_gb in (30, 30, 35, 2):
        uow = UnitOfWork(session=None, now=NOW, subjects=Subjects("test"), source="capacity-ledger")  # type: ignore[arg-type]
        gpus = [GpuSample(index=0, memory_used_bytes=used_gb * GB), GpuSample(index=1, memory_used_bytes=30 * GB)]
        event = new_event(type="telemetry.gpu", source="test", occurred_at=NOW, payload={})
        await handlers.on_gpu_telemetry(uow=uow, event=event, payload=GpuTelemetryEvent(node="n", gpus=gpus))
        run_committed(uow.committed)  # the consumer's transaction committed
        shown.append(value(metrics, "hetsched_hbm_drift_bytes", accelerator="n/gpu0"))
    assert shown == [None, 30 * GB, 35 * GB, 0]
    assert value(metrics, "hetsched_hbm_drift_bytes", accelerator="n/gpu1") is None  # uses what it reserved


class Capacity:
    """The store calls a node profile makes."""

    async def upsert_capacity(self, *, session: Any, node: str, accelerators: Any) -> dict[str, Any]:
        return {}

    async def held_above_reported(self, *, session: Any, ids: Any) -> dict[str, Any]:
        return {}


async def test_a_node_profile_event_gives_the_tp_group_gauge_its_current_nvlink_domains() -> None:
    metrics = ServiceMetrics("capacity-ledger")
    ledger = LedgerMetrics(metrics)
    handlers = LedgerHandlers(
        uow=None,  # type: ignore[arg-type]  # profiles are applied in the consumer's unit of work
        clock=lambda: NOW,
        batcher=None,  # type: ignore[arg-type]
        ceiling=0.92,
        default_lease_s=60,
        sweep_period_s=1,
        drift=DriftDetector(threshold=0.10, consecutive=2),
        store=Capacity(),  # type: ignore[arg-type]
        metrics=ledger,
    )
    group = MetricsFigures(accelerators=[], groups=[GroupFigures(("n/gpu0", "n/gpu1"), 0)], cross_domain_bytes_per_s=0)

    async def profiled(*domains: list[str]) -> None:
        payload = NodeProfileEvent.model_validate(
            {
                "node": "n",
                "region": "r1",
                "kind": "pairs",
                "fingerprint": "f",
                "profile": {
                    "name": "n",
                    "region": "r1",
                    "cluster": "c1",
                    "rack": "k1",
                    "sku": "H100",
                    "links": [],
                    "accelerators": [],
                },
                "domains": [{"id": f"n/nv{i}", "kind": "pairs", "members": m} for i, m in enumerate(domains)],
            }
        )
        uow = UnitOfWork(session=None, now=NOW, subjects=Subjects("test"), source="capacity-ledger")  # type: ignore[arg-type]
        event = new_event(type="topology.node_changed", source="test", occurred_at=NOW, payload={})
        await handlers.on_node_changed(uow=uow, event=event, payload=payload)
        ledger.show(group)  # not before the consumer's transaction commits
        assert value(metrics, "hetsched_tp_groups", degree="2", nvlinked="true") == 1
        run_committed(uow.committed)
        ledger.show(group)

    await profiled(["n/gpu0", "n/gpu1"])
    assert value(metrics, "hetsched_tp_groups", degree="2", nvlinked="true") == 1
    await profiled(["n/gpu0"], ["n/gpu1"])  # their NVLink went down
    assert value(metrics, "hetsched_tp_groups", degree="2", nvlinked="false") == 1


# -- reservation-filler -----------------------------------------------------------------------------


def use(owner: int = 0, lent: int = 0, idle: int = 0, *, at: str = "") -> Usage:
    ids = iter(f"{at}g{i}" for i in range(owner + lent + idle))
    return Usage(
        owner_used=frozenset(next(ids) for _ in range(owner)),
        lent=frozenset(next(ids) for _ in range(lent)),
        idle=frozenset(next(ids) for _ in range(idle)),
    )


def test_fill_rate_per_tenant_and_cluster_overall_and_idle_cost_per_tenant() -> None:
    metrics = ServiceMetrics("reservation-filler")
    shown = ReservationMetrics(metrics)
    assert math.isnan(value(metrics, "hetsched_reservation_fill_rate_overall") or 0.0)  # nothing worked out yet
    filled = [
        # acme: 4 GPUs on c1 (2 owner, 1 lent, 1 idle) and 2 idle on c2, at 3 $/h each idle.
        Filled("acme", use(2, 1, 3), {"c1": use(2, 1, 1, at="c1"), "c2": use(idle=2, at="c2")}, 9.0),
        # initech: a second reservation on c1, all lent.
        Filled("initech", use(lent=2), {"c1": use(lent=2, at="i")}, 0.0),
    ]
    shown.show(fill_figures(filled))
    assert value(metrics, "hetsched_reservation_fill_rate", tenant="acme", cluster="c1") == 0.75  # 3 of 4
    assert value(metrics, "hetsched_reservation_fill_rate", tenant="acme", cluster="c2") == 0.0
    assert value(metrics, "hetsched_reservation_fill_rate", tenant="initech", cluster="c1") == 1.0
    assert value(metrics, "hetsched_reservation_fill_rate_overall") == 5 / 8  # (3 + 2) used of 8 reserved
    assert value(metrics, "hetsched_reservation_idle_cost_usd_per_hour", tenant="acme") == 9.0
    assert value(metrics, "hetsched_reservation_idle_cost_usd_per_hour", tenant="initech") == 0.0

    shown.show(fill_figures([]))  # every reservation ended
    assert value(metrics, "hetsched_reservation_fill_rate", tenant="acme", cluster="c1") is None
    assert value(metrics, "hetsched_reservation_idle_cost_usd_per_hour", tenant="acme") is None
    assert math.isnan(value(metrics, "hetsched_reservation_fill_rate_overall") or 0.0)


# -- placement --------------------------------------------------------------------------------------


def test_placement_counts_decisions_by_outcome_and_times_them() -> None:
    metrics = ServiceMetrics("placement")
    placement = PlacementMetrics.create(metrics)
    placement.decided(2.5)
    placement.decided(0.5)
    placement.count(SimpleNamespace(placed=True, error_code=None))  # type: ignore[arg-type]
    placement.count(SimpleNamespace(placed=False, error_code=ErrorCode.NO_CAPACITY))  # type: ignore[arg-type]
    placement.count(SimpleNamespace(placed=False, error_code=ErrorCode.UNKNOWN_MODEL))  # type: ignore[arg-type]
    placement.count(SimpleNamespace(placed=False, error_code=ErrorCode.UNKNOWN_MODEL))  # type: ignore[arg-type]
    assert value(metrics, "hetsched_placement_decision_seconds_count") == 2
    assert value(metrics, "hetsched_placement_decision_seconds_sum") == pytest.approx(0.003)
    assert value(metrics, "hetsched_placement_decision_seconds_bucket", le="0.0005") == 1  # the 0.5 ms one
    assert value(metrics, "hetsched_placements_total") == 1
    assert value(metrics, "hetsched_placement_rejections_total", reason="no_capacity") == 1
    assert value(metrics, "hetsched_placement_rejections_total", reason="unknown_model") == 2


def test_placement_shows_pcie_per_node_fragmentation_per_pod_and_the_admission_queue() -> None:
    metrics = ServiceMetrics("placement")
    free = TpuGrid(TpuType.V5E, (4, 4))
    # Every other chip of the first row taken: the free chips no longer form one block.
    scattered = TpuGrid(TpuType.V5E, (4, 4), bytes([1, 0, 1, 0] + [0] * 12))
    snapshot = SimpleNamespace(
        pcie_util={"n1": 0.8, "n2": 0.1},
        tpu_pods={"free": SimpleNamespace(grid=free), "scattered": SimpleNamespace(grid=scattered)},
    )
    depths = {"acme": 3}
    view = ViewMetrics(metrics, snapshot=lambda: snapshot, queue_depths=lambda: depths)  # type: ignore[arg-type,return-value]
    view.refresh()
    assert value(metrics, "hetsched_pcie_utilization_ratio", node="n1") == 0.8
    assert value(metrics, "hetsched_tpu_fragmentation_ratio", pod="free") == 0.0
    scattered_figure = value(metrics, "hetsched_tpu_fragmentation_ratio", pod="scattered")
    assert scattered_figure == fragmentation(scattered) and 0 < scattered_figure < 1
    assert value(metrics, "hetsched_admit_queue_depth", tenant="acme") == 3

    snapshot.pcie_util = {"n2": 0.2}
    depths.clear()
    view.refresh()
    assert value(metrics, "hetsched_pcie_utilization_ratio", node="n1") is None  # the node left the view
    assert value(metrics, "hetsched_admit_queue_depth", tenant="acme") == 0  # its requests left the queue


# -- router and topology ----------------------------------------------------------------------------


def test_the_router_times_each_routed_request_and_counts_moves() -> None:
    metrics = ServiceMetrics("cross-region-router")
    router = RouterMetrics(metrics)
    router.routed(rtt_ms=30.0, moved=False)
    router.routed(rtt_ms=None, moved=True)  # a region the regions file has no RTT for
    assert value(metrics, "hetsched_route_rtt_seconds_count") == 1
    assert value(metrics, "hetsched_route_rtt_seconds_sum") == pytest.approx(0.03)
    assert value(metrics, "hetsched_route_switches_total") == 1


def test_topology_counts_changed_profiles_and_stamps_each_refresh() -> None:
    metrics = ServiceMetrics("topology-discovery")
    topology = TopologyMetrics(metrics, clock=lambda: NOW)
    assert value(metrics, "hetsched_topology_last_profile_timestamp_seconds") == 0
    topology.profiles_changed(0)
    topology.profiles_changed(2)
    topology.refreshed()
    assert value(metrics, "hetsched_topology_drift_total") == 2
    assert value(metrics, "hetsched_topology_last_profile_timestamp_seconds") == NOW.timestamp()


def test_topology_counts_nodes_by_state_and_ages_a_failing_nodes_profile() -> None:
    metrics = ServiceMetrics("topology-discovery")
    now = [NOW]
    topology = TopologyMetrics(metrics, clock=lambda: now[0])
    topology.nodes({Liveness.UP: 3, Liveness.LOST: 1})
    assert value(metrics, "hetsched_nodes", state="up") == 3
    assert value(metrics, "hetsched_nodes", state="lost") == 1

    topology.profiled("n1")
    topology.beat("n2")  # a beat confirms a node's profile too
    assert value(metrics, "hetsched_node_last_profile_timestamp_seconds", node="n1") == NOW.timestamp()
    assert value(metrics, "hetsched_node_last_profile_timestamp_seconds", node="n2") == NOW.timestamp()

    # n1's re-profile fails: its heartbeats no longer confirm it, while n2's do.
    topology.profile_failed("n1")
    now[0] = NOW + timedelta(minutes=1)
    topology.beat("n1")
    topology.beat("n2")
    assert value(metrics, "hetsched_node_profile_failures_total", node="n1") == 1
    assert value(metrics, "hetsched_node_last_profile_timestamp_seconds", node="n1") == NOW.timestamp()
    assert value(metrics, "hetsched_node_last_profile_timestamp_seconds", node="n2") == now[0].timestamp()

    # A profile parses again (reported even when unchanged): beats confirm it again.
    topology.profiled("n1")
    now[0] = NOW + timedelta(minutes=2)
    topology.beat("n1")
    assert value(metrics, "hetsched_node_last_profile_timestamp_seconds", node="n1") == now[0].timestamp()

    topology.forget("n1")
    assert value(metrics, "hetsched_node_last_profile_timestamp_seconds", node="n1") is None
    assert value(metrics, "hetsched_node_profile_failures_total", node="n1") is None


def test_placement_counts_reported_replicas_by_state_and_those_loading_too_long() -> None:
    metrics = ServiceMetrics("placement")
    snapshot = SimpleNamespace(pcie_util={}, tpu_pods={})
    states = {"r1": ReplicaState.LOADING, "r2": ReplicaState.READY, "r3": ReplicaState.FAILED}
    clock = [0.0]
    view = ViewMetrics(
        metrics,
        snapshot=lambda: snapshot,  # type: ignore[arg-type,return-value]
        queue_depths=dict,
        replicas=lambda: states,
        load_expected_s=600,
        now_s=lambda: clock[0],
    )
    view.refresh()
    assert value(metrics, "hetsched_replicas", state="loading") == 1
    assert value(metrics, "hetsched_replicas", state="ready") == 1
    assert value(metrics, "hetsched_replicas", state="failed") == 1
    assert value(metrics, "hetsched_replicas", state="draining") == 0
    assert value(metrics, "hetsched_replicas_loading_overdue") == 0

    clock[0] = 300.0
    states["r4"] = ReplicaState.LOADING  # starts loading 5 minutes after r1
    view.refresh()
    clock[0] = 600.0  # r1 exactly at its expected load time: not overdue
    view.refresh()
    assert value(metrics, "hetsched_replicas_loading_overdue") == 0
    clock[0] = 601.0
    view.refresh()
    assert value(metrics, "hetsched_replicas_loading_overdue") == 1  # r1 only
    clock[0] = 902.0
    view.refresh()
    assert value(metrics, "hetsched_replicas_loading_overdue") == 2

    states["r1"] = ReplicaState.READY  # r1 loaded; if it loads again, it starts from 0
    view.refresh()
    states["r1"] = ReplicaState.LOADING
    view.refresh()
    assert value(metrics, "hetsched_replicas_loading_overdue") == 1
    assert value(metrics, "hetsched_replicas", state="loading") == 2


def test_every_service_exports_its_dead_letters_per_consumer_and_its_quarantined_outbox_events() -> None:
    definition = SERVICES["capacity_ledger"]
    _app, runtime = build_app(definition, OFFLINE)
    assert runtime.consumers, "the ledger consumes events"
    durable = runtime.consumers[0].durable
    assert value(runtime.metrics, "hetsched_events_dead_lettered_total", consumer=durable) == 0
    assert value(runtime.metrics, "hetsched_outbox_quarantined_total") == 0  # no relay before it starts
    runtime.consumers[0].dead_lettered += 2
    runtime.relay = SimpleNamespace(quarantined=3)  # type: ignore[assignment]
    assert value(runtime.metrics, "hetsched_events_dead_lettered_total", consumer=durable) == 2
    assert value(runtime.metrics, "hetsched_outbox_quarantined_total") == 3


def test_placement_shows_each_engines_kv_use_and_counts_preemptions_per_model() -> None:
    metrics = ServiceMetrics("placement")
    snapshot = SimpleNamespace(pcie_util={}, tpu_pods={})
    usage = {"r1": ("llama3-70b", 0.97), "r2": ("llama3-8b", 0.2)}
    preempted = {"llama3-70b": 4}
    view = ViewMetrics(
        metrics,
        snapshot=lambda: snapshot,  # type: ignore[arg-type,return-value]
        queue_depths=dict,
        kv_usage=lambda: usage,
        preempted=lambda: preempted,
    )
    view.refresh()
    assert value(metrics, "hetsched_engine_kv_usage_ratio", replica="r1", model="llama3-70b") == 0.97
    assert value(metrics, "hetsched_engine_preemptions_total", model="llama3-70b") == 4
    preempted["llama3-70b"] = 10
    del usage["r1"]  # its reports went stale, or it ended
    view.refresh()
    view.refresh()  # nothing new: counted once
    assert value(metrics, "hetsched_engine_preemptions_total", model="llama3-70b") == 10
    assert value(metrics, "hetsched_engine_kv_usage_ratio", replica="r1", model="llama3-70b") is None
