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


POOL = 1000


@settings(max_examples=200, deadline=None)
@given(
    st.lists(  # intervals; in each: requests (size, picked up late by the engine?) and releases
        st.tuples(
            st.lists(st.tuples(st.integers(1, 400), st.booleans()), max_size=12),
            st.lists(st.integers(0, 50), max_size=6),
        ),
        min_size=1,
        max_size=25,
    )
)
def test_admissions_never_exceed_the_reported_pool_by_more_than_one_intervals_grants(
    intervals: list[tuple[list[tuple[int, bool]], list[int]]],
) -> None:
    """A fake engine reports its KV use at the start of every interval. A request is in the engine's use
    from its admission, unless it is picked up late: then it misses the next report (and is in the one
    after). Requests end at random (released to the account at the same time). However the sequence goes,
    what the engine really holds never exceeds the pool by more than the grants of one interval."""
    account = ReplicaAccount(POOL)
    live: dict[str, int] = {}  # admitted and not released: what the engine really holds (or will hold)
    late: set[str] = set()  # admitted in the last interval, not yet in the engine's use
    previous_grants = 0  # bytes granted in the interval before the latest report
    worst = 0  # the most bytes granted in one interval so far
    serial = 0
    for step, (arrivals, releases) in enumerate(intervals):
        reported = sum(n for a, n in live.items() if a not in late)
        account.report(EngineReport(kv_used_bytes=min(reported, POOL * 2), queue_depth=0, at_ms=step * 1000))
        late_missed = {a for a in late if a in live}  # missed this report; in the next
        late = set()
        grants_now = 0
        for nbytes, picked_late in arrivals:
            serial += 1
            admission_id = f"r{serial}"
            if account.grant(_grant(admission_id, nbytes, at=step * 1000 + 1)):
                live[admission_id] = nbytes
                grants_now += nbytes
                if picked_late:
                    late.add(admission_id)
                # A grant is made only while the engine's real use, less what its report missed, fits.
                missed = sum(live[a] for a in late_missed if a in live)
                assert missed <= previous_grants
                assert sum(live.values()) <= POOL + missed, (sum(live.values()), missed)
            worst = max(worst, previous_grants)
            assert sum(live.values()) <= POOL + worst
        for index in releases:
            if live:
                admission_id = sorted(live)[index % len(live)]
                del live[admission_id]
                assert account.release(admission_id) is not None
        previous_grants = grants_now
        assert account.estimate_bytes >= 0
