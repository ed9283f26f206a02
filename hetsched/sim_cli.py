"""`hetsched sim`: the IO shell around the pure simulator (``shared.domain.sim``).

Reads the fleet and the trace, assigns models with the default mix, runs each policy with a
wall-clock timer around its decisions, and prints a table or JSON; ``--plots`` writes one PNG per
policy of the per-minute time series (active replicas, queue length, SLO attainment).

Default model mix (all fit the demo fleet): llama3-8b 50 %, llama3-70b 30 %, mixtral-8x7b 20 %.

``--sharing compare`` replays the trace twice with ``hetsched``: every replica exclusive, then the small
models (``shared.domain.sim.sharing.small_models``) asking ``sharing: shared``, and prints both KPI
sets side by side, for the whole workload and for the small models' requests alone.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from shared.domain.placement import FleetSnapshot
from shared.domain.sim import POLICIES, Kpis, Policy, SimConfig, SimResult, compute_kpis, make_policy, simulate
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
    return FleetSnapshot.from_fleet(fleet, skus=skus, models=models), assigned, trace


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
    policy name."""
    snapshot, assigned, trace = _load(
        fleet_path, trace_path, seed=seed, on_bad_rows=on_bad_rows, model_mix=model_mix, limit=limit
    )
    if live is not None:
        return {live.name: simulate(snapshot, assigned, live, config=config, timer=time.perf_counter)}, trace
    names: Sequence[str] = POLICIES if policy is None else (policy,)
    results = {
        name: simulate(snapshot, assigned, make_policy(name, seed=seed), config=config, timer=time.perf_counter)
        for name in names
    }
    return results, trace


def results_json(results: Mapping[str, SimResult]) -> dict[str, Any]:
    return {"policies": {name: r.kpis.to_dict() for name, r in results.items()}}


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
    for key, header in _COLUMNS:
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


def dump_json(results: Mapping[str, SimResult]) -> str:
    return json.dumps(results_json(results), indent=2)


def dump_sharing_json(comparison: SharingComparison) -> str:
    return json.dumps(sharing_json(comparison), indent=2)
