"""`hetsched sim`: the options, what goes with what, and which run they ask for (``run.py`` runs it,
``report.py`` prints it)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from hetsched.cli.choices import BadRows, SimPolicy, SimSharing
from hetsched.cli.common import DataDirOption, bad_input, console, endpoints, err, settings_of
from hetsched.stack import operator_options
from shared.contracts.subjects import Subjects
from shared.infra.refusal import NatsRefused

if TYPE_CHECKING:
    from shared.domain.traces import OnError

app = typer.Typer()


@app.command()
def sim(
    fleet: Annotated[
        Path | None,
        typer.Option("--fleet", help="Fleet inventory YAML (API.md format); default: the shipped demo fleet."),
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option(
            "--trace",
            help="Workload trace (Azure CSV, Mooncake JSONL, plain CSV); default: the shipped sample (4,000 "
            "requests of the Azure LLM inference trace 2023, CC-BY 4.0), at --load 0.8 unless given.",
        ),
    ] = None,
    policy: Annotated[SimPolicy | None, typer.Option(help="One policy; default all.")] = None,
    seed: Annotated[int, typer.Option(help="Seed of the model mix and the random policy.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help='Print {"policies": {NAME: KPIS}}.')] = False,
    plots: Annotated[Path | None, typer.Option("--plots", help="Write per-policy time-series PNGs here.")] = None,
    bad_rows: Annotated[
        BadRows, typer.Option("--bad-rows", help="reject (exit non-zero naming the row) or skip.")
    ] = BadRows.REJECT,
    limit: Annotated[int | None, typer.Option(help="Only the first N requests of the trace.")] = None,
    live: Annotated[
        bool, typer.Option("--live", help="Ask a running stack's placement.place for every replica (see README).")
    ] = False,
    sharing: Annotated[
        SimSharing,
        typer.Option(
            "--sharing",
            help="exclusive (every replica), shared (small models ask sharing: shared), or compare: hetsched "
            'both ways, side by side (--json: {"sharing": {"exclusive": KPIS, "shared": KPIS}}).',
        ),
    ] = SimSharing.EXCLUSIVE,
    load: Annotated[
        float | None,
        typer.Option(
            "--load",
            help="Scale the arrivals so the fleet runs at this load (e.g. 0.8). Load = the sum over models of "
            "the model's arrival rate / the requests per second the whole fleet completes of that model alone, "
            "every replica full (placed by hetsched on the empty fleet until it refuses; docs/PERFORMANCE.md).",
        ),
    ] = None,
    sweep: Annotated[
        bool,
        typer.Option(
            "--sweep",
            help="Run the policies at each of --loads: one table (rows policy x load), ours against the best "
            'baseline per load; --plots writes cost-vs-SLO PNGs (sim_<trace>_<policy>.png); --json: {"sweep": ...}.',
        ),
    ] = False,
    loads: Annotated[str, typer.Option("--loads", help="Loads for --sweep, comma separated.")] = "0.6,0.8,0.95",
    reserve: Annotated[
        list[str] | None,
        typer.Option(
            "--reserve",
            help="TENANT:POLICY:COUNT:SKU (policy hard, soft or spot), repeatable: COUNT GPUs of SKU reserved for "
            "TENANT (whole nodes first); the KPIs then add fill rate, preemptions and preempted requests.",
        ),
    ] = None,
    owner_models: Annotated[
        list[str] | None,
        typer.Option(
            "--owner-models",
            help="With --reserve: the models whose replicas are the reserving tenant's (not preemptible), a,b, or "
            "TENANT=a,b when several tenants reserve (repeatable); every other model's replicas are one "
            "preemptible tenant's and may borrow what soft and spot reservations lend.",
        ),
    ] = None,
    data_dir: DataDirOption = None,
) -> None:
    """Replay a workload trace against a fleet under each placement policy and print the KPIs (with no
    --trace: the shipped sample at load 0.8 on the demo fleet)."""
    from hetsched.cli.sim.plots import write_plots
    from hetsched.cli.sim.report import dump_json, render_table
    from hetsched.cli.sim.run import SAMPLE_LOAD, parse_reservations, run_sim, sample_trace_path, trace_notes
    from shared.domain.sim import SimConfig
    from shared.infra.catalog import demo_fleet_path, load_models

    compare = sharing is SimSharing.COMPARE
    if sharing is not SimSharing.EXCLUSIVE and live:
        bad_input("--sharing: only exclusive with --live (the live path does not ask for sharing)")
    if (sweep or load is not None) and (live or compare):
        bad_input("--load and --sweep: not with --live or --sharing compare")
    if load is not None and not load > 0:
        bad_input(f"--load: expected a positive load, got {load}")
    if (reserve or owner_models) and (live or compare):
        bad_input("--reserve: not with --live or --sharing compare")
    if compare and policy not in (None, SimPolicy.HETSCHED):
        bad_input("--sharing compare runs hetsched only: the baselines do not read `sharing`")
    try:
        reservations = parse_reservations(reserve or [], owner_models or [], known_models=load_models())
    except ValueError as exc:
        bad_input(str(exc))
    if fleet is None:
        fleet = demo_fleet_path()
        err.print(f"fleet: the shipped demo fleet, {fleet}", markup=False, soft_wrap=True)
    if trace is None:
        trace = sample_trace_path()
        err.print(f"trace: the shipped sample, {trace}", markup=False, soft_wrap=True)
        notes = trace_notes(trace)
        for key in ("Sample", "Source", "Licence", "Citation"):
            if key in notes:
                err.print(f"  {key.lower()}: {notes[key]}", markup=False, highlight=False, soft_wrap=True)
        if load is None and not (sweep or live or compare):
            # At its own rate the sample keeps the demo fleet ~2 % busy: every policy would score the same.
            load = SAMPLE_LOAD
            err.print(f"load: {load:g}, the sample's default (--load sets another)")
    policy_name = policy.value if policy is not None else None
    if sweep or load is not None:
        _sim_sweep(
            fleet,
            trace,
            policy_name,
            loads=loads if load is None else str(load),
            seed=seed,
            bad_rows=bad_rows,
            limit=limit,
            share_small=sharing is SimSharing.SHARED,
            as_json=as_json,
            plots=plots,
            sweep=sweep,
            reservations=reservations,
        )
        return
    if compare:
        _sim_sharing_compare(fleet, trace, seed=seed, bad_rows=bad_rows, limit=limit, as_json=as_json, plots=plots)
        return
    live_policy = None
    if live:
        from hetsched.sim_live import LivePolicy

        settings = settings_of(data_dir)
        nats_url, _db, prefix = endpoints(settings)
        try:
            live_policy = LivePolicy(
                nats_url=nats_url,
                subjects=Subjects(prefix),
                timeout_s=settings.kit.request_timeout_ms / 1000,
                options=operator_options(settings),
            )
        except NatsRefused as refused:  # its credential: one line naming the setting to fix
            bad_input(refused.line)
        except Exception as exc:
            err.print(f"[red]--live: no stack at {nats_url}: {type(exc).__name__} {exc}[/red]")
            raise typer.Exit(2) from exc
    try:
        with _trace_errors(trace):
            results, loaded = run_sim(
                fleet,
                trace,
                policy_name,
                seed=seed,
                on_bad_rows=_on_error(bad_rows),
                limit=limit,
                config=SimConfig(share_small=sharing is SimSharing.SHARED, reservations=reservations),
                live=live_policy,
            )
    finally:
        if live_policy is not None:
            live_policy.close()
    _report_skipped(loaded)
    if as_json:
        print(dump_json(results))
    else:
        render_table(results, console)
    if plots is not None:
        for path in write_plots(results, plots, title=_title(trace, fleet, results)):
            err.print(f"wrote {path}")


def _title(trace: Path, fleet: Path, results: Any, load: float | None = None) -> str:
    """The comparison figure's title: what ran, on what, how hard."""
    requests = max((r.kpis.requests for r in results.values()), default=0)
    at = "its own rate" if load is None else f"load {load:g}"
    return f"{trace.stem} on {fleet.stem}: {requests} requests at {at}"


@contextlib.contextmanager
def _trace_errors(trace: Path) -> Iterator[None]:
    """A trace that cannot be read exits 1 naming it; a file or value the run refuses exits 2."""
    from shared.domain.traces import TraceError

    try:
        yield
    except TraceError as exc:
        err.print(f"[red]{trace}: {exc}[/red]")
        raise typer.Exit(1) from exc
    except (OSError, ValueError) as exc:
        bad_input(str(exc))


def _on_error(bad_rows: BadRows) -> OnError:
    return "skip" if bad_rows is BadRows.SKIP else "reject"


def _report_skipped(loaded: Any) -> None:
    """With `--bad-rows skip`: how many rows were left out, and why (on stderr)."""
    if loaded.skipped_total:
        counts = ", ".join(f"{reason}={n}" for reason, n in sorted(loaded.skipped.items()))
        err.print(f"skipped {loaded.skipped_total} bad rows ({counts})")


def _sim_sweep(
    fleet: Path,
    trace: Path,
    policy: str | None,
    *,
    loads: str,
    seed: int,
    bad_rows: BadRows,
    limit: int | None,
    share_small: bool,
    as_json: bool,
    plots: Path | None,
    sweep: bool,
    reservations: Any = None,  # shared.domain.sim.reservations.ReservationSetup (imported when run)
) -> None:
    """`hetsched sim --sweep`: every policy at each load, one table, margins, cost-vs-SLO plots. Without
    ``sweep`` (`--load X`): the one load's KPI table, its plots (policies compared, time series), and the
    scaling on stderr."""
    from hetsched.cli.sim.plots import write_plots, write_sweep_plots
    from hetsched.cli.sim.report import dump_json, dump_sweep_json, render_sweep, render_table
    from hetsched.cli.sim.run import parse_loads, run_sweep
    from shared.domain.sim import SimConfig

    with _trace_errors(trace):
        targets = parse_loads(loads)
        result, loaded = run_sweep(
            fleet,
            trace,
            targets,
            policy,
            seed=seed,
            on_bad_rows=_on_error(bad_rows),
            limit=limit,
            config=SimConfig(share_small=share_small, reservations=reservations),
        )
    _report_skipped(loaded)
    if not sweep:
        (point,) = result.points
        err.print(
            f"load {point.load:g}: arrivals {point.factor:.1f}x as fast as the trace's own "
            f"(its load {result.native.load:.4f}), over {point.span_s:.0f} s"
        )
        if as_json:
            print(dump_json(point.results, point))
        else:
            render_table(point.results, console)
        if plots is not None:
            for path in write_plots(point.results, plots, title=_title(trace, fleet, point.results, point.load)):
                err.print(f"wrote {path}")
        return
    if as_json:
        print(dump_sweep_json([result]))
    else:
        render_sweep(result, console)
    if plots is not None:
        for path in write_sweep_plots(result, plots):
            err.print(f"wrote {path}")


def _sim_sharing_compare(
    fleet: Path, trace: Path, *, seed: int, bad_rows: BadRows, limit: int | None, as_json: bool, plots: Path | None
) -> None:
    """`hetsched sim --sharing compare`: the same trace with small models exclusive, then shared."""
    from hetsched.cli.sim.plots import write_plots
    from hetsched.cli.sim.report import dump_sharing_json, render_sharing_table
    from hetsched.cli.sim.run import run_sharing_compare

    with _trace_errors(trace):
        comparison, loaded = run_sharing_compare(fleet, trace, seed=seed, on_bad_rows=_on_error(bad_rows), limit=limit)
    _report_skipped(loaded)
    if as_json:
        print(dump_sharing_json(comparison))
    else:
        render_sharing_table(comparison, console)
    if plots is not None:
        title = f"{trace.stem} on {fleet.stem}: hetsched, every replica exclusive vs small models shared"
        for path in write_plots(comparison.results, plots, title=title):
            err.print(f"wrote {path}")
