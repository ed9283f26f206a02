"""Properties of the reservation rules over random histories: allocations come and go (the owner's and
other tenants', on and off the reservation), the owner reclaims random borrowers, the ledger
acknowledges preemptions, time moves on. After every step ``usage`` partitions the reservation,
what is offered is idle (and nothing for hard), the fill rate is a fraction, and every change bumps
the version by one while no change keeps it."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.domain.reservations import (
    POLICIES,
    LendingPolicy,
    Policy,
    Reservation,
    Use,
    cancel,
    lifo,
    preemption_done,
    reclaim,
    refresh,
    usage,
)

T0 = datetime(2025, 6, 1, 12, 0, tzinfo=UTC)
MINE = tuple(f"r/gpu{i}" for i in range(8))
ELSEWHERE = ("x/gpu0", "x/gpu1")
TENANTS = ("acme", "acme", "globex", "initech")  # acme owns: half the allocations are its own
POLICY_CHOICES = (LendingPolicy(), LendingPolicy(backoff_s=0), LendingPolicy(fill_target=0.5, backoff_s=5))


def _versioned(before: Reservation, after: Reservation) -> None:
    """Every change bumps the version by exactly one; no change keeps the value (and version)."""
    if after == before:
        assert after.version == before.version
    else:
        assert after.version == before.version + 1


def _check(r: Reservation, uses: list[Use], now: datetime, policy: LendingPolicy) -> None:
    current = usage(r, uses)
    owner, lent, idle = current.owner_used, current.lent, current.idle
    assert not owner & lent and not owner & idle and not lent & idle
    assert owner | lent | idle == set(MINE)
    assert current.total == len(MINE)
    assert 0.0 <= current.fill_rate <= 1.0 and 0.0 <= current.owner_fill <= current.fill_rate
    assert r.offered <= idle
    if r.policy == "hard" or current.owner_fill >= policy.fill_target:
        assert r.offered == frozenset()
    assert not any(acc in r.backoff and r.backoff[acc].until > now for acc in r.offered)
    # Borrowers: other tenants' live allocations on the reservation, oldest first.
    live = {u.allocation_id: u for u in uses if u.accelerators & set(MINE)}
    assert all(b.tenant != r.tenant and b.allocation_id in live for b in r.borrowers)
    assert {b.allocation_id for b in r.borrowers} == {i for i, u in live.items() if u.tenant != r.tenant}
    assert [b.lent_at for b in r.borrowers] == sorted(b.lent_at for b in r.borrowers)
    assert [b.allocation_id for b in lifo(r)] == [b.allocation_id for b in reversed(r.borrowers)]
    assert all(p.allocation_id in live for p in r.preemptions)


@dataclass(frozen=True)
class Allocate:
    tenant: str
    accelerators: frozenset[str]


@dataclass(frozen=True)
class Release:
    index: int  # of the live allocations, modulo their number


@dataclass(frozen=True)
class Reclaim:
    positions: frozenset[int]  # in LIFO order, modulo the number of borrowers


@dataclass(frozen=True)
class Done:
    index: int  # of the open preemptions, modulo their number


@dataclass(frozen=True)
class Expire:
    """The ledger frees every preempted allocation whose deadline has come (and acknowledges)."""


@dataclass(frozen=True)
class Wait:
    seconds: int


Action = Allocate | Release | Reclaim | Done | Expire | Wait
actions: st.SearchStrategy[Action] = st.one_of(
    st.builds(Allocate, st.sampled_from(TENANTS), st.frozensets(st.sampled_from(MINE + ELSEWHERE), min_size=1)),
    st.builds(Release, st.integers(0, 20)),
    st.builds(Reclaim, st.frozensets(st.integers(0, 20), max_size=4)),
    st.builds(Done, st.integers(0, 20)),
    st.builds(Expire),
    st.builds(Wait, st.sampled_from([0, 1, 5, 29, 30, 31, 120, 1800, 3600])),
)


@settings(max_examples=300, deadline=None)
@given(
    policy=st.sampled_from(POLICIES),
    spot_eviction_s=st.integers(5, 30),
    lending=st.sampled_from(POLICY_CHOICES),
    steps=st.lists(actions, max_size=40),
    cancelled_at=st.one_of(st.none(), st.integers(0, 40)),
)
def test_random_histories_keep_the_invariants(
    policy: Policy,
    spot_eviction_s: int,
    lending: LendingPolicy,
    steps: list[Action],
    cancelled_at: int | None,
) -> None:
    r = Reservation("r", "acme", policy, MINE, T0, spot_eviction_s=spot_eviction_s)
    uses: list[Use] = []
    now = T0
    for n, step in enumerate(steps):
        if isinstance(step, Allocate):
            bytes_ = dict.fromkeys(sorted(step.accelerators), 1)
            uses.append(Use(f"a{n}", step.tenant, step.tenant != "acme", bytes_, now))
        elif isinstance(step, Release) and uses:
            uses.pop(step.index % len(uses))
        elif isinstance(step, Reclaim):
            # Borrowers picked by position in LIFO order, plus an id that is nobody's.
            order = lifo(r)
            ids = [order[i % len(order)].allocation_id for i in sorted(step.positions)] if order else []
            before = r
            r, issued = reclaim(r, [*ids, "nobody"], now=now, policy=lending)
            _versioned(before, r)
            assert [p.allocation_id for p in issued] == list(dict.fromkeys(ids))
            notice = timedelta(seconds=spot_eviction_s if policy == "spot" else 0)
            for p in issued:
                assert p.deadline_at - p.issued_at == notice
                assert r.preemption(p.allocation_id) == p
            freed = {a for b in r.borrowers if b.allocation_id in ids for a in b.accelerators}
            assert not r.offered & freed
        elif isinstance(step, Done) and r.preemptions:
            before = r
            target = r.preemptions[step.index % len(r.preemptions)].allocation_id
            r = preemption_done(r, target)
            _versioned(before, r)
            assert all(p.done for p in r.preemptions if p.allocation_id == target)
        elif isinstance(step, Expire):
            due = {p.allocation_id for p in r.preemptions if p.deadline_at <= now}
            uses = [u for u in uses if u.allocation_id not in due]
            for allocation_id in sorted(due):
                r = preemption_done(r, allocation_id)
        elif isinstance(step, Wait):
            now += timedelta(seconds=step.seconds)
        if cancelled_at == n:
            before = r
            r = cancel(r)
            _versioned(before, r)
            assert not r.active and r.offered == frozenset() and r.preemptions == ()
        before = r
        r = refresh(r, uses, now=now, policy=lending)
        _versioned(before, r)
        if r.active:
            _check(r, uses, now, lending)
        else:
            assert r == before  # a cancelled reservation is not refreshed
        # refresh is idempotent: the same world at the same time changes nothing more.
        assert refresh(r, uses, now=now, policy=lending) == r
