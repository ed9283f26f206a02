"""An exact reference for batches of placements on small fleets (DESIGN §4): a MILP solved by HiGHS
(``scipy.optimize.milp``), so the greedy's optimality gap is a measured number.

Model. The exact request only: requests must be exact-or-nothing (``fallbacks=()``, no pipeline
stages), since the fallback ladder is not modelled. For every request r, ``candidate_options``
enumerates every way to place it on the batch's starting snapshot: each TP degree the demand
prefilter allows, on each host that passes the host-scope filters, every group of that many GPUs in
which every pair is NVLinked and each GPU may be used by the request's sharing mode and has room for
the share (all cliques, not only the best one), and every free slice of the TPU shape in every
orientation and origin. The GPUs a mode may use are ``GpuLoad.room``'s: an exclusive group idle GPUs
only, a shared (TP=1) replica idle GPUs or GPUs held by shared replicas only. The remaining
placement filters that are not about capacity (the SLO) judge each option; capacity is the MILP's
constraints:

* binary x[o] per option, at most one option per request;
* per GPU g: sum of share bytes of the chosen options holding g <= free bytes of g (in GB, so the
  rows are well scaled: in bytes HiGHS once proved "optimal" a solution below the greedy's);
* exclusivity, per GPU g with exclusive options: binary s[g] set by any chosen shared option
  holding g; sum of the chosen exclusive options holding g + s[g] <= 1 (an exclusive group is
  alone on its GPUs; shared replicas may pile up on one GPU within its HBM);
* per TPU chip: at most one chosen option holds it;
* rack power: binary busy[g] per idle GPU in a rack with a budget, set by any chosen option holding
  g; per rack, sum of TDP x busy <= budget - used.

Objective (``objective``): the number of requests placed, then the options' quality as a tie-break:
``placed + sum(quality) / (n + 1)`` for n requests, where quality is the profile's weighted score of
the option on the starting snapshot, normalised over the request's options. Since each quality is
in [0, 1], one more request placed always outweighs any quality. ``greedy_batch`` places the same
requests one by one with ``decide`` + ``apply`` (the online placement), ``planned_batch`` with
``decide_batch`` (the batch placement); both are scored with the same function.

``online_bound`` is the same MILP with the rules of an online placement added: requests decided in
order, none refused while one of its options is free, each at the fewest accelerators still free.
The online ``decide`` obeys them, so its objective is at most the bound's: the bound's gap to the
optimum is the price of deciding online, the greedy's gap to the bound what better scores could win.

Option counts grow as C(GPUs, TP) per node: this is for fleets of a few nodes (``max_options``).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp
from scipy.sparse import coo_matrix

from shared.domain.placement.batch import DEFAULT_MAX_DECISIONS, decide_batch
from shared.domain.placement.decide import decide
from shared.domain.placement.framework import (
    DEFAULT_PROFILE,
    GB,
    Binding,
    Candidate,
    CycleState,
    Demand,
    GpuGroup,
    PluginFactory,
    Profile,
    demand_of,
)
from shared.domain.placement.hosts import GpuHost, GpuLoad, HostKind, TpuHost, TpuLoad, index_of
from shared.domain.placement.registry import framework_for
from shared.domain.placement.types import Decision, FleetSnapshot, PlacementRequest, RackKey, apply, chip_id
from shared.domain.topology.tpu import TpuSlice, orientations

CAPACITY_FILTERS: Final = frozenset({"hbm", "nvlink_group", "tpu_slice", "rack_power"})
"""Filters the MILP models as constraints or enumeration instead of calling them."""


@dataclass(frozen=True, slots=True)
class Option:
    """One way to place request ``request`` (its index in the batch): GPU ids in TP rank order or
    TPU chip ids, the bytes each GPU holds (0 on TPUs: a slice is exclusive), its quality, and
    whether it is a shared replica (which may share its GPU with other shared replicas)."""

    request: int
    host: str
    tp: int
    accelerators: tuple[str, ...]
    share_bytes: int
    quality: float
    tpu: TpuSlice | None = None
    shared: bool = False


@dataclass(frozen=True, slots=True)
class BatchResult:
    """Per request, the chosen option or None; ``objective`` as ``objective`` computes it;
    ``optimal`` is True when the solver proved optimality (always False for the greedy)."""

    placements: tuple[Option | None, ...]
    objective: float
    optimal: bool

    @property
    def placed(self) -> int:
        return sum(1 for p in self.placements if p is not None)


def objective(placements: Sequence[Option | None]) -> float:
    """``placed + sum(quality of placed) / (n + 1)``: placing one more request beats any quality."""
    chosen = [p for p in placements if p is not None]
    return len(chosen) + sum(p.quality for p in chosen) / (len(placements) + 1)


def candidate_options(
    snapshot: FleetSnapshot,
    requests: Sequence[PlacementRequest],
    profile: Profile = DEFAULT_PROFILE,
    *,
    registry: Mapping[str, PluginFactory] | None = None,
    max_options: int = 200_000,
) -> list[list[Option]]:
    """Every option of every request on ``snapshot`` (see the module docstring); a request the
    prefilter refuses has none. Raises ``ValueError`` for a request that is not exact-or-nothing
    (the fallback ladder is not modelled) and past ``max_options`` options in all."""
    framework = framework_for(profile, registry)
    index = index_of(snapshot, grouped=False)
    extra_filters = tuple(f for f in framework.placement_filters if f.name not in CAPACITY_FILTERS)
    result: list[list[Option]] = []
    total = 0
    for r, request in enumerate(requests):
        if request.fallbacks != () or (request.pp or 1) > 1:
            raise ValueError(f"request {r}: the MILP models exact placements only (fallbacks=(), no pp)")
        state = CycleState()
        if not framework.run_prefilter(state, snapshot, request).ok:
            result.append([])
            continue
        demand = demand_of(state)
        candidates: list[Candidate] = []
        for static in index.statics:
            host = static.rep
            load = index.loads[host.id]
            if not framework.filter_host(state, Candidate(host, load, 0, None))[0].ok:
                continue
            for level in demand.levels:
                share = demand.share_for(host, level)
                if share is None:
                    continue
                for binding in _bindings(host, load, level, share.total, demand):
                    candidate = Candidate(host, load, level, share, binding)
                    if all(f.filter(state, candidate).ok for f in extra_filters):
                        candidates.append(candidate)
        total += len(candidates)
        if total > max_options:
            raise ValueError(f"more than {max_options} options: the MILP reference is for small fleets")
        scores = framework.score(state, candidates) if candidates else []
        shared = request.sharing == "shared"
        result.append([_option(r, c, s["total"], shared) for c, s in zip(candidates, scores, strict=True)])
    return result


def _bindings(host: GpuHost | TpuHost, load: GpuLoad | TpuLoad, level: int, need: int, demand: Demand) -> list[Binding]:
    """Every GPU group of ``level`` GPUs the request's sharing mode may use, with room, in which
    every pair is NVLinked; or every free slice of the demand's TPU shape in any orientation and
    origin."""
    if isinstance(host, TpuHost) and isinstance(load, TpuLoad):
        tpu = demand.tpu.get((host.tpu_type, host.usable_per_chip))
        if tpu is None or tpu.shape is None:
            return []
        slices: list[Binding] = []
        for shape in orientations(tpu.shape):
            ranges = [range(extent - side + 1) for extent, side in zip(load.grid.dims, shape, strict=True)]
            for origin in itertools.product(*ranges):
                block = TpuSlice(tuple(origin), shape)
                if load.grid.is_free(block):
                    slices.append(block)
        return slices
    assert isinstance(host, GpuHost) and isinstance(load, GpuLoad)
    free, _ = load.room(demand.request.sharing)
    room = [p for p in range(host.size) if load.available[p] and free[p] >= need]
    return [
        GpuGroup(tuple(sorted(combo, key=lambda p: (host.nodes[p], host.indices[p]))))
        for combo in itertools.combinations(room, level)
        if host.kind is HostKind.FABRIC or _clique(host, combo)
    ]


def _clique(host: GpuHost, combo: Sequence[int]) -> bool:
    assert host.matrix is not None
    masks = host.matrix.nv_masks
    indices = [host.indices[p] for p in combo]
    return all(masks[a] >> b & 1 for k, a in enumerate(indices) for b in indices[k + 1 :])


def _option(request: int, candidate: Candidate, quality: float, shared: bool) -> Option:
    host, binding = candidate.host, candidate.binding
    if isinstance(host, TpuHost) and isinstance(binding, TpuSlice):
        chips = tuple(chip_id(host.id, coord) for coord in binding.coords())
        return Option(request, host.id, candidate.tp, chips, 0, quality, binding)
    assert isinstance(host, GpuHost) and isinstance(binding, GpuGroup) and candidate.share is not None
    accelerators = tuple(host.members[p] for p in binding.positions)
    return Option(request, host.id, candidate.tp, accelerators, candidate.share.total, quality, shared=shared)


def optimal_batch(
    snapshot: FleetSnapshot,
    requests: Sequence[PlacementRequest],
    profile: Profile = DEFAULT_PROFILE,
    *,
    options: Sequence[Sequence[Option]] | None = None,
    time_limit_s: float = 60.0,
) -> BatchResult:
    """The batch placement that maximises ``objective``, solved exactly by HiGHS (within its
    default tolerances; ``optimal`` False when the time limit stopped it first)."""
    options = candidate_options(snapshot, requests, profile) if options is None else options
    return _solve(snapshot, len(requests), options, time_limit_s, online=False)


def online_bound(
    snapshot: FleetSnapshot,
    requests: Sequence[PlacementRequest],
    profile: Profile = DEFAULT_PROFILE,
    *,
    options: Sequence[Sequence[Option]] | None = None,
    time_limit_s: float = 60.0,
) -> BatchResult:
    """The best ``objective`` any online placement can reach: one that decides the requests in the
    order given, never refuses a request some option of which is still free, and places each at the
    fewest accelerators still free (``decide``'s rule), whatever it prefers among those. The MILP of
    ``optimal_batch`` plus, per option o of request r: o is blocked (an accelerator of o taken by an
    earlier request's option, or o's GPUs past its rack's power budget after the earlier requests'),
    or r is placed at o's accelerator count or fewer. ``decide`` + ``apply`` is such a placement, so
    its objective is at most this one; ``optimal_batch`` minus this is the price of deciding online.
    Exclusive requests only (raises ``ValueError`` for a shared one)."""
    options = candidate_options(snapshot, requests, profile) if options is None else options
    if any(o.shared for per_request in options for o in per_request):
        raise ValueError("online_bound models exclusive placements only")
    return _solve(snapshot, len(requests), options, time_limit_s, online=True)


class _Model:
    """A MILP built row by row; columns are binary unless added with an upper bound."""

    def __init__(self, columns: int) -> None:
        self.integral = [1.0] * columns
        self.high = [1.0] * columns
        self.rows: list[int] = []
        self.cols: list[int] = []
        self.vals: list[float] = []
        self.lower: list[float] = []
        self.upper: list[float] = []

    @property
    def width(self) -> int:
        return len(self.high)

    def column(self, high: float | None = None) -> int:
        """A new binary column, or a continuous one in [0, ``high``]."""
        self.integral.append(1.0 if high is None else 0.0)
        self.high.append(1.0 if high is None else high)
        return self.width - 1

    def constraint(self, entries: Sequence[tuple[int, float]], low: float, high: float) -> None:
        row = len(self.lower)
        for col, value in entries:
            self.rows.append(row)
            self.cols.append(col)
            self.vals.append(value)
        self.lower.append(low)
        self.upper.append(high)


def _solve(
    snapshot: FleetSnapshot, n: int, options: Sequence[Sequence[Option]], time_limit_s: float, *, online: bool
) -> BatchResult:
    flat = [o for per_request in options for o in per_request]
    if not flat:
        return BatchResult(placements=(None,) * n, objective=0.0, optimal=True)
    model = _Model(len(flat))
    constraint = model.constraint
    for r in range(n):
        constraint([(k, 1.0) for k, o in enumerate(flat) if o.request == r], 0.0, 1.0)
    holders: dict[str, list[int]] = {}
    for k, o in enumerate(flat):
        for acc in o.accelerators:
            holders.setdefault(acc, []).append(k)
    for acc, ks in holders.items():
        cap = snapshot.capacity.get(acc)
        if cap is None:  # a TPU chip: exclusive
            constraint([(k, 1.0) for k in ks], 0.0, 1.0)
        else:
            constraint([(k, flat[k].share_bytes / GB) for k in ks], 0.0, cap.free / GB)  # GB: rows HiGHS scales well
    # Exclusivity: s[g] per GPU with both kinds of options, set by any chosen shared option on g.
    for ks in holders.values():
        exclusive = [k for k in ks if not flat[k].shared and flat[k].tpu is None]
        if not exclusive:
            continue
        shared = [k for k in ks if flat[k].shared]
        if shared:
            col = model.column()
            for k in shared:
                constraint([(k, 1.0), (col, -1.0)], -np.inf, 0.0)
            constraint([*((k, 1.0) for k in exclusive), (col, 1.0)], -np.inf, 1.0)
        else:
            constraint([(k, 1.0) for k in exclusive], -np.inf, 1.0)
    # Rack power: busy[g] for each idle GPU in a budgeted rack, forced on by any option holding g.
    busy: dict[str, int] = {}
    per_rack: dict[RackKey, list[str]] = {}
    for acc in holders:
        cap = snapshot.capacity.get(acc)
        if cap is None or not cap.idle:
            continue
        rack = snapshot.rack_key(cap.node)
        if snapshot.rack_headroom_w(rack) is None:
            continue
        busy[acc] = model.column()
        per_rack.setdefault(rack, []).append(acc)
    for acc, col in busy.items():
        ks = holders[acc]
        constraint([*((k, 1.0) for k in ks), (col, -float(len(ks)))], -np.inf, 0.0)
    for rack, accs in per_rack.items():
        headroom = snapshot.rack_headroom_w(rack)
        assert headroom is not None
        tdp = [(busy[a], snapshot.skus[snapshot.capacity[a].sku].tdp_w) for a in accs]
        constraint(tdp, -np.inf, headroom)
    if online:
        _online_rows(snapshot, flat, holders, model)
    cost = np.zeros(model.width)
    for k, o in enumerate(flat):
        cost[k] = -(1.0 + o.quality / (n + 1))
    matrix = coo_matrix((model.vals, (model.rows, model.cols)), shape=(len(model.lower), model.width)).tocsr()
    solution = milp(
        cost,
        constraints=LinearConstraint(matrix, np.array(model.lower), np.array(model.upper)),
        integrality=np.array(model.integral),
        bounds=Bounds(np.zeros(model.width), np.array(model.high)),
        options={"time_limit": time_limit_s, "mip_rel_gap": 1e-9},
    )
    if solution.x is None:
        raise ValueError(f"HiGHS found no solution: {solution.message}")
    chosen: list[Option | None] = [None] * n
    for k, o in enumerate(flat):
        if solution.x[k] > 0.5:
            chosen[o.request] = o
    return BatchResult(placements=tuple(chosen), objective=objective(chosen), optimal=int(solution.status) == 0)


def _online_rows(
    snapshot: FleetSnapshot, flat: Sequence[Option], holders: Mapping[str, list[int]], model: _Model
) -> None:
    """Per option o: o blocked by earlier requests' options, or its request placed at o's
    accelerator count or fewer (see ``online_bound``). Exclusive options hold idle GPUs only, so the
    power an option turns on is the TDP of its GPUs, and no accelerator is counted twice."""
    watts: list[dict[RackKey, float]] = []
    for o in flat:
        per_rack: dict[RackKey, float] = {}
        for acc in o.accelerators:
            cap = snapshot.capacity.get(acc)
            if cap is not None and snapshot.rack_headroom_w(rack := snapshot.rack_key(cap.node)) is not None:
                per_rack[rack] = per_rack.get(rack, 0.0) + snapshot.skus[cap.sku].tdp_w
        watts.append(per_rack)
    by_request: dict[int, list[int]] = {}
    for k, o in enumerate(flat):
        by_request.setdefault(o.request, []).append(k)
    taken: dict[tuple[str, int], int | None] = {}  # accelerator held before request r: a column, None if never
    drawn: dict[tuple[RackKey, int], int] = {}  # watts turned on in a rack before request r
    over: dict[tuple[RackKey, int, float], int] = {}  # 1 only when that is more than headroom - need

    def taken_col(acc: str, r: int) -> int | None:
        if (acc, r) not in taken:
            earlier = [j for j in holders[acc] if flat[j].request < r]
            col = model.column(1.0) if earlier else None
            if col is not None:
                model.constraint([(col, 1.0), *((j, -1.0) for j in earlier)], 0.0, 0.0)
            taken[(acc, r)] = col
        return taken[(acc, r)]

    def over_col(rack: RackKey, r: int, need: float) -> int:
        col = over.get((rack, r, need))
        if col is None:
            col = over[(rack, r, need)] = model.column()
            headroom = snapshot.rack_headroom_w(rack)
            assert headroom is not None
            if headroom - need >= 0:  # otherwise the option never fits the rack: over may be 1
                if (rack, r) not in drawn:
                    total = drawn[(rack, r)] = model.column(float(np.inf))
                    earlier = [
                        (j, -watts[j][rack]) for q in range(r) for j in by_request.get(q, ()) if rack in watts[j]
                    ]
                    model.constraint([(total, 1.0), *earlier], 0.0, 0.0)
                model.constraint([(drawn[(rack, r)], 1.0), (col, -(headroom - need + 1e-3))], 0.0, np.inf)
        return col

    for k, o in enumerate(flat):
        r = o.request
        blocked = [(col, 1.0) for acc in o.accelerators if (col := taken_col(acc, r)) is not None]
        blocked.extend((over_col(rack, r, need), 1.0) for rack, need in watts[k].items())
        fewer = [(j, 1.0) for j in by_request[r] if len(flat[j].accelerators) <= len(o.accelerators)]
        model.constraint([*blocked, *fewer], 1.0, np.inf)


def greedy_batch(
    snapshot: FleetSnapshot,
    requests: Sequence[PlacementRequest],
    profile: Profile = DEFAULT_PROFILE,
    *,
    options: Sequence[Sequence[Option]] | None = None,
) -> tuple[BatchResult, tuple[Decision, ...]]:
    """Place ``requests`` in order with ``decide`` and ``apply``; the result is scored with the
    options of the starting snapshot so it compares with ``optimal_batch``."""
    options = candidate_options(snapshot, requests, profile) if options is None else options
    decisions: list[Decision] = []
    current = snapshot
    for request in requests:
        decision = decide(current, request, profile)
        decisions.append(decision)
        current = apply(current, decision)
    return _scored(decisions, options), tuple(decisions)


def planned_batch(
    snapshot: FleetSnapshot,
    requests: Sequence[PlacementRequest],
    profile: Profile = DEFAULT_PROFILE,
    *,
    options: Sequence[Sequence[Option]] | None = None,
    max_decisions: int = DEFAULT_MAX_DECISIONS,
) -> tuple[BatchResult, tuple[Decision, ...]]:
    """Place ``requests`` together with ``decide_batch``; scored like ``greedy_batch``."""
    options = candidate_options(snapshot, requests, profile) if options is None else options
    plan = decide_batch(snapshot, requests, profile, max_decisions=max_decisions)
    return _scored(plan.decisions, options), plan.decisions


def _scored(decisions: Sequence[Decision], options: Sequence[Sequence[Option]]) -> BatchResult:
    """Each placed decision as the option of the starting snapshot with the same accelerators.
    Raises ``ValueError`` when there is none: the options and the placement disagree on a rule."""
    chosen: list[Option | None] = []
    for r, decision in enumerate(decisions):
        if not decision.placed:
            chosen.append(None)
            continue
        key = frozenset(decision.accelerators)
        match = next((o for o in options[r] if frozenset(o.accelerators) == key), None)
        if match is None:
            raise ValueError(f"request {r}: the placement chose {sorted(key)}, which is not among its options")
        chosen.append(match)
    return BatchResult(placements=tuple(chosen), objective=objective(chosen), optimal=False)
