"""plan_commits: each commit of a batch decided in order against the locked view, all or nothing.

These are about bytes, so the replicas here are ``shared`` (several may sit on one GPU) and n/gpu0 is
held by shared replicas; who may sit with whom is tested in test_sharing.py."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from shared.domain.errors import ErrorCode
from shared.domain.ledger import (
    REQUEST_RETIRED,
    Accepted,
    CommitIntent,
    CommitPlan,
    Duplicate,
    ExistingAllocation,
    Refused,
    plan_commits,
    same_shares,
)
from shared.domain.memory import MemoryShare
from tests.unit.domain.ledger import builders
from tests.unit.domain.ledger.builders import GB, NOW, gpu, hbm, view

LEASE_S = 300
V = view(
    gpu("n/gpu0", usable_gb=80, reserved_gb=30, shared=True),
    gpu("n/gpu1", usable_gb=80),
    gpu("n/gpu2", available=False),
)


def intent(*shares: tuple[str, MemoryShare], **extra: Any) -> CommitIntent:
    """A commit of a shared replica unless said otherwise."""
    return builders.intent(*shares, **{"sharing": "shared", **extra})


def plan(
    *intents: CommitIntent,
    existing: dict[tuple[str, str], ExistingAllocation] | None = None,
) -> CommitPlan:
    return plan_commits(intents, view=V, existing=existing or {}, now=NOW, default_lease_s=LEASE_S)


def refused(outcome: object) -> Refused:
    assert isinstance(outcome, Refused), outcome
    return outcome


def test_a_commit_that_fits_is_accepted_with_the_default_lease_and_reserves_its_bytes() -> None:
    result = plan(intent(("n/gpu0", hbm(20)), ("n/gpu1", hbm(5, kv_gb=5))))
    assert result.outcomes == (Accepted(NOW + timedelta(seconds=LEASE_S)),)
    assert result.view["n/gpu0"].reserved == 50 * GB and result.view["n/gpu1"].reserved == 10 * GB


def test_the_lease_comes_from_lease_s_or_the_absolute_end() -> None:
    end = NOW + timedelta(hours=2)
    result = plan(
        intent(("n/gpu1", hbm(1)), rid="a", lease_s=60),
        intent(("n/gpu1", hbm(1)), rid="b", lease_expires_at=end),
        intent(("n/gpu1", hbm(1)), rid="c", lease_expires_at=NOW),  # ends now: in the past
    )
    assert result.outcomes[:2] == (Accepted(NOW + timedelta(seconds=60)), Accepted(end))
    assert refused(result.outcomes[2]).code is ErrorCode.INVALID_REQUEST


def test_unknown_accelerators_are_not_found_and_nothing_is_reserved() -> None:
    result = plan(intent(("n/gpu1", hbm(1)), ("x/gpu1", hbm(1)), ("a/gpu0", hbm(1))))
    out = refused(result.outcomes[0])
    assert out.code is ErrorCode.NOT_FOUND and out.message == "unknown accelerator(s): a/gpu0, x/gpu1"
    assert result.view == V


@pytest.mark.parametrize(
    ("expected", "code"),
    [
        (None, ErrorCode.NO_CAPACITY),
        ({"n/gpu0": 30 * GB}, ErrorCode.NO_CAPACITY),  # the caller saw the current view: it just does not fit
        ({"n/gpu0": 0}, ErrorCode.CONFLICT),  # the caller decided on a stale view
        ({"n/gpu1": 0, "n/gpu0": 30 * GB}, ErrorCode.NO_CAPACITY),
        ({"n/gpu1": 5}, ErrorCode.CONFLICT),  # stale on another accelerator of the same commit
    ],
)
def test_a_commit_that_does_not_fit_is_a_conflict_only_when_the_view_was_stale(
    expected: dict[str, int] | None, code: ErrorCode
) -> None:
    result = plan(intent(("n/gpu0", hbm(60)), ("n/gpu1", hbm(1)), expected=expected))
    out = refused(result.outcomes[0])
    assert out.code is code
    assert out.message == "n/gpu0: HBM short by 10.00 GB"
    assert out.view == (V["n/gpu0"], V["n/gpu1"])  # the fresh view to retry with
    assert result.view == V


def test_an_unavailable_accelerator_is_no_capacity_saying_unavailable() -> None:
    out = refused(plan(intent(("n/gpu2", hbm(1)))).outcomes[0])
    assert out.code is ErrorCode.NO_CAPACITY and out.message == "n/gpu2: unavailable"


def test_later_commits_see_what_earlier_ones_reserved_and_refusals_reserve_nothing() -> None:
    result = plan(
        intent(("n/gpu1", hbm(50)), rid="a"),
        intent(("n/gpu1", hbm(40)), rid="b"),  # 50 + 40 > 80
        intent(("n/gpu1", hbm(30)), rid="c"),  # 50 + 30 = 80: fits, b took nothing
    )
    assert [type(o) for o in result.outcomes] == [Accepted, Refused, Accepted]
    assert refused(result.outcomes[1]).view == (gpu("n/gpu1", usable_gb=80, reserved_gb=50, shared=True),)
    assert result.view["n/gpu1"].reserved == 80 * GB
    assert [i for i, _ in result.accepted] == [0, 2]


def test_a_repeated_commit_returns_the_stored_allocation() -> None:
    stored = ExistingAllocation("al-9", NOW + timedelta(minutes=1), (("n/gpu1", hbm(2)), ("n/gpu0", hbm(1))))
    same = intent(("n/gpu0", hbm(1)), ("n/gpu1", hbm(2)), rid="r-9")  # same shares, another order
    other = intent(("n/gpu0", hbm(1)), rid="r-9")
    for candidate, expected in ((same, Duplicate), (other, Refused)):
        outcome = plan(candidate, existing={("acme", "r-9"): stored}).outcomes[0]
        assert type(outcome) is expected
    duplicate = plan(same, existing={("acme", "r-9"): stored}).outcomes[0]
    assert duplicate == Duplicate("al-9", stored.lease_expires_at, (V["n/gpu0"], V["n/gpu1"]))
    assert refused(plan(other, existing={("acme", "r-9"): stored}).outcomes[0]).code is ErrorCode.INVALID_REQUEST
    assert plan(same, existing={("globex", "r-9"): stored}).outcomes[0] == Accepted(NOW + timedelta(seconds=LEASE_S))


def test_the_same_request_id_twice_in_one_batch_is_invalid_the_second_time() -> None:
    result = plan(intent(("n/gpu1", hbm(1))), intent(("n/gpu1", hbm(1))))
    assert isinstance(result.outcomes[0], Accepted)
    assert refused(result.outcomes[1]).message == "request_id appears twice in this batch"
    assert result.view["n/gpu1"].reserved == 1 * GB


def request_hold(kv_gb: float, *, rid: str = "q", acc: str = "n/gpu0") -> CommitIntent:
    return intent((acc, hbm(kv_gb=kv_gb)), rid=rid, kind="request", parent_id="al-rep")


def test_a_request_commit_is_refused_invalid_and_reserves_nothing() -> None:
    """The ledger holds replicas only: admissions are counted by placement in memory."""
    replica = intent(("n/gpu1", hbm(5)), rid="r")
    result = plan(request_hold(1), replica, request_hold(1, rid="q2", acc="n/gpu1"))
    first, accepted, last = result.outcomes
    for outcome in (first, last):
        assert refused(outcome).code is ErrorCode.INVALID_REQUEST and refused(outcome).message == REQUEST_RETIRED
        assert refused(outcome).view is None
    assert "replicas only" in REQUEST_RETIRED and "placement" in REQUEST_RETIRED
    assert isinstance(accepted, Accepted)  # a refused request in the batch stops nothing else
    assert result.view["n/gpu0"] == V["n/gpu0"] and result.view["n/gpu1"].reserved == 5 * GB


def test_a_request_commit_under_an_existing_key_is_refused_not_answered_as_a_duplicate() -> None:
    """A retry of a request hold written before the retirement does not learn of it as committed."""
    held = ExistingAllocation("al-q", NOW + timedelta(seconds=60), (("n/gpu0", hbm(kv_gb=1)),))
    result = plan(request_hold(1), existing={("acme", "q"): held})
    assert refused(result.outcomes[0]).message == REQUEST_RETIRED


def test_outcomes_keep_the_batch_order() -> None:
    intents = [intent(("n/gpu1", hbm(10)), rid=f"r-{i}") for i in range(9)]  # 8 fit in 80 GB, the 9th not
    result = plan(*intents)
    assert [type(o) for o in result.outcomes] == [Accepted] * 8 + [Refused]


def test_same_shares_ignores_order_but_not_bytes() -> None:
    a = [("x", hbm(1)), ("y", hbm(kv_gb=2))]
    assert same_shares(a, list(reversed(a)))
    assert not same_shares(a, [("x", hbm(1)), ("y", hbm(2))])  # same total, other kind of bytes
    assert not same_shares(a, a[:1])


def test_a_cluster_s_cross_domain_budget_is_a_hard_limit_within_a_batch() -> None:
    """Replicas whose TP traffic crosses NVLink domains are charged to their cluster; past the budget
    the commit is refused, and a batch's earlier commits count for its later ones."""
    accelerators = view(*(gpu(f"n/gpu{i}") for i in range(4)))
    clusters: dict[str, str | None] = {a: "r1/c1" for a in accelerators}

    def crossing(rid: str, index: int, gbps: int) -> CommitIntent:
        return builders.intent((f"n/gpu{index}", hbm(1)), rid=rid, cross_domain_bytes_per_s=gbps * GB)

    def decided(*intents: CommitIntent, budget: int) -> CommitPlan:
        return plan_commits(
            intents,
            view=accelerators,
            existing={},
            now=NOW,
            default_lease_s=LEASE_S,
            clusters=clusters,
            crossing={"r1/c1": 50 * GB},
            crossing_budget=budget,
        )

    batch = decided(
        crossing("a", 0, 100), crossing("b", 1, 100), crossing("c", 2, 100), crossing("d", 3, 0), budget=256 * GB
    )
    assert [type(o).__name__ for o in batch.outcomes] == ["Accepted", "Accepted", "Refused", "Accepted"]
    refused = batch.outcomes[2]
    assert isinstance(refused, Refused) and refused.code is ErrorCode.NO_CAPACITY
    assert "r1/c1's cross-domain budget: 250.0 GB/s in use + 100.0 GB/s > 256 GB/s" in refused.message
    # Without a budget (0) the ledger only records the traffic.
    assert type(decided(crossing("e", 2, 1000), budget=0).outcomes[0]).__name__ == "Accepted"
