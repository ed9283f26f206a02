"""The reconciler: no intent stays ``committing`` forever, and no HBM stays without an owner
(``shared.domain.placement.ownership``). It abandons intents no attempt touched within the grace period,
and releases placement's allocations in the ledger that no decision owns."""

from __future__ import annotations

import asyncio
import logging

from services.placement.attempts import Ownership
from services.placement.records import Turn
from services.placement.store import DecisionStore
from shared.contracts.ledger import LedgerReleaseReply, LedgerReleaseRequest
from shared.contracts.subjects import Rpc
from shared.domain.placement.ownership import is_stale, owns, stale_before
from shared.infra.clock import Clock
from shared.infra.rpc import RpcClient, RpcError
from shared.infra.uow import UnitOfWork, UnitOfWorkFactory

RECONCILE_BATCH = 500
"""Intents, and allocations, one pass looks at (the oldest first)."""


class Reconciler:
    """Abandons stuck intents and releases the allocations no decision owns."""

    def __init__(
        self,
        *,
        store: DecisionStore,
        uow: UnitOfWorkFactory,
        rpc: RpcClient,
        ownership: Ownership,
        clock: Clock,
        log: logging.Logger,
    ) -> None:
        self._store = store
        self._uow = uow
        self._rpc = rpc
        self._ownership = ownership
        self._clock = clock
        self._log = log

    async def run(self) -> None:
        """Forever: a pass every ``Ownership.reconcile_period_s``."""
        while True:
            await asyncio.sleep(self._ownership.reconcile_period_s)
            try:
                await self.reconcile_once()
            except Exception:
                self._log.exception("placement's reconciler failed; retrying")

    async def reconcile_once(self) -> list[str]:
        """One pass; the allocations it released."""
        grace_s = self._ownership.grace_s
        now = self._clock()
        stuck = await self._uow.read(
            lambda session: self._store.committing(
                session=session, touched_before=stale_before(now=now, grace_s=grace_s), limit=RECONCILE_BATCH
            )
        )
        for intent in stuck:
            if not is_stale(intent, now=now, grace_s=grace_s):
                continue
            turn = Turn(intent.tenant, intent.request_id, intent.attempt)

            async def abandon(uow: UnitOfWork, turn: Turn = turn) -> bool:
                return await self._store.abandon(session=uow.session, turn=turn, now=uow.now)

            if await self._uow.run(abandon):
                self._log.warning(
                    "abandoned a placement intent stuck in committing",
                    extra={"tenant": intent.tenant, "request_id": intent.request_id},
                )
        seen = await self._uow.read(
            lambda session: self._store.active_allocations(
                session=session, seen_before=stale_before(now=now, grace_s=grace_s), limit=RECONCILE_BATCH
            )
        )
        released: list[str] = []
        for allocation in seen:
            if owns(
                allocation.intent,
                allocation_id=allocation.allocation_id,
                seen_at=allocation.seen_at,
                now=now,
                grace_s=grace_s,
            ):
                continue
            try:
                reply = await self._rpc.ask(
                    Rpc.LEDGER_RELEASE,
                    LedgerReleaseRequest(allocation_id=allocation.allocation_id, tenant=allocation.tenant),
                    LedgerReleaseReply,
                )
            except RpcError as exc:
                self._log.warning("the reconciler could not release an allocation", extra={"error": exc.reason})
                continue
            if isinstance(reply, LedgerReleaseReply) and reply.status == "released":
                released.append(allocation.allocation_id)
                self._log.warning(
                    "released an allocation no placement decision owns",
                    extra={"allocation_id": allocation.allocation_id, "request_id": allocation.request_id},
                )
        return released
