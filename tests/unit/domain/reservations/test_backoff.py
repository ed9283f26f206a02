"""Backoff (issue 15): an owner whose use oscillates must not make its idle capacity flip between lent
and reclaimed every time. Exponential backoff per accelerator (``next_backoff``), simulated on a fake
clock against a borrower that grabs whatever is offered."""

from __future__ import annotations

import itertools
from datetime import UTC, datetime, timedelta

import pytest

from shared.domain.reservations import (
    DEFAULT_BACKOFF_MAX_S,
    DEFAULT_BACKOFF_S,
    Backoff,
    LendingPolicy,
    Reservation,
    Use,
    next_backoff,
    preemption_done,
    reclaim,
    refresh,
    usage,
)

T0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
GB = 10**9
ACCS = tuple(f"n{i // 8:02d}/gpu{i % 8}" for i in range(100))
LENT = ACCS[60:]  # what the owner leaves idle at 60 and needs back at 100


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def oscillate(policy: LendingPolicy, *, period_s: int = 10, duration_s: int = 1800) -> dict[str, list[float]]:
    """The owner of a soft 100-GPU reservation uses 60 at t = 0, 20, 40, ... and 100 at t = 10, 30, ...
    A borrower takes every offered accelerator the moment it is offered (one allocation each); when the
    owner needs its 40 back, every borrower on them is reclaimed (soft: at once) and the owner runs
    there. Returns, per accelerator, the times its borrower was evicted."""
    r = Reservation(id="res-1", tenant="acme", policy="soft", accelerators=ACCS, created_at=T0)
    world: dict[str, Use] = {}
    evicted: dict[str, list[float]] = {a: [] for a in ACCS}
    for k in range(duration_s // period_s):
        t = k * period_s
        now = at(t)
        if k % 2 == 0:  # the owner at 60: borrowers grab what is offered
            world["own"] = Use("own", "acme", False, {a: GB for a in ACCS[:60]}, now)
            r = refresh(r, world.values(), now=now, policy=policy)
            for acc in sorted(r.offered):
                world[f"b{k}-{acc}"] = Use(f"b{k}-{acc}", "globex", True, {acc: GB}, now)
            r = refresh(r, world.values(), now=now, policy=policy)
            assert r.offered == frozenset()
        else:  # the owner at 100: reclaim every borrower, then the owner takes all
            r = refresh(r, world.values(), now=now, policy=policy)
            ids = [b.allocation_id for b in r.borrowers]
            r, issued = reclaim(r, ids, now=now, policy=policy)
            assert [p.deadline_at for p in issued] == [now] * len(ids)  # soft: at once
            for b in r.borrowers:
                for acc in b.accelerators:
                    evicted[acc].append(t)
            for i in ids:
                del world[i]
                r = preemption_done(r, i)
            world["own"] = Use("own", "acme", False, {a: GB for a in ACCS}, now)
            r = refresh(r, world.values(), now=now, policy=policy)
            current = usage(r, world.values())
            assert len(current.owner_used) == 100 and r.offered == frozenset() and r.preemptions == ()
    return evicted


def test_backoff_stops_the_lend_reclaim_loop_of_an_oscillating_owner() -> None:
    """30 minutes of an owner flipping 100/60 every 10 s. Without backoff each of the 40 accelerators is
    lent at every 60 and evicted at every 100: 1800 / 20 = 90 evictions each. With the default policy
    (30 s, doubling) an accelerator is evicted at t = 10 (backs off to 40, lent at 40), 50 (wait 60, to
    110, lent at 120), 130 (120 s, lent at 260), 270 (240 s, lent at 520), 530 (480 s, lent at 1020) and
    1030 (960 s, to 1990: past the end): 6 evictions each."""
    default = oscillate(LendingPolicy())
    none = oscillate(LendingPolicy(backoff_s=0))

    assert all(len(none[a]) == 90 for a in LENT)
    assert all(default[a] == [10, 50, 130, 270, 530, 1030] for a in LENT)
    assert not any(default[a] or none[a] for a in ACCS[:60])  # never lent: the owner held them
    total_default = sum(len(v) for v in default.values())
    total_none = sum(len(v) for v in none.values())
    assert total_default == 40 * 6 and total_none == 40 * 90
    assert total_default < total_none / 4


def test_next_backoff_doubles_per_strike_and_caps() -> None:
    """Strikes 1 s apart: 30, 60, 120, 240, 480, 960, then 1920 capped at 1800, and 1800 after that."""
    policy = LendingPolicy()
    waits: list[float] = []
    strikes: list[int] = []
    previous: Backoff | None = None
    for n in range(9):
        now = at(n)
        previous = next_backoff(previous, now=now, policy=policy)
        assert previous.last == now
        waits.append((previous.until - now).total_seconds())
        strikes.append(previous.strikes)
    assert waits == [30, 60, 120, 240, 480, 960, 1800, 1800, 1800]
    assert strikes == list(range(1, 10))
    assert DEFAULT_BACKOFF_S == 30 and DEFAULT_BACKOFF_MAX_S == 1800


@pytest.mark.parametrize(
    ("quiet_s", "strikes", "wait_s"),
    [
        (0, 4, 240),
        (1919, 4, 240),  # its wait ended (t=120) less than backoff_max_s ago: one more
        (1920, 1, 30),  # quiet for backoff_max_s after its wait ended: back to the first strike
        (86_400, 1, 30),
    ],
)
def test_next_backoff_resets_after_a_quiet_period(quiet_s: int, strikes: int, wait_s: int) -> None:
    policy = LendingPolicy()
    previous = Backoff(until=at(120), strikes=3, last=at(0))
    now = at(quiet_s)
    after = next_backoff(previous, now=now, policy=policy)
    assert (after.strikes, after.until - now, after.last) == (strikes, timedelta(seconds=wait_s), now)


def test_next_backoff_follows_the_policy() -> None:
    """backoff_s 10, factor 3, cap 100: 10, 30, 90, 100 (270 capped)."""
    policy = LendingPolicy(backoff_s=10, factor=3, backoff_max_s=100)
    previous: Backoff | None = None
    waits = []
    for n in range(4):
        previous = next_backoff(previous, now=at(n), policy=policy)
        waits.append((previous.until - at(n)).total_seconds())
    assert waits == [10, 30, 90, 100]


def test_refresh_offers_an_accelerator_again_when_its_backoff_ends_and_forgets_it_later() -> None:
    """Reclaimed at t=0 (first strike: until 30): not offered at 29, offered at 30; its record is kept
    (a second strike within 1800 s of the wait's end doubles) until 1800 s after the wait ended, then forgotten."""
    policy = LendingPolicy()
    owner = Use("own", "acme", False, {a: GB for a in ACCS[:60]}, T0)
    borrower = Use("b", "globex", True, {ACCS[99]: GB}, T0)
    r = Reservation(id="res-1", tenant="acme", policy="soft", accelerators=ACCS, created_at=T0)
    r = refresh(r, [owner, borrower], now=T0, policy=policy)
    r, _ = reclaim(r, ["b"], now=T0, policy=policy)
    r = preemption_done(r, "b")
    r = refresh(r, [owner], now=at(29), policy=policy)
    assert ACCS[99] not in r.offered and len(r.offered) == 39
    r = refresh(r, [owner], now=at(30), policy=policy)
    assert ACCS[99] in r.offered and len(r.offered) == 40
    r = refresh(r, [owner], now=at(1829), policy=policy)
    assert r.backoff[ACCS[99]].strikes == 1
    r = refresh(r, [owner], now=at(1830), policy=policy)
    assert ACCS[99] not in r.backoff


def test_an_owner_oscillating_for_hours_keeps_its_borrowers_at_the_longest_backoff() -> None:
    """Quiet is measured from the end of the last wait: once the waits reach the cap (after 6 evictions,
    ~30 min) a GPU is evicted at most once per cap + one flip, not cycled back to 30 s waits."""
    evictions = oscillate(LendingPolicy(), duration_s=3 * 3600)
    for times in evictions.values():
        late = [t for t in times if t > 1800]
        gaps = [b - a for a, b in itertools.pairwise(late)]
        assert all(gap >= DEFAULT_BACKOFF_MAX_S for gap in gaps), gaps
        assert len(times) <= 6 + (3 * 3600 - 1800) // DEFAULT_BACKOFF_MAX_S + 1
