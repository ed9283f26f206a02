"""``decide``: one placement decision, pure and deterministic (``explain`` is the same function).

The pipeline (DESIGN §4): the profile's prefilter derives the demand; host-scope filters judge each
class of hosts once; then, TP degree by TP degree, placement-scope filters judge each load class
(binding the NVLink group or TPU slice), the score plugins rank the classes that pass, and the best
wins, ties going to the lowest host id.

**Which TP degree.** DESIGN says "select TP degree greedily 16 -> 8 -> 4 -> 2 -> 1"; taken literally
(the first degree at which anything fits, from the top) every replica that fits on one GPU would take
sixteen. The rule here walks the same ladder from the other end: **the smallest accelerator count at
which some candidate passes every filter** (TP 1, 2, 4, 8, 16, with a TPU slice entering at its chip
count), and the scores choose among the candidates at that count. Why:

* a TP group's GPUs serve one replica: the fewest GPUs that hold it leave the most capacity, and
  whole NVLink domains, for the replicas that need them (the HBM per GPU shrinks with TP, so the
  smallest TP that fits is the tightest fit);
* more TP buys latency, not capacity, and pays for it in all-reduces (the latency model's TP term);
  when latency matters the request says so: with an SLO the ``slo`` filter rejects the degrees that
  miss it, so the walk climbs to the smallest TP that meets it; a pinned ``tp`` is the only degree.

Among candidates at the chosen degree, cost, energy, SKU fit, link quality and packing decide.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Final

from shared.domain.memory import MemoryShare
from shared.domain.placement.framework import (
    DEFAULT_PROFILE,
    GB,
    Candidate,
    CycleState,
    Demand,
    Framework,
    GpuGroup,
    PluginFactory,
    Profile,
    RejectionTally,
    Scoring,
    demand_of,
)
from shared.domain.placement.hosts import GpuHost, GpuLoad, SnapshotIndex, StaticClass, TpuHost, index_of
from shared.domain.placement.ladder import NAME as LADDER
from shared.domain.placement.ladder import emptied, estimate_of, ladder_config, with_fallbacks
from shared.domain.placement.perf import perf_of
from shared.domain.placement.registry import framework_for
from shared.domain.placement.types import (
    Decision,
    ErrorCode,
    FleetSnapshot,
    PlacementRequest,
    TpuPlacement,
    chip_id,
)
from shared.domain.topology.tpu import TpuSlice


@dataclass(frozen=True, slots=True)
class _Scored:
    """A candidate class that passed every filter, with its scores and the notes of its filters."""

    candidate: Candidate
    hosts: tuple[str, ...]
    notes: tuple[str, ...]
    score: dict[str, float]


@dataclass(frozen=True, slots=True)
class _Screened:
    """A load class that passed the bulk screen at one TP degree, waiting to be bound and scored."""

    candidate: Candidate
    hosts: tuple[str, ...]
    notes: tuple[str, ...]


def decide(
    snapshot: FleetSnapshot,
    request: PlacementRequest,
    profile: Profile = DEFAULT_PROFILE,
    *,
    registry: Mapping[str, PluginFactory] | None = None,
) -> Decision:
    """Place one replica on ``snapshot`` (which is not changed: ``apply`` the decision for that).

    Promises: a placed decision's accelerators passed every enabled filter (with the default
    profile: HBM fits, every pair of the TP group NVLinked, a whole free legal TPU slice, rack power);
    a refused one carries ``error_code`` (request errors before any candidate is looked at,
    ``no_capacity`` when none passes) and, for ``no_capacity``, every rejected class with its count.
    The same snapshot, request and profile always give the same decision.
    """
    framework = framework_for(profile, registry)
    state = CycleState()
    status = framework.run_prefilter(state, snapshot, request)
    if not status.ok:
        reason = status.describe()
        return Decision(
            request_id=request.request_id,
            status="rejected",
            error_code=ErrorCode(status.code.value),
            message=reason,
            explanation=(reason,),
            sharing=request.sharing,
        )
    demand = demand_of(state)
    index = index_of(snapshot, grouped=profile.group_classes)

    def exact(asked: PlacementRequest) -> Decision:
        if asked is request:
            return _search(framework, state, demand, index)
        return decide(snapshot, asked, profile, registry=registry)  # e.g. the KV quantised: no ladder

    def fits(asked: PlacementRequest) -> bool:
        if asked.fallbacks != () or (asked.pp or 1) != 1:
            return exact(asked).placed
        asked_state = CycleState()
        if not framework.run_prefilter(asked_state, snapshot, asked).ok:
            return False
        return _feasible(framework, asked_state, demand_of(asked_state), index)

    if request.fallbacks == () and (request.pp or 1) == 1:
        return exact(request)
    config = ladder_config(profile.config_for(LADDER))

    def on_empty(asked: PlacementRequest) -> bool:
        empty = emptied(snapshot)  # kept with the fleet's frame: so are its verdicts, per request shape
        key = (replace(asked, request_id=""), profile.name, id(registry))
        verdicts = empty._memo.verdicts
        known = verdicts.get(key)
        if isinstance(known, bool):
            return known
        fits = _ever_fits(empty, asked, profile, registry)
        if len(verdicts) >= VERDICTS_KEPT:
            verdicts.clear()
        verdicts[key] = fits
        return fits

    return with_fallbacks(snapshot, request, exact, framework, state, demand, index, config, on_empty, fits)


def _ever_fits(
    empty: FleetSnapshot,
    request: PlacementRequest,
    profile: Profile,
    registry: Mapping[str, PluginFactory] | None,
) -> bool:
    """``decide(empty, request, profile, registry=registry).placed``, the queue step's question. When
    the exact request fits, which candidate wins does not matter: the first that passes every filter
    answers it, unscored (``_feasible``); only a request the exact search refuses walks its ladder."""
    framework = framework_for(profile, registry)
    state = CycleState()
    if not framework.run_prefilter(state, empty, request).ok:
        return False
    if (request.pp or 1) == 1:
        if _feasible(framework, state, demand_of(state), index_of(empty, grouped=profile.group_classes)):
            return True
        if request.fallbacks == ():
            return False  # the exact request is all ``decide`` would try
    return decide(empty, request, profile, registry=registry).placed


def _feasible(framework: Framework, state: CycleState, demand: Demand, index: SnapshotIndex) -> bool:
    """Whether ``_search`` places the request: some candidate class, at some accelerator count, passes
    every filter (the same filters in the same order; scores only choose among those that pass)."""
    request = demand.request
    open_classes = [static for static, verdict, _ in framework.host_verdicts(state, index) if verdict.ok]
    classes_of = index.classes_for(request.sharing)
    for level in demand.levels:
        for static in open_classes:
            share = demand.share_for(static.rep, level)
            if share is None:
                continue
            classes, _ = framework.filter_bulk(
                state, static.rep, level, share, classes_of[static.key], index.screens, static.key
            )
            for c in classes:
                if framework.filter_placement(state, Candidate(c.rep, c.load, level, share))[0].ok:
                    return True
    return False


def _search(framework: Framework, state: CycleState, demand: Demand, index: SnapshotIndex) -> Decision:
    """The exact request: the smallest accelerator count at which a candidate passes every filter."""
    request = demand.request
    tally = RejectionTally()
    open_classes: list[tuple[StaticClass, tuple[str, ...]]] = []
    for static, verdict, notes in framework.host_verdicts(state, index):
        if verdict.ok:
            open_classes.append((static, notes))
        else:
            tally.add(verdict, len(static.hosts), static.rep.kind)
    classes_of = index.classes_for(request.sharing)
    tried: list[int] = []
    for level in demand.levels:
        tried.append(level)
        screened: list[list[_Screened]] = []  # per static class
        for static, host_notes in open_classes:
            share = demand.share_for(static.rep, level)
            if share is None:
                continue
            classes, rejected = framework.filter_bulk(
                state, static.rep, level, share, classes_of[static.key], index.screens, static.key
            )
            for verdict, count in rejected:
                tally.add(verdict, count, static.rep.kind)
            if classes:
                group = [_Screened(Candidate(c.rep, c.load, level, share), c.hosts, host_notes) for c in classes]
                screened.append(group)
        if screened:
            chosen = _choose(framework, state, screened, tally)
            if chosen is not None:
                best, runner_up, skipped = chosen
                return _placed(framework, demand, best, runner_up, skipped, tried, tally)
    tried_text = ", ".join(map(str, tried)) if tried else "none"
    message = f"no candidate passes every filter (accelerator counts tried: {tried_text})"
    rejections = tally.classes()
    return Decision(
        request_id=request.request_id,
        status="rejected",
        error_code=ErrorCode.NO_CAPACITY,
        message=message,
        explanation=(message, *_demand_lines(demand), *demand.notes, *(r.describe() for r in rejections)),
        rejections=rejections,
        sharing=request.sharing,
    )


def _share_text(share: MemoryShare) -> str:
    return (
        f"weights {share.weights / GB:.1f} GB + KV {share.kv / GB:.1f} GB + activation {share.activation / GB:.1f} GB"
        f" + workspace {share.workspace / GB:.1f} GB = {share.total / GB:.1f} GB"
    )


def _demand_lines(demand: Demand) -> list[str]:
    """What the replica needs per accelerator at each degree tried: the figures behind the refusals."""
    lines = [f"needs per GPU at TP={tp}: {_share_text(share)}" for tp, share in sorted(demand.gpu_shares.items())]
    for (tpu_type, _usable), tpu in sorted(demand.tpu.items()):
        if tpu.share is not None and tpu.shape is not None:
            shape = "x".join(map(str, tpu.shape))
            lines.append(f"needs a {tpu_type.value} {shape} slice, per chip: {_share_text(tpu.share)}")
    return lines


VERDICTS_KEPT: Final = 1024
"""Request shapes whose empty-fleet verdict (fits or not) a frame keeps at most (beyond, it starts afresh)."""

explain = decide
"""``placement.explain``: the same decision; the caller simply does not reserve it."""


def _choose(
    framework: Framework, state: CycleState, groups: Sequence[Sequence[_Screened]], tally: RejectionTally
) -> tuple[_Scored, _Scored | None, int] | None:
    """The best candidate class of one TP degree (highest total, then lowest host id), the next best
    scored, and how many hosts were skipped; None when every class fails a filter.

    Branch and bound, exact: classes are visited by their upper bound (``Scoring.upper_bounds``),
    highest first, and the visit stops at the first whose bound is below the best total found. So
    the classes bound and scored are exactly those whose bound reaches the winner's total: the same
    set whether hosts are judged per class or one by one, and rejections among them are counted.
    """
    screened = [item for group in groups for item in group]
    scoring = Scoring(framework, state, [s.candidate for s in screened])
    bounds = [b for group in groups for b in scoring.upper_bounds([s.candidate for s in group])]
    order = sorted(range(len(screened)), key=lambda i: (-bounds[i], screened[i].hosts[0]))
    best: _Scored | None = None
    runner_up: _Scored | None = None
    skipped = 0
    for position, i in enumerate(order):
        if best is not None and bounds[i] < best.score["total"]:
            skipped = sum(len(screened[j].hosts) for j in order[position:])
            break
        item = screened[i]
        verdict, bound, notes = framework.filter_placement(state, item.candidate)
        if not verdict.ok:
            tally.add(verdict, len(item.hosts), item.candidate.host.kind)
            continue
        scored = _Scored(bound, item.hosts, item.notes + notes, scoring.score(bound))
        if best is None or _better(scored, best):
            best, runner_up = scored, best
        elif runner_up is None or _better(scored, runner_up):
            runner_up = scored
    return None if best is None else (best, runner_up, skipped)


def _better(a: _Scored, b: _Scored) -> bool:
    ta, tb = a.score["total"], b.score["total"]
    return ta > tb or (ta == tb and a.hosts[0] < b.hosts[0])


def _placed(
    framework: Framework,
    demand: Demand,
    best: _Scored,
    runner_up: _Scored | None,
    skipped: int,
    tried: Sequence[int],
    tally: RejectionTally,
) -> Decision:
    score = best.score
    candidate = best.candidate
    host, tp, share = candidate.host, candidate.tp, candidate.share
    assert share is not None
    rejections = tally.classes()
    lines = [
        f"TP={tp}: the fewest accelerators at which a candidate passes every filter "
        f"(tried {', '.join(map(str, tried))})",
        f"per accelerator: {_share_text(share)}",
        "score {:.3f} (weighted mean): {}".format(
            score["total"],
            ", ".join(f"{plugin.name} {score[plugin.name]:.2f} x{weight:g}" for plugin, weight in framework.scores),
        ),
    ]
    if runner_up is not None:
        lines.append(
            f"next best scored: {runner_up.hosts[0]} ({runner_up.candidate.host.sku.name}) at "
            f"{runner_up.score['total']:.3f}"
        )
    if skipped:
        lines.append(f"{skipped} more hosts passed the capacity screen but could not reach {score['total']:.3f}")
    lines.extend(best.notes)
    lines.extend(demand.notes)
    lines.extend(r.describe() for r in rejections)
    model = f"{demand.model.name} ({demand.dtype} weights, {demand.kv_dtype} KV)"
    request = demand.request
    # One Decision built once (a dataclass of 25 fields: ``replace`` would build it again per step).
    if isinstance(host, TpuHost):
        block = candidate.binding
        assert isinstance(block, TpuSlice)
        chips = tuple(chip_id(host.id, coord) for coord in block.coords())
        headline = (
            f"placed {model} on a {'x'.join(map(str, block.shape))} slice at {block.origin} "
            f"of {host.tpu_type.value} pod {host.id}"
        )
        return Decision(
            request_id=request.request_id,
            status="placed",
            message=headline,
            backend="tpu",
            region=host.region,
            cluster=host.cluster,
            sku=host.sku.name,
            tp=tp,
            accelerators=chips,
            share=share,
            tpu=TpuPlacement(pod=host.id, origin=block.origin, shape=block.shape, chips=chips),
            score=score,
            explanation=(headline, *lines),
            rejections=rejections,
            sharing=request.sharing,
        )
    group = candidate.binding
    assert isinstance(host, GpuHost) and isinstance(group, GpuGroup)
    perf = perf_of(demand, host.sku, tp)
    # A shared replica joining a GPU others use gets a share of its compute: at least half with one
    # co-tenant (the simulator's charge, docs/PLACEMENT.md); the ledger knows the holders, not how busy.
    load = candidate.load
    contended = isinstance(load, GpuLoad) and any(not load.idle[p] for p in group.positions)
    slow = 2.0 if contended else 1.0
    estimate = estimate_of(perf, share, host, slow=slow)
    if contended:
        lines.append("shares its GPU with other shared replicas: latency estimates x2 (at least)")
    positions = group.positions
    accelerators = tuple(host.members[p] for p in positions)
    nodes = tuple(dict.fromkeys(host.nodes[p] for p in positions))
    first = positions[0]
    headline = f"placed {model} at TP={tp} on {', '.join(accelerators)} ({host.sku.name}, domain {host.domains[first]})"
    return Decision(
        request_id=request.request_id,
        status="placed",
        message=headline,
        backend="gpu",
        region=host.region,
        cluster=host.cluster,
        rack=host.racks[host.member_rack[first]][2],
        node=nodes[0],
        nodes=nodes,
        sku=host.sku.name,
        tp=tp,
        accelerators=accelerators,
        domain=host.domains[first],
        share=share,
        score=score,
        explanation=(headline, _links(host, positions), *lines),
        rejections=rejections,
        sharing=request.sharing,
        estimate=estimate,
    )


def _links(host: GpuHost, positions: Sequence[int]) -> str:
    """The group's links in words: "group links: 6 pairs NV18"."""
    if len(positions) < 2:
        return "group links: a single GPU, no TP traffic"
    if host.matrix is None:
        return f"group links: all {len(positions) * (len(positions) - 1) // 2} pairs through the NVLink fabric"
    matrix = host.matrix
    codes = Counter(
        matrix.link(host.indices[a], host.indices[b]).code for k, a in enumerate(positions) for b in positions[k + 1 :]
    )
    return "group links: " + ", ".join(
        f"{count} pair{'' if count == 1 else 's'} {code}" for code, count in sorted(codes.items())
    )
