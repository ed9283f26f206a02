"""One replica's in-flight account (``shared.domain.admission.account``): hand-checked cases, and a property
test with a fake engine that reports every interval."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.domain.admission import EngineReport, InFlight, ReplicaAccount


def _grant(admission_id: str, nbytes: int, *, tenant: str = "acme", at: float = 0.0) -> InFlight:
    return InFlight(admission_id, tenant, admission_id, nbytes, at, at + 300_000)


def test_the_estimate_is_the_reported_use_plus_the_grants_since_the_report() -> None:
    account = ReplicaAccount(100)
    assert account.grant(_grant("a", 30)) and account.grant(_grant("b", 30))
    assert account.estimate_bytes == 60  # no report yet: the grants alone
    assert not account.grant(_grant("c", 50))  # 60 + 50 > 100: refused, nothing counted
    assert account.estimate_bytes == 60 and "c" not in account.grants
    account.report(EngineReport(kv_used_bytes=55, queue_depth=2, at_ms=10))  # a and b are in it now
    assert (account.estimate_bytes, account.unreported_count) == (55, 0)
    assert account.grant(_grant("c", 40, at=11)) and account.estimate_bytes == 95
    assert account.release("c") is not None and account.estimate_bytes == 55  # released: drops at once
    assert account.release("c") is None  # idempotent
    assert account.holders("acme") == 2
    account.report(EngineReport(kv_used_bytes=50, queue_depth=0, at_ms=5))  # older than the last: ignored
    assert account.estimate_bytes == 55


def test_the_same_admission_counts_once_and_leases_end() -> None:
    account = ReplicaAccount(100)
    assert account.grant(_grant("a", 60)) and account.grant(_grant("a", 60))
    assert account.estimate_bytes == 60
    account.renew("a", 600_000)
    assert account.expire(300_000) == [] and [g.admission_id for g in account.expire(600_000)] == ["a"]
    assert account.estimate_bytes == 0 and account.renew("a", 1) is None


def test_after_a_restart_the_account_fills_from_the_next_report() -> None:
    account = ReplicaAccount(100)  # a new process: nothing known
    assert account.estimate_bytes == 0
    account.report(EngineReport(kv_used_bytes=90, queue_depth=3, at_ms=1))
    assert not account.grant(_grant("x", 20)) and account.grant(_grant("y", 10))


def test_a_new_account_given_grants_counts_those_since_the_report_once() -> None:
    """What the book does when a replica's pool changes: a new account with the old one's grants, its
    unreported ids cut to the grants it holds; the estimate carries over."""
    old = ReplicaAccount(100)
    old.report(EngineReport(kv_used_bytes=20, queue_depth=0, at_ms=1))
    assert old.grant(_grant("a", 30)) and old.grant(_grant("b", 10))
    new = ReplicaAccount(80, grants=dict(old.grants), last_report=old.last_report, unreported={"a", "b", "gone"})
    assert (new.estimate_bytes, new.unreported_count, new.unreported_bytes) == (60, 2, 40)
    assert not new.grant(_grant("c", 21)) and new.grant(_grant("c", 20)) and new.estimate_bytes == 80
    assert new.expire(300_000) and new.estimate_bytes == 20 and new.unreported_count == 0


POOL = 1000


@settings(max_examples=300, deadline=None)
@given(
    st.lists(  # report intervals
        st.tuples(
            st.integers(0, 700),  # the engine's own use: requests admission did not grant (before a restart)
            st.lists(st.tuples(st.integers(1, 400), st.booleans()), max_size=12),  # arrivals: size, picked up late
            st.lists(st.integers(0, 50), max_size=6),  # releases
            st.booleans(),  # a delayed report, older than the latest, arrives in the interval
        ),
        min_size=1,
        max_size=25,
    )
)
def test_admissions_never_exceed_the_reported_pool_by_more_than_one_intervals_grants(
    intervals: list[tuple[int, list[tuple[int, bool]], list[int], bool]],
) -> None:
    """A fake engine reports at the start of every interval what it holds: its own use (requests admission
    never granted) and the admitted requests it has picked up. A request is picked up on admission, unless
    it is picked up late: then it misses the next report (and is in the one after). Requests end at random
    (released to the account at the same time); a delayed report may arrive out of order.

    Every grant is decided as the estimate says (the last report's figure plus the grants since it, against
    the pool), and however the sequence goes, a grant never takes what the engine really holds past the pool
    by more than the grants the latest report missed, which are at most the grants of the interval before it."""
    account = ReplicaAccount(POOL)
    live: dict[str, int] = {}  # admitted and not released: what the engine holds (or will hold) for admission
    late: set[str] = set()  # admitted in this interval, to miss the next report
    serial = 0
    previous_grants = 0  # bytes granted in the interval before the latest report
    for step, (own, arrivals, releases, delayed) in enumerate(intervals):
        reported = own + sum(n for a, n in live.items() if a not in late)
        account.report(EngineReport(kv_used_bytes=reported, queue_depth=0, at_ms=step * 1000))
        missed, late = {a for a in late if a in live}, set()  # admitted before this report, not in it
        since: set[str] = set()  # granted since this report
        if delayed and step:  # an older report changes nothing
            account.report(EngineReport(kv_used_bytes=0, queue_depth=0, at_ms=step * 1000 - 500))
        grants_now = 0
        for nbytes, picked_late in arrivals:
            serial += 1
            admission_id = f"r{serial}"
            expected = reported + sum(live[a] for a in since) + nbytes <= POOL
            assert account.grant(_grant(admission_id, nbytes, at=step * 1000 + 1)) == expected
            if expected:
                live[admission_id] = nbytes
                since.add(admission_id)
                grants_now += nbytes
                if picked_late:
                    late.add(admission_id)
                # With this grant the engine holds no more than the pool, beyond the grants its report missed
                # (its own use may outgrow the pool between reports: then the estimate refuses every grant).
                over = sum(live[a] for a in missed if a in live)
                assert over <= previous_grants
                assert own + sum(live.values()) <= POOL + over, (own, live, over)
        for index in releases:
            if live:
                admission_id = sorted(live)[index % len(live)]
                nbytes = live.pop(admission_id)
                since.discard(admission_id)
                assert account.release(admission_id) is not None and account.release(admission_id) is None
        assert account.estimate_bytes == reported + sum(live[a] for a in since)
        assert (account.unreported_count, account.unreported_bytes) == (len(since), sum(live[a] for a in since))
        previous_grants = grants_now
