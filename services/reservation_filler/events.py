"""The filler's RESERVATION events: each carries the reservation's whole state after a change (placement
folds them into its ``ReservationBook``), and says what changed."""

from __future__ import annotations

from shared.contracts.reservation import ReservationEvent, ReservationEventName
from shared.contracts.subjects import Context
from shared.domain.reservations import Preemption, Reservation
from shared.infra.reservations import state_of
from shared.infra.uow import UnitOfWork


def event_name(before: Reservation, after: Reservation, allocation_id: str | None) -> ReservationEventName | None:
    """What the change is, seen from ``allocation_id``'s event: it became a borrower (``lent``), it stopped
    being one (``reclaimed``), or only the offer (or other state) moved (``offered``); None: no change."""
    if after.version == before.version:
        return None
    if allocation_id is not None:
        was = before.borrow(allocation_id) is not None
        now = after.borrow(allocation_id) is not None
        if now and not was:
            return ReservationEventName.LENT
        if was and not now:
            return ReservationEventName.RECLAIMED
    return ReservationEventName.OFFERED


def emit(
    uow: UnitOfWork,
    name: ReservationEventName,
    reservation: Reservation,
    *,
    accelerators: list[str] | None = None,
    allocation_id: str | None = None,
    tenant: str | None = None,
    preemption: Preemption | None = None,
    reason: str | None = None,
) -> None:
    """Write one RESERVATION event with the transaction (``preemption``: about that borrower)."""
    if preemption is not None:
        borrow = reservation.borrow(preemption.allocation_id)
        accelerators = list(borrow.accelerators) if borrow is not None else []
        allocation_id, tenant = preemption.allocation_id, preemption.tenant
    payload = ReservationEvent(
        reservation=state_of(reservation),
        accelerators=accelerators or [],
        allocation_id=allocation_id,
        tenant=tenant,
        reservation_id=reservation.id,
        deadline_at=preemption.deadline_at if preemption is not None else None,
        reason=reason,
    )
    uow.emit(Context.RESERVATION, name, payload, tenant=tenant or reservation.tenant, correlation_id=reservation.id)
