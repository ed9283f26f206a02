"""An exact reference for batches of placements on small fleets (DESIGN §4): a MILP solved by HiGHS
(``scipy.optimize.milp``), so the greedy's optimality gap is a measured number.

Model. For every request r, ``candidate_options`` enumerates every way to place it on the batch's
starting snapshot: each TP degree the demand prefilter allows, on each host that passes the
host-scope filters, every group of that many GPUs in which every pair is NVLinked and each GPU has
room for the share (all cliques, not only the best one), and every free slice of the TPU shape in
every orientation and origin. The remaining placement filters that are not about capacity (the SLO)
judge each option; capacity is the MILP's constraints:

* binary x[o] per option, at most one option per request;
* per GPU g: sum of share bytes of the chosen options holding g <= free bytes of g;
* per TPU chip: at most one chosen option holds it;
* rack power: binary busy[g] per idle GPU in a rack with a budget, set by any chosen option holding
  g; per rack, sum of TDP x busy <= budget - used.

Objective (``objective``): the number of requests placed, then the options' quality as a tie-break:
``placed + sum(quality) / (n + 1)`` for n requests, where quality is the profile's weighted score of
the option on the starting snapshot, normalised over the request's options. Since each quality is
in [0, 1], one more request placed always outweighs any quality. ``greedy_batch`` places the same
requests one by one with ``decide`` + ``apply`` and is scored with the same function.

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

from shared.domain.placement.decide import decide
from shared.domain.placement.framework import (
    DEFAULT_PROFILE,
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
    TPU chip ids, the bytes each GPU holds (0 on TPUs: a slice is exclusive), and its quality."""

    request: int
    host: str
    tp: int
    accelerators: tuple[str, ...]
    share_bytes: int
    quality: float
    tpu: TpuSlice | None = None


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
    prefilter refuses has none. Raises ``ValueError`` past ``max_options`` options in all."""
    framework = framework_for(profile, registry)
    index = index_of(snapshot, grouped=False)
    extra_filters = tuple(f for f in framework.placement_filters if f.name not in CAPACITY_FILTERS)
    result: list[list[Option]] = []
    total = 0
    for r, request in enumerate(requests):
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
        result.append([_option(r, c, s["total"]) for c, s in zip(candidates, scores, strict=True)])
    return result


def _bindings(host: GpuHost | TpuHost, load: GpuLoad | TpuLoad, level: int, need: int, demand: Demand) -> list[Binding]:
    """Every GPU group of ``level`` GPUs with room in which every pair is NVLinked, or every free
    slice of the demand's TPU shape in any orientation and origin."""
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
    room = [p for p in range(host.size) if load.available[p] and load.free[p] >= need]
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


def _option(request: int, candidate: Candidate, quality: float) -> Option:
    host, binding = candidate.host, candidate.binding
    if isinstance(host, TpuHost) and isinstance(binding, TpuSlice):
        chips = tuple(chip_id(host.id, coord) for coord in binding.coords())
        return Option(request, host.id, candidate.tp, chips, 0, quality, binding)
    assert isinstance(host, GpuHost) and isinstance(binding, GpuGroup) and candidate.share is not None
    accelerators = tuple(host.members[p] for p in binding.positions)
    return Option(request, host.id, candidate.tp, accelerators, candidate.share.total, quality)


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
    flat = [o for per_request in options for o in per_request]
    n = len(requests)
    if not flat:
        return BatchResult(placements=(None,) * n, objective=0.0, optimal=True)
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    lower: list[float] = []
    upper: list[float] = []

    def constraint(entries: Sequence[tuple[int, float]], low: float, high: float) -> None:
        row = len(lower)
        for col, value in entries:
            rows.append(row)
            cols.append(col)
            vals.append(value)
        lower.append(low)
        upper.append(high)

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
            constraint([(k, float(flat[k].share_bytes)) for k in ks], 0.0, float(cap.free))
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
        busy[acc] = len(flat) + len(busy)
        per_rack.setdefault(rack, []).append(acc)
    for acc, col in busy.items():
        ks = holders[acc]
        constraint([*((k, 1.0) for k in ks), (col, -float(len(ks)))], -np.inf, 0.0)
    for rack, accs in per_rack.items():
        headroom = snapshot.rack_headroom_w(rack)
        assert headroom is not None
        tdp = [(busy[a], snapshot.skus[snapshot.capacity[a].sku].tdp_w) for a in accs]
        constraint(tdp, -np.inf, headroom)
    width = len(flat) + len(busy)
    cost = np.zeros(width)
    for k, o in enumerate(flat):
        cost[k] = -(1.0 + o.quality / (n + 1))
    matrix = coo_matrix((vals, (rows, cols)), shape=(len(lower), width)).tocsr()
    solution = milp(
        cost,
        constraints=LinearConstraint(matrix, np.array(lower), np.array(upper)),
        integrality=np.ones(width),
        bounds=Bounds(np.zeros(width), np.ones(width)),
        options={"time_limit": time_limit_s, "mip_rel_gap": 1e-9},
    )
    if solution.x is None:
        raise ValueError(f"HiGHS found no solution: {solution.message}")
    chosen: list[Option | None] = [None] * n
    for k, o in enumerate(flat):
        if solution.x[k] > 0.5:
            chosen[o.request] = o
    return BatchResult(placements=tuple(chosen), objective=objective(chosen), optimal=int(solution.status) == 0)


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
    chosen: list[Option | None] = []
    current = snapshot
    for r, request in enumerate(requests):
        decision = decide(current, request, profile)
        decisions.append(decision)
        current = apply(current, decision)
        if not decision.placed:
            chosen.append(None)
            continue
        key = frozenset(decision.accelerators)
        match = next((o for o in options[r] if frozenset(o.accelerators) == key), None)
        if match is None:
            raise ValueError(f"request {r}: greedy chose {sorted(key)}, which is not among its options")
        chosen.append(match)
    return BatchResult(placements=tuple(chosen), objective=objective(chosen), optimal=False), tuple(decisions)
