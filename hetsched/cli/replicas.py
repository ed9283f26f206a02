"""`hetsched place`, `hetsched release`, `hetsched renew` and `hetsched replicas`: a replica placed (or
explained, or printed as the engine's launch line), released, its lease renewed, and the replicas placed.
Each acts as the operator, or with `--credential` as a tenant's gateway (on its tenant's subjects)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any

import typer

from hetsched.cli import common
from hetsched.cli.choices import Backend, Dtype, ReplicaState
from hetsched.cli.common import (
    CredentialOption,
    DataDirOption,
    JsonOption,
    ask,
    bad_input,
    build,
    err,
    print_reply,
    refusal,
    refused_input,
    say,
    settings_of,
    shown,
    table,
)
from hetsched.emit import EmitKind, NothingToEmit, emit_note, emit_text
from shared.contracts.base import Rejected
from shared.contracts.placement import (
    PlaceReply,
    PlaceRequest,
    ReleaseReply,
    ReleaseRequest,
    RenewReply,
    RenewRequest,
    ReplicasReply,
    ReplicasRequest,
    ReplicaView,
)
from shared.contracts.subjects import Rpc
from shared.domain.placement.listing import index_ranges
from shared.infra.rpc import RpcClient

OwnerOption = Annotated[
    str | None, typer.Option(help="Owner (default with --credential: the credential's tenant, when it has one).")
]

app = typer.Typer()


@app.command()
def place(
    model: Annotated[str, typer.Option(help="Catalog model name.")],
    context_tokens: Annotated[int, typer.Option(help="Longest sequence held.")],
    tenant: OwnerOption = None,
    concurrency: Annotated[int, typer.Option(help="Sequences held at once.")] = 1,
    request_id: Annotated[str | None, typer.Option(help="Idempotency key (random by default).")] = None,
    dtype: Annotated[Dtype | None, typer.Option(help="Weights dtype.")] = None,
    kv_dtype: Annotated[Dtype | None, typer.Option(help="KV dtype.")] = None,
    input_tokens: Annotated[int | None, typer.Option(help="Typical input tokens.")] = None,
    output_tokens: Annotated[int | None, typer.Option(help="Typical output tokens.")] = None,
    tp: Annotated[int | None, typer.Option(help="Fixed tensor-parallel degree.")] = None,
    backend: Annotated[Backend, typer.Option(help="Accelerator kind.")] = Backend.ANY,
    sku: Annotated[list[str] | None, typer.Option(help="Allowed SKU (repeatable).")] = None,
    region: Annotated[str | None, typer.Option(help="Required region.")] = None,
    preemptible: Annotated[bool, typer.Option(help="May run on lent capacity.")] = False,
    lease_s: Annotated[int | None, typer.Option(help="Lease length.")] = None,
    explain: Annotated[
        bool,
        typer.Option(
            "--explain",
            "--dry-run",
            help="Dry run (placement.explain): the decision, and with --emit its launch lines, without reserving.",
        ),
    ] = False,
    as_json: JsonOption = False,
    data_dir: DataDirOption = None,
    credential: CredentialOption = None,
    emit: Annotated[
        EmitKind | None,
        typer.Option(
            help="Print only what an operator pastes, per node of the replica: a `# node ... (rank R of N), "
            "allocation ...` comment, then the `vllm serve` or `sglang.launch_server` line (with its devices, "
            "taskset and multi-node arguments), or `env` KEY=value lines. No launch: the reply goes to "
            "stderr and the exit code is 1."
        ),
    ] = None,
) -> None:
    """One `placement.place` call (or `placement.explain` with --explain / --dry-run: nothing reserved)."""
    fields: dict[str, Any] = {
        "request_id": request_id or f"cli-{uuid.uuid4()}",
        "tenant": _owner(data_dir, credential, tenant),
        "model": model,
        "context_tokens": context_tokens,
        "concurrency": concurrency,
        "backend": backend.value,
        "preemptible": preemptible,
        "dtype": dtype.value if dtype else None,
        "kv_dtype": kv_dtype.value if kv_dtype else None,
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "tp": tp,
        "skus": sku,
        "region": region,
        "lease_s": lease_s,
    }
    request = build(lambda: PlaceRequest.model_validate({k: v for k, v in fields.items() if v is not None}))
    rpc = Rpc.PLACEMENT_EXPLAIN if explain else Rpc.PLACEMENT_PLACE
    # A refused placement keeps its PlaceReply (the explanation says what was tried and why not).
    reply = ask(data_dir, rpc, request, PlaceReply, rejection_as_reply=True, credential=credential)
    if not explain and isinstance(reply, PlaceReply) and reply.status == "placed" and reply.allocation_id:
        _confirm(data_dir, credential, request, reply.allocation_id)
    if emit is not None:
        _emit(reply, emit)
        return
    print_reply(reply, as_json)


def _confirm(data_dir: Path | None, credential: Path | None, request: PlaceRequest, allocation_id: str) -> None:
    """A new replica holds a short first lease until its caller renews (or its engine reports): the CLI
    renews it at once for the lease it asked for. A failed renew is a warning: the replica is placed, and
    `hetsched renew` or its engine's first report keeps it."""
    lease = request.lease_s or settings_of(data_dir).placement.default_lease_s
    renew = RenewRequest(allocation_id=allocation_id, tenant=request.tenant, lease_s=lease)
    reply = ask(data_dir, Rpc.PLACEMENT_RENEW, renew, RenewReply, rejection_as_reply=True, credential=credential)
    if not isinstance(reply, RenewReply) or reply.status != "renewed":
        why = reply.error.message if reply.error is not None else reply.status
        err.print(
            f"warning: placed {allocation_id}, but could not extend its first lease ({why}); "
            f"run `hetsched renew {allocation_id}` or start its engine",
            soft_wrap=True,
            markup=False,
            highlight=False,
        )


def _emit(reply: PlaceReply | Rejected, kind: EmitKind) -> None:
    """stdout gets only the pasteable text (comments and lines); anything else (the reply without a
    launch, a note on where the nodes meet) goes to stderr, and no launch exits 1."""
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
    tenant: OwnerOption = None,
    as_json: JsonOption = False,
    data_dir: DataDirOption = None,
    credential: CredentialOption = None,
) -> None:
    """One `placement.release` call."""
    owner = _owner(data_dir, credential, tenant)
    request = build(lambda: ReleaseRequest(allocation_id=allocation_id, tenant=owner))
    print_reply(ask(data_dir, Rpc.PLACEMENT_RELEASE, request, ReleaseReply, credential=credential), as_json)


@app.command()
def renew(
    allocation_id: Annotated[str, typer.Argument(help="The replica (its allocation id) whose lease to renew.")],
    tenant: OwnerOption = None,
    lease_s: Annotated[
        int | None,
        typer.Option(help="New lease length from now, in seconds (default: HETSCHED_PLACEMENT_DEFAULT_LEASE_S)."),
    ] = None,
    as_json: JsonOption = False,
    data_dir: DataDirOption = None,
    credential: CredentialOption = None,
) -> None:
    """One `placement.renew` call: the replica's lease ends `--lease-s` seconds from now; prints the new end."""
    owner = _owner(data_dir, credential, tenant)
    lease = lease_s if lease_s is not None else settings_of(data_dir).placement.default_lease_s
    request = build(lambda: RenewRequest(allocation_id=allocation_id, tenant=owner, lease_s=lease))
    reply = shown(data_dir, Rpc.PLACEMENT_RENEW, request, RenewReply, as_json, credential=credential)
    if reply is None:
        return
    ends = _when(reply.lease_expires_at)
    say(f"renewed {allocation_id} for {owner}: the lease ends {ends} (in {lease} s) unless renewed again")


@app.command("replicas")
def replicas_(
    tenant: Annotated[
        str | None,
        typer.Option(help="Only this tenant's (a gateway's credential: its tenant's, by default its only one)."),
    ] = None,
    model: Annotated[str | None, typer.Option(help="Only replicas of this catalog model.")] = None,
    node: Annotated[str | None, typer.Option(help="Only replicas with accelerators on this node or TPU pod.")] = None,
    state: Annotated[ReplicaState | None, typer.Option(help="Only replicas in this lifecycle state.")] = None,
    limit: Annotated[
        int | None, typer.Option(help="One page of at most this many (1-500) instead of every page.")
    ] = None,
    cursor: Annotated[str | None, typer.Option(help="One page, from this `next_cursor` of an earlier page.")] = None,
    wide: Annotated[
        bool, typer.Option("--wide", help="Add request id, region, SKU, placed at, endpoint; no folding.")
    ] = False,
    as_json: JsonOption = False,
    data_dir: DataDirOption = None,
    credential: CredentialOption = None,
) -> None:
    """The replicas placed (`placement.replicas`): the operator's are every tenant's, a gateway's
    (`--credential`) its tenant's only. Every page, or one with `--limit` / `--cursor`."""
    fields: dict[str, Any] = {
        "tenant": _tenant(data_dir, credential, tenant),
        "model": model,
        "node": node,
        "state": state.value if state else None,
        "limit": limit,
        "cursor": cursor,
    }
    request = build(lambda: ReplicasRequest.model_validate({k: v for k, v in fields.items() if v is not None}))
    answer = _listed(data_dir, request, credential, every_page=limit is None and cursor is None)
    refusal(answer, as_json)
    assert isinstance(answer, ReplicasReply)
    if as_json:
        print(answer.model_dump_json(indent=2))
        return
    _table(answer.replicas, wide=wide)
    shown_now = len(answer.replicas)
    whose = f" of {fields['tenant']}" if fields["tenant"] else ""
    say(f"{shown_now} of {answer.total} replica(s){whose}")
    if answer.next_cursor:
        say(f"more: --cursor {answer.next_cursor}")


def _tenant(data_dir: Path | None, credential: Path | None, given: str | None) -> str | None:
    """The tenant a call names: ``given``, or acting as a gateway, the gateway's (exit 2 when it has several)."""
    acting = common.acting_as(data_dir, credential)
    if acting is None or not acting.scoped:
        return given
    return acting.tenant(given)


def _owner(data_dir: Path | None, credential: Path | None, given: str | None) -> str:
    """The tenant a call acts for: ``--tenant``, or a one-tenant gateway credential's; else exit 2."""
    owner = _tenant(data_dir, credential, given)
    if owner is None:
        bad_input("--tenant is required (or --credential of a gateway with one tenant)")
    return owner


def _listed(
    data_dir: Path | None, request: ReplicasRequest, credential: Path | None, *, every_page: bool
) -> ReplicasReply | Rejected:
    """One page, or every page merged (asked over one connection, each from the last page's cursor)."""
    acting = common.acting_as(data_dir, credential)
    options = common.call_options(acting, Rpc.PLACEMENT_REPLICAS, request)

    async def work(client: RpcClient) -> ReplicasReply | Rejected:
        replicas: list[ReplicaView] = []
        ask_next = request
        while True:
            page = await client.ask(Rpc.PLACEMENT_REPLICAS, ask_next, ReplicasReply, **options)
            if isinstance(page, Rejected):
                return page
            replicas.extend(page.replicas)
            if not every_page or page.next_cursor is None:
                return page.model_copy(update={"replicas": replicas})
            ask_next = ask_next.model_copy(update={"cursor": page.next_cursor})

    answer = common.with_rpc(data_dir, Rpc.PLACEMENT_REPLICAS.value, work, **common.acting_option(acting))
    refused_input(answer)
    return answer


def _when(at: datetime | None) -> str:
    """A UTC time to the second (``2026-01-01T12:05:00Z``); ``-`` when unknown."""
    if at is None:
        return "-"
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _where(replica: ReplicaView) -> tuple[str, str]:
    """Its nodes and, per node in the same order, its GPU indices (``0-3``); a TPU replica: its pod, and its
    slice (``4x4@0,0``: shape at origin)."""
    if replica.tpu_slice is not None:
        tpu = replica.tpu_slice
        shape = "x".join(str(n) for n in tpu.shape)
        return tpu.pod, f"{shape}@{','.join(str(n) for n in tpu.origin)}"
    nodes = ",".join(p.node for p in replica.placements) or "-"
    gpus = ";".join(index_ranges(p.gpus) or "-" for p in replica.placements) or "-"
    return nodes, gpus


def _table(replicas: list[ReplicaView], *, wide: bool) -> None:
    if not replicas:
        say("no replicas")
        return
    headers = ["id", "tenant", "model", "nodes", "gpus", "tp/pp", "lease end", "state"]
    if wide:
        headers += ["request id", "region", "sku", "placed at", "endpoint"]
    rows = []
    for r in replicas:
        nodes, gpus = _where(r)
        row = [r.replica_id, r.tenant, r.model or "-", nodes, gpus, f"{r.tp}/{r.pp}", _when(r.lease_expires_at)]
        row.append(r.state.value)
        if wide:
            row += [r.request_id, r.region or "-", r.sku or "-", _when(r.placed_at), r.endpoint or "-"]
        rows.append(row)
    table(headers, rows, wide=wide)
