"""Lending and reclaiming one reservation on a fake clock (issue 15): an owner reserves 100 GPUs, its use
goes 100 -> 60 -> 100; the 40 it leaves idle are offered, borrowers take them, and the owner's return
evicts them most recently lent first, at once (soft) or after the notice (spot). Also: a hard
reservation never lends, and whose work may use which reserved accelerator (``ReservationBook.withheld``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

import pytest

from shared.domain.reservations import (
    Borrow,
    LendingPolicy,
    Policy,
    Reservation,
    ReservationBook,
    Use,
    lifo,
    preemption_done,
    reclaim,
    refresh,
    usage,
)

T0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
GB = 10**9
OWNER = "acme"
POLICY = LendingPolicy()
ACCS = tuple(f"n{i // 8:02d}/gpu{i % 8}" for i in range(100))  # 12.5 eight-GPU nodes


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def use(allocation_id: str, tenant: str, accelerators: Iterable[str], since: datetime) -> Use:
    """An allocation of 1 GB on each accelerator; other tenants' work is preemptible (it borrows)."""
    return Use(allocation_id, tenant, tenant != OWNER, {a: GB for a in accelerators}, since)


def reservation(policy: Policy, accelerators: tuple[str, ...] = ACCS, *, spot_eviction_s: int = 30) -> Reservation:
    return Reservation(
        id=f"res-{policy}",
        tenant=OWNER,
        policy=policy,
        accelerators=accelerators,
        created_at=T0,
        spot_eviction_s=spot_eviction_s,
    )


@dataclass
class Filler:
    """Drives one reservation as the filler would: the ledger's live allocations (``world``) change,
    then ``observe`` refreshes the reservation and checks what must hold after every step."""

    reservation: Reservation
    world: dict[str, Use] = field(default_factory=dict)
    fills_while_lent: list[float] = field(default_factory=list)

    def observe(self, now: datetime) -> Reservation:
        before = self.reservation
        after = refresh(before, self.world.values(), now=now, policy=POLICY)
        self.check(before, after)
        self.reservation = after
        current = usage(after, self.world.values())
        if after.borrowers:
            self.fills_while_lent.append(current.fill_rate)
        return after

    def check(self, before: Reservation, after: Reservation) -> None:
        current = usage(after, self.world.values())
        # No accelerator is both the owner's and lent: neither in the usage nor in the ledger.
        assert not current.owner_used & current.lent
        for borrow in after.borrowers:
            assert not set(borrow.accelerators) & current.owner_used, borrow
        assert after.offered <= current.idle
        assert after.version >= before.version
        assert (after == before) == (after.version == before.version)

    def reclaim(self, ids: list[str], now: datetime) -> list[str]:
        before = self.reservation
        self.reservation, issued = reclaim(before, ids, now=now, policy=POLICY)
        self.check(before, self.reservation)
        return [p.allocation_id for p in issued]


def lifo_prefix(reservation: Reservation, need: int) -> list[str]:
    """The fewest borrowers, most recently lent first, whose leaving frees ``need`` accelerators."""
    ids: list[str] = []
    freed = 0
    for borrow in lifo(reservation):
        if freed >= need:
            break
        if reservation.preemption(borrow.allocation_id) is None:
            ids.append(borrow.allocation_id)
            freed += len(borrow.accelerators)
    assert freed >= need, "not enough lent to reclaim"
    return ids


@pytest.mark.parametrize(
    ("policy", "spot_eviction_s", "notice_s"),
    [("soft", 30, 0), ("spot", 5, 5), ("spot", 30, 30)],
    ids=["soft", "spot-5s", "spot-30s"],
)
def test_owner_100_60_100_lends_the_idle_40_and_takes_them_back_lifo(
    policy: Policy, spot_eviction_s: int, notice_s: int
) -> None:
    """100 -> 60: the 40 idle are offered (owner fill 0.6 < 0.85) and three borrowers take 25, 10 and 5
    of them at t=70, 80, 90 (fill 0.85, 0.95, 1.0). 60 -> 100 as two owner replicas: one needs 15 at
    t=120 (the newest two, 5 + 10, leave; the oldest stays), one needs 25 at t=200 (the oldest leaves).
    Each preemption's deadline is ``notice_s`` after it was issued, and the owner runs on the freed
    accelerators exactly then: never on one a borrower still holds."""
    filler = Filler(reservation(policy, spot_eviction_s=spot_eviction_s))
    filler.world["own-100"] = use("own-100", OWNER, ACCS, T0)
    r = filler.observe(T0)
    assert r.offered == frozenset()
    assert usage(r, filler.world.values()).fill_rate == 1.0

    # 100 -> 60: the owner gives back its last 40.
    del filler.world["own-100"]
    filler.world["own-60"] = use("own-60", OWNER, ACCS[:60], at(60))
    r = filler.observe(at(60))
    assert r.offered == frozenset(ACCS[60:])
    assert usage(r, filler.world.values()).owner_fill == 0.6

    # Borrowers take what is offered, at increasing times.
    for name, count, t in (("b0", 25, 70), ("b1", 10, 80), ("b2", 5, 90)):
        taken = sorted(filler.reservation.offered)[:count]
        assert len(taken) == count
        filler.world[name] = use(name, f"tenant-{name}", taken, at(t))
        r = filler.observe(at(t))
        borrow = r.borrow(name)
        assert borrow is not None and borrow.lent_at == at(t) and set(borrow.accelerators) == set(taken)
        assert not r.offered & set(taken)
    assert usage(r, filler.world.values()).fill_rate == 1.0  # (60 owner + 40 lent) / 100
    assert r.offered == frozenset()
    assert [b.allocation_id for b in lifo(r)] == ["b2", "b1", "b0"]
    # A later refresh keeps each borrower's lent_at (the LIFO order does not drift).
    r = filler.observe(at(100))
    assert [(b.allocation_id, b.lent_at) for b in lifo(r)] == [("b2", at(90)), ("b1", at(80)), ("b0", at(70))]

    owner_replicas = [(120, 15, ["b2", "b1"]), (200, 25, ["b0"])]
    for n, (t, need, newest) in enumerate(owner_replicas):
        now = at(t)
        ids = lifo_prefix(filler.reservation, need)
        assert ids == newest  # the most recently lent; older borrowers stay
        issued = filler.reclaim(ids, now)
        assert issued == ids
        r = filler.reservation
        freed = {a for i in ids for a in r.borrow(i).accelerators}  # type: ignore[union-attr]
        for i in ids:
            p = r.preemption(i)
            assert p is not None and not p.done
            assert p.issued_at == now
            assert p.deadline_at - p.issued_at == timedelta(seconds=notice_s)
            assert p.tenant == f"tenant-{i}" and p.reservation_id == r.id
        assert not r.offered & freed
        assert all(r.backoff[a].until > now for a in freed)
        # Asking again (e.g. the filler restarted) re-issues the same preemptions and changes nothing.
        again, same = reclaim(r, ids, now=now + timedelta(seconds=1), policy=POLICY)
        assert again == r and same == [r.preemption(i) for i in ids]

        deadline = now + timedelta(seconds=notice_s)
        if notice_s:
            # During the notice the borrowers run on; the owner waits.
            r = filler.observe(now + timedelta(seconds=notice_s / 2))
            assert {b.allocation_id for b in r.borrowers} >= set(ids)
            assert all(r.preemption(i) is not None for i in ids)
        # At the deadline the ledger frees the borrowers and acknowledges.
        for i in ids:
            del filler.world[i]
            filler.reservation = preemption_done(filler.reservation, i)
            assert filler.reservation.preemption(i).done  # type: ignore[union-attr]
        r = filler.observe(deadline)
        assert r.preemptions == ()  # done and gone: forgotten
        assert not {b.allocation_id for b in r.borrowers} & set(ids)
        assert freed <= usage(r, filler.world.values()).idle
        # The owner takes them at the deadline, not later (that they are not offered to borrowers
        # meanwhile is test_freed_accelerators_are_not_offered_when_the_notice_ends).
        filler.world[f"own-back-{n}"] = use(f"own-back-{n}", OWNER, sorted(freed), deadline)
        r = filler.observe(deadline)
        assert freed <= usage(r, filler.world.values()).owner_used

    final = usage(filler.reservation, filler.world.values())
    assert len(final.owner_used) == 100 and not final.lent and not final.idle
    assert filler.reservation.borrowers == () and filler.reservation.offered == frozenset()
    assert filler.fills_while_lent and min(filler.fills_while_lent) >= POLICY.fill_target


@pytest.mark.parametrize(
    ("policy", "spot_eviction_s"),
    [
        ("soft", 30),
        ("spot", 5),
        ("spot", 29),
        ("spot", 30),
    ],
)
def test_freed_accelerators_are_not_offered_when_the_notice_ends(policy: Policy, spot_eviction_s: int) -> None:
    """A borrower reclaimed from an owner at 60% fill: when its notice ends and the ledger frees it, its
    accelerators are idle and the owner still fills < 0.85, yet they back off (first strike: 30 s) and
    are not lent again at once: the owner, who asked for them, takes them."""
    world = [use("own", OWNER, ACCS[:60], T0), use("b", "globex", ACCS[60:], at(10))]
    r = refresh(reservation(policy, spot_eviction_s=spot_eviction_s), world, now=at(10), policy=POLICY)
    r, (preemption,) = reclaim(r, ["b"], now=at(20), policy=POLICY)
    r = preemption_done(r, "b")
    r = refresh(r, world[:1], now=preemption.deadline_at, policy=POLICY)
    assert r.preemptions == () and not r.borrowers
    assert r.offered == frozenset()


@pytest.mark.parametrize(
    ("owner_count", "offered_count"),
    [
        (100, 0),
        (86, 0),
        (85, 0),  # 0.85 is not under the target
        (84, 16),
        (60, 40),
        (0, 100),
    ],
)
def test_lending_starts_under_the_fill_target(owner_count: int, offered_count: int) -> None:
    """A lending reservation offers every idle accelerator while the owner fills < 0.85, none otherwise."""
    uses = [use("own", OWNER, ACCS[:owner_count], T0)] if owner_count else []
    r = refresh(reservation("soft"), uses, now=T0, policy=POLICY)
    assert len(r.offered) == offered_count
    assert r.offered == (frozenset(ACCS[owner_count:]) if offered_count else frozenset())


@pytest.mark.parametrize("owner_count", [0, 1, 30, 60, 84, 100])
@pytest.mark.parametrize("borrowed", [0, 10])
def test_hard_reservation_is_never_offered(owner_count: int, borrowed: int) -> None:
    """Whatever the owner uses (even nothing) and even with foreign work on it, hard offers nothing."""
    uses = [use("own", OWNER, ACCS[:owner_count], T0)] if owner_count else []
    if borrowed:
        uses.append(use("x", "globex", ACCS[-borrowed:], T0))
    r = reservation("hard")
    for step in range(3):
        r = refresh(r, uses, now=at(step * 60), policy=POLICY)
        assert r.offered == frozenset()
    assert not r.lends


def _res(rid: str, tenant: str, policy: Policy, accelerators: tuple[str, ...], offered: Iterable[str]) -> Reservation:
    return Reservation(
        id=rid,
        tenant=tenant,
        policy=policy,
        accelerators=accelerators,
        created_at=T0,
        offered=frozenset(offered),
    )


HARD = ("h/gpu0", "h/gpu1")
SOFT = ("s/gpu0", "s/gpu1")
SPOT = ("p/gpu0", "p/gpu1")
OTHER = ("o/gpu0",)


@pytest.fixture
def book() -> ReservationBook:
    """acme reserves hard, soft and spot pairs and offers gpu1 of each (hard's offer is a corrupt state
    that must not matter); initech reserves one accelerator, offered nowhere."""
    book = ReservationBook()
    for r in (
        _res("r-hard", "acme", "hard", HARD, ["h/gpu1"]),
        _res("r-soft", "acme", "soft", SOFT, ["s/gpu1"]),
        _res("r-spot", "acme", "spot", SPOT, ["p/gpu1"]),
        _res("r-other", "initech", "soft", OTHER, []),
    ):
        assert book.apply(r)
    return book


@pytest.mark.parametrize(
    ("tenant", "preemptible", "withheld"),
    [
        # Another tenant's preemptible work may use soft/spot accelerators on offer, nothing else.
        ("globex", True, {*HARD, "s/gpu0", "p/gpu0", *OTHER}),
        # Non-preemptible work never uses reserved capacity of others.
        ("globex", False, {*HARD, *SOFT, *SPOT, *OTHER}),
        # The owner always uses its own; initech's are still withheld from it.
        ("acme", False, {*OTHER}),
        ("acme", True, {*OTHER}),
        ("initech", False, {*HARD, *SOFT, *SPOT}),
        ("initech", True, {*HARD, "s/gpu0", "p/gpu0"}),
    ],
)
def test_withheld(book: ReservationBook, tenant: str, preemptible: bool, withheld: set[str]) -> None:
    assert book.withheld(tenant, preemptible=preemptible) == frozenset(withheld)


def test_borrowed_from_lists_the_owners_borrowers_newest_first_over_reservations() -> None:
    """Across a tenant's lending reservations, newest first; a borrower already told to leave is not
    offered for eviction again (it is `leaving_for` the placement it makes room for); a hard reservation
    and another tenant's reservations are not the owner's to reclaim."""

    def borrow(i: str, t: float, acc: str) -> Borrow:
        return Borrow(i, "globex", (acc,), {acc: GB}, at(t))

    soft = _res("r-soft", "acme", "soft", SOFT, [])
    spot = _res("r-spot", "acme", "spot", SPOT, [])
    soft = replace(soft, borrowers=(borrow("a", 10, SOFT[0]), borrow("c", 30, SOFT[1])))
    spot = replace(spot, borrowers=(borrow("b", 20, SPOT[0]), borrow("d", 40, SPOT[1])))
    spot, _ = reclaim(spot, ["d"], now=at(50), policy=POLICY, request_id="acme-7")
    other = replace(_res("r-o", "initech", "soft", OTHER, []), borrowers=(borrow("e", 99, OTHER[0]),))
    book = ReservationBook()
    for r in (soft, spot, other):
        book.apply(r)
    # "d" is preempted for acme-7: still there, counted as leaving for that placement only.
    assert [b.allocation_id for _, b in book.borrowed_from("acme")] == ["c", "b", "a"]
    assert [(b.allocation_id, p.deadline_at) for b, p in book.leaving_for("acme", "acme-7")] == [("d", at(50 + 30))]
    assert book.leaving_for("acme", "acme-8") == [] and book.leaving_for("globex", "acme-7") == []
    book.apply(preemption_done(spot, "d"))
    assert [b.allocation_id for _, b in book.borrowed_from("acme")] == ["c", "b", "a"]
    assert len(book.leaving_for("acme", "acme-7")) == 1  # acknowledged, not gone yet
    assert [r.id for r, _ in book.borrowed_from("acme")] == ["r-soft", "r-spot", "r-soft"]
    assert book.borrowed_from("globex") == []
