"""The rebalancer's GPU planners (issue 16) on real snapshots with the real ``decide``: consolidation
frees whole nodes make-before-break, broken TP groups are re-placed on NVLink cliques, and plans run
step by step with rollback. ``run_plan`` is the step-by-step simulator the property tests share."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pytest

from shared.domain.placement.decide import decide
from shared.domain.placement.types import Decision, FleetSnapshot, PlacementRequest, apply
from shared.domain.placement.withhold import withhold
from shared.domain.rebalance.plans import (
    Move,
    Plan,
    Replica,
    broken_groups,
    consolidate,
    copy_failed,
    move_request,
    next_step,
    plan_of,
    replace,
    replica_of,
    replicate_plan,
    rolled_back,
    step_done,
    step_failed,
)
from shared.domain.sim.engine import release
from shared.domain.topology import LinkMatrix, maximal_nvlink_cliques
from tests.unit.placement.builders import NodeBuilder, node, request, snapshot

NOW = datetime(2025, 1, 1, tzinfo=UTC)  # a fake clock: plans only record it

# -- fixtures and the step-by-step simulator --------------------------------------------------------


def place_all(
    snap: FleetSnapshot, asks: Iterable[PlacementRequest]
) -> tuple[FleetSnapshot, list[Replica], dict[str, Decision]]:
    """Place each request in turn with ``decide`` (refusals skipped): the snapshot after, the replicas
    (allocation ``alloc-<request_id>``) and each allocation's decision."""
    replicas: list[Replica] = []
    decisions: dict[str, Decision] = {}
    for ask in asks:
        decision = decide(snap, ask)
        if not decision.placed:
            continue
        snap = apply(snap, decision)
        allocation = f"alloc-{ask.request_id}"
        replicas.append(replica_of(allocation, ask, decision))
        decisions[allocation] = decision
    return snap, replicas, decisions


def gpus_of(snap: FleetSnapshot, name: str) -> set[str]:
    profile = snap.nodes[name]
    return {profile.accelerator_id(a.index) for a in profile.accelerators}


def invariant_violations(snap: FleetSnapshot, live: Mapping[str, Decision]) -> list[str]:
    """What is wrong with ``snap`` holding exactly the ``live`` allocations: an accelerator reserving
    more than it offers, bytes that do not add up to the live shares, or an exclusive group (TP>1 or
    not) sharing a GPU with anything else."""
    problems = [f"{a}: {c.reserved} > usable {c.usable}" for a, c in snap.capacity.items() if c.reserved > c.usable]
    expected: dict[str, int] = {}
    holders: dict[str, list[str]] = {}
    for allocation, decision in live.items():
        if decision.tpu is not None:
            continue
        assert decision.share is not None
        for acc in decision.accelerators:
            expected[acc] = expected.get(acc, 0) + decision.share.total
            holders.setdefault(acc, []).append(allocation)
    problems += [
        f"{a}: reserved {c.reserved} != live {expected.get(a, 0)}"
        for a, c in snap.capacity.items()
        if c.reserved != expected.get(a, 0)
    ]
    for allocation, decision in live.items():
        if decision.sharing == "exclusive":
            for acc in decision.accelerators:
                if holders.get(acc, [allocation]) != [allocation]:
                    problems.append(f"exclusive {allocation} (tp={decision.tp}) shares {acc} with {holders[acc]}")
    return problems


@dataclass
class Run:
    """The outcome of running a plan step by step: the snapshot after, the live allocations, the
    plan's final value, and every violation seen after any step."""

    snapshot: FleetSnapshot
    live: dict[str, Decision]
    plan: Plan
    violations: list[str] = field(default_factory=list)
    copies: dict[str, str] = field(default_factory=dict)  # old allocation -> its copy


def run_plan(snap: FleetSnapshot, live: Mapping[str, Decision], plan: Plan, moves: Sequence[Move]) -> Run:
    """Run ``plan`` as the service would: each ``place`` asks ``decide`` again with the step's ``avoid``
    withheld and applies the answer, each ``release`` frees the old replica (``sim.engine.release``).
    After every step the ledger invariants are checked and every moved replica must still have a
    placement (its old copy, its new one, or both)."""
    by_allocation = {m.replica.allocation_id: m for m in moves}
    run = Run(snap, dict(live), plan)
    while (index := next_step(run.plan)) is not None:
        step = run.plan.steps[index]
        move = by_allocation[step.allocation_id]
        if step.action == "place":
            decision = decide(withhold(run.snapshot, step.avoid), move_request(move.replica))
            if not decision.placed:
                run.violations.append(f"{step.allocation_id}: the copy found no placement when the plan ran")
                break
            if decision.accelerators != move.decision.accelerators:
                run.violations.append(f"{step.allocation_id}: placed on {decision.accelerators}, planned elsewhere")
            run.snapshot = apply(run.snapshot, decision)
            new_id = f"{step.allocation_id}+copy"
            run.live[new_id] = decision
            run.copies[step.allocation_id] = new_id
            run.plan = step_done(run.plan, index, new_allocation_id=new_id)
        else:
            run.snapshot = release(run.snapshot, run.live.pop(step.allocation_id))
            run.plan = step_done(run.plan, index)
        run.violations += [f"after step {index}: {p}" for p in invariant_violations(run.snapshot, run.live)]
        for allocation in by_allocation:
            if allocation not in run.live and run.copies.get(allocation) not in run.live:
                run.violations.append(f"after step {index}: {allocation} has no placement")
    return run


# -- consolidation ----------------------------------------------------------------------------------


def place_on(
    snap: FleetSnapshot, name: str, ask: PlacementRequest, live: dict[str, Decision]
) -> tuple[FleetSnapshot, Replica]:
    """``ask`` placed on node ``name`` (decided with every other node withheld), recorded in ``live``."""
    others = set().union(*(gpus_of(snap, n) for n in snap.nodes if n != name))
    decision = decide(withhold(snap, others), ask)
    assert decision.placed and decision.node == name, decision.message
    allocation = f"alloc-{ask.request_id}"
    live[allocation] = decision
    return apply(snap, decision), replica_of(allocation, ask, decision)


def test_consolidation_frees_whole_nodes_make_before_break() -> None:
    """Three 8-GPU H100 nodes; the busy one (a) holds a TP=4 70B and an 8B; the cold ones hold an 8B
    (b) and a TP=2 8B (c). Draining b and c (max 2) moves their two replicas to a; every copy is placed
    while the old one still holds its GPUs, then the old ones are released: b and c end idle, a's own
    replicas stay where they were, and no replica is ever without a placement."""
    snap = snapshot(node("a"), node("b"), node("c"))
    live: dict[str, Decision] = {}
    replicas: list[Replica] = []
    for name, ask in (
        ("a", request("llama3-70b", request_id="big", tp=4)),
        ("a", request("llama3-8b", request_id="small-a")),
        ("b", request("llama3-8b", request_id="small-b")),
        ("c", request("llama3-8b", request_id="pair-c", tp=2)),
    ):
        snap, replica = place_on(snap, name, ask, live)
        replicas.append(replica)

    moves = consolidate(snap, replicas, ["b", "c"], decide=decide, max_nodes=2)

    assert [m.replica.allocation_id for m in moves] == ["alloc-small-b", "alloc-pair-c"]
    drained = gpus_of(snap, "b") | gpus_of(snap, "c")
    assert all(m.avoid == drained for m in moves)
    assert all(m.decision.node == "a" for m in moves)
    plan = plan_of("consolidate", "p1", "us-west-1/c1", "b,c", "cold nodes", NOW, moves)
    assert [(s.action, s.allocation_id) for s in plan.steps] == [
        ("place", "alloc-small-b"),
        ("place", "alloc-pair-c"),
        ("release", "alloc-small-b"),
        ("release", "alloc-pair-c"),
    ]
    run = run_plan(snap, live, plan, moves)
    assert run.violations == []
    assert run.plan.state == "done"
    assert all(run.snapshot.capacity[g].reserved == 0 for g in drained)
    assert run.live["alloc-big"] == live["alloc-big"] and run.live["alloc-small-a"] == live["alloc-small-a"]


def test_a_node_that_cannot_be_drained_whole_is_skipped() -> None:
    """b is the coldest but holds a TP=8 70B that fits nowhere else (a has gpu0 held by another
    replica, c an 8B): b is skipped, with no partial drain, and c (its 8B fits on a) is drained instead."""
    snap = snapshot(node("a").reserve(0, 10**9), node("b"), node("c"))
    live: dict[str, Decision] = {}
    snap, wide = place_on(snap, "b", request("llama3-70b", request_id="wide", tp=8), live)
    snap, small = place_on(snap, "c", request("llama3-8b", request_id="small-c"), live)

    moves = consolidate(snap, [wide, small], ["b", "c"], decide=decide, max_nodes=1)

    assert [m.replica.allocation_id for m in moves] == ["alloc-small-c"]
    assert moves[0].decision.node == "a" and moves[0].avoid == gpus_of(snap, "c")
    assert consolidate(snap, [wide, small], ["b"], decide=decide, max_nodes=3) == []


def test_consolidation_respects_max_nodes_and_unknown_holders() -> None:
    """b holds bytes of an allocation the rebalancer does not know of (gpu3): b is skipped. Of c and d
    (an 8B each) only the first is drained with max_nodes 1, both with 2; every move then avoids both."""
    snap = snapshot(node("a"), node("b").reserve(3, 10**9), node("c"), node("d"))
    live: dict[str, Decision] = {}
    replicas: list[Replica] = []
    for name in ("b", "c", "d"):
        snap, replica = place_on(snap, name, request("llama3-8b", request_id=f"on-{name}"), live)
        replicas.append(replica)

    one = consolidate(snap, replicas, ["b", "c", "d"], decide=decide)
    two = consolidate(snap, replicas, ["b", "c", "d"], decide=decide, max_nodes=2)

    assert [m.replica.allocation_id for m in one] == ["alloc-on-c"]
    assert [m.replica.allocation_id for m in two] == ["alloc-on-c", "alloc-on-d"]
    assert all(m.avoid == gpus_of(snap, "c") | gpus_of(snap, "d") for m in two)
    assert consolidate(snap, replicas, ["b"], decide=decide) == []
    assert consolidate(snap, replicas, ["nowhere", "a"], decide=decide) == []  # unknown; nothing on a
    assert consolidate(snap, replicas, ["c"], decide=decide, max_nodes=0) == []


# -- a changed NVLink domain ------------------------------------------------------------------------


def nvswitch_without(pairs: Iterable[tuple[int, int]], gpus: int = 8) -> LinkMatrix:
    """An NVSwitch node with the NVLink of each pair in ``pairs`` down (the pair talks over SYS)."""
    down = {frozenset(p) for p in pairs}
    codes = [
        ["X" if i == j else "SYS" if frozenset((i, j)) in down else "NV18" for j in range(gpus)] for i in range(gpus)
    ]
    return LinkMatrix.from_codes(codes, numa=[2 * i // gpus for i in range(gpus)])


def cliques_of(snap: FleetSnapshot, name: str) -> list[frozenset[str]]:
    profile = snap.nodes[name]
    return [frozenset(profile.accelerator_id(i) for i in clique) for clique in maximal_nvlink_cliques(profile.links)]


def degraded(builders: Sequence[NodeBuilder], decisions: Iterable[Decision]) -> FleetSnapshot:
    """The fleet the topology service reports after a link change, holding the same allocations."""
    snap = snapshot(*builders)
    for decision in decisions:
        snap = apply(snap, decision)
    return snap


def test_a_node_whose_nvlink_domain_changes_has_its_tp_groups_replaced_on_cliques() -> None:
    """Node a (NVSwitch) holds a TP=4 70B on gpu0-3 and a TP=2 8B on gpu4-5. Then the NVLink between
    gpu4 and gpu5 goes down: the cliques are {0-4,6,7} and {0-3,5-7}, so the TP=2 group is broken and
    the TP=4 one is not. The broken group is re-placed on a clique (gpu6-7, the only idle pair, away
    from its old GPUs) while the old one still holds gpu4-5, and then the old one is released."""
    asks = [request("llama3-70b", request_id="tp4", tp=4), request("llama3-8b", request_id="tp2", tp=2)]
    _, replicas, live = place_all(snapshot(node("a")), asks)
    assert [r.accelerators for r in replicas] == [tuple(f"a/gpu{i}" for i in range(4)), ("a/gpu4", "a/gpu5")]
    snap = degraded([node("a").links(nvswitch_without([(4, 5)]))], live.values())
    cliques = cliques_of(snap, "a")
    assert sorted(len(c) for c in cliques) == [7, 7]

    broken = broken_groups(replicas, "a", cliques)
    assert [r.allocation_id for r in broken] == ["alloc-tp2"]
    moves = replace(snap, broken, decide=decide)

    assert [m.decision.accelerators for m in moves] == [("a/gpu6", "a/gpu7")]
    assert moves[0].avoid == {"a/gpu4", "a/gpu5"}
    assert any(frozenset(moves[0].decision.accelerators) <= clique for clique in cliques)
    plan = plan_of("replace", "p2", replicas[1].cluster, "a", "NVLink a/gpu4-a/gpu5 down", NOW, moves)
    run = run_plan(snap, live, plan, moves)
    assert run.violations == []
    assert "alloc-tp2" not in run.live and run.copies["alloc-tp2"] in run.live
    assert run.live["alloc-tp4"] == live["alloc-tp4"]
    assert run.snapshot.capacity["a/gpu4"].reserved == run.snapshot.capacity["a/gpu5"].reserved == 0


def test_broken_groups_reads_only_tp_groups_on_the_node() -> None:
    """a holds an 8B (gpu0), a TP=4 70B (gpu4-7) and a TP=2 8B (gpu1-2); b a TP=4 70B. When a's
    NVLink graph splits into {0,1} and {2..7}, only the TP=2 group (gpu1 and gpu2 in different cliques)
    is broken: TP=1 replicas never are, the TP=4 stays inside {2..7}, and b's group is not on a."""
    snap = snapshot(node("a"), node("b"))
    live: dict[str, Decision] = {}
    replicas: list[Replica] = []
    for name, ask in (
        ("a", request("llama3-8b", request_id="one")),
        ("a", request("llama3-70b", request_id="four", tp=4)),
        ("a", request("llama3-8b", request_id="two", tp=2)),
        ("b", request("llama3-70b", request_id="four-b", tp=4)),
    ):
        snap, replica = place_on(snap, name, ask, live)
        replicas.append(replica)
    assert [r.accelerators for r in replicas[:3]] == [
        ("a/gpu0",),
        ("a/gpu4", "a/gpu5", "a/gpu6", "a/gpu7"),
        ("a/gpu1", "a/gpu2"),
    ]
    split = [frozenset({"a/gpu0", "a/gpu1"}), frozenset(f"a/gpu{i}" for i in range(2, 8))]

    assert [r.allocation_id for r in broken_groups(replicas, "a", split)] == ["alloc-two"]
    assert [r.allocation_id for r in broken_groups(replicas, "a", [])] == ["alloc-four", "alloc-two"]
    assert broken_groups(replicas, "b", cliques_of(snap, "b")) == []


def test_a_group_is_on_a_node_by_its_exact_name_never_a_prefix() -> None:
    """Issue 23 row 3: node `a`'s NVLink change says nothing of node `a/x`'s group (ids `a/x/gpu<i>`,
    which a `startswith("a/")` test put on `a`), nor of `ab`'s."""
    ask = request("llama3-8b", request_id="two", tp=2)
    elsewhere = [
        Replica(
            allocation_id=f"alloc-{name}",
            tenant="t",
            request=ask,
            node=name,
            accelerators=(f"{name}/gpu0", f"{name}/gpu1"),
            tp=2,
            cluster="r1/c1",
            bytes_per_accelerator={},
        )
        for name in ("a/x", "ab")
    ]
    assert broken_groups(elsewhere, "a", []) == []
    assert [r.allocation_id for r in broken_groups(elsewhere, "a/x", [])] == ["alloc-a/x"]


def test_replace_leaves_out_a_replica_without_a_copy_and_moves_the_rest() -> None:
    """a holds a TP=8 70B, b an 8B on gpu0. The TP=8 group has no copy (b has 7 idle GPUs, a none
    outside its own), the 8B has one (on b): only the 8B moves, avoiding its own GPU."""
    _, replicas, live = place_all(
        snapshot(node("a"), node("b")),
        [request("llama3-70b", request_id="eight", tp=8), request("llama3-8b", request_id="one")],
    )
    assert [len(r.accelerators) for r in replicas] == [8, 1]
    snap = degraded([node("a"), node("b")], live.values())

    moves = replace(snap, replicas, decide=decide)

    assert [m.replica.allocation_id for m in moves] == ["alloc-one"]
    assert moves[0].avoid == frozenset(replicas[1].accelerators)


# -- plans as values --------------------------------------------------------------------------------


def two_moves() -> list[Move]:
    snap, replicas, _ = place_all(
        snapshot(node("a"), node("b")),
        [request("llama3-8b", request_id="x"), request("llama3-8b", request_id="y")],
    )
    return replace(snap, replicas, decide=decide)


def test_a_plan_places_every_copy_before_releasing_anything() -> None:
    moves = two_moves()
    plan = plan_of("consolidate", "p", "us-west-1/c1", "a", "cold", NOW, moves)
    assert plan.state == "open" and plan.created_at == NOW
    assert [s.action for s in plan.steps] == ["place", "place", "release", "release"]
    assert plan.steps[0].avoid == tuple(sorted(moves[0].avoid))
    assert next_step(plan) == 0
    with pytest.raises(ValueError, match="not the next"):
        step_done(plan, 2)  # a release before the places: refused
    with pytest.raises(ValueError, match="copy"):
        step_done(plan, 0)  # a place without the copy's id: a rollback could not release it
    plan = step_done(plan, 0, new_allocation_id="x2")
    assert plan.state == "running" and next_step(plan) == 1
    assert step_done(plan, 0, new_allocation_id="x2") is plan  # redelivered
    for index, copy in ((1, "y2"), (2, None), (3, None)):
        plan = step_done(plan, index, new_allocation_id=copy)
    assert plan.state == "done" and next_step(plan) is None
    with pytest.raises(ValueError):
        plan_of("consolidate", "p", "us-west-1/c1", "a", "cold", NOW, [])


def test_a_failed_place_rolls_back_the_copies_and_touches_no_old_replica() -> None:
    plan = plan_of("replace", "p", "us-west-1/c1", "a", "link down", NOW, two_moves())
    plan = step_done(plan, 0, new_allocation_id="x2")
    failed, rollback = step_failed(plan, 1)
    assert failed.state == "failed" and rollback == ["x2"]
    assert [s.state for s in failed.steps] == ["done", "failed", "pending", "pending"]
    assert next_step(failed) is None  # no release runs: the old replicas keep serving
    with pytest.raises(ValueError):
        step_done(failed, 2)
    done = rolled_back(failed)
    assert done.state == "rolled_back" and [s.state for s in done.steps][:2] == ["rolled_back", "failed"]
    assert rolled_back(done) is done
    with pytest.raises(ValueError):
        rolled_back(plan)  # a running plan has nothing to roll back
    first, nothing = step_failed(plan_of("replace", "q", "c", "a", "r", NOW, two_moves()), 0)
    assert first.state == "failed" and nothing == []


def test_a_failed_release_is_retried() -> None:
    plan = plan_of("replace", "p", "us-west-1/c1", "a", "link down", NOW, two_moves())
    for index, copy in ((0, "x2"), (1, "y2")):
        plan = step_done(plan, index, new_allocation_id=copy)
    same, rollback = step_failed(plan, 2)
    assert same == plan and rollback == [] and next_step(same) == 2


def test_a_copy_whose_engine_fails_rolls_back_the_moves_not_done_and_keeps_those_done() -> None:
    plan = plan_of("consolidate", "p", "us-west-1/c1", "a", "cold", NOW, two_moves())
    for index, copy in ((0, "x2"), (1, "y2")):
        plan = step_done(plan, index, new_allocation_id=copy)
    with pytest.raises(ValueError, match="not a release"):
        copy_failed(step_done(plan_of("replace", "q", "c", "a", "r", NOW, two_moves()), 0, new_allocation_id="x2"), 1)
    with pytest.raises(ValueError, match="not the next"):
        copy_failed(plan, 3)

    # The first move's copy fails before its old replica is drained: both copies go, both old replicas stay.
    failed, rollback = copy_failed(plan, 2)
    assert failed.state == "failed" and rollback == ["x2", "y2"]
    assert [s.state for s in failed.steps] == ["done", "done", "failed", "pending"] and next_step(failed) is None
    assert [s.state for s in rolled_back(failed).steps] == ["rolled_back", "rolled_back", "failed", "pending"]

    # The first move is done (its old replica released, its copy serves); the second copy fails: only it goes.
    moved = step_done(plan, 2)
    failed, rollback = copy_failed(moved, 3)
    assert rollback == ["y2"]
    after = rolled_back(failed)
    assert after.state == "rolled_back"
    assert [s.state for s in after.steps] == ["done", "rolled_back", "done", "failed"]


def test_a_replicate_plan_is_one_place_step() -> None:
    _, replicas, _ = place_all(snapshot(node("a")), [request("llama3-8b", request_id="hot")])
    plan = replicate_plan(replicas[0], "r1", NOW)
    assert (plan.kind, plan.target, plan.cluster) == ("replicate", "alloc-hot", "us-west-1/c1")
    assert [(s.action, s.avoid) for s in plan.steps] == [("place", replicas[0].accelerators)]
    assert step_done(plan, 0, new_allocation_id="hot2").state == "done"


def test_replica_of_a_refused_decision_is_an_error() -> None:
    refused = Decision(request_id="r", status="rejected")
    with pytest.raises(ValueError):
        replica_of("a", request(), refused)
