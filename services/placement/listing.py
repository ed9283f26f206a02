"""``placement.replicas``: the placed replicas, a page at a time, from placement's own decisions (every
placement process records them, so any one answers for all) with the state placement can tell of each from
what it follows (the rebalancer's draining replicas, the engines' reports). A tenant's subject lists only its
tenant's (the request must name it; the kit refuses another as ``forbidden``); the operator's unscoped subject
lists every tenant's, or one's with ``tenant``.

Reads like the others: check the filters -> the state filter (pure, ``shared.domain.placement.listing``) ->
one page and the count from the store -> the reply."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Set

from pydantic import BaseModel, ValidationError
from sqlalchemy.ext.asyncio import AsyncSession

from services.placement.records import PlacedReplica, ReplicaFilter
from services.placement.store import DecisionStore
from shared.contracts.base import ErrorCode, echo, rejected
from shared.contracts.placement import PlaceReply, ReplicaPlacement, ReplicasReply, ReplicasRequest, ReplicaView
from shared.domain.models import ModelSpec
from shared.domain.placement.listing import (
    Position,
    ReplicaState,
    decode_cursor,
    gpu_indices,
    page_end,
    replica_state,
    state_filter,
)
from shared.infra.uow import UnitOfWorkFactory


class ReplicaListing:
    """Lists placed replicas. ``knows_node``: whether a name is a node or TPU pod of the fleet view;
    ``draining``: replicas the rebalancer moves off; ``serving``: replicas whose engine reports healthy and
    fresh."""

    def __init__(
        self,
        *,
        store: DecisionStore,
        uow: UnitOfWorkFactory,
        models: Mapping[str, ModelSpec],
        knows_node: Callable[[str], bool],
        draining: Callable[[], Set[str]],
        serving: Callable[[], Set[str]],
        reported: Callable[[Set[str]], Mapping[str, ReplicaState]] = lambda _draining: {},
        endpoint: Callable[[str], str | None] = lambda _replica_id: None,
    ) -> None:
        self._reported = reported
        self._endpoint = endpoint
        self._store = store
        self._uow = uow
        self._models = models
        self._knows_node = knows_node
        self._draining = draining
        self._serving = serving

    async def replicas(self, request: ReplicasRequest) -> BaseModel:
        if request.model is not None and request.model not in self._models:
            return rejected(ErrorCode.UNKNOWN_MODEL, f"no model {echo(request.model)} in the catalog")
        if request.node is not None and not self._knows_node(request.node):
            return rejected(ErrorCode.NOT_FOUND, f"no node or TPU pod {echo(request.node)} in the fleet")
        draining, serving = set(self._draining()), set(self._serving())
        reported = self._reported(draining)
        states = state_filter(request.state, draining=draining, serving=serving, reported=reported)
        where = ReplicaFilter(
            tenant=request.tenant,
            model=request.model,
            node=request.node,
            only=states.only,
            excluding=states.excluding,
        )
        after = decode_cursor(request.cursor) if request.cursor is not None else None

        async def read(session: AsyncSession) -> tuple[list[PlacedReplica], int]:
            rows = await self._store.replicas(session=session, where=where, after=after, limit=request.limit + 1)
            return rows, await self._store.count_replicas(session=session, where=where)

        rows, total = await self._uow.read(read)
        page, next_cursor = page_end(rows, request.limit, lambda row: Position(row.tenant, row.request_id))
        return ReplicasReply(
            replicas=[
                view_of(row, draining=draining, serving=serving, reported=reported, endpoint=self._endpoint)
                for row in page
            ],
            next_cursor=next_cursor,
            total=total,
        )


def view_of(
    row: PlacedReplica,
    *,
    draining: Set[str],
    serving: Set[str],
    reported: Mapping[str, ReplicaState] | None = None,
    endpoint: Callable[[str], str | None] = lambda _replica_id: None,
) -> ReplicaView:
    """One listed replica from its placed decision (its stored reply: where it runs, on what), in the state
    its agents' reports fold into (``reported``), else the one the engine rule gives."""
    state = replica_state(
        draining=row.allocation_id in draining,
        serving=row.allocation_id in serving,
        reported=(reported or {}).get(row.allocation_id),
    )
    try:
        reply = PlaceReply.model_validate(row.reply)
    except ValidationError:  # a reply no longer readable: the replica is still listed, with what is known
        reply = PlaceReply(status="placed", request_id=row.request_id, allocation_id=row.allocation_id)
    return ReplicaView(
        replica_id=row.allocation_id,
        tenant=row.tenant,
        request_id=row.request_id,
        model=reply.model,
        backend=reply.backend,
        sku=reply.sku,
        region=reply.region,
        cluster=reply.cluster,
        tp=reply.tp or 1,
        pp=reply.pp,
        sharing=reply.sharing,
        placements=[
            ReplicaPlacement(
                node=p.node, accelerators=p.accelerators, domain=p.domain, gpus=gpu_indices(p.accelerators)
            )
            for p in reply.placements
        ],
        tpu_slice=reply.tpu_slice,
        state=state,
        lease_expires_at=row.lease_expires_at,
        placed_at=row.placed_at,
        endpoint=endpoint(row.allocation_id) if state in (ReplicaState.READY, ReplicaState.DRAINING) else None,
    )
