"""``placement.assignments``: the replica parts one node runs, what its agent starts each engine with
(API.md "Replica lifecycle"). Asked by the node's agent on its own subject
(``<prefix>.placement.assignments.<node>``: the kit refuses a body naming another node as ``forbidden``), or
by an operator on the unscoped one.

Reads like the others: the placed decisions with accelerators on the node (placement's own records, so any
placement process answers for all) -> one ``Assignment`` each, from the reply the placement gave (its
binding for this node, its launch), the rebalancer's word (draining), the reservation filler's (a
borrowed replica's preemption deadline: ``stop_by``) -> the reply. A node nobody placed anything on gets
an empty list. A TPU replica's part is assigned to its pod's name (TPU pods have no host names in the
fleet's profiles): the agent that runs TPU engines runs under the pod's name."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Set
from datetime import datetime

from pydantic import BaseModel, ValidationError
from sqlalchemy.ext.asyncio import AsyncSession

from services.placement.records import PlacedReplica, ReplicaFilter
from services.placement.store import DecisionStore
from shared.contracts.engines import Assignment, AssignmentsReply, AssignmentsRequest
from shared.contracts.placement import PlaceReply
from shared.domain.models import ModelSpec
from shared.domain.placement.lifecycle import rank_order
from shared.infra.uow import UnitOfWorkFactory


def replica_nodes(reply: PlaceReply) -> list[str]:
    """The nodes of a placed replica in rank order (rank 0, the head, first): its binding's order, then
    any node the binding does not name, in placement order; a TPU replica's pod."""
    if reply.tpu_slice is not None:
        return [reply.tpu_slice.pod]
    stages = reply.stages or [reply.placements]
    placed = [p.node for stage in stages for p in stage]
    return rank_order([b.node for b in reply.binding or []], placed)


def assignment_of(
    node: str,
    *,
    tenant: str,
    reply: PlaceReply,
    lease_expires_at: datetime | None,
    models: Mapping[str, ModelSpec],
    draining: bool = False,
    stop_by: datetime | None = None,
) -> Assignment | None:
    """The part of a placed replica ``node`` runs; None when the replica has nothing on it (or its reply
    names no model or allocation)."""
    nodes = replica_nodes(reply)
    if node not in nodes or reply.allocation_id is None or reply.model is None:
        return None
    spec = models.get(reply.model)
    dtype = reply.dtype or (spec.dtype if spec is not None else None)
    if dtype is None:
        return None
    binding = next((b for b in reply.binding or [] if b.node == node), None)
    return Assignment(
        replica_id=reply.allocation_id,
        tenant=tenant,
        model=reply.model,
        dtype=dtype,
        sku=reply.sku,
        backend=reply.backend or "gpu",
        tp=reply.tp or 1,
        pp=reply.pp,
        rank=nodes.index(node),
        ranks=len(nodes),
        head_node=nodes[0],
        binding=binding,
        launch=reply.launch,
        draining=draining,
        stop_by=stop_by,
        lease_expires_at=lease_expires_at,
    )


def assignments_of(
    node: str,
    rows: list[PlacedReplica],
    *,
    models: Mapping[str, ModelSpec],
    draining: Set[str],
    stop_by: Mapping[str, datetime],
) -> list[Assignment]:
    """Every replica part on ``node`` among placed decisions ``rows`` (a reply no longer readable is left out)."""
    out: list[Assignment] = []
    for row in rows:
        try:
            reply = PlaceReply.model_validate(row.reply)
        except ValidationError:
            continue
        reply = reply.model_copy(update={"allocation_id": row.allocation_id})
        part = assignment_of(
            node,
            tenant=row.tenant,
            reply=reply,
            lease_expires_at=row.lease_expires_at,
            models=models,
            draining=row.allocation_id in draining,
            stop_by=stop_by.get(row.allocation_id),
        )
        if part is not None:
            out.append(part)
    return out


class Assignments:
    """Answers ``placement.assignments``. ``draining``: replicas the rebalancer moves off; ``deadlines``:
    borrowed replicas told to leave by a deadline (a reservation's preemptions)."""

    PAGE = 500

    def __init__(
        self,
        *,
        store: DecisionStore,
        uow: UnitOfWorkFactory,
        models: Mapping[str, ModelSpec],
        draining: Callable[[], Set[str]],
        deadlines: Callable[[], Mapping[str, datetime]],
    ) -> None:
        self._store = store
        self._uow = uow
        self._models = models
        self._draining = draining
        self._deadlines = deadlines

    async def assignments(self, request: AssignmentsRequest) -> BaseModel:
        where = ReplicaFilter(node=request.node)

        async def read(session: AsyncSession) -> list[PlacedReplica]:
            rows: list[PlacedReplica] = []
            after = None
            while True:  # every page: a node holds a handful of replicas, a TPU pod maybe more
                page = await self._store.replicas(session=session, where=where, after=after, limit=self.PAGE)
                rows.extend(page)
                if len(page) < self.PAGE:
                    return rows
                after = page[-1].position

        rows = await self._uow.read(read)
        return AssignmentsReply(
            node=request.node,
            assignments=assignments_of(
                request.node, rows, models=self._models, draining=self._draining(), stop_by=self._deadlines()
            ),
        )
