"""What the filler follows: the GPUs it may reserve (TOPOLOGY events) and who uses each reserved GPU (LEDGER
events): the owner, a borrower, nobody. A change of use refreshes the reservations it touches (lent,
reclaimed, offered)."""

from __future__ import annotations

from collections.abc import Iterable

from services.reservation_filler.events import emit, event_name
from services.reservation_filler.store import ReservationStore
from shared.contracts.envelope import EventEnvelope
from shared.contracts.ledger import AllocationEvent
from shared.contracts.reservation import ReservationEventName
from shared.contracts.topology import NodeProfileEvent, NodeStateEvent
from shared.domain.fleet import AcceleratorId, cluster_key
from shared.domain.reservations import LendingPolicy, Slot, Use, refresh
from shared.infra.uow import UnitOfWork


class UseHandlers:
    def __init__(self, *, store: ReservationStore, policy: LendingPolicy) -> None:
        self._store = store
        self._policy = policy

    async def on_allocation_committed(self, *, uow: UnitOfWork, event: EventEnvelope, payload: AllocationEvent) -> None:
        """A replica's allocation: the owner's use or a borrower's on the reservations it touches."""
        use = Use(
            allocation_id=payload.allocation_id,
            tenant=payload.tenant,
            preemptible=payload.preemptible,
            bytes={s.accelerator_id: s.total_bytes for s in payload.shares},
            since=event.occurred_at,
        )
        reservations = await self._store.add_use(session=uow.session, use=use)
        if reservations:  # None: recorded before; empty: on no reservation's accelerators
            await self._touched(uow, reservations, allocation_id=use.allocation_id)

    async def on_allocation_ended(self, *, uow: UnitOfWork, event: EventEnvelope, payload: AllocationEvent) -> None:
        """Released or expired (a preempted borrower's included): the capacity comes back."""
        removed = await self._store.remove_use(session=uow.session, allocation_id=payload.allocation_id)
        if removed is None:
            return
        use, reservations = removed
        if not reservations:
            return
        reason = "expired" if event.type.endswith("expired") else "released"
        await self._touched(uow, reservations, allocation_id=use.allocation_id, reason=reason)

    async def _touched(
        self, uow: UnitOfWork, reservation_ids: Iterable[str], *, allocation_id: str, reason: str | None = None
    ) -> None:
        """Refresh the active reservations ``reservation_ids`` (locked in id order) after a change of use."""
        for reservation in await self._store.load_many(session=uow.session, ids=reservation_ids, lock=True):
            uses = await self._store.uses_on(session=uow.session, accelerators=reservation.accelerators)
            after = refresh(reservation, uses, now=uow.now, policy=self._policy)
            name = event_name(reservation, after, allocation_id)
            if name is None:
                continue
            await self._store.save(session=uow.session, reservation=after, now=uow.now)
            borrow = reservation.borrow(allocation_id) or after.borrow(allocation_id)
            why = reason
            if name is ReservationEventName.RECLAIMED and reservation.preemption(allocation_id) is not None:
                why = "preempted"
            emit(
                uow,
                name,
                after,
                accelerators=list(borrow.accelerators) if borrow is not None else [],
                allocation_id=allocation_id if borrow is not None else None,
                tenant=borrow.tenant if borrow is not None else None,
                reason=why,
            )

    async def on_node_profiled(self, *, uow: UnitOfWork, event: EventEnvelope, payload: NodeProfileEvent) -> None:
        profile = payload.profile
        cluster = cluster_key(profile.region, profile.cluster or "default")
        slots = [
            Slot(
                id=AcceleratorId.gpu(payload.node, a.index),
                node=payload.node,
                sku=a.sku,
                region=profile.region,
                cluster=cluster,
            )
            for a in profile.accelerators
        ]
        await self._store.set_node(session=uow.session, node=payload.node, slots=slots)

    async def on_node_removed(self, *, uow: UnitOfWork, event: EventEnvelope, payload: NodeStateEvent) -> None:
        """Gone from the fleet: no new reservation takes its GPUs (those reserved stay, with nothing on them)."""
        await self._store.set_node(session=uow.session, node=payload.node, slots=[])
