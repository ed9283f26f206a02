"""Quotas (``shared.domain.quotas``): a tenant's placed accelerators (``gpus_placed``, counted in
``Holdings`` from the placed decisions at start, the view's LEDGER feed and this process's commits in
flight) are checked before anything is recorded; a commit in flight is assumed in the view and held for
its tenant meanwhile, and confirmed or forgotten with it."""

from __future__ import annotations

from collections.abc import Mapping

from services.placement.deciding import View
from services.placement.mapping import placement_request_id
from services.placement.metrics import PlacementMetrics
from services.placement.store import DecisionStore
from shared.contracts.base import ErrorCode, Rejected, rejected
from shared.contracts.ledger import AllocationEvent, LedgerEventName
from shared.contracts.placement import PlaceRequest
from shared.domain.placement.view import AssumeKey, Crossing
from shared.domain.quotas import Holdings, Quota, QuotaExceeded, Quotas, exceeded
from shared.infra.uow import UnitOfWorkFactory


class QuotaTally:
    """Each tenant's placed accelerators (``holdings``), the commits in flight included, against its quotas."""

    def __init__(
        self, *, view: View, store: DecisionStore, uow: UnitOfWorkFactory, quotas: Quotas, metrics: PlacementMetrics
    ) -> None:
        self.quotas = quotas
        self.holdings = Holdings()
        self._view = view
        self._store = store
        self._uow = uow
        self._metrics = metrics

    async def start(self) -> None:
        """Count what each tenant's replicas hold from the placed decisions (the view's LEDGER feed and
        this process's commits keep the count from then on)."""
        placed = await self._uow.read(lambda session: self._store.placed_allocations(session=session))
        for allocation in placed:
            self.holdings.add(allocation.allocation_id, allocation.tenant, allocation.accelerators)

    def on_view_allocation(self, name: str, payload: AllocationEvent) -> None:
        """A LEDGER allocation event the view applied (every placement process sees every one): a replica
        placement committed counts for its tenant until it ends."""
        if payload.kind != "replica" or placement_request_id(payload.request_id) is None:
            return
        if name == LedgerEventName.ALLOCATION_COMMITTED:
            self.holdings.add(payload.allocation_id, payload.tenant, (s.accelerator_id for s in payload.shares))
        elif name in (LedgerEventName.ALLOCATION_RELEASED, LedgerEventName.ALLOCATION_EXPIRED):
            self.holdings.end(payload.allocation_id)

    def over(self, request: PlaceRequest, held: Mapping[str, int]) -> QuotaExceeded | None:
        """The tenant's ``gpus_placed`` quota, were it to hold ``held``'s accelerators as well."""
        tenant = request.tenant
        return exceeded(
            self.quotas,
            tenant,
            Quota.GPUS_PLACED,
            used=self.holdings.held(tenant),
            asked=self.holdings.adds(tenant, held),
        )

    def refuse(self, over: QuotaExceeded) -> Rejected:
        """``quota_exceeded``, naming the quota, its limit and the use now."""
        self._metrics.rejections.labels(ErrorCode.QUOTA_EXCEEDED).inc()
        return rejected(ErrorCode.QUOTA_EXCEEDED, over.message, **over.details())

    def assume(
        self, key: AssumeKey, held: Mapping[str, int], *, shared: bool = False, crossing: Crossing | None = None
    ) -> int:
        """The view assumes a commit in flight, and the tenant (``key[0]``) holds its accelerators meanwhile."""
        token = self._view.assume(key, held, shared=shared, crossing=crossing)
        self.holdings.hold(token, key[0], held)
        return token

    def forget(self, token: int) -> None:
        self._view.forget(token)
        self.holdings.forget(token)

    def confirm(self, token: int, allocation_id: str) -> None:
        self._view.confirm(token, allocation_id)
        self.holdings.confirm(token, allocation_id)
