"""Reservations between the wire and the domain: ``state_of`` (a ``Reservation`` as the ``ReservationState``
its events carry; the filler writes them) and ``reservation_of`` (back; placement folds them)."""

from __future__ import annotations

from shared.contracts.reservation_state import BackoffView, BorrowView, PreemptionView, ReservationState
from shared.domain.reservations import Backoff, Borrow, Preemption, Reservation


def state_of(reservation: Reservation) -> ReservationState:
    """The wire form of a reservation's whole state."""
    return ReservationState(
        reservation_id=reservation.id,
        tenant=reservation.tenant,
        policy=reservation.policy,
        sku=reservation.sku,
        region=reservation.region,
        accelerators=list(reservation.accelerators),
        spot_eviction_s=reservation.spot_eviction_s,
        created_at=reservation.created_at,
        state=reservation.state,
        offered=sorted(reservation.offered),
        borrowers=[
            BorrowView(
                allocation_id=b.allocation_id,
                tenant=b.tenant,
                accelerators=list(b.accelerators),
                bytes=dict(b.bytes),
                lent_at=b.lent_at,
            )
            for b in reservation.borrowers
        ],
        backoff=[
            BackoffView(accelerator=acc, until=b.until, strikes=b.strikes, last=b.last)
            for acc, b in sorted(reservation.backoff.items())
        ],
        preemptions=[preemption_view(p) for p in reservation.preemptions],
        version=reservation.version,
    )


def preemption_view(p: Preemption) -> PreemptionView:
    return PreemptionView(
        allocation_id=p.allocation_id,
        tenant=p.tenant,
        reservation_id=p.reservation_id,
        deadline_at=p.deadline_at,
        issued_at=p.issued_at,
        done=p.done,
        request_id=p.request_id,
    )


def reservation_of(state: ReservationState) -> Reservation:
    """The domain value of a wire state (what an event carries)."""
    return Reservation(
        id=state.reservation_id,
        tenant=state.tenant,
        policy=state.policy,
        accelerators=tuple(state.accelerators),
        created_at=state.created_at,
        sku=state.sku,
        region=state.region,
        spot_eviction_s=state.spot_eviction_s,
        state=state.state,
        offered=frozenset(state.offered),
        borrowers=tuple(
            Borrow(
                allocation_id=b.allocation_id,
                tenant=b.tenant,
                accelerators=tuple(b.accelerators),
                bytes=dict(b.bytes),
                lent_at=b.lent_at,
            )
            for b in state.borrowers
        ),
        backoff={b.accelerator: Backoff(until=b.until, strikes=b.strikes, last=b.last) for b in state.backoff},
        preemptions=tuple(
            Preemption(
                allocation_id=p.allocation_id,
                tenant=p.tenant,
                reservation_id=p.reservation_id,
                deadline_at=p.deadline_at,
                issued_at=p.issued_at,
                done=p.done,
                request_id=p.request_id,
            )
            for p in state.preemptions
        ),
        version=state.version,
    )
