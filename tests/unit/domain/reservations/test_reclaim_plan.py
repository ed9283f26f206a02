"""``plan_reclaim`` with real placement: an owner's replica fits nowhere it may go (``withhold``); would it
fit if its borrowers left (``vacate``), most recently lent first? The fewest such borrowers, and only
those on the accelerators the decision chose."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import UTC, datetime, timedelta

import pytest

from shared.domain.placement import Decision, FleetSnapshot
from shared.domain.placement.decide import decide
from shared.domain.placement.withhold import withhold
from shared.domain.reservations import (
    Borrow,
    LendingPolicy,
    Policy,
    Reservation,
    ReservationBook,
    Use,
    plan_reclaim,
    refresh,
    vacate,
)
from tests.unit.placement.builders import node, request, snapshot

T0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
GB = 10**9
HELD = 10 * GB  # what each allocation holds per GPU


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def gpus(name: str, *indexes: int) -> tuple[str, ...]:
    return tuple(f"{name}/gpu{i}" for i in indexes)


def alloc(allocation_id: str, tenant: str, accelerators: Iterable[str], since_s: float) -> Use:
    return Use(allocation_id, tenant, tenant != "acme", {a: HELD for a in accelerators}, at(since_s))


def world(uses: list[Use], *, nodes: Iterable[str] = ("n1",)) -> FleetSnapshot:
    """8-GPU NVSwitch H100 nodes whose GPUs hold what ``uses`` say (each an exclusive replica)."""
    builders = {name: node(name).nvswitch(8) for name in nodes}
    for u in uses:
        for acc, nbytes in u.bytes.items():
            name, gpu = acc.split("/gpu")
            builders[name].reserve(int(gpu), builders[name].reserved.get(int(gpu), 0) + nbytes)
    return snapshot(*builders.values())


def book_of(uses: list[Use], *reservations: tuple[str, str, Policy, tuple[str, ...]]) -> ReservationBook:
    book = ReservationBook()
    for rid, tenant, policy, accelerators in reservations:
        r = Reservation(rid, tenant, policy, accelerators, T0)
        book.apply(refresh(r, uses, now=at(100), policy=LendingPolicy()))
    return book


def owner_decide(tp: int) -> Callable[[FleetSnapshot], Decision]:
    """acme's replica of llama3-8b at TP=``tp`` (exclusive: it takes idle GPUs only)."""
    ask = request(tenant="acme", tp=tp)
    return lambda snap: decide(snap, ask)


@pytest.mark.parametrize(
    ("old", "new", "tp", "evicted"),
    [
        # acme runs on gpu0-1; the older borrower on gpu2-3, the newer on gpu4-7. TP=4 needs 4 idle GPUs:
        # the newer leaving frees exactly 4, so only it goes.
        (gpus("n1", 2, 3), gpus("n1", 4, 5, 6, 7), 4, {"new"}),
        # The newer holds only 2: it leaving is not enough, so the older must go too (LIFO prefix of 2);
        # TP=4 on gpu2-7 uses at least 2 of the older's 4, so the older is always among the evicted.
        (gpus("n1", 2, 3, 4, 5), gpus("n1", 6, 7), 4, None),
        # TP=2: the newer's 2 GPUs are enough; the older stays.
        (gpus("n1", 2, 3, 4, 5), gpus("n1", 6, 7), 2, {"new"}),
    ],
    ids=["newest-alone-suffices", "newest-then-older", "small-newest-suffices"],
)
def test_plan_evicts_the_newest_borrowers_that_make_room(
    old: tuple[str, ...], new: tuple[str, ...], tp: int, evicted: set[str] | None
) -> None:
    uses = [
        alloc("own", "acme", gpus("n1", 0, 1), 0),
        alloc("old", "globex", old, 10),
        alloc("new", "initech", new, 20),
    ]
    snap = world(uses)
    book = book_of(uses, ("r1", "acme", "soft", gpus("n1", *range(8))))
    borrowed = book.borrowed_from("acme")
    assert [b.allocation_id for _, b in borrowed] == ["new", "old"]
    fits = owner_decide(tp)
    assert not fits(snap).placed  # the precondition: the owner's replica fits nowhere as things are

    plan = plan_reclaim(snap, borrowed, fits)
    assert plan is not None and plan.decision.placed
    names = {b.allocation_id for _, b in plan.evict}
    if evicted is not None:
        assert names == evicted
    else:
        assert "old" in names and names <= {"old", "new"}
    # The decision runs only where acme runs nothing and only evicted borrowers ran.
    freed = {a for _, b in plan.evict for a in b.accelerators}
    assert set(plan.decision.accelerators) <= freed
    assert len(plan.decision.accelerators) == tp
    # ... and it is a decision on the snapshot with exactly those gone.
    after = vacate(snap, (b for _, b in plan.evict))
    assert fits(after).placed


def test_plan_is_none_when_nothing_is_lent() -> None:
    uses = [alloc("own", "acme", gpus("n1", *range(8)), 0)]
    snap = world(uses)
    book = book_of(uses, ("r1", "acme", "soft", gpus("n1", *range(8))))
    assert book.borrowed_from("acme") == []
    assert plan_reclaim(snap, book.borrowed_from("acme"), owner_decide(4)) is None


def test_plan_is_none_when_even_evicting_all_is_not_enough() -> None:
    """acme holds gpu0-1 itself: evicting both borrowers frees 6, and TP=8 needs 8."""
    uses = [
        alloc("own", "acme", gpus("n1", 0, 1), 0),
        alloc("old", "globex", gpus("n1", 2, 3), 10),
        alloc("new", "initech", gpus("n1", 4, 5, 6, 7), 20),
    ]
    book = book_of(uses, ("r1", "acme", "soft", gpus("n1", *range(8))))
    assert len(book.borrowed_from("acme")) == 2
    assert plan_reclaim(world(uses), book.borrowed_from("acme"), owner_decide(8)) is None


def test_withheld_capacity_is_not_a_way_out_and_the_plan_reclaims_instead() -> None:
    """n2 is initech's hard reservation, idle: acme's TP=4 replica would fit there, but acme may not use
    it (``withhold``), so the plan reclaims acme's own newest borrower on n1."""
    uses = [
        alloc("own", "acme", gpus("n1", 0, 1, 2, 3), 0),
        alloc("new", "globex", gpus("n1", 4, 5, 6, 7), 20),
    ]
    snap = world(uses, nodes=("n1", "n2"))
    book = book_of(
        uses,
        ("r1", "acme", "spot", gpus("n1", *range(8))),
        ("r2", "initech", "hard", gpus("n2", *range(8))),
    )
    fits = owner_decide(4)
    assert fits(snap).placed and fits(snap).node == "n2"
    mine = withhold(snap, book.withheld("acme", preemptible=False))
    assert all(not mine.capacity[a].available for a in gpus("n2", *range(8)))
    assert not fits(mine).placed
    plan = plan_reclaim(mine, book.borrowed_from("acme"), fits)
    assert plan is not None
    assert [b.allocation_id for _, b in plan.evict] == ["new"]
    assert set(plan.decision.accelerators) == set(gpus("n1", 4, 5, 6, 7))


def test_withhold_and_vacate_change_only_what_they_name() -> None:
    uses = [alloc("b", "globex", gpus("n1", 6, 7), 0)]
    snap = world(uses)
    assert withhold(snap, []) is snap
    assert withhold(snap, ["elsewhere/gpu0"]) is snap
    held = withhold(snap, gpus("n1", 0))
    assert not held.capacity["n1/gpu0"].available
    assert all(held.capacity[a] == snap.capacity[a] for a in gpus("n1", *range(1, 8)))
    assert withhold(held, gpus("n1", 0)) is held  # already unavailable

    borrow = Borrow("b", "globex", gpus("n1", 6, 7), {a: HELD for a in gpus("n1", 6, 7)}, T0)
    assert snap.capacity["n1/gpu6"].reserved == HELD
    empty = vacate(snap, [borrow])
    assert empty.capacity["n1/gpu6"].reserved == 0 and empty.capacity["n1/gpu7"].idle
    assert all(empty.capacity[a] == snap.capacity[a] for a in gpus("n1", *range(6)))
    assert vacate(snap, []) is snap
