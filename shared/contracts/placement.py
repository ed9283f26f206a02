"""Placement request/reply contracts (API.md `hetsched.placement.*`) and the events of the PLACEMENT stream:
every decision with its explanation."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, field_validator, model_validator

from shared.contracts.base import (
    ID_MAX,
    MAX_LEASE_S,
    NAME_MAX,
    Contract,
    ErrorBody,
    Float,
    Int,
    Request,
    deprecated,
    unit_names,
)

# the domain's definitions, one each (`X as X` re-exports them as this module's names)
from shared.domain.ledger.sharing import Sharing as Sharing
from shared.domain.placement.listing import ReplicaState as ReplicaState
from shared.domain.placement.listing import decode_cursor
from shared.domain.placement.types import Backend as Backend

Dtype = Literal["fp32", "bf16", "fp16", "fp8", "int8", "int4", "fp4"]
Fallback = Literal["kv_quantize", "pipeline", "cross_domain", "queue"]
DEFAULT_FALLBACKS: tuple[Fallback, ...] = ("kv_quantize", "pipeline", "cross_domain", "queue")
MAX_QUEUE_TIMEOUT_S = 24 * 3600


class Slo(Contract):
    ttft_ms: Float | None = Field(default=None, gt=0, description="Time to first token.", examples=[500])
    tpot_ms: Float | None = Field(default=None, gt=0, description="Time per output token.", examples=[50])
    p99_ms: Float | None = Field(default=None, gt=0, description="End-to-end p99.", examples=[20000])


class PlaceRequest(Request):
    request_id: str = Field(min_length=1, max_length=NAME_MAX, description="Idempotency key.", examples=["req-42"])
    tenant: str = Field(min_length=1, max_length=NAME_MAX, description="Who pays.", examples=["acme"])
    model: str = Field(min_length=1, max_length=NAME_MAX, description="Catalog model name.", examples=["llama3-70b"])
    dtype: Dtype | None = Field(default=None, description="Weights dtype; catalog default.", examples=["fp8"])
    kv_dtype: Dtype | None = Field(default=None, description="KV cache dtype.", examples=["fp16"])
    context_tokens: Int = Field(gt=0, description="Longest sequence the replica holds.", examples=[8192])
    concurrency: Int = Field(default=1, gt=0, description="Sequences in the KV pool at once.", examples=[32])
    input_tokens: Int | None = Field(default=None, gt=0, description="Typical input length.", examples=[1000])
    output_tokens: Int | None = Field(default=None, gt=0, description="Typical output length.", examples=[200])
    tp: Int | None = Field(default=None, gt=0, description="Fixed tensor-parallel degree.", examples=[4])
    backend: Backend = Field(default="any", description="`gpu`, `tpu` or `any`.", examples=["gpu"])
    skus: list[Annotated[str, StringConstraints(max_length=NAME_MAX)]] | None = Field(
        default=None, max_length=256, description="SKU allow-list.", examples=[["H100-SXM-80GB"]]
    )
    region: str | None = Field(
        default=None, max_length=NAME_MAX, description="Required region.", examples=["us-west-1"]
    )
    preemptible: bool = Field(default=False, description="May use lent reserved capacity.", examples=[False])
    slo: Slo | None = Field(default=None, description="Latency objectives.")
    lease_s: Int | None = Field(
        default=None, gt=0, le=MAX_LEASE_S, description="Lease length in seconds (at most 30 days).", examples=[300]
    )

    sharing: Sharing = Field(
        default="exclusive",
        description="`exclusive`: no other replica shares any of its accelerators, now or later; `shared`: TP=1 "
        "only, may share one GPU with other `shared` replicas (each then gets a share of its compute).",
        examples=["exclusive"],
    )
    fallbacks: list[Fallback] | None = Field(
        default=None,
        max_length=4,
        description="What may be tried, in order, when the exact request does not fit: `kv_quantize`, "
        "`pipeline`, `cross_domain`, `queue`. Absent: all four in that order; `[]`: the exact request or a "
        "rejection.",
        examples=[["kv_quantize", "pipeline"]],
    )
    pp: Int | None = Field(
        default=None,
        gt=0,
        le=8,
        description="Fixed pipeline depth (GPU only); absent: 1 unless a fallback.",
        examples=[2],
    )
    queue_timeout_s: Int | None = Field(
        default=None,
        gt=0,
        le=MAX_QUEUE_TIMEOUT_S,
        description="How long a `queued` request waits for capacity before it is rejected (default from settings).",
        examples=[600],
    )
    avoid_accelerators: list[Annotated[str, StringConstraints(max_length=ID_MAX)]] = Field(
        default_factory=list,
        max_length=4096,
        description="Accelerators (GPU ids or TPU chip ids) this replica may not use: the rebalancer moving a "
        "replica off them.",
        examples=[[]],
    )

    @field_validator("tp")
    @classmethod
    def _tp_power_of_two(cls, tp: int | None) -> int | None:
        if tp is not None and tp & (tp - 1) != 0:
            raise ValueError("tp must be a power of two")
        return tp

    @field_validator("fallbacks")
    @classmethod
    def _fallbacks_once(cls, fallbacks: list[str] | None) -> list[str] | None:
        if fallbacks is not None and len(set(fallbacks)) != len(fallbacks):
            raise ValueError("a fallback is listed twice")
        return fallbacks

    @model_validator(mode="after")
    def _sharing_and_pipelines(self) -> PlaceRequest:
        if self.sharing == "shared" and (self.tp or 1) > 1:
            raise ValueError("sharing `shared` is for TP=1 replicas only")
        if self.sharing == "shared" and (self.pp or 1) > 1:
            raise ValueError("sharing `shared` is for single-GPU replicas: no pipeline stages")
        if self.pp is not None and self.pp > 1 and self.backend == "tpu":
            raise ValueError("pipeline stages (pp > 1) are for GPUs; a TPU replica takes one whole slice")
        return self


SHARE_BYTE_NAMES = (
    ("weights", "weights_bytes"),
    ("kv", "kv_bytes"),
    ("activation", "activation_bytes"),
    ("workspace", "workspace_bytes"),
    ("total", "total_bytes"),
)


class AcceleratorShare(Contract):
    """HBM one accelerator of the replica holds, each figure once under its `_bytes` name."""

    weights_bytes: Int = Field(
        description="Weight bytes per accelerator." + deprecated("weights"), examples=[17_500_000_000]
    )
    kv_bytes: Int = Field(description="KV cache bytes per accelerator." + deprecated("kv"), examples=[2_684_354_560])
    activation_bytes: Int = Field(
        description="Activation peak bytes." + deprecated("activation"), examples=[1_000_000_000]
    )
    workspace_bytes: Int = Field(
        description="CUDA/XLA workspace reserve." + deprecated("workspace"), examples=[1_073_741_824]
    )
    total_bytes: Int = Field(description="Sum of the above." + deprecated("total"), examples=[22_257_853_376])

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data: Any) -> Any:
        return unit_names(data, SHARE_BYTE_NAMES)


class NodePlacement(Contract):
    node: str = Field(description="Node name.", examples=["dgx-h100-01"])
    accelerators: list[str] = Field(description="Accelerator ids.", examples=[["dgx-h100-01/gpu0"]])
    domain: str | None = Field(default=None, description="NVLink domain id.", examples=["dgx-h100-01/nv0"])


class TpuSlice(Contract):
    pod: str = Field(description="TPU pod name.", examples=["v5e-pod-1"])
    origin: list[Int] = Field(description="Origin chip coordinates.", examples=[[0, 0]])
    shape: list[Int] = Field(description="Chips per axis.", examples=[[4, 4]])


class NodeBinding(Contract):
    """What one node's engine process is started with to run its part of the replica."""

    node: str = Field(description="Node name.", examples=["dgx-h100-01"])
    cuda_visible_devices: str = Field(description="GPU indices for CUDA_VISIBLE_DEVICES.", examples=["0,1,2,3"])
    tp_rank_order: list[Int] = Field(
        description="GPU indices in TP rank order, along the best NVLink ring.", examples=[[0, 1, 3, 2]]
    )
    numa_node: Int | None = Field(default=None, description="NUMA node of the GPUs, when one holds all.", examples=[0])
    cpu_set: str | None = Field(
        default=None, description="CPUs of that NUMA node (taskset -c).", examples=["0-23,48-71"]
    )


class EngineLaunch(Contract):
    """The engine arguments that realise the placement (pasteable; see `hetsched place --emit`). The same
    on every node of the replica; each node adds its own devices and its multi-node rank (docs/PLACEMENT.md
    "Launch lines")."""

    vllm: list[str] = Field(
        description="`vllm serve` arguments (on a TPU slice: vLLM TPU's).", examples=[["--tensor-parallel-size", "4"]]
    )
    sglang: list[str] = Field(
        description="`python -m sglang.launch_server` arguments; empty where SGLang has no launch (a TPU slice).",
        examples=[["--tp", "4"]],
    )
    env: dict[str, str] = Field(
        description="Environment (per the first node).", examples=[{"CUDA_VISIBLE_DEVICES": "0,1"}]
    )
    checkpoint: str | None = Field(
        default=None,
        description="What the engines load: the catalog's checkpoint for the placement's weights dtype (a "
        "pre-quantised one where listed), else the model's own.",
        examples=["neuralmagic/Meta-Llama-3.1-70B-FP8"],
    )
    quantization: str | None = Field(
        default=None,
        description="The `--quantization` method the engines apply while loading (`fp8` on a 16-bit "
        "checkpoint); null when none, or when the checkpoint's own config names its method.",
        examples=[None],
    )


class Estimate(Contract):
    ttft_ms: Float | None = Field(default=None, description="Time to first token (latency model).", examples=[120.0])
    tpot_ms: Float | None = Field(default=None, description="Time per output token.", examples=[18.5])
    tokens_per_s: Float | None = Field(default=None, description="Output tokens per second at full concurrency.")
    load_time_s: Float | None = Field(default=None, description="Cold load of the weights over PCIe.", examples=[9.1])


class PlaceReply(Contract):
    # "rejected" stays: a refused decision keeps its explanation and record (docs/API.md, "Refusals").
    status: Literal["placed", "rejected", "queued"] = Field(description="Outcome.", examples=["placed"])
    request_id: str = Field(description="Echo.", examples=["req-42"])
    allocation_id: str | None = Field(default=None, description="Ledger allocation.", examples=["alloc-1"])
    region: str | None = Field(default=None, description="Region.", examples=["us-west-1"])
    cluster: str | None = Field(default=None, description="Cluster.", examples=["c1"])
    backend: Literal["gpu", "tpu"] | None = Field(default=None, description="Backend.", examples=["gpu"])
    sku: str | None = Field(default=None, description="SKU.", examples=["H100-SXM-80GB"])
    tp: Int | None = Field(default=None, description="Tensor-parallel degree.", examples=[4])
    placements: list[NodePlacement] = Field(default_factory=list, description="Where.")
    tpu_slice: TpuSlice | None = Field(default=None, description="TPU slice, when on TPU.")
    hbm_per_accelerator: AcceleratorShare | None = Field(default=None, description="HBM per accelerator.")
    score: dict[str, Float] = Field(default_factory=dict, description="Per-plugin score breakdown.")
    explanation: list[str] = Field(default_factory=list, description="Why this choice; rejected classes.")
    error: ErrorBody | None = Field(default=None, description="Null, or why rejected.")
    sharing: Sharing | None = Field(default=None, description="How the accelerators are held.", examples=["exclusive"])
    pp: Int = Field(default=1, description="Pipeline stages.", examples=[1])
    model: str | None = Field(
        default=None, description="The model placed (admission serves it).", examples=["llama3-70b"]
    )
    stages: list[list[NodePlacement]] | None = Field(
        default=None, description="When pp > 1: the placements of each stage, in stage order."
    )
    fallback: str | None = Field(
        default=None, description="Which fallback made it fit (its cost is in the explanation).", examples=[None]
    )
    queue_position: Int | None = Field(default=None, description="When queued: 1 is next.", examples=[None])
    binding: list[NodeBinding] | None = Field(default=None, description="Per node: how to start the engine.")
    launch: EngineLaunch | None = Field(default=None, description="Engine arguments that realise the placement.")
    estimate: Estimate | None = Field(default=None, description="Latency model estimates for the placement.")
    dtype: Dtype | None = Field(
        default=None,
        description="Weights dtype the placement was made with, when the request named one (null: the model's "
        "catalog dtype).",
        examples=["fp8"],
    )


class ReleaseRequest(Request):
    allocation_id: str = Field(
        min_length=1, max_length=ID_MAX, description="Allocation to release.", examples=["alloc-1"]
    )
    tenant: str = Field(min_length=1, max_length=NAME_MAX, description="Owner.", examples=["acme"])


class ReleaseReply(Contract):
    # "rejected": deprecated, accepted for one release; refusals come as `Rejected` (docs/API.md, "Refusals").
    status: Literal["released", "rejected"] = Field(description="Outcome.", examples=["released"])
    error: ErrorBody | None = Field(default=None, description="Null, or why.")


class RenewRequest(Request):
    allocation_id: str = Field(
        min_length=1, max_length=ID_MAX, description="Allocation to renew.", examples=["alloc-1"]
    )
    tenant: str = Field(min_length=1, max_length=NAME_MAX, description="Owner.", examples=["acme"])
    lease_s: Int = Field(
        gt=0, le=MAX_LEASE_S, description="New lease length from now (at most 30 days).", examples=[300]
    )


class RenewReply(Contract):
    # "rejected": deprecated, accepted for one release; refusals come as `Rejected` (docs/API.md, "Refusals").
    status: Literal["renewed", "rejected"] = Field(description="Outcome.", examples=["renewed"])
    lease_expires_at: datetime | None = Field(default=None, description="New expiry (UTC).")
    error: ErrorBody | None = Field(default=None, description="Null, or why.")


MAX_REPLICAS_PAGE = 500  # a page of TP=8 replicas stays well under NATS's 1 MB max_payload
DEFAULT_REPLICAS_PAGE = 100


class ReplicasRequest(Request):
    """`placement.replicas`: the caller's placed replicas, a page at a time. On a tenant's subject
    (`placement.replicas.<tenant>`, a gateway's) the body must name that tenant; the operator may leave
    `tenant` out to list every tenant's."""

    tenant: str | None = Field(
        default=None,
        min_length=1,
        max_length=NAME_MAX,
        description="Whose replicas. Required on a tenant's subject (and must be its tenant, else `forbidden`); "
        "absent on the unscoped subject (operators): every tenant's.",
        examples=["acme"],
    )
    model: str | None = Field(
        default=None,
        min_length=1,
        max_length=NAME_MAX,
        description="Only replicas of this catalog model (a model the catalog does not have: `unknown_model`).",
        examples=["llama3-70b"],
    )
    node: str | None = Field(
        default=None,
        min_length=1,
        max_length=NAME_MAX,
        description="Only replicas with accelerators on this node or TPU pod (one that is not in placement's view of "
        "the fleet: `not_found`).",
        examples=["dgx-h100-01"],
    )
    state: ReplicaState | None = Field(
        default=None,
        description="Only replicas in this lifecycle state (`placed`, `starting`, `loading`, `ready`, `draining`, "
        "`stopped`, `failed`).",
        examples=["ready"],
    )
    limit: Int = Field(
        default=DEFAULT_REPLICAS_PAGE,
        gt=0,
        le=MAX_REPLICAS_PAGE,
        description=f"Most replicas in one page (1-{MAX_REPLICAS_PAGE}).",
        examples=[DEFAULT_REPLICAS_PAGE],
    )
    cursor: str | None = Field(
        default=None,
        min_length=1,
        max_length=4 * NAME_MAX,
        description="`next_cursor` of the previous page, as it came (absent: the first page).",
        examples=[None],
    )

    @field_validator("cursor")
    @classmethod
    def _cursor(cls, cursor: str | None) -> str | None:
        if cursor is not None:
            decode_cursor(cursor)  # ValueError: invalid_request, naming the field
        return cursor


class ReplicaPlacement(NodePlacement):
    """The accelerators of a replica on one node, with their GPU indices."""

    gpus: list[Int] = Field(
        default_factory=list,
        description="GPU indices on the node (CUDA ordinals), in the order of `accelerators`; empty on TPU.",
        examples=[[0, 1, 2, 3]],
    )


class ReplicaView(Contract):
    """One placed replica, as placement records it."""

    replica_id: str = Field(
        description="The replica: the allocation id `placement.place` returned for it (what `placement.renew` and "
        "`placement.release` take).",
        examples=["al-5f0c..."],
    )
    tenant: str = Field(description="Owner.", examples=["acme"])
    request_id: str = Field(description="The `placement.place` request id that placed it.", examples=["req-42"])
    model: str | None = Field(default=None, description="Catalog model.", examples=["llama3-70b"])
    backend: Literal["gpu", "tpu"] | None = Field(default=None, description="Backend.", examples=["gpu"])
    sku: str | None = Field(default=None, description="SKU of its accelerators.", examples=["H100-SXM-80GB"])
    region: str | None = Field(default=None, description="Region.", examples=["us-west-1"])
    cluster: str | None = Field(default=None, description="Cluster.", examples=["c1"])
    tp: Int = Field(description="Tensor-parallel degree.", examples=[4])
    pp: Int = Field(description="Pipeline stages.", examples=[1])
    sharing: Sharing | None = Field(default=None, description="How its accelerators are held.", examples=["exclusive"])
    placements: list[ReplicaPlacement] = Field(
        default_factory=list,
        description="Per node: its accelerators and GPU indices (every stage's, on GPUs).",
        examples=[[{"node": "dgx-h100-01", "accelerators": ["dgx-h100-01/gpu0", "dgx-h100-01/gpu1"], "gpus": [0, 1]}]],
    )
    tpu_slice: TpuSlice | None = Field(
        default=None,
        description="Its TPU slice, on TPU.",
        examples=[{"pod": "v5e-pod-1", "origin": [0, 0], "shape": [2, 2]}],
    )
    state: ReplicaState = Field(
        description="Lifecycle state: what its node agents' `replica_state` reports fold into (`starting`, "
        '`loading`, `ready`, `draining`, `stopped`, `failed`; docs/PLACEMENT.md "Replica lifecycle"); without a '
        "report within `HETSCHED_ENGINE_STALE_S`: `draining` while the rebalancer moves it off, `ready` while its "
        "engine reports healthy within `HETSCHED_ENGINE_STALE_S`, else `placed`.",
        examples=["ready"],
    )
    lease_expires_at: datetime | None = Field(
        default=None,
        description="When its lease ends unless renewed (UTC): the ledger's answer to its commit, then to each "
        "`placement.renew`; null for a replica placed before placement recorded it.",
        examples=["2026-01-01T12:05:00Z"],
    )
    placed_at: datetime | None = Field(
        default=None, description="When placement recorded it (UTC).", examples=["2026-01-01T11:05:00Z"]
    )
    endpoint: str | None = Field(
        default=None,
        description="Base URL of its engine (the head rank's, as its node agent reported it) from `ready` on; null "
        "before, or when no agent reports its lifecycle.",
        examples=["http://10.0.0.7:8100"],
    )


class ReplicasReply(Contract):
    status: Literal["ok"] = Field(
        default="ok", description="Always `ok` (refusals come as `Rejected`).", examples=["ok"]
    )
    replicas: list[ReplicaView] = Field(
        default_factory=list,
        description="This page, by tenant then placement request id.",
        examples=[
            [
                {
                    "replica_id": "al-5f0c",
                    "tenant": "acme",
                    "request_id": "req-42",
                    "model": "llama3-8b",
                    "tp": 1,
                    "pp": 1,
                    "placements": [{"node": "dgx-h100-01", "accelerators": ["dgx-h100-01/gpu3"], "gpus": [3]}],
                    "state": "ready",
                    "lease_expires_at": "2026-01-01T12:05:00Z",
                }
            ]
        ],
    )
    next_cursor: str | None = Field(
        default=None, description="Pass as `cursor` for the next page; null on the last.", examples=[None]
    )
    total: Int = Field(description="Replicas matching the filters, on every page.", examples=[12])


EngineHint = Literal["auto", "transformer", "ssm", "moe"]
EngineName = Literal["transformer", "ssm", "moe", "hybrid"]
MAX_ADMIT_TOKENS = 10_000_000  # input + output of one request: far beyond any catalog model's context


class AdmitRequest(Request):
    request_id: str = Field(
        min_length=1, max_length=NAME_MAX, description="Request id (idempotency key).", examples=["r-1"]
    )
    tenant: str = Field(min_length=1, max_length=NAME_MAX, description="Tenant.", examples=["acme"])
    model: str = Field(
        min_length=1, max_length=NAME_MAX, description="A catalog model or a model group.", examples=["chat-8b"]
    )
    input_tokens: Int = Field(gt=0, le=MAX_ADMIT_TOKENS, description="Input tokens.", examples=[1000])
    output_tokens: Int = Field(gt=0, le=MAX_ADMIT_TOKENS, description="Expected maximum output.", examples=[200])
    slo: Slo | None = Field(default=None, description="Latency objectives.")
    region: str | None = Field(default=None, max_length=NAME_MAX, description="Region.", examples=["us-west-1"])
    hint: EngineHint = Field(default="auto", description="Engine preference.", examples=["auto"])
    session_id: str | None = Field(default=None, max_length=NAME_MAX, description="Session.", examples=["s-9"])
    lease_s: Int = Field(
        default=300, gt=0, le=86400, description="Longest the KV is held without a release.", examples=[300]
    )
    failed_replica_id: str | None = Field(
        default=None,
        max_length=ID_MAX,
        description="A replica that just failed or timed out this request: it leaves rotation and the request "
        "fails over past it. Heard only from a tenant holding an admission on that replica; otherwise ignored "
        "(`failed_replica_ignored` in the reply).",
        examples=[None],
    )


class AdmitReply(Contract):
    # "rejected": only nested in `route.select`'s `admission`; `placement.admit` refuses with `Rejected`.
    status: Literal["admitted", "queued", "rejected"] = Field(description="Outcome.", examples=["admitted"])
    allocation_id: str | None = Field(
        default=None,
        description="The admission id (`adm-...`): the request counted against its replica in placement's memory, "
        "not a ledger allocation (`placement.release` ends it, `placement.renew` extends it).",
        examples=["adm-1"],
    )
    replica_id: str | None = Field(
        default=None, description="The replica: the allocation `placement.place` returned for it.", examples=["al-7"]
    )
    node: str | None = Field(default=None, description="Node.", examples=["dgx-h100-01"])
    engine: EngineName | None = Field(default=None, description="Engine kind of the replica.", examples=["ssm"])
    model: str | None = Field(default=None, description="The model that serves it.", examples=["mamba2-2.7b"])
    region: str | None = Field(default=None, description="Region of the replica.", examples=["us-west-1"])
    sku: str | None = Field(default=None, description="SKU of the replica's accelerators.", examples=["H100-SXM-80GB"])
    kv_bytes: Int | None = Field(default=None, description="KV (or SSM state) bytes held.", examples=[1_048_576])
    lease_expires_at: datetime | None = Field(default=None, description="When the hold ends without a release.")
    queue_position: Int | None = Field(default=None, description="When queued: 1 is next.", examples=[None])
    explanation: str | None = Field(default=None, description="Why this replica (or why none).")
    failover: list[str] | None = Field(
        default=None, description="Replicas to try next, in order, if this one fails.", examples=[["al-8"]]
    )
    failed_replica_ignored: bool | None = Field(
        default=None,
        description="Whether the request's `failed_replica_id` was ignored (the tenant held no admission on that "
        "replica, so it stayed in rotation); null when the request named none.",
        examples=[None],
    )
    error: ErrorBody | None = Field(default=None, description="Null, or why.")
    details: dict[str, Any] | None = Field(default=None, description="Extra.")
    endpoint: str | None = Field(
        default=None,
        description="Base URL of the replica's engine (its head rank's, as its node agent reported it once ready); "
        "null when its engine reports no lifecycle (e.g. `hetsched engine-sim`).",
        examples=["http://10.0.0.7:8100"],
    )


# --- events of the PLACEMENT stream ----------------------------------------------------------------------


class PlacementEventName(StrEnum):
    """Event names of the PLACEMENT stream (subject `<prefix>.events.placement.<name>`)."""

    PLACEMENT_DECIDED = "placement_decided"
    PLACEMENT_REJECTED = "placement_rejected"
    PLACEMENT_RELEASED = "placement_released"


PLACEMENT_DECIDED = PlacementEventName.PLACEMENT_DECIDED
PLACEMENT_REJECTED = PlacementEventName.PLACEMENT_REJECTED
PLACEMENT_RELEASED = PlacementEventName.PLACEMENT_RELEASED


class PlacementEvent(Contract):
    """Payload of `placement_decided` / `placement_rejected`: the reply the caller got."""

    request_id: str = Field(description="The request.", examples=["req-42"])
    tenant: str = Field(description="Tenant.", examples=["acme"])
    model: str = Field(description="Model.", examples=["llama3-70b"])
    reply: PlaceReply = Field(description="The `placement.place` reply, explanation included.")
    decision_ms: Float = Field(description="Time the decision took.", examples=[0.4])
    attempts: Int = Field(default=1, description="Ledger commits tried (conflicts retry).", examples=[1])
    request: PlaceRequest | None = Field(
        default=None, description="What was asked (the rebalancer asks it again, with a new id, to move it)."
    )


class PlacementReleasedEvent(Contract):
    """Payload of `placement_released`: a replica placement ended (released by its tenant, or its lease
    expired in the ledger)."""

    allocation_id: str = Field(description="Allocation.", examples=["al-..."])
    tenant: str = Field(description="Tenant.", examples=["acme"])
    reason: str = Field(default="released", description="`released` or `expired`.", examples=["released"])
