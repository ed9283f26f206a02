"""Contract -> domain for a fleet view: what placement's read model is seeded and fed with, and what the
rebalancer builds a snapshot from when it plans (``fetch_view``). Pure mapping but for ``fetch_view``."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime

from pydantic import BaseModel

from shared.contracts.base import Rejected
from shared.contracts.fleet import FleetGetReply
from shared.contracts.ledger import (
    AcceleratorBalance,
    AllocationEvent,
    CapacityChangedEvent,
    LedgerEventName,
    SnapshotReply,
)
from shared.contracts.placement import PlaceRequest
from shared.contracts.topology import (
    GpuTelemetryEvent,
    NodeProfileEvent,
    NodeProfilePayload,
    NodeStateEvent,
    TelemetryEventName,
    TopologyEventName,
    TpuPodEvent,
)
from shared.domain.capacity import AcceleratorCapacity
from shared.domain.fleet import AcceleratorId, NodeProfile, Rack, TpuPod
from shared.domain.hardware import Sku
from shared.domain.ledger.replay import allocation_delta
from shared.domain.models import ModelSpec
from shared.domain.placement.types import PlacementRequest, Slo
from shared.domain.placement.view import (
    DEFAULT_PCIE_WINDOW_S,
    FleetView,
    LedgerMirror,
    PcieSample,
)
from shared.domain.topology.tpu import TpuType
from shared.infra.profiles import profile_from_payload
from shared.infra.rpc import RpcClient


class SnapshotError(Exception):
    """``fleet.get`` or ``ledger.snapshot`` refused."""


def to_domain(request: PlaceRequest) -> PlacementRequest:
    slo = request.slo
    return PlacementRequest(
        request_id=request.request_id,
        tenant=request.tenant,
        model=request.model,
        context_tokens=request.context_tokens,
        concurrency=request.concurrency,
        dtype=request.dtype,
        kv_dtype=request.kv_dtype,
        input_tokens=request.input_tokens,
        output_tokens=request.output_tokens,
        tp=request.tp,
        backend=request.backend,
        skus=tuple(request.skus) if request.skus else None,
        region=request.region,
        preemptible=request.preemptible,
        slo=Slo(ttft_ms=slo.ttft_ms, tpot_ms=slo.tpot_ms, p99_ms=slo.p99_ms) if slo else None,
        sharing=request.sharing,
        fallbacks=tuple(request.fallbacks) if request.fallbacks is not None else None,
        pp=request.pp,
    )


def balance_to_domain(node: str | None, balance: AcceleratorBalance) -> AcceleratorCapacity:
    return AcceleratorCapacity.of_ledger(
        balance.id,
        node or AcceleratorId.parse(balance.id).host,
        balance.usable_bytes,
        balance.reserved_bytes,
        available=balance.available,
    )


def view_from(
    *,
    fleet: FleetGetReply,
    profiles: Mapping[str, NodeProfilePayload],
    ledger: SnapshotReply,
    skus: Mapping[str, Sku],
    models: Mapping[str, ModelSpec],
    pcie_window_s: float = DEFAULT_PCIE_WINDOW_S,
) -> FleetView:
    """A view seeded from ``fleet.get`` (with each node's profile) and ``ledger.snapshot`` (with which
    GPUs shared replicas hold and the cross-domain traffic per cluster). A node whose profile is missing
    or does not parse is left out until its next ``node_profiled``."""
    nodes: list[tuple[NodeProfile, bool]] = []
    for node in fleet.nodes:
        payload = profiles.get(node.name)
        if payload is None:
            continue
        try:
            nodes.append((profile_from_payload(payload), node.state == "up"))
        except ValueError:
            continue
    return FleetView(
        skus=skus,
        models=models,
        nodes=nodes,
        racks=[Rack(name=r.name, region=r.region, cluster=r.cluster, power_kw=r.power_kw) for r in fleet.racks],
        pods=[
            (
                TpuPod(name=p.name, region=p.region, type=TpuType(p.type), shape=tuple(p.shape), cluster=p.cluster),
                p.hbm_per_chip,
            )
            for p in fleet.tpu_pods
        ],
        ledger=LedgerMirror(
            [
                AcceleratorCapacity.of_ledger(
                    a.id,
                    a.node,
                    a.hbm_usable_bytes,
                    a.hbm_reserved_bytes,
                    available=a.available,
                    allocations=tuple(a.allocations),
                    shared=a.shared,
                )
                for a in ledger.accelerators
            ],
            cross_domain_used=ledger.cross_domain_used,
            crossing={
                c.allocation_id: (c.cluster, float(c.bytes_per_s))
                for c in ledger.cross_domain
                if c.cluster is not None and c.bytes_per_s > 0
            },
        ),
        pcie_window_s=pcie_window_s,
    )


def apply_event(view: FleetView, name: str, payload: BaseModel, *, at: datetime | None = None) -> None:
    """One TOPOLOGY, LEDGER or TELEMETRY event (its contract payload) folded into the view; others are
    ignored. ``at``: when the event happened (a GPU telemetry sample needs it; without it, ignored)."""
    match name, payload:
        case ((TopologyEventName.NODE_PROFILED | TopologyEventName.NODE_CHANGED), NodeProfileEvent()):
            view.node_profiled(profile_from_payload(payload.profile))
        case TopologyEventName.NODE_LOST, NodeStateEvent():
            view.node_up(payload.node, False)
        case TopologyEventName.NODE_RECOVERED, NodeStateEvent():
            view.node_up(payload.node, True)
        case TopologyEventName.NODE_REMOVED, NodeStateEvent():
            view.node_removed(payload.node)
        case TopologyEventName.TPU_POD_PROFILED, TpuPodEvent():
            pod = TpuPod(
                name=payload.pod, region=payload.region, type=TpuType(payload.type), shape=tuple(payload.shape)
            )
            view.pod_profiled(pod, payload.hbm_per_chip)
        case _, AllocationEvent():  # the ledger's fold says what it moves: commits add, ends give back
            delta = allocation_delta(name, payload)
            traffic = payload.cross_domain_bytes_per_s
            view.allocation_moved(
                payload.allocation_id,
                key=(payload.tenant, payload.request_id),
                delta=delta,
                shared=payload.sharing == "shared",
                crossing=(payload.cluster, float(traffic)) if payload.cluster is not None and traffic > 0 else None,
            )
        case TelemetryEventName.GPU, GpuTelemetryEvent() if at is not None:
            view.gpu_telemetry(
                payload.node,
                at,
                (
                    PcieSample(
                        index=g.index, tx_bytes_per_s=g.pcie_tx_bytes_per_s, rx_bytes_per_s=g.pcie_rx_bytes_per_s
                    )
                    for g in payload.gpus
                ),
            )
        case LedgerEventName.CAPACITY_CHANGED, CapacityChangedEvent():
            view.capacity_changed(balance_to_domain(payload.node, b) for b in payload.accelerators)
        case _:
            pass


async def fetch_view(rpc: RpcClient, *, skus: Mapping[str, Sku], models: Mapping[str, ModelSpec]) -> FleetView:
    """A fleet view from ``fleet.get`` (with profiles) and ``ledger.snapshot``, paged: what a service that
    does not follow the streams plans on (the rebalancer, when a detector fires)."""
    fleet = await rpc.fleet(profiles=True)
    if isinstance(fleet, Rejected):
        raise SnapshotError(f"fleet.get refused: {fleet.error.message}")
    ledger = await rpc.ledger_snapshot()
    if isinstance(ledger, Rejected):
        raise SnapshotError(f"ledger.snapshot refused: {ledger.error.message}")
    profiles = {n.name: n.profile for n in fleet.nodes if n.profile is not None}
    return view_from(fleet=fleet, profiles=profiles, ledger=ledger, skus=skus, models=models)
