"""Contract <-> domain for the rebalancer: a placed replica from its PLACEMENT event, a plan's wire form,
and the request that moves a replica."""

from __future__ import annotations

from itertools import product

from shared.contracts.placement import PlacementEvent, PlaceRequest
from shared.contracts.rebalance import PlanView, StepView
from shared.domain.fleet import NodeProfile, cluster_key, tpu_chip_id
from shared.domain.rebalance.plans import Plan, Replica, Step
from shared.domain.topology.domains import maximal_nvlink_cliques
from shared.domain.topology.tpu import TpuSlice
from shared.infra.fleet_view import to_domain

MOVE_FALLBACKS = ["kv_quantize", "pipeline", "cross_domain"]
"""A copy made to move a replica never queues: a move that cannot be placed now fails (and rolls back)."""


def replica_of(event: PlacementEvent) -> Replica | None:
    """The replica a `placement_decided` event announces; None without its request (an older placement)
    or when it was not placed."""
    reply, request = event.reply, event.request
    if request is None or reply.status != "placed" or reply.allocation_id is None:
        return None
    cluster = cluster_key(reply.region or "", reply.cluster or "")
    share = reply.hbm_per_accelerator.total_bytes if reply.hbm_per_accelerator is not None else 0
    if reply.tpu_slice is not None:
        block = TpuSlice(tuple(reply.tpu_slice.origin), tuple(reply.tpu_slice.shape))
        chips = tuple(
            tpu_chip_id(reply.tpu_slice.pod, tuple(o + d for o, d in zip(block.origin, delta, strict=True)))
            for delta in product(*(range(n) for n in block.shape))
        )
        return Replica(
            allocation_id=reply.allocation_id,
            tenant=event.tenant,
            request=to_domain(request),
            node=None,
            accelerators=chips,
            tp=reply.tp or len(chips),
            cluster=cluster,
            bytes_per_accelerator=dict.fromkeys(chips, share),
            tpu_pod=reply.tpu_slice.pod,
            tpu_slice=block,
        )
    accelerators = tuple(acc for p in reply.placements for acc in p.accelerators)
    if not accelerators:
        return None
    return Replica(
        allocation_id=reply.allocation_id,
        tenant=event.tenant,
        request=to_domain(request),
        node=reply.placements[0].node,
        accelerators=accelerators,
        tp=reply.tp or len(accelerators),
        cluster=cluster,
        bytes_per_accelerator=dict.fromkeys(accelerators, share),
    )


def move_request(request: PlaceRequest, *, request_id: str, avoid: tuple[str, ...]) -> PlaceRequest:
    """The replica's own request, asked again for its copy: a new id (the plan's step), the accelerators
    to leave withheld, and no queueing."""
    fallbacks = [f for f in (request.fallbacks if request.fallbacks is not None else MOVE_FALLBACKS) if f != "queue"]
    return request.model_copy(
        update={"request_id": request_id, "avoid_accelerators": list(avoid), "fallbacks": fallbacks}
    )


def cliques_of(profile: NodeProfile) -> list[frozenset[str]]:
    """The node's maximal all-pairs-NVLinked GPU groups, as accelerator ids."""
    return [frozenset(profile.accelerator_id(i) for i in clique) for clique in maximal_nvlink_cliques(profile.links)]


def plan_view(plan: Plan) -> PlanView:
    return PlanView(
        plan_id=plan.plan_id,
        kind=plan.kind,
        state=plan.state,
        cluster=plan.cluster,
        target=plan.target,
        reason=plan.reason,
        created_at=plan.created_at,
        steps=[
            StepView(
                action=s.action,
                allocation_id=s.allocation_id,
                avoid=list(s.avoid),
                new_allocation_id=s.new_allocation_id,
                state=s.state,
            )
            for s in plan.steps
        ],
    )


def plan_of_view(view: PlanView) -> Plan:
    return Plan(
        plan_id=view.plan_id,
        kind=view.kind,
        cluster=view.cluster,
        target=view.target,
        reason=view.reason,
        created_at=view.created_at,
        state=view.state,
        steps=tuple(
            Step(
                action=s.action,
                allocation_id=s.allocation_id,
                avoid=tuple(s.avoid),
                new_allocation_id=s.new_allocation_id,
                state=s.state,
            )
            for s in view.steps
        ),
    )
