"""``ledger.snapshot``: the ledger's accelerators page by page, with the whole fleet's cross-domain traffic
on every page, each page small enough for one NATS message (readers seed their view from it)."""

from __future__ import annotations

from collections.abc import Callable

from pydantic import BaseModel

from services.capacity_ledger import mapping, store
from services.capacity_ledger.ports import Store, Units
from shared.contracts.ledger import SnapshotReply, SnapshotRequest
from shared.domain.ledger import cross_domain_used


class SnapshotHandlers:
    """``ledger.snapshot``."""

    def __init__(
        self,
        *,
        uow: Units,
        snapshot_limit: int = 2048,
        max_payload: Callable[[], int] = lambda: 1 << 20,
        store: Store = store,
    ) -> None:
        self._uow = uow
        self._snapshot_limit = snapshot_limit
        self._max_payload = max_payload
        self._store = store

    async def snapshot(self, request: SnapshotRequest) -> BaseModel:
        page = await self._uow.read(
            lambda session: self._store.snapshot(
                session=session, node=request.node, after=request.cursor, limit=request.limit or self._snapshot_limit
            )
        )
        views = [mapping.ledger_view(e.capacity, e.allocations) for e in page.entries]
        # Cross-domain traffic is the whole fleet's on every page: a reader seeds its per-cluster budget use
        # from any page (and counts each allocation once while it follows the events).
        crossing = {
            "cross_domain_used": cross_domain_used(page.cross_domain),
            "cross_domain": [mapping.cross_domain(u) for u in page.cross_domain],
        }
        reply = SnapshotReply(accelerators=views, next_cursor=page.next_cursor, **crossing)
        # A page must fit one NATS message, whatever limit was asked: keep halving and say where to go on.
        budget = int(self._max_payload() * 0.9)
        while len(views) > 1 and len(reply.model_dump_json()) > budget:
            views = views[: len(views) // 2]
            reply = SnapshotReply(accelerators=views, next_cursor=views[-1].id, **crossing)
        return reply
