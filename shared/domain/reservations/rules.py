"""The reservation filler's rules, as pure functions over ``Reservation`` values (``now`` is a parameter).

- ``choose``: which accelerators a ``count`` + ``sku`` + ``region`` reservation takes.
- ``refresh``: a reservation after the ledger's allocations moved: its borrowers (LIFO order kept by
  ``lent_at``), its usage and fill rate, and which idle accelerators are offered to borrowers.
- ``reclaim``: the owner wants capacity back: preempt borrowers (soft: now; spot: after the notice),
  back off the accelerators so they are not lent again at once.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from shared.domain.reservations.model import (
    Backoff,
    Borrow,
    LendingPolicy,
    Preemption,
    Reservation,
    Usage,
    Use,
)


@dataclass(frozen=True, slots=True)
class Slot:
    """An accelerator the filler may reserve, as it learns it from the topology."""

    id: str
    node: str
    sku: str
    region: str
    cluster: str


def free_slots(
    inventory: Iterable[Slot], *, sku: str, region: str, taken: Collection[str], used_by_others: Collection[str]
) -> list[Slot]:
    """The accelerators of ``sku`` in ``region`` that no reservation holds and no other tenant uses."""
    return [
        s for s in inventory if s.sku == sku and s.region == region and s.id not in taken and s.id not in used_by_others
    ]


def choose(
    inventory: Iterable[Slot],
    *,
    count: int,
    sku: str,
    region: str,
    taken: Collection[str],
    used_by_others: Collection[str],
) -> tuple[str, ...] | None:
    """``count`` accelerators of ``sku`` in ``region`` that no reservation holds and no other tenant
    uses, whole nodes first (an owner's TP groups stay inside one node's NVLink domain), then the nodes
    with the most such accelerators; None when there are not enough."""
    by_node: dict[str, list[Slot]] = {}
    for slot in free_slots(inventory, sku=sku, region=region, taken=taken, used_by_others=used_by_others):
        by_node.setdefault(slot.node, []).append(slot)
    if sum(len(slots) for slots in by_node.values()) < count:
        return None
    chosen: list[str] = []
    # Fewest left over first: a node we can take whole before one we would split.
    for node in sorted(by_node, key=lambda n: (-len(by_node[n]), n)):
        slots = sorted(by_node[node], key=lambda s: s.id)
        need = count - len(chosen)
        if need <= 0:
            break
        if len(slots) <= need:
            chosen += [s.id for s in slots]
    if len(chosen) < count:  # the remainder from the smallest node that can give it whole, else any
        left = {n: [s for s in sorted(by_node[n], key=lambda s: s.id) if s.id not in chosen] for n in by_node}
        for node in sorted(left, key=lambda n: (len(left[n]) < count - len(chosen), len(left[n]), n)):
            need = count - len(chosen)
            if need <= 0:
                break
            chosen += [s.id for s in left[node][:need]]
    return tuple(chosen[:count])


def usage(reservation: Reservation, uses: Iterable[Use]) -> Usage:
    """Which of the reservation's accelerators the owner uses, borrowers use, or nobody uses."""
    mine = set(reservation.accelerators)
    owner: set[str] = set()
    others: set[str] = set()
    for use in uses:
        on = use.accelerators & mine
        if not on:
            continue
        (owner if use.tenant == reservation.tenant else others).update(on)
    lent = others - owner
    return Usage(owner_used=frozenset(owner), lent=frozenset(lent), idle=frozenset(mine - owner - lent))


def _bump(reservation: Reservation, **changes: object) -> Reservation:
    after = replace(reservation, **changes)  # type: ignore[arg-type]
    return after if after == reservation else replace(after, version=reservation.version + 1)


def refresh(reservation: Reservation, uses: Iterable[Use], *, now: datetime, policy: LendingPolicy) -> Reservation:
    """The reservation after the allocations on its accelerators are ``uses``: its borrowers (a borrower
    keeps its ``lent_at``; a new one is lent at its allocation's start), the preemptions still owed (a
    done one is forgotten once its allocation is gone), and its offer: while the owner fills less than
    ``policy.fill_target`` of a lending reservation, every idle accelerator not backing off is open to
    other tenants' preemptible work; otherwise none is. Backoff whose wait ended ``backoff_max_s`` ago is forgotten."""
    uses = list(uses)
    if not reservation.active:
        return reservation
    mine = set(reservation.accelerators)
    before = {b.allocation_id: b for b in reservation.borrowers}
    borrowers: list[Borrow] = []
    live: set[str] = set()
    for use in uses:
        on = use.accelerators & mine
        if not on:
            continue
        live.add(use.allocation_id)
        if use.tenant == reservation.tenant:
            continue
        old = before.get(use.allocation_id)
        borrowers.append(
            Borrow(
                allocation_id=use.allocation_id,
                tenant=use.tenant,
                accelerators=tuple(sorted(on)),
                bytes={acc: use.bytes[acc] for acc in sorted(on)},
                lent_at=old.lent_at if old is not None else use.since,
            )
        )
    borrowers.sort(key=lambda b: (b.lent_at, b.allocation_id))
    preemptions = tuple(p for p in reservation.preemptions if p.allocation_id in live)
    backoff = {
        acc: b for acc, b in reservation.backoff.items() if now - b.until < timedelta(seconds=policy.backoff_max_s)
    }
    current = usage(reservation, uses)
    offered: frozenset[str] = frozenset()
    if reservation.lends and current.owner_fill < policy.fill_target:
        offered = frozenset(acc for acc in current.idle if acc not in backoff or backoff[acc].until <= now)
    return _bump(reservation, borrowers=tuple(borrowers), preemptions=preemptions, backoff=backoff, offered=offered)


def lifo(reservation: Reservation) -> list[Borrow]:
    """Its borrowers, the most recently lent first: the order reclaim takes them in."""
    return sorted(reservation.borrowers, key=lambda b: (b.lent_at, b.allocation_id), reverse=True)


def reclaim(
    reservation: Reservation,
    allocation_ids: Sequence[str],
    *,
    now: datetime,
    policy: LendingPolicy,
    request_id: str | None = None,
) -> tuple[Reservation, list[Preemption]]:
    """Preempt these borrowers of the reservation for its owner: each gets a deadline (now for ``soft``,
    ``spot_eviction_s`` from now for ``spot``), a preemption already issued is returned as it was, and
    every accelerator they hold stops being offered and backs off (``LendingPolicy``). Ids that are not
    borrowers of this reservation are ignored (the caller checks). ``request_id``: the owner's placement
    the room is for (a retry of it counts these borrowers as leaving instead of evicting more)."""
    deadline = now
    if reservation.policy == "spot":
        deadline = now + timedelta(seconds=reservation.spot_eviction_s)
    preemptions = list(reservation.preemptions)
    backoff = dict(reservation.backoff)
    issued: list[Preemption] = []
    offered = set(reservation.offered)
    for allocation_id in dict.fromkeys(allocation_ids):
        borrow = reservation.borrow(allocation_id)
        if borrow is None:
            continue
        existing = reservation.preemption(allocation_id)
        if existing is not None:
            issued.append(existing)
            continue
        preemption = Preemption(
            allocation_id=allocation_id,
            tenant=borrow.tenant,
            reservation_id=reservation.id,
            deadline_at=deadline,
            issued_at=now,
            request_id=request_id,
        )
        preemptions.append(preemption)
        issued.append(preemption)
        for acc in borrow.accelerators:  # from when it is free again: not lent at the moment the owner takes it
            backoff[acc] = next_backoff(backoff.get(acc), now=deadline, policy=policy)
            offered.discard(acc)
    after = _bump(reservation, preemptions=tuple(preemptions), backoff=backoff, offered=frozenset(offered))
    return after, issued


def next_backoff(previous: Backoff | None, *, now: datetime, policy: LendingPolicy) -> Backoff:
    """An accelerator freed from a borrower at ``now``: one strike more when its last wait ended less than
    ``backoff_max_s`` ago, and a wait of ``backoff_s * factor^(strikes-1)``, at most ``backoff_max_s``."""
    strikes = 1
    # Quiet is measured from the end of the last wait (the GPU could only be lent again then): an owner
    # oscillating for hours stays at the cap instead of cycling back to the first, short wait.
    if previous is not None and now - previous.until < timedelta(seconds=policy.backoff_max_s):
        strikes = previous.strikes + 1
    wait = min(policy.backoff_max_s, policy.backoff_s * policy.factor ** (strikes - 1))
    return Backoff(until=now + timedelta(seconds=wait), strikes=strikes, last=now)


def preemption_done(reservation: Reservation, allocation_id: str) -> Reservation:
    """The ledger acknowledged the preemption of ``allocation_id``."""
    preemptions = tuple(
        replace(p, done=True) if p.allocation_id == allocation_id else p for p in reservation.preemptions
    )
    return _bump(reservation, preemptions=preemptions)


def cancel(reservation: Reservation) -> Reservation:
    """Cancelled: nothing is offered any more; borrowers already there run on (the capacity is no
    longer anyone's reservation)."""
    return _bump(reservation, state="cancelled", offered=frozenset(), preemptions=())


def idle_cost_usd_per_hour(current: Usage, price_usd_per_hour: float | None) -> float:
    """The brief (S1 §8.3): an idle reserved card costs its hourly price (idle draws ~80% of full power)."""
    return len(current.idle) * (price_usd_per_hour or 0.0)
