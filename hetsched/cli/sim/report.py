"""`hetsched sim`: the KPIs as JSON and tables (``run.py`` produces them, ``plots.py`` draws them)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

from hetsched.cli.sim.run import LOAD_HELP, SharingComparison, Sweep, SweepPoint, margins
from shared.domain.sim import SimResult


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


def results_json(results: Mapping[str, SimResult], point: SweepPoint | None = None) -> dict[str, Any]:
    """``{"policies": {NAME: KPIS}}``; at a chosen load also ``"load": {"target", "factor", "span_s"}``."""
    body: dict[str, Any] = {"policies": {name: r.kpis.to_dict() for name, r in results.items()}}
    if point is not None:
        body["load"] = {"target": point.load, "factor": point.factor, "span_s": point.span_s}
    return body


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


def dump_json(results: Mapping[str, SimResult], point: SweepPoint | None = None) -> str:
    return json.dumps(results_json(results, point), indent=2)


def dump_sharing_json(comparison: SharingComparison) -> str:
    return json.dumps(sharing_json(comparison), indent=2)
