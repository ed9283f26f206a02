"""Replay (issue 15): every RESERVATION event carries its reservation's whole state, so folding the
stream from its first event into a ``ReservationBook`` rebuilds what placement knew, whatever the
order events of different reservations come in, and a late older state changes nothing. Every state
also survives the wire (``state_of`` / ``reservation_of``)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.contracts.reservation import ReservationState
from shared.domain.reservations import (
    LendingPolicy,
    Reservation,
    ReservationBook,
    Use,
    cancel,
    preemption_done,
    reclaim,
    refresh,
)
from shared.infra.reservations import reservation_of, state_of

T0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
GB = 10**9
POLICY = LendingPolicy()
TENANTS = ("acme", "initech", "umbrella", "globex")


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def accs(node: str, n: int = 8) -> tuple[str, ...]:
    return tuple(f"{node}/gpu{i}" for i in range(n))


def _use(allocation_id: str, tenant: str, accelerators: Iterable[str], since: datetime) -> Use:
    return Use(allocation_id, tenant, tenant != "acme", {a: GB * 3 for a in accelerators}, since)


def history() -> list[Reservation]:
    """The states the filler emits, in order, for four reservations whose changes interleave: acme's
    soft ``r-soft`` and spot ``r-spot`` lend to globex and take some back, initech's hard ``r-hard`` only
    refreshes, umbrella's soft ``r-gone`` lends and is cancelled with a borrower on it."""
    current = {
        "r-soft": Reservation("r-soft", "acme", "soft", accs("a"), T0, sku="H100-SXM-80GB", region="us-west-1"),
        "r-spot": Reservation("r-spot", "acme", "spot", accs("b"), T0, spot_eviction_s=10),
        "r-hard": Reservation("r-hard", "initech", "hard", accs("c", 4), T0),
        "r-gone": Reservation("r-gone", "umbrella", "soft", accs("d", 4), T0),
    }
    events = list(current.values())

    def emit(after: Reservation) -> None:
        if after.version != current[after.id].version:
            current[after.id] = after
            events.append(after)

    world: list[Use] = [
        _use("own-a", "acme", accs("a")[:2], T0),
        _use("own-b", "acme", accs("b")[:4], T0),
        _use("own-c", "initech", accs("c")[:1], T0),
    ]
    for t, rid in enumerate(current, start=1):
        emit(refresh(current[rid], world, now=at(t), policy=POLICY))
    world += [
        _use("g1", "globex", accs("a")[2:5], at(10)),
        _use("g2", "globex", accs("b")[4:6], at(11)),
        _use("g3", "globex", accs("a")[5:8], at(12)),
        _use("g4", "globex", accs("d")[0:2], at(13)),
        _use("g5", "globex", accs("b")[6:8], at(14)),
    ]
    for t, rid in enumerate(("r-spot", "r-gone", "r-soft", "r-hard"), start=20):
        emit(refresh(current[rid], world, now=at(t), policy=POLICY))
    # acme takes some back: the newest borrower of each lending reservation.
    emit(reclaim(current["r-soft"], ["g3"], now=at(30), policy=POLICY)[0])
    emit(reclaim(current["r-spot"], ["g5"], now=at(31), policy=POLICY)[0])
    world = [u for u in world if u.allocation_id != "g3"]
    emit(preemption_done(current["r-soft"], "g3"))
    emit(refresh(current["r-soft"], world, now=at(32), policy=POLICY))
    emit(cancel(current["r-gone"]))
    world = [u for u in world if u.allocation_id != "g5"]
    emit(preemption_done(current["r-spot"], "g5"))
    emit(refresh(current["r-spot"], world, now=at(41), policy=POLICY))
    emit(refresh(current["r-gone"], world, now=at(42), policy=POLICY))  # cancelled: no new state
    return events


HISTORY = history()
LAST = {r.id: r for r in HISTORY}  # the newest state of each (the history is in version order)


def fold(events: Iterable[Reservation]) -> ReservationBook:
    book = ReservationBook()
    for r in events:
        book.apply(r)
    return book


def view(book: ReservationBook) -> tuple[object, ...]:
    """What placement reads from a book."""
    every = sorted({a for r in HISTORY for a in r.accelerators})
    return (
        book.reservations,
        sorted(r.id for r in book.active()),
        {(t, p): book.withheld(t, preemptible=p) for t in TENANTS for p in (False, True)},
        {a: book.right(a) for a in every},
    )


def test_the_history_exercises_every_kind_of_change() -> None:
    """The fixture itself: several versions per reservation, interleaved, with preemptions (done and
    not), backoff, offers and a cancellation."""
    assert len(HISTORY) > 12
    # The first refreshes: the hard one, offering nothing and lent to nobody, does not change.
    assert [(r.id, r.version) for r in HISTORY[4:7]] == [("r-soft", 2), ("r-spot", 2), ("r-gone", 2)]
    assert {r.id for r in HISTORY if r.version > 2} == {"r-soft", "r-spot", "r-gone"}
    assert any(r.preemptions and not r.preemptions[0].done for r in HISTORY)
    assert any(r.preemptions and r.preemptions[0].done for r in HISTORY)
    assert any(r.backoff for r in HISTORY) and any(r.offered for r in HISTORY)
    assert LAST["r-gone"].state == "cancelled" and LAST["r-gone"].borrowers
    for rid in LAST:
        versions = [r.version for r in HISTORY if r.id == rid]
        assert versions == sorted(set(versions))


def test_folding_twice_gives_the_same_book() -> None:
    first, second = fold(HISTORY), fold(HISTORY)
    assert view(first) == view(second)
    assert first.reservations == LAST


def test_what_the_book_says_after_the_history() -> None:
    """Expected rights: r-soft and r-spot offer their idle accelerators to globex's preemptible work
    (acme fills 2/8 and 4/8 < 0.85); r-hard withholds all; r-gone, cancelled, withholds nothing."""
    book = fold(HISTORY)
    assert sorted(r.id for r in book.active()) == ["r-hard", "r-soft", "r-spot"]
    soft, spot = LAST["r-soft"], LAST["r-spot"]
    # a/gpu5-7 (g3 left at 32) and b/gpu6-7 (g5 left at 41) back off: not offered.
    assert soft.offered == frozenset() and spot.offered == frozenset()
    # At 32 r-soft's idle are a/gpu5-7, backing off until 60.
    assert all(soft.backoff[a].until == at(60) for a in accs("a")[5:8])
    withheld = book.withheld("globex", preemptible=True)
    assert withheld == frozenset(accs("a") + accs("b") + accs("c", 4))
    assert not withheld & set(accs("d", 4))
    assert book.withheld("acme", preemptible=False) == frozenset(accs("c", 4))
    assert book.withheld("umbrella", preemptible=False) == frozenset(accs("a") + accs("b") + accs("c", 4))


@settings(max_examples=60, deadline=None)
@given(st.permutations(HISTORY))
def test_any_order_of_the_events_folds_to_the_same_book(events: list[Reservation]) -> None:
    """States of one reservation carry its version, so a stream that delivers them out of order (or a
    consumer that reads two subjects) still ends at the newest state of each."""
    assert view(fold(events)) == view(fold(HISTORY))


def test_an_older_state_after_a_newer_one_changes_nothing() -> None:
    book = fold(HISTORY)
    before, version = view(book), book.version
    for r in HISTORY:
        assert book.apply(r) is False  # the same state again, or an older one
    assert view(book) == before and book.version == version


def test_a_cancelled_reservation_releases_its_rights_and_stays_cancelled() -> None:
    gone = [r for r in HISTORY if r.id == "r-gone"]
    book = fold(HISTORY[: HISTORY.index(gone[-1])])
    assert book.right("d/gpu3") is not None and "d/gpu3" in book.withheld("acme", preemptible=False)
    assert book.apply(gone[-1])
    assert all(book.right(a) is None for a in accs("d", 4))
    assert not book.withheld("acme", preemptible=False) & set(accs("d", 4))
    assert "r-gone" not in {r.id for r in book.active()}
    assert book.get("r-gone") == gone[-1]
    # A late, older state (active) does not bring it back.
    assert not book.apply(gone[0])
    assert book.right("d/gpu0") is None


def test_every_state_survives_the_wire() -> None:
    """Domain -> contract -> JSON -> contract -> domain gives an equal value, for every state."""
    for r in HISTORY:
        state = state_of(r)
        assert reservation_of(state) == r
        assert reservation_of(ReservationState.model_validate_json(state.model_dump_json())) == r
