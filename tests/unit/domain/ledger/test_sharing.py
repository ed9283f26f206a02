"""Who may hold a GPU together: an exclusive TP group takes only idle GPUs, a shared replica idle or
shared ones, and a request (a KV hold inside its replica) is not a replica at all. Plus the cluster an
allocation's cross-domain traffic is charged to, and the per-cluster sum."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.domain.capacity import AcceleratorCapacity
from shared.domain.errors import ErrorCode
from shared.domain.ledger import (
    Accepted,
    CommitIntent,
    CommitPlan,
    CrossDomainUse,
    Refused,
    Sharing,
    allocation_cluster,
    apply_shares,
    check_sharing,
    cross_domain_used,
    holder_of,
    may_join,
    plan_commits,
)
from tests.unit.domain.ledger.builders import GB, NOW, gpu, hbm, intent, view

IDLE = gpu("n/gpu0")
HELD_SHARED = gpu("n/gpu1", reserved_gb=10, shared=True)
HELD_EXCLUSIVE = gpu("n/gpu2", reserved_gb=10)
V = view(IDLE, HELD_SHARED, HELD_EXCLUSIVE, gpu("n/gpu3"), gpu("n/gpu4", available=False, reserved_gb=10))


def plan(
    *intents: CommitIntent,
    on: dict[str, AcceleratorCapacity] | None = None,
    clusters: dict[str, str | None] | None = None,
) -> CommitPlan:
    return plan_commits(
        intents,
        view=V if on is None else on,
        existing={},
        now=NOW,
        default_lease_s=300,
        clusters=clusters,
    )


def refused(outcome: object) -> Refused:
    assert isinstance(outcome, Refused), outcome
    return outcome


@pytest.mark.parametrize(
    ("capacity", "holder", "exclusive_may", "shared_may"),
    [
        (IDLE, None, True, True),
        (HELD_SHARED, "shared", False, True),
        (HELD_EXCLUSIVE, "exclusive", False, False),
        # `shared` on an idle GPU means nothing: nothing holds it.
        (replace(IDLE, shared=True), None, True, True),
    ],
)
def test_who_may_join_what(
    capacity: AcceleratorCapacity, holder: str | None, exclusive_may: bool, shared_may: bool
) -> None:
    assert holder_of(capacity) == holder
    assert may_join(capacity, "exclusive") is exclusive_may
    assert may_join(capacity, "shared") is shared_may


def test_check_sharing_names_each_blocked_accelerator_once_in_the_commits_order() -> None:
    ids = ["n/gpu2", "n/gpu0", "n/gpu1", "n/gpu2", "x/gpu9"]  # a repeat, and one the view lacks
    assert [(r.accelerator_id, r.holder) for r in check_sharing(V, ids, "exclusive")] == [
        ("n/gpu2", "exclusive"),
        ("n/gpu1", "shared"),
    ]
    assert [r.accelerator_id for r in check_sharing(V, ids, "shared")] == ["n/gpu2"]


def test_an_exclusive_group_twice_on_one_gpu_is_refused_the_second_time() -> None:
    result = plan(intent(("n/gpu0", hbm(10)), rid="a"), intent(("n/gpu0", hbm(10)), rid="b"))
    assert isinstance(result.outcomes[0], Accepted)
    out = refused(result.outcomes[1])
    assert out.code is ErrorCode.NO_CAPACITY
    assert out.message == "n/gpu0: held by another replica (exclusive groups don't share a GPU)"
    assert out.view == (gpu("n/gpu0", reserved_gb=10),)  # the fresh view, the first group's bytes in it
    assert result.view["n/gpu0"].reserved == 10 * GB and not result.view["n/gpu0"].shared


def test_shared_replicas_sit_together_bytes_permitting() -> None:
    result = plan(
        intent(("n/gpu0", hbm(30)), rid="a", sharing="shared"),
        intent(("n/gpu0", hbm(30)), rid="b", sharing="shared"),
        intent(("n/gpu0", hbm(30)), rid="c", sharing="shared"),  # 90 > 80 GB
        intent(("n/gpu1", hbm(30)), rid="d", sharing="shared"),  # joins the shared replicas already there
    )
    assert [type(o) for o in result.outcomes] == [Accepted, Accepted, Refused, Accepted]
    assert refused(result.outcomes[2]).message == "n/gpu0: HBM short by 10.00 GB"
    assert result.view["n/gpu0"].shared and result.view["n/gpu0"].reserved == 60 * GB
    assert result.view["n/gpu1"].shared and result.view["n/gpu1"].reserved == 40 * GB


@pytest.mark.parametrize(
    ("sharing", "acc", "message"),
    [
        ("shared", "n/gpu2", "held by another replica, an exclusive one (a shared replica joins only shared ones)"),
        ("exclusive", "n/gpu1", "held by another replica, a shared one (an exclusive group takes only idle GPUs)"),
        ("exclusive", "n/gpu2", "held by another replica (exclusive groups don't share a GPU)"),
    ],
)
def test_a_replica_onto_a_gpu_it_may_not_join_is_no_capacity_and_reserves_nothing(
    sharing: Sharing, acc: str, message: str
) -> None:
    result = plan(intent((acc, hbm(1)), sharing=sharing))
    out = refused(result.outcomes[0])
    assert (out.code, out.message) == (ErrorCode.NO_CAPACITY, f"{acc}: {message}")
    assert result.view == V


def test_a_group_with_one_held_gpu_is_refused_whole_naming_only_what_stops_it() -> None:
    tp4 = intent(("n/gpu0", hbm(1)), ("n/gpu2", hbm(1)), ("n/gpu3", hbm(90)), ("n/gpu4", hbm(1)))
    out = refused(plan(tp4).outcomes[0])
    # One reason per accelerator in the group's order: held, short of bytes, unavailable (before held).
    assert out.message == (
        "n/gpu2: held by another replica (exclusive groups don't share a GPU); "
        "n/gpu3: HBM short by 10.00 GB; n/gpu4: unavailable"
    )
    assert [c.id for c in out.view or ()] == ["n/gpu0", "n/gpu2", "n/gpu3", "n/gpu4"]


@pytest.mark.parametrize(
    ("expected", "code"),
    [
        ({"n/gpu2": 0}, ErrorCode.CONFLICT),  # decided while it was idle: retry on the fresh view
        ({"n/gpu2": 10 * GB}, ErrorCode.NO_CAPACITY),  # it knew the GPU was held
        (None, ErrorCode.NO_CAPACITY),
    ],
)
def test_a_held_gpu_is_a_conflict_only_when_the_callers_view_was_stale(
    expected: dict[str, int] | None, code: ErrorCode
) -> None:
    assert refused(plan(intent(("n/gpu2", hbm(1)), expected=expected)).outcomes[0]).code is code


def test_a_gpu_given_back_takes_a_new_exclusive_group() -> None:
    first = plan(intent(("n/gpu0", hbm(10)), rid="a"))
    held = first.view
    assert holder_of(held["n/gpu0"]) == "exclusive"
    released = apply_shares(held, [("n/gpu0", hbm(10))], sign=-1)
    assert released["n/gpu0"] == IDLE
    assert isinstance(plan(intent(("n/gpu0", hbm(10)), rid="b"), on=released).outcomes[0], Accepted)
    shared_gone = apply_shares(view(HELD_SHARED), [("n/gpu1", hbm(10))], sign=-1)
    assert not shared_gone["n/gpu1"].shared  # idle again: no longer "held by shared replicas"


def test_an_accepted_commit_carries_the_cluster_of_its_first_known_accelerator() -> None:
    clusters: dict[str, str | None] = {"n/gpu0": None, "n/gpu3": "c2", "n/gpu1": "c1"}
    result = plan(
        intent(("n/gpu0", hbm(1)), ("n/gpu3", hbm(1)), rid="a", cross_domain_bytes_per_s=5 * GB),
        intent(("n/gpu1", hbm(1)), rid="b", sharing="shared"),
        clusters=clusters,
    )
    lease = NOW + timedelta(seconds=300)
    assert result.outcomes == (Accepted(lease, "c2"), Accepted(lease, "c1"))
    assert allocation_cluster(["x", "n/gpu0"], clusters) is None
    assert plan(intent(("n/gpu3", hbm(1)))).outcomes == (Accepted(lease, None),)  # no clusters known


def test_cross_domain_use_is_summed_per_known_cluster() -> None:
    uses = [
        CrossDomainUse("a", "c1", 10 * GB),
        CrossDomainUse("b", "c1", 5 * GB),
        CrossDomainUse("c", "c2", 1 * GB),
        CrossDomainUse("d", None, 7 * GB),  # a cluster the ledger does not know is charged to none
        CrossDomainUse("e", "c3", 0),
    ]
    assert cross_domain_used(uses) == {"c1": 15 * GB, "c2": 1 * GB}


# -- the property: whatever is asked, what is accepted never puts an exclusive group beside another replica


commits = st.lists(
    st.tuples(
        st.lists(st.integers(0, 3), min_size=1, max_size=3, unique=True),  # GPUs of the group
        st.sampled_from(["exclusive", "shared"]),
        st.integers(1, 40),  # GB per GPU
        st.booleans(),  # a request instead of a replica (inside the first accepted replica)
    ),
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(commits=commits, start_shared=st.booleans())
def test_accepted_replicas_never_put_an_exclusive_group_beside_another_replica(
    commits: list[tuple[list[int], str, int, bool]], start_shared: bool
) -> None:
    start = view(gpu("n/gpu0"), gpu("n/gpu1", reserved_gb=5, shared=start_shared), gpu("n/gpu2"), gpu("n/gpu3"))
    intents = []
    for n, (gpus, sharing, gb, is_request) in enumerate(commits):
        extra: dict[str, Any] = {"kind": "request", "parent_id": "al-0"} if is_request else {"sharing": sharing}
        shares = [(f"n/gpu{g}", hbm(gb) if not is_request else hbm(kv_gb=gb)) for g in gpus]
        intents.append(intent(*shares, rid=f"r{n}", **extra))
    result = plan_commits(intents, view=start, existing={}, now=NOW, default_lease_s=60)
    # Holders per GPU: the starting one on gpu1, then every accepted replica.
    holders: dict[str, list[str]] = {"n/gpu1": ["shared" if start_shared else "exclusive"]}
    assert all(intents[i].kind == "replica" for i, _ in result.accepted)  # request holds are refused
    for i, _ in result.accepted:
        for acc in intents[i].accelerator_ids:
            holders.setdefault(acc, []).append(intents[i].sharing)
    for acc, sharings in holders.items():
        assert len(sharings) == 1 or set(sharings) == {"shared"}, (acc, sharings)
        assert result.view[acc].shared == (set(sharings) == {"shared"})
        assert result.view[acc].reserved <= result.view[acc].usable
