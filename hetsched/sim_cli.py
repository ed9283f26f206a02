"""`hetsched sim`: the IO shell around the pure simulator (``shared.domain.sim``).

Reads the fleet and the trace, assigns models with the default mix, runs each policy with a
wall-clock timer around its decisions, and prints a table or JSON; ``--plots`` writes one PNG per
policy of the per-minute time series (active replicas, queue length, SLO attainment).

Default model mix (all fit the demo fleet): llama3-8b 50 %, llama3-70b 30 %, mixtral-8x7b 20 %.

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
import json
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

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
from shared.domain.traces import AssignedRequest, OnError, Trace, assign_workload, detect_format, read_trace
from shared.infra.catalog import load_inventory, load_models, load_skus

DEFAULT_MODEL_MIX: Mapping[str, float] = {"llama3-8b": 0.5, "llama3-70b": 0.3, "mixtral-8x7b": 0.2}
DEFAULT_TENANTS: Mapping[str, float] = {"tenant-a": 0.5, "tenant-b": 0.3, "tenant-c": 0.2}


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


def sweep_json(sweep: Sweep) -> dict[str, Any]:
    """``{"trace", "load_definition", "native_load", "models", "sweep": [{"load", "factor", "span_s",
    "policies": {NAME: KPIS}, "margin"}]}``."""
    return {
        "trace": sweep.trace,
        "load_definition": LOAD_HELP,
        "native_load": sweep.native.load,
        "models": [{**asdict(m), "utilisation": m.utilisation} for m in sweep.native.models],
        "sweep": [
            {
                "load": p.load,
                "factor": p.factor,
                "span_s": p.span_s,
                "policies": {name: r.kpis.to_dict() for name, r in p.results.items()},
                "margin": margins(p),
            }
            for p in sweep.points
        ],
    }


def dump_sweep_json(sweeps: Sequence[Sweep]) -> str:
    """One trace: its sweep object; several: ``{"traces": [...]}``."""
    body = sweep_json(sweeps[0]) if len(sweeps) == 1 else {"traces": [sweep_json(s) for s in sweeps]}
    return json.dumps(body, indent=2)


_SWEEP_COLUMNS = (
    ("slo_attainment", "SLO att."),
    ("cost_per_million_tokens", "$/M tok"),
    ("placed", "placed"),
    ("success_rate", "success"),
    ("replicas", "replicas"),
    ("p99_queue_wait_ms", "wait p99 ms"),
    ("decision_p50_ms", "dec p50 ms"),
    ("decision_p99_ms", "dec p99 ms"),
)


_SWEEP_WIDTH = 132


def render_sweep(sweep: Sweep, console: Console) -> None:
    """One table for the trace: a row per load and policy; then ours against the best baseline per load."""
    table = Table(
        title=f"hetsched sim --sweep: {sweep.trace} (its own load {sweep.native.load:.4f})",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    table.add_column("load", justify="right", no_wrap=True)
    table.add_column("x rate", justify="right", no_wrap=True)  # how much faster than the trace
    table.add_column("policy", no_wrap=True)
    for _, header in _SWEEP_COLUMNS:
        table.add_column(header, justify="right", no_wrap=True)
    for point in sweep.points:
        for i, (name, result) in enumerate(point.results.items()):
            row = result.kpis.to_dict()
            table.add_row(
                f"{point.load:g}" if i == 0 else "",
                f"{point.factor:.1f}" if i == 0 else "",
                name,
                *(_fmt(row[key]) for key, _ in _SWEEP_COLUMNS),
                end_section=i == len(point.results) - 1,
            )
    # Rows of 11 columns: never squeeze them into an 80-column pipe (the rows are what docs quote).
    wide = console if console.width >= _SWEEP_WIDTH else Console(file=console.file, width=_SWEEP_WIDTH)
    wide.print(table)
    for point in sweep.points:
        margin = margins(point)
        if margin is not None:
            slo, cost = margin["slo_attainment"], margin["cost_per_million_tokens"]
            cost_text = "-" if cost is None else f"{cost:+.3f}"
            wide.print(
                f"load {point.load:g}: hetsched SLO attainment {slo:+.3f} vs the best baseline, "
                f"$/M tokens {cost_text} vs the cheapest"
            )


def write_sweep_plots(sweep: Sweep, plots_dir: Path) -> list[Path]:
    """Cost against SLO attainment, one point per load: ``sim_<trace>_<policy>.png`` per policy and
    ``sim_<trace>_all.png`` with a line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots_dir.mkdir(parents=True, exist_ok=True)
    names = list(sweep.points[0].results) if sweep.points else []
    series = {
        name: [
            (p.load, p.results[name].kpis.cost_per_million_tokens, p.results[name].kpis.slo_attainment)
            for p in sweep.points
        ]
        for name in names
    }
    written = []

    def draw(ax: Any, name: str) -> None:
        points = [(load, cost, slo) for load, cost, slo in series[name] if cost is not None]
        ax.plot([c for _, c, _ in points], [s for _, _, s in points], marker="o", label=name)
        for load, cost, slo in points:
            ax.annotate(f"{load:g}", (cost, slo), textcoords="offset points", xytext=(4, 4), fontsize=8)

    def finish(fig: Any, ax: Any, title: str, path: Path) -> None:
        ax.set_xlabel("$ per million tokens")
        ax.set_ylabel("SLO attainment")
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)

    for name in names:
        fig, ax = plt.subplots(figsize=(5, 3.6))
        draw(ax, name)
        finish(fig, ax, f"{sweep.trace}: {name} (labels: load)", plots_dir / f"sim_{sweep.trace}_{name}.png")
    fig, ax = plt.subplots(figsize=(6, 4.2))
    for name in names:
        draw(ax, name)
    ax.legend(fontsize=8)
    finish(fig, ax, f"{sweep.trace}: every policy (labels: load)", plots_dir / f"sim_{sweep.trace}_all.png")
    return written


def results_json(results: Mapping[str, SimResult], point: SweepPoint | None = None) -> dict[str, Any]:
    """``{"policies": {NAME: KPIS}}``; at a chosen load also ``"load": {"target", "factor", "span_s"}``."""
    body: dict[str, Any] = {"policies": {name: r.kpis.to_dict() for name, r in results.items()}}
    if point is not None:
        body["load"] = {"target": point.load, "factor": point.factor, "span_s": point.span_s}
    return body


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


def sharing_json(comparison: SharingComparison) -> dict[str, Any]:
    """``{"sharing": {"exclusive": KPIS, "shared": KPIS}}``, plus the small models and their own KPIs."""
    return {
        "sharing": {mode: r.kpis.to_dict() for mode, r in comparison.results.items()},
        "small_models": list(comparison.small_models),
        "small_model_kpis": {mode: comparison.small_kpis(mode).to_dict() for mode in comparison.results},
    }


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


_COLUMNS = (
    ("requests", "requests"),
    ("placed", "placed"),
    ("success_rate", "success"),
    ("slo_attainment", "SLO att."),
    ("mean_queue_wait_ms", "wait mean ms"),
    ("p99_queue_wait_ms", "wait p99 ms"),
    ("replicas", "replicas"),
    ("nvlink_affinity", "NVLink aff."),
    ("tp_groups_not_nvlinked", "TP not NVL"),
    ("tpu_fragmentation", "TPU frag"),
    ("cost_per_million_tokens", "$/M tok"),
    ("energy_kwh", "kWh"),
    ("decision_p50_ms", "dec p50 ms"),
    ("decision_p99_ms", "dec p99 ms"),
)
_RESERVATION_COLUMNS = (
    ("fill_rate", "fill rate"),
    ("preemptions", "preemptions"),
    ("preempted_requests", "preempted reqs"),
)


_SHARING_COLUMNS = (
    ("requests", "requests"),
    ("placed", "placed"),
    ("success_rate", "success"),
    ("slo_attainment", "SLO att."),
    ("mean_queue_wait_ms", "wait mean ms"),
    ("replicas", "replicas"),
    ("shared_replicas", "shared replicas"),
    ("contended_requests", "on a shared GPU"),
    ("mean_tpot_ms", "TPOT mean ms"),
    ("replica_tokens_per_s", "tok/s per replica"),
    ("accelerator_hours", "GPU-hours"),
    ("gpu_hbm_fill", "HBM fill"),
    ("cost_per_million_tokens", "$/M tok"),
    ("energy_kwh", "kWh"),
)


def render_sharing_table(comparison: SharingComparison, console: Console) -> None:
    """One row per KPI; exclusive and shared side by side, for all requests and the small models'."""
    small = ", ".join(comparison.small_models) or "none"
    table = Table(title=f"hetsched sim: small models shared vs exclusive (small: {small})")
    table.add_column("KPI")
    modes = list(comparison.results)
    for mode in modes:
        table.add_column(f"all {mode}", justify="right")
    for mode in modes:
        table.add_column(f"small {mode}", justify="right")
    every = {mode: r.kpis.to_dict() for mode, r in comparison.results.items()}
    smalls = {mode: comparison.small_kpis(mode).to_dict() for mode in modes}
    for key, header in _SHARING_COLUMNS:
        small_cells = ("-" if key == "gpu_hbm_fill" else _fmt(smalls[m][key]) for m in modes)
        table.add_row(header, *(_fmt(every[m][key]) for m in modes), *small_cells)
    console.print(table)


def render_table(results: Mapping[str, SimResult], console: Console) -> None:
    """One row per KPI, one column per policy (fits a narrow terminal)."""
    table = Table(title="hetsched sim: KPIs per policy")
    table.add_column("KPI")
    for name in results:
        table.add_column(name, justify="right")
    rows = {name: r.kpis.to_dict() for name, r in results.items()}
    reserved = any(r.kpis.fill_rate is not None for r in results.values())
    for key, header in (*_COLUMNS, *(_RESERVATION_COLUMNS if reserved else ())):
        table.add_row(header, *(_fmt(rows[name][key]) for name in results))
    console.print(table)


def write_plots(results: Mapping[str, SimResult], plots_dir: Path) -> list[Path]:
    """One PNG per policy: active replicas, queue length and SLO attainment per minute."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, result in results.items():
        minutes = [s.minute for s in result.samples]
        fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
        axes[0].plot(minutes, [s.active_replicas for s in result.samples])
        axes[0].set_ylabel("active replicas")
        axes[1].plot(minutes, [s.queue_length for s in result.samples])
        axes[1].set_ylabel("queue length")
        axes[2].plot(
            minutes, [s.slo_attainment if s.slo_attainment is not None else float("nan") for s in result.samples]
        )
        axes[2].set_ylabel("SLO attainment")
        axes[2].set_ylim(0, 1.05)
        axes[2].set_xlabel("minute")
        fig.suptitle(f"policy {name}")
        path = plots_dir / f"{name}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written


def dump_json(results: Mapping[str, SimResult], point: SweepPoint | None = None) -> str:
    return json.dumps(results_json(results, point), indent=2)


def dump_sharing_json(comparison: SharingComparison) -> str:
    return json.dumps(sharing_json(comparison), indent=2)
