"""`hetsched sim`: the IO shell around the pure simulator (``shared.domain.sim``), its running half
(``report.py`` prints and plots what this runs).

Reads the fleet and the trace, assigns models with the default mix, runs each policy with a
wall-clock timer around its decisions, and prints a table or JSON; ``--plots`` writes one PNG per
policy of the per-minute time series (active replicas, queue length, SLO attainment).

Default model mix (all fit the demo fleet): llama3-8b 50 %, llama3-70b 30 %, mixtral-8x7b 20 %.

Without ``--trace`` the run replays the shipped sample (``SAMPLE_TRACE``: the first 4,000 requests of
the Azure LLM inference trace 2023, conversation service, CC-BY 4.0; its source, licence and citation
are the file's ``#`` lines, printed on stderr) and, without ``--load``, scales it to ``SAMPLE_LOAD``:
at its own rate the demo fleet is about 2 % busy, every replica has free slots, and every policy
scores the same.
Without ``--fleet`` it runs on the shipped demo fleet (``shared/catalog/demo_fleet.yaml``).

``--load X`` scales the trace's arrivals so the fleet runs at load X (``shared.domain.sim.load``:
the sum over models of arrival rate / the rate the whole fleet serves that model alone, every
replica full); ``--sweep`` runs every policy at each of ``--loads`` and prints one table per trace,
ours against the best baseline per load, and with ``--plots`` a cost-vs-SLO PNG per policy.

``--sharing compare`` replays the trace twice with ``hetsched``: every replica exclusive, then the small
models (``shared.domain.sim.sharing.small_models``) asking ``sharing: shared``, and prints both KPI
sets side by side, for the whole workload and for the small models' requests alone.

``--reserve TENANT:POLICY:COUNT:SKU`` (repeatable) replays the trace with reservations
(``shared.domain.sim.reservations``): ``--owner-models`` names the models whose replicas are the
reserving tenant's (``TENANT=a,b`` when several tenants reserve); every other model's replicas are one
preemptible tenant's, which borrow what soft and spot reservations lend. The table then adds the fill
rate, the preemptions and the requests that failed on a preempted replica.
"""

from __future__ import annotations

import gc
import itertools
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from shared.domain.placement import FleetSnapshot
from shared.domain.reservations import POLICIES as RESERVATION_POLICIES
from shared.domain.sim import (
    POLICIES,
    Kpis,
    Policy,
    ReservationSetup,
    SimConfig,
    SimReservation,
    SimResult,
    compute_kpis,
    make_policy,
    simulate,
)
from shared.domain.sim.load import FleetLoad, fleet_load, scale_arrivals
from shared.domain.sim.sharing import small_models
from shared.domain.traces import (
    AssignedRequest,
    OnError,
    Trace,
    assign_workload,
    comment_header,
    detect_format,
    read_trace,
)
from shared.infra.catalog import load_inventory, load_models, load_skus, packaged_file

DEFAULT_MODEL_MIX: Mapping[str, float] = {"llama3-8b": 0.5, "llama3-70b": 0.3, "mixtral-8x7b": 0.2}
DEFAULT_TENANTS: Mapping[str, float] = {"tenant-a": 0.5, "tenant-b": 0.3, "tenant-c": 0.2}

SAMPLE_TRACE = "azure_conv_2023_sample.csv"  # in the package shared.catalog, beside the demo fleet
SAMPLE_LOAD = 0.8  # the sample's default load: busy enough to queue in bursts, below saturation


def sample_trace_path() -> Path:
    """The shipped sample trace (installed with the package)."""
    return packaged_file(SAMPLE_TRACE)


def trace_notes(path: Path) -> dict[str, str]:
    """The ``Key: value`` lines among the ``#`` lines before a CSV trace's header (the sample's
    ``Sample``, ``Source``, ``Licence``, ``Citation``, ...); empty for a file without them or one
    that cannot be read."""
    try:
        with path.open(encoding="utf-8", errors="replace") as handle:
            head = "".join(itertools.islice(handle, 64))
    except OSError:
        return {}
    notes = {}
    for line in comment_header(head):
        key, sep, value = line.partition(":")
        if sep and key.strip() and " " not in key.strip():
            notes[key.strip()] = value.strip()
    return notes


def load_trace(path: Path, *, on_bad_rows: OnError) -> Trace:
    """The trace at ``path``; ``TraceError`` names the bad row when ``on_bad_rows`` is ``reject``."""
    text = path.read_text()
    return read_trace(text, detect_format(text, path.name), on_error=on_bad_rows)


def _load(
    fleet_path: Path,
    trace_path: Path,
    *,
    seed: int,
    on_bad_rows: OnError,
    model_mix: Mapping[str, float] | None,
    limit: int | None,
) -> tuple[FleetSnapshot, list[AssignedRequest], Trace]:
    skus = load_skus()
    models = load_models()
    fleet, _ = load_inventory(fleet_path, skus=skus)
    trace = load_trace(trace_path, on_bad_rows=on_bad_rows)
    requests = trace.requests[:limit] if limit is not None else trace.requests
    assigned = assign_workload(requests, models=model_mix or DEFAULT_MODEL_MIX, tenants=DEFAULT_TENANTS, seed=seed)
    snapshot = FleetSnapshot.from_fleet(fleet, skus=skus, models=models)
    # The trace and the fleet live for the whole run: kept out of the cyclic collector's full passes
    # (as the placement service keeps its view), so those passes do not land inside timed decisions.
    gc.collect()
    gc.freeze()
    return snapshot, assigned, trace


def run_sim(
    fleet_path: Path,
    trace_path: Path,
    policy: str | None = None,
    *,
    seed: int = 0,
    on_bad_rows: OnError = "reject",
    model_mix: Mapping[str, float] | None = None,
    limit: int | None = None,
    config: SimConfig | None = None,
    live: Policy | None = None,
) -> tuple[dict[str, SimResult], Trace]:
    """Run one policy (or all of ``POLICIES``, or only ``live``) over the trace on the fleet; results by
    policy name. ``run_sweep`` runs them at chosen loads instead."""
    snapshot, assigned, trace = _load(
        fleet_path, trace_path, seed=seed, on_bad_rows=on_bad_rows, model_mix=model_mix, limit=limit
    )
    if live is not None:
        return {live.name: simulate(snapshot, assigned, live, config=config, timer=time.perf_counter)}, trace
    return _run_policies(snapshot, assigned, policy, seed=seed, config=config), trace


def _run_policies(
    snapshot: FleetSnapshot,
    assigned: Sequence[AssignedRequest],
    policy: str | None,
    *,
    seed: int,
    config: SimConfig | None,
) -> dict[str, SimResult]:
    names: Sequence[str] = POLICIES if policy is None else (policy,)
    return {
        name: simulate(snapshot, assigned, make_policy(name, seed=seed), config=config, timer=time.perf_counter)
        for name in names
    }


# -- `--reserve` and `--owner-models` ---------------------------------------------------------------


def parse_reserve(text: str) -> SimReservation:
    """``TENANT:POLICY:COUNT:SKU`` -> a reservation of COUNT GPUs of SKU; ValueError saying what is wrong."""
    parts = text.split(":")
    if len(parts) != 4 or not all(p.strip() for p in parts):
        raise ValueError(f"--reserve: expected TENANT:POLICY:COUNT:SKU, got {text!r}")
    tenant, policy, count, sku = (p.strip() for p in parts)
    if policy not in RESERVATION_POLICIES:
        raise ValueError(f"--reserve {text}: policy {policy!r} is not one of {', '.join(RESERVATION_POLICIES)}")
    try:
        n = int(count)
    except ValueError:
        raise ValueError(f"--reserve {text}: count {count!r} is not a whole number") from None
    if n <= 0:
        raise ValueError(f"--reserve {text}: count must be positive")
    return SimReservation(tenant=tenant, policy=policy, count=n, sku=sku)


def parse_owner_models(values: Sequence[str], tenants: Sequence[str]) -> tuple[tuple[str, str], ...]:
    """``a,b`` (the one reserving tenant's) or ``TENANT=a,b`` -> (model, tenant) pairs; ValueError when
    a bare list is ambiguous (several tenants reserve), a tenant reserves nothing, or a model repeats."""
    owners: dict[str, str] = {}
    for value in values:
        tenant, sep, models = value.rpartition("=")
        if not sep:
            if len(set(tenants)) != 1:
                raise ValueError(f"--owner-models {value}: several tenants reserve; write TENANT={value}")
            tenant = tenants[0]
        elif tenant not in tenants:
            raise ValueError(f"--owner-models {value}: tenant {tenant!r} has no --reserve")
        names = [m.strip() for m in models.split(",") if m.strip()]
        if not names:
            raise ValueError(f"--owner-models {value!r}: no model named")
        for model in names:
            if model in owners:
                raise ValueError(f"--owner-models: {model} is named twice")
            owners[model] = tenant
    return tuple(owners.items())


def parse_reservations(
    reserve: Sequence[str], owner_models: Sequence[str], *, known_models: Collection[str] | None = None
) -> ReservationSetup | None:
    """The ``SimConfig.reservations`` of ``--reserve`` and ``--owner-models`` (None without either);
    ValueError for a bad value, an owner model without a reservation, or a model ``known_models`` lacks."""
    if not reserve:
        if owner_models:
            raise ValueError("--owner-models: give --reserve too")
        return None
    reservations = tuple(parse_reserve(text) for text in reserve)
    owners = parse_owner_models(owner_models, [r.tenant for r in reservations])
    if known_models is not None:
        unknown = sorted(m for m, _ in owners if m not in known_models)
        if unknown:
            raise ValueError(f"--owner-models: unknown model(s) {', '.join(unknown)}")
    return ReservationSetup(reservations=reservations, owner_models=owners)


# -- `--load` and `--sweep` -------------------------------------------------------------------------

DEFAULT_LOADS: tuple[float, ...] = (0.6, 0.8, 0.95)
LOAD_HELP = (
    "load = the sum over models of (the model's arrival rate / the requests per second the whole fleet "
    "completes of that model alone, every replica full); arrivals are scaled by target / load"
)


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """Every policy over the trace scaled to one load."""

    load: float
    factor: float  # the arrivals came this many times faster than in the trace
    span_s: float  # first to last arrival of the scaled trace
    results: Mapping[str, SimResult]


@dataclass(frozen=True, slots=True)
class Sweep:
    """The same trace at several loads: the trace's own load, and each point."""

    trace: str
    native: FleetLoad
    points: tuple[SweepPoint, ...]


def run_sweep(
    fleet_path: Path,
    trace_path: Path,
    loads: Sequence[float] = DEFAULT_LOADS,
    policy: str | None = None,
    *,
    seed: int = 0,
    on_bad_rows: OnError = "reject",
    model_mix: Mapping[str, float] | None = None,
    limit: int | None = None,
    config: SimConfig | None = None,
) -> tuple[Sweep, Trace]:
    """Each policy (or one) over the trace scaled to each of ``loads``; ValueError for a load <= 0."""
    snapshot, assigned, trace = _load(
        fleet_path, trace_path, seed=seed, on_bad_rows=on_bad_rows, model_mix=model_mix, limit=limit
    )
    native = fleet_load(snapshot, assigned, config or SimConfig())
    points = []
    for load in loads:
        factor = native.factor(load)
        scaled = scale_arrivals(assigned, factor)
        points.append(
            SweepPoint(
                load=load,
                factor=factor,
                span_s=native.span_s / factor,
                results=_run_policies(snapshot, scaled, policy, seed=seed, config=config),
            )
        )
    return Sweep(trace=trace_path.stem, native=native, points=tuple(points)), trace


def parse_loads(text: str) -> tuple[float, ...]:
    """``"0.6,0.8,0.95"`` -> (0.6, 0.8, 0.95); ValueError naming a value that is not a positive number."""
    loads = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise ValueError(f"--loads: {part.strip()!r} is not a number") from None
        if not value > 0 or value == float("inf"):
            raise ValueError(f"--loads: {part.strip()} is not a positive load")
        loads.append(value)
    return tuple(loads)


def margins(point: SweepPoint, ours: str = "hetsched") -> dict[str, float | None] | None:
    """Ours against the baselines at one load: SLO attainment minus the best baseline's, and $/M tokens
    minus the cheapest baseline's (negative: ours is cheaper; None where a cost is missing); None
    without ours or a baseline."""
    if ours not in point.results or len(point.results) < 2:
        return None
    mine = point.results[ours].kpis
    others = [r.kpis for name, r in point.results.items() if name != ours]
    costs = [k.cost_per_million_tokens for k in others if k.cost_per_million_tokens is not None]
    own_cost = mine.cost_per_million_tokens
    return {
        "slo_attainment": mine.slo_attainment - max(k.slo_attainment for k in others),
        "cost_per_million_tokens": own_cost - min(costs) if costs and own_cost is not None else None,
    }


SHARING_MODES: tuple[str, ...] = ("exclusive", "shared")


@dataclass(frozen=True, slots=True)
class SharingComparison:
    """The same trace replayed with every replica exclusive and with the small models shared."""

    small_models: tuple[str, ...]  # the small models of the workload
    results: Mapping[str, SimResult]  # by mode: exclusive, shared

    def small_kpis(self, mode: str) -> Kpis:
        """The KPIs of the small models' requests and replicas alone in run ``mode``."""
        result = self.results[mode]
        small = set(self.small_models)
        return compute_kpis(
            [o for o in result.outcomes if o.model in small], [r for r in result.replicas if r.model in small], (), ()
        )


def run_sharing_compare(
    fleet_path: Path,
    trace_path: Path,
    *,
    seed: int = 0,
    on_bad_rows: OnError = "reject",
    model_mix: Mapping[str, float] | None = None,
    limit: int | None = None,
    config: SimConfig | None = None,
) -> tuple[SharingComparison, Trace]:
    """``hetsched`` over the trace twice: every replica exclusive, then the small models shared."""
    snapshot, assigned, trace = _load(
        fleet_path, trace_path, seed=seed, on_bad_rows=on_bad_rows, model_mix=model_mix, limit=limit
    )
    base = config or SimConfig()
    results = {
        mode: simulate(
            snapshot,
            assigned,
            make_policy("hetsched", seed=seed),
            config=replace(base, share_small=mode == "shared"),
            timer=time.perf_counter,
        )
        for mode in SHARING_MODES
    }
    present = {r.model for r in assigned}
    small = tuple(sorted(small_models(snapshot, base.small_fraction) & present))
    return SharingComparison(small_models=small, results=results), trace
