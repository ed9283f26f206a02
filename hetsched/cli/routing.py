"""`hetsched admit`, `hetsched route` and `hetsched route-region`: the request path (a request onto a
running replica, the region that serves it) and an operator's regions."""

from __future__ import annotations

from typing import Annotated

import typer

from hetsched.cli.choices import EngineHint, RegionState
from hetsched.cli.common import (
    CredentialOption,
    DataDirOption,
    JsonOption,
    RequestIdOption,
    TenantOption,
    ask,
    build,
    print_reply,
)
from hetsched.cli.common import (
    request_id as _request_id,
)
from shared.contracts.placement import AdmitReply, AdmitRequest, Slo
from shared.contracts.routing import RouteRegionReply, RouteRegionRequest, RouteSelectReply, RouteSelectRequest
from shared.contracts.subjects import Rpc

app = typer.Typer()

ModelOrGroupOption = Annotated[str, typer.Option(help="Catalog model or model group.")]
OutputTokensOption = Annotated[int, typer.Option(help="Expected maximum output tokens.")]
TtftOption = Annotated[float | None, typer.Option(help="TTFT SLO.")]


@app.command()
def admit(
    model: ModelOrGroupOption,
    tenant: TenantOption,
    input_tokens: Annotated[int, typer.Option(help="Input tokens.")],
    output_tokens: OutputTokensOption = 256,
    region: Annotated[str | None, typer.Option(help="Region.")] = None,
    ttft_ms: TtftOption = None,
    hint: Annotated[EngineHint, typer.Option(help="Engine preference.")] = EngineHint.AUTO,
    request_id: RequestIdOption = None,
    as_json: JsonOption = False,
    data_dir: DataDirOption = None,
    credential: CredentialOption = None,
) -> None:
    """One `placement.admit` call: a request onto a running replica."""
    request = build(
        lambda: AdmitRequest(
            request_id=_request_id(request_id),
            tenant=tenant,
            model=model,
            input_tokens=input_tokens,
            output_tokens=output_tokens,
            region=region,
            slo=Slo(ttft_ms=ttft_ms) if ttft_ms else None,
            hint=hint.value,
        )
    )
    print_reply(ask(data_dir, Rpc.PLACEMENT_ADMIT, request, AdmitReply, credential=credential), as_json)


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
    credential: CredentialOption = None,
) -> None:
    """One `route.select` call: which region serves this request (and, by default, its admission there)."""
    request = build(
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
        )
    )
    print_reply(ask(data_dir, Rpc.ROUTE_SELECT, request, RouteSelectReply, credential=credential), as_json)


@app.command("route-region")
def route_region(
    region: Annotated[str, typer.Argument(help="Region.")],
    state: Annotated[RegionState, typer.Option(help="The region's new state.")],
    as_json: JsonOption = False,
    data_dir: DataDirOption = None,
) -> None:
    """Operators: drain a region (no new tenants or sessions; in-flight sessions stay), down it, or bring it up."""
    request = build(lambda: RouteRegionRequest(region=region, state=state.value))
    print_reply(ask(data_dir, Rpc.ROUTE_REGION, request, RouteRegionReply), as_json)
