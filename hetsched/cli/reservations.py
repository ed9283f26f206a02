"""`hetsched reserve` and `hetsched reservations`: accelerators reserved for a tenant, their fill rate and
idle cost, a reservation cancelled, and the operators' report (docs/RESERVATIONS.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from hetsched.cli.choices import ReservationPolicy
from hetsched.cli.common import (
    CredentialOption,
    DataDirOption,
    JsonOption,
    TenantOption,
    bad_input,
    build,
    columns,
    fraction,
    say,
    shown,
)
from hetsched.cli.common import (
    request_id as _request_id,
)
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
from shared.contracts.subjects import Rpc

app = typer.Typer()


@app.command()
def reserve(
    tenant: TenantOption,
    policy: Annotated[ReservationPolicy, typer.Option(help="Reservation policy (docs/RESERVATIONS.md).")],
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
    credential: CredentialOption = None,
) -> None:
    """One `reservation.create` call: reserve accelerators for a tenant; prints its id and accelerators."""
    by_count = {"--count": count, "--sku": sku, "--region": region}
    if accelerator and any(v is not None for v in by_count.values()):
        bad_input("give --accelerator (repeatable), or --count with --sku and --region, not both")
    if not accelerator:
        missing = [name for name, value in by_count.items() if value is None]
        if len(missing) == len(by_count):
            bad_input("give --count with --sku and --region, or --accelerator (repeatable)")
        if missing:
            bad_input(f"--count, --sku and --region go together: {', '.join(missing)} missing")
    if spot_eviction_s is not None and policy is not ReservationPolicy.SPOT:
        bad_input("--spot-eviction-s: only with --policy spot")
    fields: dict[str, Any] = {
        "request_id": _request_id(request_id),
        "tenant": tenant,
        "policy": policy.value,
        "accelerators": accelerator or None,
        "count": count,
        "sku": sku,
        "region": region,
        "spot_eviction_s": spot_eviction_s,
    }
    request = build(lambda: ReservationCreateRequest.model_validate({k: v for k, v in fields.items() if v is not None}))
    reply = shown(data_dir, Rpc.RESERVATION_CREATE, request, ReservationCreateReply, as_json, credential=credential)
    if reply is None:
        return
    again = " (this request id had created it before)" if reply.duplicate else ""
    say(f"reservation {reply.reservation_id}: {policy.value}, {len(reply.accelerators)} accelerators{again}")
    for acc in reply.accelerators:
        say(f"  {acc}")


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
    credential: CredentialOption = None,
) -> None:
    """A tenant's reservations (`reservation.status`): fill rate, lent and idle accelerators, idle cost.
    `--report`: `reservation.report`; `--cancel RES_ID --tenant T`: `reservation.cancel`."""
    if report and (cancel is not None or tenant is not None):
        bad_input("--report: not with --tenant or --cancel (it covers every tenant)")
    if report:
        _reservation_report(data_dir, as_json)
        return
    if tenant is None:
        bad_input("--tenant is required (or --report, for operators)")
    if cancel is not None:
        _reservation_cancel(data_dir, cancel, tenant, as_json, credential)
        return
    request = build(lambda: ReservationStatusRequest(tenant=tenant))
    answer = shown(data_dir, Rpc.RESERVATION_STATUS, request, ReservationStatusReply, as_json, credential=credential)
    if answer is None:
        return
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
            fraction(view.fill_rate),
            f"{view.idle_cost_usd_per_hour:.2f}",
        ]
        for view in answer.reservations
    ]
    headers = ["id", "policy", "sku", "region", "reserved", "owner_used", "lent", "idle", "offered", "fill_rate"]
    columns([*headers, "idle $/h"], rows)
    for view in answer.reservations:
        for p in view.preemptions:
            leaves = p.deadline_at.isoformat()
            say(f"{view.reservation_id}: borrower {p.tenant} ({p.allocation_id}) leaves by {leaves}")
    say(
        f"{tenant}: fill rate {fraction(answer.fill_rate)}, idle ${answer.idle_cost_usd_per_hour:.2f}/h "
        f"over {len(answer.reservations)} reservation(s)"
    )


def _reservation_cancel(
    data_dir: Path | None, reservation_id: str, tenant: str, as_json: bool, credential: Path | None
) -> None:
    """`hetsched reservations --cancel RES_ID --tenant T`: one `reservation.cancel` call."""
    request = build(lambda: ReservationCancelRequest(reservation_id=reservation_id, tenant=tenant))
    reply = shown(data_dir, Rpc.RESERVATION_CANCEL, request, ReservationCancelReply, as_json, credential=credential)
    if reply is None:
        return
    before = " (it had been cancelled before)" if reply.already else ""
    say(f"cancelled {reply.reservation_id}{before}")


def _reservation_report(data_dir: Path | None, as_json: bool) -> None:
    """`hetsched reservations --report`: one `reservation.report` call (operators)."""
    request = ReservationReportRequest()
    answer = shown(data_dir, Rpc.RESERVATION_REPORT, request, ReservationReportReply, as_json)
    if answer is None:
        return
    say(
        f"fill rate {fraction(answer.fill_rate)}: {answer.reserved} reserved, {answer.owner_used} used by their "
        f"owners, {answer.lent} lent; idle ${answer.idle_cost_usd_per_hour:.2f}/h"
    )
    for title, rates in (("tenant", answer.by_tenant), ("cluster", answer.by_cluster)):
        say("")
        columns([title, "fill_rate"], [[name, fraction(rate)] for name, rate in sorted(rates.items())])
