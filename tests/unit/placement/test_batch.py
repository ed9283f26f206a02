"""``decide_batch``: several requests decided together, against the online ``decide`` + ``apply`` loop."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import HealthCheck, given, settings

from shared.domain.placement import Decision, FleetSnapshot, PlacementRequest, apply, decide
from shared.domain.placement.batch import decide_batch
from tests.unit.placement.builders import node, request, small_instances, snapshot


def online(snap: FleetSnapshot, reqs: Sequence[PlacementRequest]) -> list[Decision]:
    decisions = []
    for r in reqs:
        decisions.append(decide(snap, r))
        snap = apply(snap, decisions[-1])
    return decisions


def test_a_request_that_can_go_elsewhere_leaves_the_only_fit_to_one_that_cannot() -> None:
    # llama3-70b fp8 at 8k x 16 needs 116.1 GB per GPU at TP=1 (only the H200 holds it) or 58.8 GB at
    # TP=2 (the H100 pair). Online, the first request takes the H200 (fewest GPUs) and the second,
    # pinned to TP=1, fits nowhere; decided together, the pinned one goes first and both are placed.
    snap = snapshot(node("h100").nvswitch(2), node("h200").sku("H200-SXM-141GB").nvswitch(1))
    shape = {"dtype": "fp8", "context_tokens": 8192, "concurrency": 16}
    reqs = [request("llama3-70b", request_id="a", **shape), request("llama3-70b", request_id="b", tp=1, **shape)]
    assert sum(d.placed for d in online(snap, reqs)) == 1
    plan = decide_batch(snap, reqs)
    assert plan.placed == 2
    assert [(d.node, d.tp) for d in plan.decisions] == [("h100", 2), ("h200", 1)]
    assert plan.order == (1, 0)


def test_one_large_replica_yields_to_several_smaller_ones() -> None:
    # A TP=8 replica first takes the whole node online; the batch places the four TP=2 ones instead,
    # and the large one's refusal is a real one: nothing is left for it.
    snap = snapshot(node("a").nvswitch(8))
    reqs = [
        request("llama3-70b", request_id="big", tp=8),
        *(request("llama3-70b", request_id=f"s{i}", tp=2) for i in range(4)),
    ]
    assert [d.placed for d in online(snap, reqs)] == [True, False, False, False, False]
    plan = decide_batch(snap, reqs)
    assert [d.placed for d in plan.decisions] == [False, True, True, True, True]
    assert plan.decisions[0] == decide(plan.snapshot, reqs[0])
    assert plan.decisions[0].error_code is not None and plan.decisions[0].error_code.value == "no_capacity"


def test_a_request_refused_from_the_start_costs_the_search_nothing() -> None:
    snap = snapshot(node("a").nvswitch(1))
    reqs = [request("llama3-405b", request_id="huge", tp=1), request("llama3-8b", request_id="small")]
    plan = decide_batch(snap, reqs)
    assert [d.placed for d in plan.decisions] == [False, True]
    assert plan.order == (1, 0)


def test_no_budget_keeps_the_best_start_order() -> None:
    snap = snapshot(node("a").nvswitch(8))
    reqs = [request("llama3-70b", request_id="big", tp=8), request("llama3-70b", request_id="s", tp=2)]
    plan = decide_batch(snap, reqs, max_decisions=0)
    # No local search: the start orders (as given, largest first, smallest first) still place one.
    assert plan.placed == 1
    assert plan.decisions_made == 2 + 2 * 2 + 1  # sizes, two distinct starts of two, one refusal


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(small_instances(pods=True))
def test_the_plan_is_a_valid_online_sequence_and_never_worse(
    instance: tuple[FleetSnapshot, list[PlacementRequest]],
) -> None:
    snap, reqs = instance
    plan = decide_batch(snap, reqs, max_decisions=200)
    assert plan.placed >= sum(d.placed for d in online(snap, reqs))
    assert sorted(plan.order) == list(range(len(reqs)))
    # Each placed decision is decide's on the snapshot after those placed before it in the order.
    current = snap
    for i in plan.order:
        decision = plan.decisions[i]
        if decision.placed:
            assert decision == decide(current, reqs[i])
            current = apply(current, decision)
        else:
            assert decision == decide(plan.snapshot, reqs[i])
    assert current == plan.snapshot
    placed = [i for i in plan.order if plan.decisions[i].placed]
    assert list(plan.order[: len(placed)]) == placed
    assert plan.decisions_made <= max(200, 5 * len(reqs)) + 2 * len(reqs)
    assert decide_batch(snap, reqs, max_decisions=200) == plan
