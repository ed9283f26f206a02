"""A new replica's first lease (docs/PLACEMENT.md, "One durable step"). The ledger's commit is a placement's
only durable step on its critical path, so a caller whose answer was lost, and who never retries, would leave
the replica's accelerators held for the whole lease it asked for. A replica is therefore committed with a short
first lease (``HETSCHED_PLACEMENT_FIRST_LEASE_S``), and extended to the lease its caller asked for by the first
sign that someone uses it: the caller's first ``placement.renew``, or the first status report of an engine on
one of its nodes. ``FirstLeases`` keeps those replicas in memory (filled by the placements this process makes,
by the LEDGER events of every placement, and at start from ``placement.decisions.lease_s``) and extends one
off any request's critical path."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from services.placement.ledger_calls import ask_ledger
from services.placement.store import DecisionStore
from shared.contracts.base import ErrorCode, Rejected
from shared.contracts.ledger import LedgerRenewReply, LedgerRenewRequest
from shared.contracts.subjects import Rpc
from shared.infra.rpc import RpcClient
from shared.infra.uow import UnitOfWork, UnitOfWorkFactory


@dataclass(frozen=True, slots=True)
class FirstLease:
    """A replica on its first lease: whose, the lease asked for, and the nodes an engine may report from."""

    tenant: str
    lease_s: int
    nodes: frozenset[str]


class FirstLeases:
    """The replicas still on their first lease, and their extension to the lease asked for."""

    def __init__(self, *, store: DecisionStore, uow: UnitOfWorkFactory, rpc: RpcClient, log: logging.Logger) -> None:
        self._store = store
        self._uow = uow
        self._rpc = rpc
        self._log = log
        self._leases: dict[str, FirstLease] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def add(self, allocation_id: str, *, tenant: str, lease_s: int, nodes: Iterable[str]) -> None:
        self._leases[allocation_id] = FirstLease(tenant, lease_s, frozenset(nodes))

    def asked(self, allocation_id: str) -> int | None:
        """The lease asked for by a replica on its first lease, else None."""
        lease = self._leases.get(allocation_id)
        return lease.lease_s if lease is not None else None

    def forget(self, allocation_id: str) -> None:
        """Extended (a renew) or ended: no longer on its first lease."""
        self._leases.pop(allocation_id, None)

    async def load(self) -> None:
        """At start: the placed replicas whose first lease no one has extended yet."""
        rows = await self._uow.read(lambda session: self._store.first_leases(session=session))
        for allocation_id, tenant, lease_s, nodes in rows:
            self.add(allocation_id, tenant=tenant, lease_s=lease_s, nodes=nodes)

    def engine_reported(self, replica_id: str, node: str) -> None:
        """An engine reported for ``replica_id`` from ``node``: a replica on its first lease, reported from
        one of its own nodes, is extended to the lease asked for (in the background)."""
        lease = self._leases.get(replica_id)
        if lease is None or node not in lease.nodes:
            return
        del self._leases[replica_id]
        task = asyncio.get_running_loop().create_task(self._extend(replica_id, lease))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _extend(self, allocation_id: str, lease: FirstLease) -> None:
        renewed = await ask_ledger(
            self._rpc,
            Rpc.LEDGER_RENEW,
            LedgerRenewRequest(allocation_id=allocation_id, tenant=lease.tenant, lease_s=lease.lease_s),
            LedgerRenewReply,
        )
        if isinstance(renewed, Rejected) or renewed.status != "renewed" or renewed.lease_expires_at is None:
            # The ledger did not answer: the next report tries again. Refused: it ended meanwhile.
            if isinstance(renewed, Rejected) and renewed.error.code is ErrorCode.INTERNAL:
                self._leases.setdefault(allocation_id, lease)
            self._log.info("could not extend a replica's first lease", extra={"allocation_id": allocation_id})
            return
        ends = renewed.lease_expires_at

        async def work(uow: UnitOfWork) -> None:
            await self._store.lease_renewed(session=uow.session, allocation_id=allocation_id, lease_expires_at=ends)

        try:
            await self._uow.run_grouped(work)
        except Exception:  # the ledger holds the lease; the listing's lease end catches up on the next renew
            self._log.exception("could not record a replica's extended lease", extra={"allocation_id": allocation_id})
