"""Placement's contracts <-> the placement domain: requests in, replies and ledger commits out."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from pydantic import BaseModel

from shared.contracts.base import ErrorCode, rejected
from shared.contracts.fleet import FleetGetReply
from shared.contracts.ledger import (
    AcceleratorBalance,
    AllocationEvent,
    CapacityChangedEvent,
    CommitRequest,
    LedgerEvent,
    ShareIn,
    SnapshotReply,
)
from shared.contracts.placement import AcceleratorShare, NodePlacement, PlaceReply, PlaceRequest, TpuSlice
from shared.contracts.topology import (
    NodeProfileEvent,
    NodeProfilePayload,
    NodeStateEvent,
    TopologyEvent,
    TpuPodEvent,
)
from shared.domain.fleet import AcceleratorId, NodeProfile, Rack, TpuPod
from shared.domain.hardware import Sku
from shared.domain.ledger.replay import allocation_delta
from shared.domain.models import ModelSpec
from shared.domain.placement.types import Decision, FleetSnapshot, PlacementRequest, Slo
from shared.domain.placement.view import AssumeKey, FleetView, LedgerAccelerator, LedgerMirror, reservation
from shared.domain.topology.tpu import TpuType
from shared.infra.profiles import profile_from_payload

LEDGER_REQUEST_PREFIX = "placement/"


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
    )


def to_reply(decision: Decision, *, allocation_id: str | None = None) -> PlaceReply:
    share = decision.share
    placements: list[NodePlacement] = []
    if decision.placed and decision.tpu is None:
        by_node: dict[str, list[str]] = {}
        for acc in decision.accelerators:
            by_node.setdefault(AcceleratorId.parse(acc).host, []).append(acc)
        placements = [NodePlacement(node=n, accelerators=accs, domain=decision.domain) for n, accs in by_node.items()]
    error = None
    if not decision.placed:
        error = rejected(decision.error_code or ErrorCode.NO_CAPACITY, decision.message or "no placement").error
    return PlaceReply(
        status=decision.status,
        request_id=decision.request_id,
        allocation_id=allocation_id,
        region=decision.region,
        cluster=decision.cluster,
        backend="tpu" if decision.tpu is not None else ("gpu" if decision.placed else None),
        sku=decision.sku,
        tp=decision.tp,
        placements=placements,
        tpu_slice=TpuSlice(pod=decision.tpu.pod, origin=list(decision.tpu.origin), shape=list(decision.tpu.shape))
        if decision.tpu is not None
        else None,
        hbm_per_accelerator=AcceleratorShare(
            weights=share.weights,
            kv=share.kv,
            activation=share.activation,
            workspace=share.workspace,
            total=share.total,
        )
        if share is not None and decision.placed
        else None,
        score=dict(decision.score),
        explanation=list(decision.explanation),
        error=error,
    )


def ledger_key(request: PlaceRequest) -> AssumeKey:
    """The (tenant, request id) the ledger knows this placement by."""
    return request.tenant, f"{LEDGER_REQUEST_PREFIX}{request.request_id}"


def placement_request_id(ledger_request_id: str) -> str | None:
    """Placement's request id of a ledger request id, or None when the allocation is not placement's."""
    if ledger_request_id.startswith(LEDGER_REQUEST_PREFIX):
        return ledger_request_id[len(LEDGER_REQUEST_PREFIX) :]
    return None


def body_hash(request: PlaceRequest) -> str:
    """What a request asks, hashed: a reused request id with another body is a conflict. The contract
    version is left out (``1`` and ``"1.0"`` ask the same)."""
    return hashlib.sha256(request.model_dump_json(exclude={"version"}).encode()).hexdigest()


def commit_held(commit: CommitRequest) -> dict[str, int]:
    """Bytes per accelerator a commit reserves (what the view assumes while it is in flight)."""
    return {s.accelerator_id: s.weights + s.kv + s.activation + s.workspace for s in commit.shares}


def held_bytes(snapshot: FleetSnapshot, decision: Decision) -> dict[str, int]:
    """Bytes per accelerator the commit of ``decision`` reserves (what the view assumes meanwhile)."""
    return {acc: share.total for acc, share in reservation(snapshot, decision).items()}


def to_commit(request: PlaceRequest, decision: Decision, snapshot: FleetSnapshot, *, lease_s: int) -> CommitRequest:
    """The ledger commit of a placed decision, with the reserved bytes it was decided on (``expected``):
    if they changed and the commit no longer fits, the ledger answers ``conflict``."""
    shares = reservation(snapshot, decision)
    if decision.tpu is not None:
        expected = dict.fromkeys(shares, 0)  # a slice is only decided on free chips
    else:
        expected = {acc: snapshot.capacity[acc].reserved for acc in shares}
    tenant, request_id = ledger_key(request)
    return CommitRequest(
        request_id=request_id,
        tenant=tenant,
        kind="replica",
        preemptible=request.preemptible,
        lease_s=lease_s,
        shares=[
            ShareIn(
                accelerator_id=acc,
                weights=share.weights,
                kv=share.kv,
                activation=share.activation,
                workspace=share.workspace,
            )
            for acc, share in shares.items()
        ],
        expected=expected,
    )


def balance_to_domain(node: str | None, balance: AcceleratorBalance) -> LedgerAccelerator:
    return LedgerAccelerator(
        id=balance.id,
        node=node or AcceleratorId.parse(balance.id).host,
        usable=balance.usable,
        reserved=balance.reserved,
        available=balance.available,
    )


def view_from(
    *,
    fleet: FleetGetReply,
    profiles: Mapping[str, NodeProfilePayload],
    ledger: SnapshotReply,
    skus: Mapping[str, Sku],
    models: Mapping[str, ModelSpec],
) -> FleetView:
    """A view seeded from ``fleet.get`` (with each node's profile) and ``ledger.snapshot``. A node whose
    profile is missing or does not parse is left out until its next ``node_profiled``."""
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
            LedgerAccelerator(
                id=a.id,
                node=a.node,
                usable=a.hbm_usable,
                reserved=a.hbm_reserved,
                available=a.available,
                allocations=tuple(a.allocations),
            )
            for a in ledger.accelerators
        ),
    )


def apply_event(view: FleetView, name: str, payload: BaseModel) -> None:
    """One TOPOLOGY or LEDGER event (its contract payload) folded into the view; others are ignored."""
    match name, payload:
        case ((TopologyEvent.NODE_PROFILED | TopologyEvent.NODE_CHANGED), NodeProfileEvent()):
            view.node_profiled(profile_from_payload(payload.profile))
        case TopologyEvent.NODE_LOST, NodeStateEvent():
            view.node_up(payload.node, False)
        case TopologyEvent.NODE_RECOVERED, NodeStateEvent():
            view.node_up(payload.node, True)
        case TopologyEvent.NODE_REMOVED, NodeStateEvent():
            view.node_removed(payload.node)
        case TopologyEvent.TPU_POD_PROFILED, TpuPodEvent():
            pod = TpuPod(
                name=payload.pod, region=payload.region, type=TpuType(payload.type), shape=tuple(payload.shape)
            )
            view.pod_profiled(pod, payload.hbm_per_chip)
        case _, AllocationEvent():  # the ledger's fold says what it moves: commits add, ends give back
            delta = allocation_delta(name, payload)
            view.allocation_moved(payload.allocation_id, key=(payload.tenant, payload.request_id), delta=delta)
        case LedgerEvent.CAPACITY_CHANGED, CapacityChangedEvent():
            view.capacity_changed(balance_to_domain(payload.node, b) for b in payload.accelerators)
        case _:
            pass
