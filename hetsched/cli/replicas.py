"""`hetsched place` and `hetsched release`: a replica placed (or explained, or printed as the engine's
launch line) and released."""

from __future__ import annotations

import uuid
from typing import Annotated, Any

import typer

from hetsched.cli.choices import Backend, Dtype
from hetsched.cli.common import DataDirOption, JsonOption, ask, build, err, print_reply
from hetsched.emit import EmitKind, NothingToEmit, emit_note, emit_text
from shared.contracts.base import Rejected
from shared.contracts.placement import PlaceReply, PlaceRequest, ReleaseReply, ReleaseRequest
from shared.contracts.subjects import Rpc

app = typer.Typer()


@app.command()
def place(
    model: Annotated[str, typer.Option(help="Catalog model name.")],
    tenant: Annotated[str, typer.Option(help="Tenant.")],
    context_tokens: Annotated[int, typer.Option(help="Longest sequence held.")],
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
    explain: Annotated[bool, typer.Option(help="Dry run (placement.explain).")] = False,
    as_json: JsonOption = False,
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
    fields: dict[str, Any] = {
        "request_id": request_id or f"cli-{uuid.uuid4()}",
        "tenant": tenant,
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
    reply = ask(data_dir, rpc, request, PlaceReply, rejection_as_reply=True)
    if emit is not None:
        _emit(reply, emit)
        return
    print_reply(reply, as_json)


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
    as_json: JsonOption = False,
    data_dir: DataDirOption = None,
) -> None:
    """One `placement.release` call."""
    request = build(lambda: ReleaseRequest(allocation_id=allocation_id, tenant=tenant))
    print_reply(ask(data_dir, Rpc.PLACEMENT_RELEASE, request, ReleaseReply), as_json)
