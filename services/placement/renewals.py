"""A replica's lease, renewed while its node agents report it (docs/PLACEMENT.md "Replica lifecycle").

Each ``replica_state`` report of a rank whose engine runs or is coming up (``starting``, ``loading``,
``ready``, ``draining``) and is fresh is a sign the replica is used: when less than half of its lease
(``HETSCHED_PLACEMENT_DEFAULT_LEASE_S``) is left, placement renews it as ``placement.renew`` does (the
ledger's renewal, then the lease end placement lists), off the report's path. An agent that stops
reporting (it died, its node went away) renews nothing: the lease lapses, the ledger expires the
allocation and placement ends the replica, as for any lease.

A replica still on its first lease is left to ``FirstLeases`` (its first report extends it to the lease
asked for). Before renewing, the lease end is read again from placement's records (a caller's own
``placement.renew`` may have moved it further), so a renewal never shortens a lease."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime

from pydantic import BaseModel
from sqlalchemy.ext.asyncio import AsyncSession

from services.placement.first_lease import FirstLeases
from services.placement.store import DecisionStore
from shared.contracts.placement import RenewReply, RenewRequest
from shared.domain.placement.lifecycle import renew_due
from shared.infra.clock import Clock
from shared.infra.uow import UnitOfWorkFactory


def _ms(at: datetime | None) -> float | None:
    return at.timestamp() * 1000 if at is not None else None


class Renewals:
    """Renews the leases of replicas whose ranks report. ``renew``: the ``placement.renew`` handler;
    ``lease_s``: the lease a renewal asks for."""

    def __init__(
        self,
        *,
        store: DecisionStore,
        uow: UnitOfWorkFactory,
        renew: Callable[[RenewRequest], Awaitable[BaseModel]],
        first_leases: FirstLeases,
        lease_s: int,
        clock: Clock,
        log: logging.Logger,
    ) -> None:
        self._store = store
        self._uow = uow
        self._renew = renew
        self._first_leases = first_leases
        self._lease_ms = lease_s * 1000
        self._lease_s = lease_s
        self._clock = clock
        self._log = log
        self._ends: dict[str, datetime | None] = {}  # replica -> its lease end as last seen
        self._busy: set[str] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def _due(self, end: datetime | None) -> bool:
        return renew_due(expires_at_ms=_ms(end), lease_ms=self._lease_ms, now_ms=self._clock().timestamp() * 1000)

    def reported(self, replica_id: str) -> None:
        """A rank of the replica reports a live engine: renew its lease in the background when it is due."""
        if replica_id in self._busy or self._first_leases.asked(replica_id) is not None:
            return
        if replica_id in self._ends and not self._due(self._ends[replica_id]):
            return
        self._busy.add(replica_id)
        task = asyncio.get_running_loop().create_task(self._renew_if_due(replica_id))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def forget(self, replica_id: str) -> None:
        self._ends.pop(replica_id, None)

    async def _renew_if_due(self, replica_id: str) -> None:
        try:

            async def read(session: AsyncSession) -> tuple[str, datetime | None] | None:
                return await self._store.lease_of(session=session, allocation_id=replica_id)

            held = await self._uow.read(read)
            if held is None:  # not placed (or no longer): nothing to renew
                self._ends.pop(replica_id, None)
                return
            tenant, end = held
            if not self._due(end):
                self._ends[replica_id] = end
                return
            reply = await self._renew(RenewRequest(allocation_id=replica_id, tenant=tenant, lease_s=self._lease_s))
            if isinstance(reply, RenewReply) and reply.status == "renewed":
                self._ends[replica_id] = reply.lease_expires_at
            else:  # refused (it ended meanwhile) or no answer: the next report tries again
                self._ends.pop(replica_id, None)
                self._log.info("could not renew a reporting replica's lease", extra={"allocation_id": replica_id})
        except Exception:
            self._log.exception("renewing a reporting replica's lease failed", extra={"allocation_id": replica_id})
        finally:
            self._busy.discard(replica_id)
