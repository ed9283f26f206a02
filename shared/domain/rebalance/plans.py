"""The rebalancer's planners: which replicas to move, and the plan that moves them make-before-break.

Every planner is pure: it reads a ``FleetSnapshot`` and the replicas the rebalancer knows of (from
PLACEMENT and LEDGER events) and asks the placement core's ``decide`` where each copy would go. A
move re-asks the replica's own request (with a new request id) on the snapshot where the earlier
moves' copies are already placed and every old replica still holds its accelerators: that is the
state the fleet is in when the copy is really placed, because a plan places every copy before it
releases any old replica (make-before-break as a unit, ``plan_of``). So at no step is a replica
without a placement, and no step holds more bytes than an accelerator offers (``apply`` checks it).

A ``Plan`` is a value; the service runs it one step at a time (``next_step``), recording each outcome
(``step_done`` / ``step_failed``, or ``copy_failed`` when a copy's engine does not come up before its old
replica is drained) and, for a failed plan, releasing the copies already placed (``rolled_back``).
Time is handed in (``now``), never read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Literal

from shared.domain.fleet import AcceleratorId, cluster_key
from shared.domain.placement.types import Decision, FleetSnapshot, PlacementRequest, apply
from shared.domain.placement.withhold import withhold
from shared.domain.topology.tpu import TpuSlice

Decide = Callable[[FleetSnapshot, PlacementRequest], Decision]
"""``placement.decide`` with its default profile (or any function with its promises)."""

PlanKind = Literal["replicate", "consolidate", "defragment", "throttle", "replace"]
PlanState = Literal["open", "running", "done", "failed", "rolled_back"]
StepAction = Literal["place", "release"]
StepState = Literal["pending", "done", "failed", "rolled_back"]

__all__ = [
    "Decide",
    "Move",
    "Plan",
    "PlanKind",
    "PlanState",
    "Replica",
    "Step",
    "StepAction",
    "StepState",
    "broken_groups",
    "consolidate",
    "copy_failed",
    "move_request",
    "next_step",
    "plan_of",
    "replace",
    "replica_of",
    "replicate_plan",
    "rolled_back",
    "step_done",
    "step_failed",
]


@dataclass(frozen=True, slots=True)
class Replica:
    """A placed replica as the rebalancer knows it (from PLACEMENT/LEDGER events)."""

    allocation_id: str
    tenant: str
    request: PlacementRequest  # what placement was asked (re-asked with a new request_id to move it)
    node: str | None  # GPU replicas: first node; TPU: None
    accelerators: tuple[str, ...]  # GPU ids, or TPU chip ids
    tp: int
    cluster: str  # "<region>/<cluster>"
    bytes_per_accelerator: Mapping[str, int]
    tpu_pod: str | None = None
    tpu_slice: TpuSlice | None = None


@dataclass(frozen=True, slots=True)
class Move:
    """One replica to copy elsewhere, then release: ``decision`` is where the pure ``decide`` put the
    copy when planning (advisory: the service asks placement again with ``avoid`` withheld)."""

    replica: Replica
    avoid: frozenset[str]  # accelerators the new copy must not use (placement withholds them)
    decision: Decision


def replica_of(allocation_id: str, request: PlacementRequest, decision: Decision) -> Replica:
    """The replica a placed ``decision`` for ``request`` became (``ValueError`` when it was refused)."""
    if not decision.placed or decision.share is None:
        raise ValueError(f"decision {decision.request_id} is not placed")
    cluster = cluster_key(decision.region or "", decision.cluster or "")
    if decision.tpu is not None:
        chips = decision.tpu.chips
        return Replica(
            allocation_id=allocation_id,
            tenant=request.tenant,
            request=request,
            node=None,
            accelerators=chips,
            tp=decision.tp or len(chips),
            cluster=cluster,
            bytes_per_accelerator=dict.fromkeys(chips, decision.share.total),
            tpu_pod=decision.tpu.pod,
            tpu_slice=decision.tpu.slice,
        )
    return Replica(
        allocation_id=allocation_id,
        tenant=request.tenant,
        request=request,
        node=decision.node,
        accelerators=decision.accelerators,
        tp=decision.tp or len(decision.accelerators),
        cluster=cluster,
        bytes_per_accelerator=dict.fromkeys(decision.accelerators, decision.share.total),
    )


def move_request(replica: Replica) -> PlacementRequest:
    """The replica's own request, re-asked for its copy: the same demand under a new request id
    (``<allocation_id>:move``), so placement's idempotency does not answer with the old decision."""
    return dataclasses.replace(replica.request, request_id=f"{replica.allocation_id}:move")


def _gpus_of(snapshot: FleetSnapshot, node: str) -> frozenset[str]:
    profile = snapshot.nodes[node]
    return frozenset(profile.accelerator_id(acc.index) for acc in profile.accelerators)


def _on_node(snapshot: FleetSnapshot, replica: Replica, node: str) -> bool:
    """Whether any of the replica's GPUs is on ``node`` (a multi-node group counts on each of its nodes)."""
    if replica.node == node:
        return True
    for acc in replica.accelerators:
        cap = snapshot.capacity.get(acc)
        if cap is not None and cap.node == node:
            return True
    return False


def _known_holders(snapshot: FleetSnapshot, replicas: Sequence[Replica], gpus: frozenset[str]) -> bool:
    """Whether the known replicas account for every byte reserved on ``gpus``: a GPU holding bytes of
    an allocation the rebalancer does not know of cannot be emptied by moving what it knows."""
    known: dict[str, int] = {}
    for replica in replicas:
        for acc, nbytes in replica.bytes_per_accelerator.items():
            if acc in gpus:
                known[acc] = known.get(acc, 0) + nbytes
    return all(snapshot.capacity[acc].reserved <= known.get(acc, 0) for acc in gpus if acc in snapshot.capacity)


def _plan_moves(
    snapshot: FleetSnapshot, movers: Sequence[Replica], avoid: frozenset[str], decide: Decide
) -> list[Move] | None:
    """A copy for each of ``movers`` in order, each decided on ``snapshot`` with the earlier copies
    applied and ``avoid`` withheld; None as soon as one has no placement."""
    moves: list[Move] = []
    so_far = snapshot
    for replica in movers:
        decision = decide(withhold(so_far, avoid), move_request(replica))
        if not decision.placed:
            return None
        so_far = apply(so_far, decision)  # the old replica still counted: make-before-break
        moves.append(Move(replica=replica, avoid=avoid, decision=decision))
    return moves


def consolidate(
    snapshot: FleetSnapshot,
    replicas: Sequence[Replica],
    cold_nodes: Sequence[str],
    *,
    decide: Decide,
    max_nodes: int = 1,
) -> list[Move]:
    """Moves that empty up to ``max_nodes`` of ``cold_nodes`` (coldest first, in the order given) whole.

    A node is drained only when every replica on it (and on the nodes already chosen) gets a decision
    on ``withhold(snapshot_so_far, GPUs of every node being drained)``, where ``snapshot_so_far`` has
    the earlier moves' copies applied and every old replica still counted (make-before-break). When a
    node joins, the moves of the nodes already chosen are decided again with the larger withheld set,
    so every move's ``avoid`` is the same (all drained nodes' GPUs) and each ``decision`` is what
    placement answers when the plan runs on an unchanged fleet. A node that cannot be drained whole is
    skipped (no partial drains), as is one holding bytes of allocations not in ``replicas``, an
    unknown node, or one with nothing on it. Returns the moves in order (node by node, in the
    replicas' order within a node); [] when no node can be drained. Copies may land on cold nodes that
    are not drained (placement's scores choose). Cost: a node that joins re-decides the moves of the
    nodes before it, O(max_nodes^2) nodes' replicas in all; ``max_nodes`` is small (migrations are
    rate-limited per cluster).
    """
    chosen: list[str] = []
    moves: list[Move] = []
    for node in cold_nodes:
        if len(chosen) >= max_nodes:
            break
        if node in chosen or node not in snapshot.nodes:
            continue
        gpus = _gpus_of(snapshot, node)
        on_it = [r for r in replicas if _on_node(snapshot, r, node)]
        if not on_it or not _known_holders(snapshot, replicas, gpus):
            continue
        draining = [*chosen, node]
        avoid = frozenset().union(*(_gpus_of(snapshot, n) for n in draining))
        movers: list[Replica] = []
        seen: set[str] = set()
        for name in draining:
            for replica in replicas:
                if replica.allocation_id not in seen and _on_node(snapshot, replica, name):
                    seen.add(replica.allocation_id)
                    movers.append(replica)
        planned = _plan_moves(snapshot, movers, avoid, decide)
        if planned is None:
            continue
        chosen.append(node)
        moves = planned
    return moves


def broken_groups(replicas: Sequence[Replica], node: str, cliques: Sequence[frozenset[str]]) -> list[Replica]:
    """TP>1 GPU replicas on ``node`` whose accelerators are no longer all inside one clique of the
    node's new NVLink graph (``cliques``: its maximal all-pairs-NVLinked groups, as accelerator ids).
    A group is on ``node`` when ``node`` is its first node or one of its GPUs is on it (names compared
    exactly, never as prefixes)."""
    broken: list[Replica] = []
    for replica in replicas:
        if replica.tpu_pod is not None or replica.tp <= 1 or len(replica.accelerators) <= 1:
            continue
        if replica.node != node and not any(AcceleratorId.on_host(acc, node) for acc in replica.accelerators):
            continue
        group = frozenset(replica.accelerators)
        if not any(group <= clique for clique in cliques):
            broken.append(replica)
    return broken


def replace(snapshot: FleetSnapshot, replicas: Sequence[Replica], *, decide: Decide) -> list[Move]:
    """A move for each replica (broken TP groups, a draining node's...), in order: its copy decided on
    ``snapshot`` with the earlier moves' copies applied, the old replicas still counted, and its own
    accelerators withheld (``avoid``). A replica without a placeable copy is left out (the others
    still move)."""
    moves: list[Move] = []
    so_far = snapshot
    for replica in replicas:
        avoid = frozenset(replica.accelerators)
        decision = decide(withhold(so_far, avoid), move_request(replica))
        if not decision.placed:
            continue
        so_far = apply(so_far, decision)
        moves.append(Move(replica=replica, avoid=avoid, decision=decision))
    return moves


# -- plans ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Step:
    """One action of a plan. ``allocation_id`` is the old replica's; a done ``place`` step records the
    copy's allocation in ``new_allocation_id`` (what a rollback releases)."""

    action: StepAction
    allocation_id: str
    avoid: tuple[str, ...] = ()
    new_allocation_id: str | None = None
    state: StepState = "pending"


@dataclass(frozen=True, slots=True)
class Plan:
    """A migration, defragmentation or replication the rebalancer runs step by step."""

    plan_id: str
    kind: PlanKind
    cluster: str
    target: str  # node, pod, replica...
    reason: str
    created_at: datetime
    state: PlanState = "open"
    steps: tuple[Step, ...] = ()


def plan_of(
    kind: PlanKind,
    plan_id: str,
    cluster: str,
    target: str,
    reason: str,
    now: datetime,
    moves: Sequence[Move],
) -> Plan:
    """A plan that runs ``moves`` make-before-break as a unit: every ``place`` step first (in move
    order, each with its move's ``avoid``, sorted), then every ``release`` step (same order). So no old
    replica is released before every copy is placed, and a failed place leaves every old replica
    serving. ``ValueError`` for no moves (a plan that does nothing is the caller's mistake)."""
    if not moves:
        raise ValueError(f"plan {plan_id}: no moves")
    places = tuple(Step("place", m.replica.allocation_id, tuple(sorted(m.avoid))) for m in moves)
    releases = tuple(Step("release", m.replica.allocation_id) for m in moves)
    return Plan(plan_id, kind, cluster, target, reason, now, steps=places + releases)


def replicate_plan(
    replica: Replica, plan_id: str, now: datetime, *, reason: str = "hot replica: a copy onto idle capacity"
) -> Plan:
    """One ``place`` step: a copy of a hot replica, which keeps serving (no release). The copy avoids
    the replica's own accelerators, where it would add no compute."""
    step = Step("place", replica.allocation_id, tuple(sorted(replica.accelerators)))
    return Plan(plan_id, "replicate", replica.cluster, replica.allocation_id, reason, now, steps=(step,))


def next_step(plan: Plan) -> int | None:
    """The index of the first pending step; None when the plan is finished, failed or rolled back."""
    if plan.state not in ("open", "running"):
        return None
    return next((i for i, step in enumerate(plan.steps) if step.state == "pending"), None)


def _with_step(plan: Plan, index: int, step: Step, state: PlanState) -> Plan:
    steps = (*plan.steps[:index], step, *plan.steps[index + 1 :])
    return dataclasses.replace(plan, steps=steps, state=state)


def step_done(plan: Plan, index: int, *, new_allocation_id: str | None = None, skipped: bool = False) -> Plan:
    """The plan with step ``index`` done: ``running``, or ``done`` once every step is.

    Steps run in order: ``index`` must be ``next_step(plan)`` (``ValueError`` otherwise), which is what
    keeps every release after every place. A ``place`` step needs ``new_allocation_id`` (the copy a
    rollback would release), unless ``skipped``: the old replica was released meanwhile, so there is
    nothing to copy (its release step is then skipped too). Recording a done step again with the same
    copy returns the plan unchanged (a redelivered outcome)."""
    step = plan.steps[index]
    if step.state == "done" and step.new_allocation_id == new_allocation_id:
        return plan
    if index != next_step(plan):
        raise ValueError(f"plan {plan.plan_id} ({plan.state}): step {index} is not the next one to run")
    if step.action == "place" and new_allocation_id is None and not skipped:
        raise ValueError(f"plan {plan.plan_id}: place step {index} done without the copy's allocation id")
    done = dataclasses.replace(step, state="done", new_allocation_id=new_allocation_id)
    finished = all(s.state == "done" for i, s in enumerate(plan.steps) if i != index)
    return _with_step(plan, index, done, "done" if finished else "running")


def step_failed(plan: Plan, index: int) -> tuple[Plan, list[str]]:
    """Record that step ``index`` failed; returns the plan and the copies to release (a rollback).

    A ``place`` failing fails the plan: the step is ``failed`` and the copies already placed (their
    ``new_allocation_id``, in step order) must be released; the old replicas are untouched, since no
    release runs before every place is done. Once they are released, ``rolled_back(plan)``. The steps
    that never ran stay ``pending`` (``next_step`` is None for a failed plan).

    A ``release`` failing leaves everything as it was (returns the plan unchanged and []): every copy
    is placed, the old replica still holds its accelerators and the copy serves, so undoing the copies
    would throw away work that succeeded; the caller retries the release (it stays the next step).
    ``ValueError`` when ``index`` is not the next step to run.
    """
    if index != next_step(plan):
        raise ValueError(f"plan {plan.plan_id} ({plan.state}): step {index} is not the next one to run")
    step = plan.steps[index]
    if step.action == "release":
        return plan, []
    copies = [s.new_allocation_id for s in plan.steps[:index] if s.action == "place" and s.new_allocation_id]
    return _with_step(plan, index, dataclasses.replace(step, state="failed"), "failed"), copies


def copy_failed(plan: Plan, index: int) -> tuple[Plan, list[str]]:
    """Record that the copy of release step ``index``'s replica will not serve (its engine failed, or it was
    not ready in time); returns the plan and the copies to release (a rollback).

    The plan fails before that old replica is drained: the release step is ``failed``, and the copies of
    every move whose old replica is not released yet (this one and the later ones, in step order) are to
    be released, so each of those old replicas keeps serving. Moves already done stay done: their old
    replicas are gone and their copies serve. Once the copies are released, ``rolled_back(plan)``.
    ``ValueError`` when ``index`` is not the next step to run or not a release."""
    if index != next_step(plan):
        raise ValueError(f"plan {plan.plan_id} ({plan.state}): step {index} is not the next one to run")
    step = plan.steps[index]
    if step.action != "release":
        raise ValueError(f"plan {plan.plan_id}: step {index} is a {step.action}, not a release")
    kept = {s.allocation_id for s in plan.steps if s.action == "release" and s.state != "done"}
    copies = [
        s.new_allocation_id
        for s in plan.steps
        if s.action == "place" and s.state == "done" and s.new_allocation_id and s.allocation_id in kept
    ]
    return _with_step(plan, index, dataclasses.replace(step, state="failed"), "failed"), copies


def rolled_back(plan: Plan) -> Plan:
    """A failed plan once its placed copies are released: ``rolled_back``, those place steps too (the
    place steps of moves whose old replica was already released stay ``done``: their copies serve).
    Idempotent; ``ValueError`` for a plan that has not failed."""
    if plan.state == "rolled_back":
        return plan
    if plan.state != "failed":
        raise ValueError(f"plan {plan.plan_id} is {plan.state}, not failed: nothing to roll back")
    moved = {s.allocation_id for s in plan.steps if s.action == "release" and s.state == "done"}
    steps = tuple(
        dataclasses.replace(s, state="rolled_back")
        if s.action == "place" and s.state == "done" and s.allocation_id not in moved
        else s
        for s in plan.steps
    )
    return dataclasses.replace(plan, steps=steps, state="rolled_back")
