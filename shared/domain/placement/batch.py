"""``decide_batch``: several placements decided together, for a caller that holds them at once (a
deployment of several replicas, a queue drained when capacity frees). Pure and deterministic.

The online ``decide`` places one request at a time and cannot see the next one, so it never refuses a
request that fits: one large replica that arrives first takes a whole node even when the five smaller
ones behind it would have fit there instead. A batch sees them all, and the order in which its
requests are decided changes what fits: deciding the 70B replicas before the 8B ones keeps the
large-HBM GPUs for the replicas that need them, and lets the small ones spill to other accelerators
once those are taken.

**Objective.** The most requests placed, then the highest sum of the placed decisions' scores
(``score["total"]``): one more replica placed outweighs any score, as in the MILP reference
(``tests/reference/milp.py``).

**Search.** A candidate solution is an order of the requests. It is *decoded* by deciding its
requests one by one with ``decide`` and ``apply`` (so every placement passes every filter and explains
itself exactly as an online decision does, with the TP degree and candidate ``decide`` picks). Since
placements only take capacity, a request refused in its turn is refused on the final snapshot too: a
refusal in the plan is a real one, never a replica left out while it still fits. The start orders
are the given one, largest first (size: accelerators x bytes per accelerator of the request's
decision on the starting snapshot), largest per accelerator first (the replicas only big GPUs hold)
and smallest first. From each start in turn, the best first, a local search moves one request to the
end (it yields its capacity to the others), to the front, or swaps two, and keeps the first move that
improves the objective, until none does. No further start is tried once a plan places every request
that fits the starting snapshot, and the search stops once ``max_decisions`` ``decide`` calls are
made. A move re-decides only the requests from the first position it changes (the incumbent's
earlier steps are kept).

**Work.** One ``decide`` per request for the sizes, at most four per request for the start orders,
then the local search within ``max_decisions`` calls in all (the order being decoded when the budget
runs out is finished: at most one more per request), and one per request left unplaced, for its
refusal on the final snapshot.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from shared.domain.placement.decide import decide
from shared.domain.placement.framework import DEFAULT_PROFILE, PluginFactory, Profile
from shared.domain.placement.types import Decision, FleetSnapshot, PlacementRequest, apply

DEFAULT_MAX_DECISIONS: Final = 2000
"""``decide`` calls after which ``decide_batch`` stops its local search (about 0.4 ms each on a fleet of
a few nodes: at most about a second for a batch)."""


@dataclass(frozen=True, slots=True)
class BatchPlan:
    """The batch's decisions, one per request in the order given; ``order`` is the order they were
    decided and applied in (indices into the requests: the placed ones, then the refused ones);
    ``snapshot`` is the starting one with every placed decision applied; ``decisions_made`` counts the
    ``decide`` calls spent."""

    decisions: tuple[Decision, ...]
    order: tuple[int, ...]
    snapshot: FleetSnapshot
    decisions_made: int

    @property
    def placed(self) -> int:
        return sum(1 for d in self.decisions if d.placed)


@dataclass(frozen=True, slots=True)
class _Step:
    """One request of an order decided: the snapshot after it, and the placed count and score sum
    of the order so far."""

    snapshot: FleetSnapshot
    decision: Decision | None
    placed: int
    score: float


@dataclass(frozen=True, slots=True)
class _Decoded:
    """An order and its steps (``steps[k]``: after its first k requests; ``steps[0]`` the start)."""

    order: tuple[int, ...]
    steps: tuple[_Step, ...]

    @property
    def value(self) -> tuple[int, float]:
        last = self.steps[-1]
        return last.placed, last.score


class _Decoder:
    """Decides orders of the batch's requests, counting ``decide`` calls."""

    def __init__(
        self,
        requests: Sequence[PlacementRequest],
        profile: Profile,
        registry: Mapping[str, PluginFactory] | None,
    ) -> None:
        self._requests = requests
        self._profile = profile
        self._registry = registry
        self.calls = 0

    def decide(self, snapshot: FleetSnapshot, request: PlacementRequest) -> Decision:
        self.calls += 1
        return decide(snapshot, request, self._profile, registry=self._registry)

    def decode(self, order: tuple[int, ...], known: _Decoded) -> _Decoded:
        """``order`` decided, reusing the steps of ``known`` up to the first position they differ."""
        same = 0
        while same < min(len(order), len(known.order)) and order[same] == known.order[same]:
            same += 1
        steps = list(known.steps[: same + 1])
        for i in order[same:]:
            before = steps[-1]
            decision = self.decide(before.snapshot, self._requests[i])
            if decision.placed:
                total = decision.score["total"] if decision.score is not None else 0.0
                steps.append(_Step(apply(before.snapshot, decision), decision, before.placed + 1, before.score + total))
            else:
                steps.append(_Step(before.snapshot, decision, before.placed, before.score))
        return _Decoded(order, tuple(steps))


def decide_batch(
    snapshot: FleetSnapshot,
    requests: Sequence[PlacementRequest],
    profile: Profile = DEFAULT_PROFILE,
    *,
    registry: Mapping[str, PluginFactory] | None = None,
    max_decisions: int = DEFAULT_MAX_DECISIONS,
) -> BatchPlan:
    """Place ``requests`` together on ``snapshot`` (which is not changed), searching for the order
    that places the most of them, then the best scores (see the module docstring).

    Promises: every placed decision is ``decide``'s on the snapshot after the decisions placed
    before it in ``order``, so it passes every filter; applying them in that order gives ``snapshot``;
    every refused decision is ``decide``'s refusal on that final snapshot; the plan places at least
    as many requests as deciding them online in the order given; the same inputs give the same plan.
    """
    decoder = _Decoder(requests, profile, registry)
    empty = _Decoded((), (_Step(snapshot, None, 0, 0.0),))
    # Requests refused on the starting snapshot are refused on every later one: they take no part.
    first = [decoder.decide(snapshot, request) for request in requests]
    live = tuple(i for i, d in enumerate(first) if d.placed)
    size = {i: _size(first[i]) for i in live}
    each = {i: _per_accelerator(first[i]) for i in live}
    starts = (
        live,
        tuple(sorted(live, key=lambda i: (-size[i], i))),
        tuple(sorted(live, key=lambda i: (-each[i], -size[i], i))),
        tuple(sorted(live, key=lambda i: (size[i], i))),
    )
    decoded = [decoder.decode(order, empty) for order in dict.fromkeys(starts)]
    # Each start climbs in turn, the best first (ties: the earlier start, the given order first),
    # while the budget lasts; the best of the local optima wins.
    best = max(decoded, key=lambda d: d.value)
    for start in sorted(decoded, key=lambda d: d.value, reverse=True):
        if decoder.calls >= max_decisions or best.value[0] == len(live):
            break
        climbed = _climb(decoder, start, max_decisions)
        if climbed.value > best.value:
            best = climbed
    final = best.steps[-1].snapshot
    decisions = {
        i: step.decision
        for i, step in zip(best.order, best.steps[1:], strict=True)
        if step.decision is not None and step.decision.placed
    }
    placed = tuple(decisions)
    refused = tuple(i for i in range(len(requests)) if i not in decisions)
    for i in refused:
        decisions[i] = decoder.decide(final, requests[i])
    return BatchPlan(
        decisions=tuple(decisions[i] for i in range(len(requests))),
        order=(*placed, *refused),
        snapshot=final,
        decisions_made=decoder.calls,
    )


def _climb(decoder: _Decoder, start: _Decoded, max_decisions: int) -> _Decoded:
    """First-improvement local search from ``start`` over ``_moves``, until no move improves or the
    decoder has made ``max_decisions`` calls."""
    best = start
    improved = True
    while improved and decoder.calls < max_decisions:
        improved = False
        for order in _moves(best.order):
            if decoder.calls >= max_decisions:
                break
            candidate = decoder.decode(order, best)
            if candidate.value > best.value:
                best, improved = candidate, True
                break
    return best


def _per_accelerator(decision: Decision) -> int:
    """The bytes a placed decision holds on each accelerator."""
    return decision.share.total if decision.share is not None else 0


def _size(decision: Decision) -> int:
    """What a placed decision holds: accelerators x bytes per accelerator."""
    return len(decision.accelerators) * _per_accelerator(decision)


def _moves(order: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    """The neighbours of ``order``: one request moved to the end, one moved to the front, two swapped."""
    n = len(order)
    for k in range(n - 1):
        yield (*order[:k], *order[k + 1 :], order[k])
    for k in range(1, n):
        yield (order[k], *order[:k], *order[k + 1 :])
    for a in range(n):
        for b in range(a + 1, n):
            swapped = list(order)
            swapped[a], swapped[b] = swapped[b], swapped[a]
            yield tuple(swapped)
