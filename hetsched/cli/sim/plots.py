"""`hetsched sim --plots`: the figures (``report.py`` prints the tables).

One figure compares the policies (``policies.png`` for a run, ``sim_<trace>_all.png`` for a sweep);
the per-policy PNGs beside it give each policy's detail. The rules every figure keeps:

* Every axis starts at 0 (a share runs 0-100 %), so a bar or a line's height is the value itself.
* SLO is drawn as the share of requests that *missed* it (100 x (1 - SLO attainment)): the figures
  that matter (5-20 %) would sit in the top sliver of a 0-1 attainment axis.
* A policy has one colour, marker and line style in every figure (Okabe-Ito colours, which read under
  the common colour blindnesses). Policies with the very same numbers share one line, labelled with
  every name (``gpu-index = first-fit``), so no line hides behind another.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from hetsched.cli.sim.run import Sweep
from shared.domain.sim import Kpis, SimConfig, SimResult

K = TypeVar("K", bound=Hashable)

# (colour, marker, line style) per policy; any other name (a live policy, a sharing mode) gets the rest.
_STYLES: dict[str, tuple[str, str, Any]] = {
    "hetsched": ("#0072B2", "o", "-"),
    "gpu-index": ("#E69F00", "s", "--"),
    "random": ("#009E73", "^", "-."),
    "first-fit": ("#D55E00", "D", ":"),
    "cheapest-sku": ("#CC79A7", "v", (0, (3, 1, 1, 1, 1, 1))),
}
_SPARE: tuple[tuple[str, str, Any], ...] = (
    ("#56B4E9", "P", "-"),
    ("#000000", "X", "--"),
    ("#F0E442", "*", "-."),
    ("#999999", "h", ":"),
)


def style(name: str, index: int) -> tuple[str, str, Any]:
    """The colour, marker and line style of policy ``name`` (the ``index``-th drawn, for other names)."""
    return _STYLES.get(name) or _SPARE[index % len(_SPARE)]


def group_identical(series: Mapping[str, K]) -> list[tuple[tuple[str, ...], K]]:
    """The names whose series are equal, together, in the order each group's first name comes:
    ``{"a": 1, "b": 2, "c": 1}`` -> ``[(("a", "c"), 1), (("b",), 2)]``."""
    groups: dict[K, list[str]] = {}
    for name, values in series.items():
        groups.setdefault(values, []).append(name)
    return [(tuple(names), values) for values, names in groups.items()]


def missed_slo_pct(kpis: Kpis) -> float:
    """The share of requests that missed the SLO, in % (a failed request misses it)."""
    return 100.0 * (1.0 - kpis.slo_attainment)


# (title with its unit, the value from a run's KPIs (None: not known), the label's format)
_Metric = tuple[str, Callable[[Kpis], float | None], str]
_COMPARED: tuple[_Metric, ...] = (
    ("missed the SLO, % of requests", missed_slo_pct, "{:.1f}"),
    ("$ per million tokens", lambda k: k.cost_per_million_tokens, "{:.2f}"),
    (
        f"queue wait p99, s (a request fails at {SimConfig().queue_timeout_s:g} s)",
        lambda k: k.p99_queue_wait_ms / 1000.0,
        "{:.1f}",
    ),
)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_comparison(results: Mapping[str, SimResult], path: Path, *, title: str) -> Path:
    """One figure, a panel per KPI (missed SLO, $/M tokens, queue wait p99), a bar per policy with its
    value written at the bar's end; every axis from 0, lower is better in each."""
    plt = _pyplot()
    names = list(results)
    fig, axes = plt.subplots(1, len(_COMPARED), figsize=(11, 1.2 + 0.45 * len(names)), sharey=True)
    rows = list(range(len(names)))[::-1]  # the first policy on top
    for ax, (label, value_of, fmt) in zip(axes, _COMPARED, strict=True):
        values = [value_of(results[name].kpis) for name in names]
        drawn = [0.0 if v is None else v for v in values]
        colours = [style(name, i)[0] for i, name in enumerate(names)]
        ax.barh(rows, drawn, color=colours, height=0.6)
        top = max(drawn, default=0.0) or 1.0
        for row, value in zip(rows, values, strict=True):
            text = "n/a" if value is None else fmt.format(value)
            ax.text((value or 0.0) + top * 0.02, row, text, va="center", fontsize=9)
        ax.set_xlim(0, top * 1.25)  # room for the labels
        ax.set_title(f"{label}\n(lower is better)", fontsize=10)
        ax.grid(True, axis="x", alpha=0.3)
        ax.set_axisbelow(True)
    axes[0].set_yticks(rows, names, fontsize=10)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_timeseries(name: str, result: SimResult, path: Path) -> Path:
    """One policy's active replicas, queue length and SLO attainment per sample period (a minute)."""
    plt = _pyplot()
    minutes = [s.minute for s in result.samples]
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    colour, marker, _ = style(name, 0)
    axes[0].plot(minutes, [s.active_replicas for s in result.samples], color=colour, marker=marker)
    axes[0].set_ylabel("active replicas")
    axes[1].plot(minutes, [s.queue_length for s in result.samples], color=colour, marker=marker)
    axes[1].set_ylabel("queue length, requests")
    slo = [s.slo_attainment if s.slo_attainment is not None else float("nan") for s in result.samples]
    axes[2].plot(minutes, slo, color=colour, marker=marker)
    axes[2].set_ylabel("SLO attainment")
    axes[0].set_ylim(0, max([1, *(s.active_replicas for s in result.samples)]) * 1.1)
    axes[1].set_ylim(0, max([1, *(s.queue_length for s in result.samples)]) * 1.1)
    axes[2].set_ylim(0, 1.05)
    axes[2].set_xlim(0, max([1.0, *minutes]) * 1.05)
    axes[2].set_xlabel("minute of simulated time (one sample a minute)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"policy {name}")
    fig.savefig(path)
    plt.close(fig)
    return path


def write_plots(results: Mapping[str, SimResult], plots_dir: Path, *, title: str = "hetsched sim") -> list[Path]:
    """``policies.png`` (every policy compared) and one time-series PNG per policy (``NAME.png``)."""
    plots_dir.mkdir(parents=True, exist_ok=True)
    written = [write_comparison(results, plots_dir / "policies.png", title=title)]
    written += [write_timeseries(name, result, plots_dir / f"{name}.png") for name, result in results.items()]
    return written


def _sweep_series(sweep: Sweep, name: str, value_of: Callable[[Kpis], float | None]) -> tuple[float | None, ...]:
    return tuple(value_of(p.results[name].kpis) for p in sweep.points)


def write_sweep_plots(sweep: Sweep, plots_dir: Path) -> list[Path]:
    """``sim_<trace>_all.png``: missed SLO and $/M tokens against load, a line per policy (policies with
    the same numbers share one, named together); ``sim_<trace>_<policy>.png``: one policy's cost
    against SLO attainment, a point per load."""
    plt = _pyplot()
    plots_dir.mkdir(parents=True, exist_ok=True)
    names = list(sweep.points[0].results) if sweep.points else []
    loads = [p.load for p in sweep.points]
    written = []

    fig, axes = plt.subplots(1, 2, figsize=(10, 4.4))
    panels: tuple[_Metric, ...] = (_COMPARED[0], _COMPARED[1])
    # Grouped on both panels' numbers at once, so a line is the same policies in each.
    both = {name: tuple(_sweep_series(sweep, name, value_of) for _, value_of, _ in panels) for name in names}
    groups = group_identical(both)
    for at, (ax, (label, _, _)) in enumerate(zip(axes, panels, strict=True)):
        top = 0.0
        for g, (group, series) in enumerate(groups):
            values = series[at]
            colour, marker, line = style(group[0], names.index(group[0]))
            ys = [float("nan") if v is None else v for v in values]
            # Later lines smaller and in front: where two meet, both markers still show (one inside the other).
            ax.plot(
                loads,
                ys,
                color=colour,
                marker=marker,
                markersize=max(4.0, 10.0 - 1.5 * g),
                linestyle=line,
                linewidth=1.8,
                zorder=2 + g,
                clip_on=False,  # a point at 0 shows whole
                label=" = ".join(group),
            )
            top = max([top, *(v for v in values if v is not None)])
        ax.set_ylim(0, (top or 1.0) * 1.15)
        pad = 0.1 * ((max(loads) - min(loads)) or 1.0) if loads else 0.1
        ax.set_xlim(min(loads, default=0.0) - pad, max(loads, default=1.0) + pad)
        ax.set_xticks(loads)
        ax.set_xlabel("load (share of what the fleet serves)")
        ax.set_title(f"{label} (lower is better)", fontsize=10)
        ax.grid(True, alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 5), fontsize=9, frameon=False)
    fig.suptitle(f"{sweep.trace}: every policy by load", fontsize=11)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    path = plots_dir / f"sim_{sweep.trace}_all.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)

    for i, name in enumerate(names):
        fig, ax = plt.subplots(figsize=(5, 3.6))
        colour, marker, line = style(name, i)
        points = [
            (p.load, p.results[name].kpis.cost_per_million_tokens, p.results[name].kpis.slo_attainment)
            for p in sweep.points
        ]
        shown = [(load, cost, slo) for load, cost, slo in points if cost is not None]
        ax.plot([c for _, c, _ in shown], [s for _, _, s in shown], color=colour, marker=marker, linestyle=line)
        for load, cost, slo in shown:
            ax.annotate(f"load {load:g}", (cost, slo), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlim(0, max((c for _, c, _ in shown), default=1.0) * 1.3)
        ax.set_ylim(0, 1.05)
        ax.set_xlabel("$ per million tokens")
        ax.set_ylabel("SLO attainment")
        ax.set_title(f"{sweep.trace}: {name}", fontsize=10)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        path = plots_dir / f"sim_{sweep.trace}_{name}.png"
        fig.savefig(path, dpi=80)
        plt.close(fig)
        written.append(path)
    return written
