"""What placement knows of reservations: a fold of the RESERVATION stream (every event carries its
reservation's whole state, so folding from the first sequence rebuilds it), and the rights it reads
when deciding for a tenant.

- ``withheld``: the accelerators a tenant's replica may not use: other tenants' reserved ones, except,
  for preemptible work, those a soft or spot reservation offers now.
- ``plan_reclaim``: an owner's replica fits nowhere it may go; would it fit if borrowers of its own
  reservations left, taken most recently lent first (LIFO)? The fewest such borrowers, and the decision.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from shared.domain.placement.types import Decision, FleetSnapshot
from shared.domain.reservations.model import Borrow, Preemption, Reservation
from shared.domain.reservations.rules import lifo


@dataclass(frozen=True, slots=True)
class Right:
    """One reserved accelerator: whose, under which policy, and whether it is offered now."""

    reservation_id: str
    owner: str
    policy: str
    offered: bool


class ReservationBook:
    """Active reservations by id, with an index by accelerator; ``apply`` takes each event's state."""

    def __init__(self) -> None:
        self._reservations: dict[str, Reservation] = {}
        self._rights: dict[str, Right] = {}
        self.version = 0  # bumped by every change (caches key on it)

    def apply(self, reservation: Reservation) -> bool:
        """Fold one event's reservation in; False when it is not newer than what the book holds."""
        held = self._reservations.get(reservation.id)
        if held is not None and held.version >= reservation.version:
            return False
        if held is not None:
            for acc in held.accelerators:
                self._rights.pop(acc, None)
        if reservation.active:
            self._reservations[reservation.id] = reservation
            for acc in reservation.accelerators:
                self._rights[acc] = Right(
                    reservation_id=reservation.id,
                    owner=reservation.tenant,
                    policy=reservation.policy,
                    offered=acc in reservation.offered,
                )
        else:
            # Kept as a tombstone (version only) so a late, older event does not bring it back.
            self._reservations[reservation.id] = reservation
        self.version += 1
        return True

    def get(self, reservation_id: str) -> Reservation | None:
        return self._reservations.get(reservation_id)

    @property
    def reservations(self) -> dict[str, Reservation]:
        """Every reservation the stream named, cancelled ones included."""
        return dict(self._reservations)

    def active(self) -> list[Reservation]:
        return [r for r in self._reservations.values() if r.active]

    def right(self, accelerator: str) -> Right | None:
        return self._rights.get(accelerator)

    @property
    def empty(self) -> bool:
        return not self._rights

    def withheld(self, tenant: str, *, preemptible: bool) -> frozenset[str]:
        """Accelerators reserved by another tenant that this tenant's replica may not use."""
        return frozenset(
            acc
            for acc, right in self._rights.items()
            if right.owner != tenant and not (preemptible and right.offered and right.policy != "hard")
        )

    def borrowed_from(self, tenant: str) -> list[tuple[Reservation, Borrow]]:
        """Borrowers on the tenant's lending reservations that nobody has told to leave yet, most recently
        lent first (over all of them): the order reclaim takes them in."""
        pairs = [
            (r, b)
            for r in self._reservations.values()
            if r.active and r.tenant == tenant and r.lends
            for b in lifo(r)
            if r.preemption(b.allocation_id) is None
        ]
        return sorted(pairs, key=lambda p: (p[1].lent_at, p[1].allocation_id), reverse=True)

    def leaving_for(self, tenant: str, request_id: str) -> list[tuple[Borrow, Preemption]]:
        """Borrowers told to leave to make room for this placement of the tenant's, still there."""
        return [
            (b, p)
            for r in self._reservations.values()
            if r.active and r.tenant == tenant
            for p in r.preemptions
            if p.request_id == request_id
            for b in (r.borrow(p.allocation_id),)
            if b is not None
        ]


def vacate(snapshot: FleetSnapshot, borrows: Iterable[Borrow]) -> FleetSnapshot:
    """``snapshot`` as if these borrowers' allocations had ended (their bytes given back)."""
    capacity = dict(snapshot.capacity)
    changed: set[str] = set()
    for borrow in borrows:
        for acc, nbytes in borrow.bytes.items():
            cap = capacity.get(acc)
            if cap is None:
                continue
            capacity[acc] = replace(cap, reserved=max(0, cap.reserved - nbytes), shared=False)
            changed.add(acc)
    if not changed:
        return snapshot
    return snapshot.evolve(capacity=capacity, changed=(frozenset(changed), frozenset(), frozenset()))


@dataclass(frozen=True, slots=True)
class ReclaimPlan:
    decision: Decision
    evict: tuple[tuple[Reservation, Borrow], ...]  # the borrowers whose accelerators the decision uses


def plan_reclaim(
    snapshot: FleetSnapshot,
    borrowed: list[tuple[Reservation, Borrow]],
    decide: Callable[[FleetSnapshot], Decision],
) -> ReclaimPlan | None:
    """The smallest LIFO prefix of ``borrowed`` (most recently lent first) whose leaving lets ``decide``
    place, found by bisection (leaving more never makes a fit impossible); of that prefix, the borrowers
    on the accelerators the decision chose are the ones to evict. None when even all leaving is not
    enough (or there is nobody to evict)."""
    if not borrowed:
        return None

    def attempt(k: int) -> Decision:
        return decide(vacate(snapshot, (b for _, b in borrowed[:k])))

    best = attempt(len(borrowed))
    if not best.placed:
        return None
    low, high = 1, len(borrowed)  # the answer is in [low, high]; high is known to place
    while low < high:
        mid = (low + high) // 2
        decision = attempt(mid)
        if decision.placed:
            high, best = mid, decision
        else:
            low = mid + 1
    chosen = set(best.accelerators) | (set(best.tpu.chips) if best.tpu is not None else set())
    evict = tuple((r, b) for r, b in borrowed[:high] if chosen & set(b.accelerators))
    if not evict:  # it fits without evicting anyone after all
        return None
    return ReclaimPlan(decision=best, evict=evict)
