"""The `hetsched` command line (API.md)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from pydantic import BaseModel, ValidationError
from rich.console import Console
from rich.table import Table

from hetsched.credentials_cli import app as credentials_app
from hetsched.deadletter_cli import app as deadletter_app
from hetsched.emit import EmitKind, NothingToEmit, emit_note, emit_text
from hetsched.stack import ServerDied, Stack, operator_options, read_state, server_liveness, wait_healthy
from services.registry import SERVICES
from shared.contracts.base import Rejected
from shared.contracts.placement import (
    AdmitReply,
    AdmitRequest,
    PlaceReply,
    PlaceRequest,
    ReleaseReply,
    ReleaseRequest,
    Slo,
)
from shared.contracts.rebalance import RebalanceStatusReply, RebalanceStatusRequest
from shared.contracts.reservation import (
    ReservationCancelReply,
    ReservationCancelRequest,
    ReservationCreateReply,
    ReservationCreateRequest,
    ReservationReportReply,
    ReservationReportRequest,
    ReservationStatusReply,
    ReservationStatusRequest,
)
from shared.contracts.routing import RouteRegionReply, RouteRegionRequest, RouteSelectReply, RouteSelectRequest
from shared.contracts.subjects import Rpc, Subjects
from shared.infra.bus import invalid_request
from shared.infra.rpc import RpcClient
from shared.infra.settings import Settings, load_settings

DataDirOption = Annotated[
    Path | None, typer.Option(help="Data dir of a running `hetsched up` (to find its NATS); default as `up`.")
]
app = typer.Typer(help="hetsched: places LLM inference on heterogeneous GPU/TPU fleets.", no_args_is_help=True)
console = Console()
err = Console(stderr=True)
app.add_typer(deadletter_app, name="deadletter")
app.add_typer(credentials_app, name="credentials")


def _settings(data_dir: Path | None = None) -> Settings:
    return load_settings(kit={"data_dir": data_dir}) if data_dir else load_settings()


def _endpoints(settings: Settings) -> tuple[str, str | None, str]:
    """NATS URL, database URL and subject prefix: from the environment, else a running `hetsched up`."""
    state = read_state(settings) or {}
    nats_url = settings.kit.nats_url or state.get("nats_url") or "nats://127.0.0.1:4222"
    database_url = settings.kit.database_url or state.get("database_url")
    prefix = (
        state.get("subject_prefix", settings.kit.subject_prefix)
        if not settings.kit.nats_url
        else settings.kit.subject_prefix
    )
    return nats_url, database_url, prefix


ReplyT = TypeVar("ReplyT")


def _with_rpc(data_dir: Path | None, what: str, work: Callable[[RpcClient], Awaitable[ReplyT]]) -> ReplyT:
    """Run ``work`` with a client on the stack's NATS (timeout: ``HETSCHED_REQUEST_TIMEOUT_MS``); no
    answer exits 2 and says where it asked."""
    settings = _settings(data_dir)
    nats_url, _db, prefix = _endpoints(settings)

    async def session() -> ReplyT:
        rpc = await RpcClient.connect(
            nats_url,
            Subjects(prefix),
            timeout_s=settings.kit.request_timeout_ms / 1000,
            name="hetsched-cli",
            **operator_options(settings),
        )
        try:
            return await work(rpc)
        finally:
            await rpc.close()

    try:
        return asyncio.run(session())
    except Exception as exc:
        err.print(f"[red]no answer from {what} at {nats_url}: {type(exc).__name__} {exc}[/red]")
        raise typer.Exit(2) from exc


@app.command()
def up(
    fleet: Annotated[Path | None, typer.Option(help="Fleet inventory file (YAML); a demo fleet by default.")] = None,
    data_dir: Annotated[Path | None, typer.Option(help="Where embedded servers keep their data.")] = None,
    health_timeout_s: Annotated[float, typer.Option(help="How long to wait for six healthy services.")] = 60.0,
) -> None:
    """Start the local stack in the foreground; SIGINT/SIGTERM stops everything cleanly."""
    settings = _settings(data_dir)
    stack = Stack(settings, echo=console.print, fleet_file=fleet)
    stop_requested = False

    def _on_signal(signum: int, _frame: Any) -> None:
        nonlocal stop_requested
        stop_requested = True

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    started = time.monotonic()
    died: ServerDied | None = None
    try:
        stack.start_servers()
        if stop_requested:
            return
        console.print(f"NATS      {stack.nats_url}{'  (embedded)' if stack.nats else ''}")
        console.print(f"Postgres  {stack.database_url}{'  (embedded)' if stack.postgres else ''}", soft_wrap=True)
        stack.migrate()
        console.print("migrations at head")
        console.print(f"fleet     {fleet or settings.topology.inventory or 'built-in demo fleet'}")
        stack.create_streams()
        stack.start_services()
        stack.write_state()
        if stack.operator_seed is not None:
            console.print(f"operator  NKey seed {stack.operator_seed} (NATS requires authentication)")
        health = asyncio.run(
            wait_healthy(
                nats_url=stack.nats_url,
                subjects=Subjects(settings.kit.subject_prefix),
                deadline_s=health_timeout_s,
                **stack.nats_options(),
            )
        )
        for package, reply in health.items():
            console.print(f"  {SERVICES[package].name:<22} {reply.get('status')}")
        ok = all(r.get("status") == "ok" for r in health.values())
        console.print(
            f"{'ready' if ok else 'NOT ready'} in {time.monotonic() - started:.1f}s; state in {settings.kit.data_dir}; "
            "Ctrl-C stops everything"
        )
        while not stop_requested:
            stack.supervise_once()
            time.sleep(0.2)
    except ServerDied as exc:
        died = exc
        err.print(f"[bold red]!!! {exc}: stopping the stack[/bold red]")
    finally:
        console.print("stopping...")
        stack.stop()
        console.print("stopped")
    if died is not None:
        err.print(f"[bold red]hetsched up exits: embedded {died.server} died[/bold red]")
        raise typer.Exit(3)


@app.command()
def status(
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    data_dir: Annotated[Path | None, typer.Option(help="Data dir of a running `hetsched up`.")] = None,
) -> None:
    """Health of each service and the NATS and Postgres endpoints in use."""
    settings = _settings(data_dir)
    nats_url, database_url, prefix = _endpoints(settings)
    try:
        health = asyncio.run(
            wait_healthy(nats_url=nats_url, subjects=Subjects(prefix), deadline_s=0, **operator_options(settings))
        )
    except Exception as exc:
        health = {p: {"status": "down", "error": f"NATS unreachable: {type(exc).__name__}"} for p in SERVICES}
    services = {SERVICES[p].name: r for p, r in health.items()}
    report: dict[str, Any] = {
        "nats_url": nats_url,
        "database_url": database_url,
        "nats_nkey_seed_file": (read_state(settings) or {}).get("nats_nkey_seed_file"),
        "servers": server_liveness(read_state(settings) or {}),
        "services": services,
    }
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        console.print(f"NATS      {nats_url}\nPostgres  {database_url}", soft_wrap=True)  # a URL is not folded
        for server, live in report["servers"].items():
            console.print(f"embedded {server}: pid {live['pid']} {'running' if live['running'] else 'NOT RUNNING'}")
        table = Table("service", "status", "version", "checks")
        for name, reply in services.items():
            table.add_row(
                name, str(reply.get("status")), str(reply.get("version", "")), json.dumps(reply.get("checks", {}))
            )
        console.print(table)
    if not all(r.get("status") == "ok" for r in health.values()):
        raise typer.Exit(1)


def _print_reply(reply: BaseModel, as_json: bool) -> None:
    """A reply exactly as the service sent it (its contract model), as JSON; a refusal exits 1."""
    text = reply.model_dump_json(indent=2)
    if as_json:
        print(text)
    else:
        console.print_json(text)
    if getattr(reply, "status", None) == "rejected":
        raise typer.Exit(1)


@app.command()
def place(
    model: Annotated[str, typer.Option(help="Catalog model name.")],
    tenant: Annotated[str, typer.Option(help="Tenant.")],
    context_tokens: Annotated[int, typer.Option(help="Longest sequence held.")],
    concurrency: Annotated[int, typer.Option(help="Sequences held at once.")] = 1,
    request_id: Annotated[str | None, typer.Option(help="Idempotency key (random by default).")] = None,
    dtype: Annotated[str | None, typer.Option(help="Weights dtype.")] = None,
    kv_dtype: Annotated[str | None, typer.Option(help="KV dtype.")] = None,
    input_tokens: Annotated[int | None, typer.Option(help="Typical input tokens.")] = None,
    output_tokens: Annotated[int | None, typer.Option(help="Typical output tokens.")] = None,
    tp: Annotated[int | None, typer.Option(help="Fixed tensor-parallel degree.")] = None,
    backend: Annotated[str, typer.Option(help="gpu, tpu or any.")] = "any",
    sku: Annotated[list[str] | None, typer.Option(help="Allowed SKU (repeatable).")] = None,
    region: Annotated[str | None, typer.Option(help="Required region.")] = None,
    preemptible: Annotated[bool, typer.Option(help="May run on lent capacity.")] = False,
    lease_s: Annotated[int | None, typer.Option(help="Lease length.")] = None,
    explain: Annotated[bool, typer.Option(help="Dry run (placement.explain).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    data_dir: DataDirOption = None,
    emit: Annotated[
        EmitKind | None,
        typer.Option(
            help="Print only what an operator pastes: the `vllm serve` or `sglang.launch_server` line "
            "(with CUDA_VISIBLE_DEVICES and taskset), or `env` KEY=value lines. No launch: the reply goes to "
            "stderr and the exit code is 1."
        ),
    ] = None,
) -> None:
    """One `placement.place` call (or `placement.explain` with --explain)."""
    import uuid

    fields: dict[str, Any] = {
        "request_id": request_id or f"cli-{uuid.uuid4()}",
        "tenant": tenant,
        "model": model,
        "context_tokens": context_tokens,
        "concurrency": concurrency,
        "backend": backend,
        "preemptible": preemptible,
        "dtype": dtype,
        "kv_dtype": kv_dtype,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "tp": tp,
        "skus": sku,
        "region": region,
        "lease_s": lease_s,
    }
    try:
        request = PlaceRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:  # the answer the service gives to the same body
        _print_reply(invalid_request(exc, request_id=fields["request_id"]), as_json)
        return
    rpc = Rpc.PLACEMENT_EXPLAIN if explain else Rpc.PLACEMENT_PLACE
    reply = _with_rpc(data_dir, rpc.value, lambda client: client.ask(rpc, request, PlaceReply, rejection_as_reply=True))
    if emit is not None:
        _emit(reply, emit)
        return
    _print_reply(reply, as_json)


def _emit(reply: PlaceReply | Rejected, kind: EmitKind) -> None:
    """stdout gets only the pasteable text; anything else (the reply without a launch, a note that the
    replica spans nodes) goes to stderr, and no launch exits 1."""
    try:
        text = emit_text(reply, kind)
    except NothingToEmit as exc:
        err.print(str(exc), soft_wrap=True, markup=False, highlight=False)
        err.print_json(reply.model_dump_json(indent=2))
        raise typer.Exit(1) from None
    print(text)
    note = emit_note(reply)
    if note:
        err.print(note, soft_wrap=True, markup=False, highlight=False)


@app.command()
def release(
    allocation_id: Annotated[str, typer.Argument(help="Allocation to release.")],
    tenant: Annotated[str, typer.Option(help="Owner.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    data_dir: DataDirOption = None,
) -> None:
    """One `placement.release` call."""
    request = ReleaseRequest(allocation_id=allocation_id, tenant=tenant)
    reply = _with_rpc(
        data_dir,
        Rpc.PLACEMENT_RELEASE.value,
        lambda client: client.ask(Rpc.PLACEMENT_RELEASE, request, ReleaseReply, rejection_as_reply=True),
    )
    _print_reply(reply, as_json)


def _ask_and_print(
    data_dir: Path | None,
    rpc: Rpc,
    build: Callable[[], BaseModel],
    reply_type: type[BaseModel],
    as_json: bool,
) -> None:
    """Build the request (a bad option exits 2 saying why), send it, print the reply as `_print_reply`."""
    try:
        request = build()
    except ValidationError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    reply = _with_rpc(data_dir, rpc.value, lambda client: client.ask(rpc, request, reply_type, rejection_as_reply=True))
    _print_reply(reply, as_json)


ModelOrGroupOption = Annotated[str, typer.Option(help="Catalog model or model group.")]
TenantOption = Annotated[str, typer.Option(help="Tenant.")]
OutputTokensOption = Annotated[int, typer.Option(help="Expected maximum output tokens.")]
TtftOption = Annotated[float | None, typer.Option(help="TTFT SLO.")]
RequestIdOption = Annotated[str | None, typer.Option(help="Request id (random by default).")]
JsonOption = Annotated[bool, typer.Option("--json", help="Print JSON.")]


def _request_id(given: str | None) -> str:
    return given or f"cli-{uuid.uuid4().hex[:12]}"


@app.command()
def admit(
    model: ModelOrGroupOption,
    tenant: TenantOption,
    input_tokens: Annotated[int, typer.Option(help="Input tokens.")],
    output_tokens: OutputTokensOption = 256,
    region: Annotated[str | None, typer.Option(help="Region.")] = None,
    ttft_ms: TtftOption = None,
    hint: Annotated[str, typer.Option(help="auto, transformer, ssm or moe.")] = "auto",
    request_id: RequestIdOption = None,
    as_json: JsonOption = False,
    data_dir: DataDirOption = None,
) -> None:
    """One `placement.admit` call: a request onto a running replica."""
    _ask_and_print(
        data_dir,
        Rpc.PLACEMENT_ADMIT,
        lambda: AdmitRequest(
            request_id=_request_id(request_id),
            tenant=tenant,
            model=model,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            region=region,
            slo=Slo(ttft_ms=ttft_ms) if ttft_ms else None,
            hint=hint,
        ),
        AdmitReply,
        as_json,
    )


@app.command()
def route(
    model: ModelOrGroupOption,
    tenant: TenantOption,
    origin: Annotated[str, typer.Option(help="Region the request entered (origin_region).")],
    input_tokens: Annotated[int, typer.Option(help="Input tokens.")] = 1000,
    output_tokens: OutputTokensOption = 256,
    session_id: Annotated[str | None, typer.Option(help="Session (its region is kept while in flight).")] = None,
    in_flight: Annotated[bool, typer.Option(help="A message of the session is streaming.")] = False,
    admit: Annotated[bool, typer.Option(help="Also admit it in the chosen region.")] = True,
    ttft_ms: TtftOption = None,
    request_id: RequestIdOption = None,
    as_json: JsonOption = False,
    data_dir: DataDirOption = None,
) -> None:
    """One `route.select` call: which region serves this request (and, by default, its admission there)."""
    _ask_and_print(
        data_dir,
        Rpc.ROUTE_SELECT,
        lambda: RouteSelectRequest(
            request_id=_request_id(request_id),
            tenant=tenant,
            origin_region=origin,
            model=model,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            session_id=session_id,
            in_flight=in_flight,
            admit=admit,
            slo=Slo(ttft_ms=ttft_ms) if ttft_ms else None,
        ),
        RouteSelectReply,
        as_json,
    )


@app.command("route-region")
def route_region(
    region: Annotated[str, typer.Argument(help="Region.")],
    state: Annotated[str, typer.Option(help="up, drain or down.")],
    as_json: JsonOption = False,
    data_dir: DataDirOption = None,
) -> None:
    """Operators: drain a region (no new tenants or sessions; in-flight sessions stay), down it, or bring it up."""
    _ask_and_print(
        data_dir, Rpc.ROUTE_REGION, lambda: RouteRegionRequest(region=region, state=state), RouteRegionReply, as_json
    )


POLICY_NAMES = ("soft", "hard", "spot")


def _refuse(message: str) -> NoReturn:
    """A bad combination of options: say which on stderr and exit 2, before anything is asked."""
    err.print(message, style="red", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(2)


def _build(build: Callable[[], BaseModel]) -> BaseModel:
    """The request, or exit 2 with what the contract refused (the answer the service would give)."""
    try:
        return build()
    except ValidationError as exc:
        _refuse(str(exc))


def _refusal(reply: BaseModel, as_json: bool) -> None:
    """A `rejected` reply exits 1 with its code and message on stderr (after the JSON with --json)."""
    if getattr(reply, "status", None) != "rejected":
        return
    if as_json:
        print(reply.model_dump_json(indent=2))
    error = getattr(reply, "error", None)
    what = f"{error.code}: {error.message}" if error is not None else "no reason given"
    err.print(f"rejected: {what}", style="red", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(1)


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _say(text: str) -> None:
    """One line as it is: no markup, no highlighting, never folded (ids are copied from it)."""
    console.print(text, markup=False, highlight=False, soft_wrap=True)


def _columns(headers: list[str], rows: list[list[str]]) -> None:
    """A plain table, each column as wide as its widest cell: nothing is cut or folded to fit the
    terminal (an id is copied from it into `--cancel`), and `awk` reads it."""
    widths = [max(len(cell) for cell in column) for column in zip(headers, *rows, strict=False)]
    for line in [headers, *rows]:
        _say("  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip())


@app.command()
def reserve(
    tenant: TenantOption,
    policy: Annotated[str, typer.Option(help="soft, hard or spot (docs/RESERVATIONS.md).")],
    count: Annotated[int | None, typer.Option(help="How many accelerators (with --sku and --region).")] = None,
    sku: Annotated[str | None, typer.Option(help="SKU of the accelerators (with --count).")] = None,
    region: Annotated[str | None, typer.Option(help="Region of the accelerators (with --count).")] = None,
    accelerator: Annotated[
        list[str] | None,
        typer.Option("--accelerator", help="Reserve this accelerator (repeatable), instead of --count/--sku/--region."),
    ] = None,
    spot_eviction_s: Annotated[
        int | None, typer.Option(help="Spot only: how long a borrower has to leave (5-30 s, default 30).")
    ] = None,
    request_id: Annotated[str | None, typer.Option(help="Idempotency key (random by default).")] = None,
    as_json: JsonOption = False,
    data_dir: DataDirOption = None,
) -> None:
    """One `reservation.create` call: reserve accelerators for a tenant; prints its id and accelerators."""
    if policy not in POLICY_NAMES:
        _refuse(f"--policy: expected soft, hard or spot, got {policy!r}")
    by_count = {"--count": count, "--sku": sku, "--region": region}
    if accelerator and any(v is not None for v in by_count.values()):
        _refuse("give --accelerator (repeatable), or --count with --sku and --region, not both")
    if not accelerator:
        missing = [name for name, value in by_count.items() if value is None]
        if len(missing) == len(by_count):
            _refuse("give --count with --sku and --region, or --accelerator (repeatable)")
        if missing:
            _refuse(f"--count, --sku and --region go together: {', '.join(missing)} missing")
    if spot_eviction_s is not None and policy != "spot":
        _refuse("--spot-eviction-s: only with --policy spot")
    fields: dict[str, Any] = {
        "request_id": _request_id(request_id),
        "tenant": tenant,
        "policy": policy,
        "accelerators": accelerator or None,
        "count": count,
        "sku": sku,
        "region": region,
        "spot_eviction_s": spot_eviction_s,
    }
    request = _build(
        lambda: ReservationCreateRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    )
    reply = _with_rpc(
        data_dir,
        Rpc.RESERVATION_CREATE.value,
        lambda client: client.ask(Rpc.RESERVATION_CREATE, request, ReservationCreateReply, rejection_as_reply=True),
    )
    _refusal(reply, as_json)
    if as_json:
        print(reply.model_dump_json(indent=2))
        return
    assert isinstance(reply, ReservationCreateReply)
    again = " (this request id had created it before)" if reply.duplicate else ""
    _say(f"reservation {reply.reservation_id}: {policy}, {len(reply.accelerators)} accelerators{again}")
    for acc in reply.accelerators:
        _say(f"  {acc}")


@app.command()
def reservations(
    tenant: Annotated[str | None, typer.Option(help="Tenant (its own reservations only).")] = None,
    report: Annotated[
        bool, typer.Option("--report", help="Operators: fill rate overall, by tenant and by cluster.")
    ] = False,
    cancel: Annotated[
        str | None, typer.Option("--cancel", metavar="RES_ID", help="Cancel this reservation (with --tenant).")
    ] = None,
    as_json: JsonOption = False,
    data_dir: DataDirOption = None,
) -> None:
    """A tenant's reservations (`reservation.status`): fill rate, lent and idle accelerators, idle cost.
    `--report`: `reservation.report`; `--cancel RES_ID --tenant T`: `reservation.cancel`."""
    if report and (cancel is not None or tenant is not None):
        _refuse("--report: not with --tenant or --cancel (it covers every tenant)")
    if report:
        _reservation_report(data_dir, as_json)
        return
    if tenant is None:
        _refuse("--tenant is required (or --report, for operators)")
    if cancel is not None:
        _reservation_cancel(data_dir, cancel, tenant, as_json)
        return
    request = _build(lambda: ReservationStatusRequest(tenant=tenant))
    # No rejection_as_reply: a refusal has no field in the status reply and would lose its error.
    answer = _with_rpc(
        data_dir,
        Rpc.RESERVATION_STATUS.value,
        lambda client: client.ask(Rpc.RESERVATION_STATUS, request, ReservationStatusReply),
    )
    _refusal(answer, as_json)
    if as_json:
        print(answer.model_dump_json(indent=2))
        return
    assert isinstance(answer, ReservationStatusReply)
    rows = [
        [
            view.reservation_id,
            view.policy,
            view.sku or "-",
            view.region or "-",
            str(len(view.accelerators)),
            str(view.owner_used),
            str(view.lent),
            str(view.idle),
            str(view.offered),
            _fraction(view.fill_rate),
            f"{view.idle_cost_usd_per_hour:.2f}",
        ]
        for view in answer.reservations
    ]
    headers = ["id", "policy", "sku", "region", "reserved", "owner_used", "lent", "idle", "offered", "fill_rate"]
    _columns([*headers, "idle $/h"], rows)
    for view in answer.reservations:
        for p in view.preemptions:
            leaves = p.deadline_at.isoformat()
            _say(f"{view.reservation_id}: borrower {p.tenant} ({p.allocation_id}) leaves by {leaves}")
    _say(
        f"{tenant}: fill rate {_fraction(answer.fill_rate)}, idle ${answer.idle_cost_usd_per_hour:.2f}/h "
        f"over {len(answer.reservations)} reservation(s)"
    )


def _reservation_cancel(data_dir: Path | None, reservation_id: str, tenant: str, as_json: bool) -> None:
    """`hetsched reservations --cancel RES_ID --tenant T`: one `reservation.cancel` call."""
    request = _build(lambda: ReservationCancelRequest(reservation_id=reservation_id, tenant=tenant))
    reply = _with_rpc(
        data_dir,
        Rpc.RESERVATION_CANCEL.value,
        lambda client: client.ask(Rpc.RESERVATION_CANCEL, request, ReservationCancelReply, rejection_as_reply=True),
    )
    _refusal(reply, as_json)
    if as_json:
        print(reply.model_dump_json(indent=2))
        return
    assert isinstance(reply, ReservationCancelReply)
    before = " (it had been cancelled before)" if reply.already else ""
    _say(f"cancelled {reply.reservation_id}{before}")


def _reservation_report(data_dir: Path | None, as_json: bool) -> None:
    """`hetsched reservations --report`: one `reservation.report` call (operators)."""
    request = ReservationReportRequest()
    answer = _with_rpc(
        data_dir,
        Rpc.RESERVATION_REPORT.value,
        lambda client: client.ask(Rpc.RESERVATION_REPORT, request, ReservationReportReply),
    )
    _refusal(answer, as_json)
    if as_json:
        print(answer.model_dump_json(indent=2))
        return
    assert isinstance(answer, ReservationReportReply)
    _say(
        f"fill rate {_fraction(answer.fill_rate)}: {answer.reserved} reserved, {answer.owner_used} used by their "
        f"owners, {answer.lent} lent; idle ${answer.idle_cost_usd_per_hour:.2f}/h"
    )
    for title, rates in (("tenant", answer.by_tenant), ("cluster", answer.by_cluster)):
        _say("")
        _columns([title, "fill_rate"], [[name, _fraction(rate)] for name, rate in sorted(rates.items())])


@app.command()
def rebalance(as_json: JsonOption = False, data_dir: DataDirOption = None) -> None:
    """Operators: the rebalancer now (`rebalance.status`): each detector and its targets pending or firing,
    the plans open or running (and the last finished) and the recent actions, newest first."""
    request = RebalanceStatusRequest()
    # No rejection_as_reply: a refusal has no field in the status reply and would lose its error.
    answer = _with_rpc(
        data_dir,
        Rpc.REBALANCE_STATUS.value,
        lambda client: client.ask(Rpc.REBALANCE_STATUS, request, RebalanceStatusReply),
    )
    _refusal(answer, as_json)
    if as_json:
        print(answer.model_dump_json(indent=2))
        return
    assert isinstance(answer, RebalanceStatusReply)
    # The direction is part of the threshold (`>0.85` fires above it), so each cell is one word for `awk`.
    _columns(
        ["detector", "threshold", "window_s", "state", "targets"],
        [
            [d.name, f"{'>' if d.above else '<'}{d.threshold:g}", f"{d.window_s:g}", d.state, str(len(d.targets))]
            for d in answer.detectors
        ],
    )
    targets = [
        [d.name, t.key, t.phase, f"{t.value:.3f}", t.since.isoformat()] for d in answer.detectors for t in d.targets
    ]
    _say("")
    if targets:
        _columns(["detector", "target", "phase", "value", "since"], targets)
    else:
        _say("no target pending or firing")
    _say("")
    if answer.plans:
        # The reason is free text with spaces: last, so the columns before it stay one word each.
        _columns(
            ["plan", "kind", "state", "cluster", "target", "steps", "reason"],
            [
                [
                    p.plan_id,
                    p.kind,
                    p.state,
                    p.cluster or "-",
                    p.target or "-",
                    f"{sum(s.state == 'done' for s in p.steps)}/{len(p.steps)}",
                    p.reason,
                ]
                for p in answer.plans
            ],
        )
    else:
        _say("no plan")
    _say("")
    if answer.recent:
        _columns(["at", "plan", "what"], [[a.at.isoformat(), a.plan_id or "-", a.what] for a in answer.recent])
    else:
        _say("no action yet")


@app.command("engine-sim")
def engine_sim(
    replica: Annotated[str, typer.Option("--replica", help="The replica's allocation id (placement.place's).")],
    node: Annotated[str, typer.Option(help="Node the replica runs on (its first node).")],
    interval_s: Annotated[float, typer.Option(help="Seconds between reports.")] = 2.0,
    count: Annotated[int, typer.Option(help="Reports to send, then stop (0: until interrupted).")] = 0,
    queue_depth: Annotated[int, typer.Option(help="Requests waiting in the engine.")] = 2,
    kv_used: Annotated[float, typer.Option(help="KV in use, as a fraction of its total.")] = 0.4,
    kv_total_gb: Annotated[float, typer.Option(help="KV capacity (GB).")] = 40.0,
    latency_ms: Annotated[float, typer.Option(help="TTFT p50 with an empty queue.")] = 80.0,
    unhealthy: Annotated[bool, typer.Option(help="Report a failed health check.")] = False,
    data_dir: DataDirOption = None,
) -> None:
    """A simulated engine: reports one replica's status so `placement.admit` can be run without GPUs."""
    from hetsched.engine_sim import EngineLoad, run_engine

    load = EngineLoad(
        kv_total_bytes=int(kv_total_gb * 1e9),
        kv_used=kv_used,
        queue_depth=queue_depth,
        base_latency_ms=latency_ms,
        healthy=not unhealthy,
    )

    async def work(client: RpcClient) -> int:
        subjects = Subjects(_endpoints(_settings(data_dir))[2])
        return await run_engine(
            client.nc.jetstream(),
            subjects,
            replica_id=replica,
            node=node,
            load=load,
            interval_s=interval_s,
            count=count,
        )

    sent = _with_rpc(data_dir, "the TELEMETRY stream", work)
    console.print(f"{sent} engine status report(s) sent for {replica} on {node}")


@app.command()
def fleet(
    region: Annotated[str | None, typer.Option(help="Only this region.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    data_dir: DataDirOption = None,
) -> None:
    """The fleet as the services see it: nodes, NVLink domains, HBM, TPU pods."""
    reply = _with_rpc(data_dir, Rpc.FLEET_GET.value, lambda client: client.fleet(region=region))
    if as_json or isinstance(reply, Rejected):
        _print_reply(reply, as_json)
        return
    from hetsched.fleet_view import render_fleet

    render_fleet(reply, console)


@app.command("console")
def console_page(
    port: Annotated[int, typer.Option(help="Port to serve on (0: any free port; the URL is printed).")] = 8470,
    host: Annotated[
        str, typer.Option(help="Address to listen on. The page shows operator data: keep it on loopback.")
    ] = "127.0.0.1",
    data_dir: DataDirOption = None,
) -> None:
    """Operators: a live web page of the fleet (per-GPU HBM, NVLink domains, TPU pods with their slices),
    reservations and fill rate, recent placements with their explanations, and the rebalancer; it polls
    every second. Read-only; connects to NATS as the other commands do. Ctrl-C stops it.

    It answers only with its token (printed at start in a URL that logs the browser in, or
    HETSCHED_CONSOLE_TOKEN) and only to the Host names of HETSCHED_CONSOLE_ALLOWED_HOSTS (loopback)."""
    import secrets

    from hetsched.console.server import run_console
    from shared.infra.httpserver import Limits

    settings = _settings(data_dir)
    nats_url, _db, prefix = _endpoints(settings)
    # An empty HETSCHED_CONSOLE_TOKEN (a compose file's blank) counts as unset.
    configured = (settings.console.token.get_secret_value() if settings.console.token is not None else "") or None
    if configured is not None and len(configured) < 16:
        err.print("[red]console: HETSCHED_CONSOLE_TOKEN must be at least 16 characters[/red]")
        raise typer.Exit(2)
    token = configured or secrets.token_urlsafe(32)

    def announce(url: str) -> None:
        print(f"hetsched console at {url}", flush=True)
        if configured is None:  # printed once: the URL logs the browser in (an HttpOnly cookie)
            hint = "a new token at each start; HETSCHED_CONSOLE_TOKEN sets one"
            print(f"open {url}login?token={token}  ({hint})", flush=True)
        else:
            print(f"log in at {url}login with the token of HETSCHED_CONSOLE_TOKEN", flush=True)

    try:
        asyncio.run(
            run_console(
                nats_url=nats_url,
                subject_prefix=prefix,
                stream_prefix=settings.kit.stream_prefix,
                host=host,
                port=port,
                timeout_s=settings.kit.request_timeout_ms / 1000,
                connect_options=operator_options(settings),
                token=token,
                allowed_hosts=settings.console.allowed_hosts,
                limits=Limits(
                    max_connections=settings.console.max_connections, read_timeout_s=settings.console.read_timeout_s
                ),
                announce=announce,
            )
        )
    except OSError as exc:
        err.print(f"[red]console: {type(exc).__name__} {exc} (NATS at {nats_url}, http on {host}:{port})[/red]")
        raise typer.Exit(2) from exc


@app.command()
def sim(
    fleet: Annotated[Path, typer.Option("--fleet", help="Fleet inventory YAML (API.md format).")],
    trace: Annotated[Path, typer.Option("--trace", help="Workload trace (Azure CSV, Mooncake JSONL, plain CSV).")],
    policy: Annotated[
        str | None, typer.Option(help="One policy (hetsched, gpu-index, random, first-fit, cheapest-sku); default all.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the model mix and the random policy.")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help='Print {"policies": {NAME: KPIS}}.')] = False,
    plots: Annotated[Path | None, typer.Option("--plots", help="Write per-policy time-series PNGs here.")] = None,
    bad_rows: Annotated[
        str, typer.Option("--bad-rows", help="reject (exit non-zero naming the row) or skip.")
    ] = "reject",
    limit: Annotated[int | None, typer.Option(help="Only the first N requests of the trace.")] = None,
    live: Annotated[
        bool, typer.Option("--live", help="Ask a running stack's placement.place for every replica (see README).")
    ] = False,
    sharing: Annotated[
        str,
        typer.Option(
            "--sharing",
            help="exclusive (every replica), shared (small models ask sharing: shared), or compare: hetsched "
            'both ways, side by side (--json: {"sharing": {"exclusive": KPIS, "shared": KPIS}}).',
        ),
    ] = "exclusive",
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
    """Replay a workload trace against a fleet under each placement policy and print the KPIs."""
    from hetsched.sim_cli import dump_json, parse_reservations, render_table, run_sim, write_plots
    from shared.domain.sim import POLICIES, SimConfig
    from shared.infra.catalog import load_models

    if bad_rows not in ("reject", "skip"):
        err.print(f"[red]--bad-rows: expected reject or skip, got {bad_rows!r}[/red]")
        raise typer.Exit(2)
    if policy is not None and policy not in POLICIES:
        err.print(f"[red]--policy: expected one of {', '.join(POLICIES)}, got {policy!r}[/red]")
        raise typer.Exit(2)
    if sharing not in ("exclusive", "shared", "compare"):
        err.print(f"[red]--sharing: expected exclusive, shared or compare, got {sharing!r}[/red]")
        raise typer.Exit(2)
    if sharing != "exclusive" and live:
        err.print("[red]--sharing: only exclusive with --live (the live path does not ask for sharing)[/red]")
        raise typer.Exit(2)
    if (sweep or load is not None) and (live or sharing == "compare"):
        err.print("[red]--load and --sweep: not with --live or --sharing compare[/red]")
        raise typer.Exit(2)
    if load is not None and not load > 0:
        err.print(f"[red]--load: expected a positive load, got {load}[/red]")
        raise typer.Exit(2)
    if (reserve or owner_models) and (live or sharing == "compare"):
        err.print("[red]--reserve: not with --live or --sharing compare[/red]")
        raise typer.Exit(2)
    try:
        reservations = parse_reservations(reserve or [], owner_models or [], known_models=load_models())
    except ValueError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc
    if sweep or load is not None:
        _sim_sweep(
            fleet,
            trace,
            policy,
            loads=loads if load is None else str(load),
            seed=seed,
            bad_rows=bad_rows,
            limit=limit,
            share_small=sharing == "shared",
            as_json=as_json,
            plots=plots,
            sweep=sweep,
            reservations=reservations,
        )
        return
    if sharing == "compare":
        if policy not in (None, "hetsched"):
            err.print("[red]--sharing compare runs hetsched only: the baselines do not read `sharing`[/red]")
            raise typer.Exit(2)
        _sim_sharing_compare(fleet, trace, seed=seed, bad_rows=bad_rows, limit=limit, as_json=as_json, plots=plots)
        return
    live_policy = None
    if live:
        from hetsched.sim_live import LivePolicy

        settings = _settings(data_dir)
        nats_url, _db, prefix = _endpoints(settings)
        try:
            live_policy = LivePolicy(
                nats_url=nats_url,
                subjects=Subjects(prefix),
                timeout_s=settings.kit.request_timeout_ms / 1000,
                options=operator_options(settings),
            )
        except Exception as exc:
            err.print(f"[red]--live: no stack at {nats_url}: {type(exc).__name__} {exc}[/red]")
            raise typer.Exit(2) from exc
    try:
        with _trace_errors(trace):
            results, loaded = run_sim(
                fleet,
                trace,
                policy,
                seed=seed,
                on_bad_rows="skip" if bad_rows == "skip" else "reject",
                limit=limit,
                config=SimConfig(share_small=sharing == "shared", reservations=reservations),
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
        for path in write_plots(results, plots):
            err.print(f"wrote {path}")


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
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from exc


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
    bad_rows: str,
    limit: int | None,
    share_small: bool,
    as_json: bool,
    plots: Path | None,
    sweep: bool,
    reservations: Any = None,  # shared.domain.sim.reservations.ReservationSetup (imported when run)
) -> None:
    """`hetsched sim --sweep`: every policy at each load, one table, margins, cost-vs-SLO plots. Without
    ``sweep`` (`--load X`): the one load's KPI table, time-series plots, and the scaling on stderr."""
    from hetsched.sim_cli import (
        dump_json,
        dump_sweep_json,
        parse_loads,
        render_sweep,
        render_table,
        run_sweep,
        write_plots,
        write_sweep_plots,
    )
    from shared.domain.sim import SimConfig

    with _trace_errors(trace):
        targets = parse_loads(loads)
        result, loaded = run_sweep(
            fleet,
            trace,
            targets,
            policy,
            seed=seed,
            on_bad_rows="skip" if bad_rows == "skip" else "reject",
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
            for path in write_plots(point.results, plots):
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
    fleet: Path, trace: Path, *, seed: int, bad_rows: str, limit: int | None, as_json: bool, plots: Path | None
) -> None:
    """`hetsched sim --sharing compare`: the same trace with small models exclusive, then shared."""
    from hetsched.sim_cli import dump_sharing_json, render_sharing_table, run_sharing_compare, write_plots

    with _trace_errors(trace):
        comparison, loaded = run_sharing_compare(
            fleet, trace, seed=seed, on_bad_rows="skip" if bad_rows == "skip" else "reject", limit=limit
        )
    _report_skipped(loaded)
    if as_json:
        print(dump_sharing_json(comparison))
    else:
        render_sharing_table(comparison, console)
    if plots is not None:
        for path in write_plots(comparison.results, plots):
            err.print(f"wrote {path}")


topo_app = typer.Typer(help="Topology tools.", no_args_is_help=True)
app.add_typer(topo_app, name="topo")


@topo_app.command("parse")
def topo_parse(
    file: Annotated[Path, typer.Argument(help="A saved `nvidia-smi topo -m` output.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON (API.md shape).")] = False,
) -> None:
    """Parse one `nvidia-smi topo -m` output: GPUs, link matrix, NVLink domains, NUMA/CPU affinity."""
    from hetsched.fleet_view import render_topology, topology_json
    from shared.domain.topology import TopologyParseError, parse_topo_matrix

    try:
        text = file.read_text()
    except OSError as exc:
        err.print(f"[red]{file}: {exc.strerror}[/red]")
        raise typer.Exit(2) from exc
    try:
        parsed = parse_topo_matrix(text)
    except TopologyParseError as exc:
        err.print(f"[red]{file}: {exc}[/red]")
        raise typer.Exit(1) from exc
    if as_json:
        print(json.dumps(topology_json(parsed), indent=2))
    else:
        render_topology(parsed, console)


@app.command()
def asyncapi(
    out: Annotated[Path | None, typer.Option(help="Write here instead of printing.")] = None,
) -> None:
    """The AsyncAPI 3.0 document of every request subject and event (as docs/asyncapi.json)."""
    from shared.contracts.asyncapi import asyncapi_document
    from shared.infra.service import hetsched_version

    text = json.dumps(asyncapi_document(version=hetsched_version()), indent=2, sort_keys=True) + "\n"
    if out is None:
        print(text, end="")
    else:
        out.write_text(text)


if __name__ == "__main__":  # pragma: no cover - `python -m hetsched.cli`
    app()
