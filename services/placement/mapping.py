"""Placement's contracts <-> the placement domain: requests in, replies and ledger commits out."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from shared.contracts.base import ErrorCode, rejected
from shared.contracts.ledger import (
    CommitRequest,
    ShareIn,
)
from shared.contracts.placement import (
    AcceleratorShare,
    EngineLaunch,
    Estimate,
    NodeBinding,
    NodePlacement,
    PlaceReply,
    PlaceRequest,
    TpuSlice,
)
from shared.domain.fleet import AcceleratorId, fleet_domains
from shared.domain.models import ModelSpec
from shared.domain.placement import binding as engine_binding
from shared.domain.placement.binding import bind, launch, tpu_launch
from shared.domain.placement.types import Decision, FleetSnapshot, PlacementRequest
from shared.domain.placement.view import (
    AssumeKey,
    Crossing,
    reservation,
)

LEDGER_REQUEST_PREFIX = "placement/"


def may_queue(request: PlaceRequest) -> bool:
    """The request lets placement queue it: the default ladder, or `queue` among its fallbacks."""
    return request.fallbacks is None or "queue" in request.fallbacks


def _by_node(accelerators: Sequence[str]) -> dict[str, list[str]]:
    by_node: dict[str, list[str]] = {}
    for acc in accelerators:
        by_node.setdefault(AcceleratorId.parse(acc).host, []).append(acc)
    return by_node


def _domain_of(accelerators: Sequence[str], snapshot: FleetSnapshot | None) -> str | None:
    """The NVLink domain holding all of ``accelerators`` (a pipeline stage), when one does."""
    if snapshot is None or not accelerators:
        return None
    profiles = [snapshot.nodes[n] for n in _by_node(accelerators) if n in snapshot.nodes]
    wanted = set(accelerators)
    return next((d.id for d in fleet_domains(profiles) if wanted <= set(d.members)), None)


def _stages(decision: Decision, snapshot: FleetSnapshot | None) -> list[list[NodePlacement]] | None:
    """Each pipeline stage's accelerators grouped by node, with the stage's NVLink domain."""
    if decision.pp <= 1 or not decision.stages:
        return None
    stages: list[list[NodePlacement]] = []
    for stage in decision.stages:
        domain = _domain_of(stage, snapshot)
        stages.append([NodePlacement(node=n, accelerators=accs, domain=domain) for n, accs in _by_node(stage).items()])
    return stages


def _estimate(decision: Decision) -> Estimate | None:
    if not decision.estimate:
        return None
    figures = decision.estimate
    return Estimate(
        ttft_ms=figures.get("ttft_ms"),
        tpot_ms=figures.get("tpot_ms"),
        tokens_per_s=figures.get("tokens_per_s"),
        load_time_s=figures.get("load_time_s"),
    )


def launch_dtypes(decision: Decision, request: PlacementRequest, spec: ModelSpec) -> tuple[str, str]:
    """(weights dtype, KV dtype) the decision was made with: the request's, else the catalog's; the
    `kv_quantize` fallback holds the KV cache in fp8 (its explanation says so)."""
    dtype = request.dtype or spec.dtype
    kv_dtype = request.kv_dtype or spec.kv_dtype
    if decision.fallback == "kv_quantize":
        kv_dtype = "fp8"
    return dtype, kv_dtype


def _device_hbm(decision: Decision, snapshot: FleetSnapshot) -> int | None:
    """The HBM of the decision's devices as discovery reported it (the smallest, should they differ),
    else the SKU's nominal figure: what the engines' memory fraction is a fraction of."""
    sizes = []
    for acc in decision.accelerators:
        parsed = AcceleratorId.parse(acc)
        profile = snapshot.nodes.get(parsed.host)
        if profile is None or parsed.gpu_index is None:
            continue
        sizes += [a.hbm_bytes for a in profile.accelerators if a.index == parsed.gpu_index]
    if sizes:
        return min(sizes)
    sku = snapshot.skus.get(decision.sku or "")
    return sku.hbm_bytes if sku is not None else None


def binding_and_launch(
    decision: Decision, snapshot: FleetSnapshot, request: PlacementRequest
) -> tuple[list[NodeBinding] | None, EngineLaunch | None, str | None]:
    """What an engine is started with for a placed decision (``shared.domain.placement.binding``): a GPU
    decision's per-node binding and engine arguments, a TPU slice's vLLM TPU arguments; and a note when
    the arguments cannot be said (the binding stays)."""
    if not decision.placed:
        return None, None, None
    spec = snapshot.models.get(request.model)
    if decision.tpu is not None:
        if spec is None:
            return None, None, "no engine arguments: the model is unknown"
        pod = snapshot.tpu_pods.get(decision.tpu.pod)
        dtype, kv_dtype = launch_dtypes(decision, request, spec)
        try:
            engine = tpu_launch(
                decision,
                model=spec,
                hbm_per_chip=pod.hbm_per_chip if pod is not None else None,
                context_tokens=request.context_tokens,
                concurrency=request.concurrency,
                dtype=dtype,
                kv_dtype=kv_dtype,
            )
        except ValueError as exc:
            return None, None, f"no engine arguments: {exc}"
        return None, _launch(engine), None
    try:
        bindings = bind(decision, snapshot.nodes)
    except ValueError as exc:
        return None, None, f"no binding: {exc}"
    hbm = _device_hbm(decision, snapshot)
    if spec is None or hbm is None:
        return _bindings(bindings), None, "no engine arguments: the model or the device HBM is unknown"
    dtype, kv_dtype = launch_dtypes(decision, request, spec)
    try:
        engine = launch(
            decision,
            model=spec,
            hbm_bytes=hbm,
            context_tokens=request.context_tokens,
            concurrency=request.concurrency,
            dtype=dtype,
            kv_dtype=kv_dtype,
            bindings=bindings,
        )
    except ValueError as exc:
        return _bindings(bindings), None, f"no engine arguments: {exc}"
    return _bindings(bindings), _launch(engine), None


def _launch(engine: engine_binding.Launch) -> EngineLaunch:
    return EngineLaunch(
        vllm=list(engine.vllm),
        sglang=list(engine.sglang),
        env=dict(engine.env),
        checkpoint=engine.checkpoint,
        quantization=engine.quantization,
    )


def _bindings(bindings: Sequence[engine_binding.NodeBinding]) -> list[NodeBinding]:
    return [
        NodeBinding(
            node=b.node,
            cuda_visible_devices=b.cuda_visible_devices,
            tp_rank_order=list(b.tp_rank_order),
            numa_node=b.numa_node,
            cpu_set=b.cpu_set,
        )
        for b in bindings
    ]


def to_reply(
    decision: Decision,
    *,
    allocation_id: str | None = None,
    snapshot: FleetSnapshot | None = None,
    request: PlacementRequest | None = None,
) -> PlaceReply:
    """The reply for a decision; with the ``snapshot`` it was made on and its ``request``, a placed GPU
    decision also carries its ``binding`` and ``launch`` (and its stages their NVLink domains)."""
    share = decision.share
    placements: list[NodePlacement] = []
    if decision.placed and decision.tpu is None:
        domain = decision.domain if decision.pp <= 1 else None  # stages name theirs
        placements = [
            NodePlacement(node=n, accelerators=accs, domain=domain)
            for n, accs in _by_node(decision.accelerators).items()
        ]
    error = None
    if not decision.placed:
        error = rejected(decision.error_code or ErrorCode.NO_CAPACITY, decision.message or "no placement").error
    binding: list[NodeBinding] | None = None
    engine: EngineLaunch | None = None
    explanation = list(decision.explanation)
    if snapshot is not None and request is not None:
        binding, engine, note = binding_and_launch(decision, snapshot, request)
        if note:
            explanation.append(note)
    return PlaceReply(
        status=decision.status,
        request_id=decision.request_id,
        allocation_id=allocation_id,
        region=decision.region,
        cluster=decision.cluster,
        backend="tpu" if decision.tpu is not None else ("gpu" if decision.placed else None),
        sku=decision.sku,
        tp=decision.tp,
        placements=placements,
        tpu_slice=TpuSlice(pod=decision.tpu.pod, origin=list(decision.tpu.origin), shape=list(decision.tpu.shape))
        if decision.tpu is not None
        else None,
        hbm_per_accelerator=AcceleratorShare(
            weights_bytes=share.weights,
            kv_bytes=share.kv,
            activation_bytes=share.activation,
            workspace_bytes=share.workspace,
            total_bytes=share.total,
        )
        if share is not None and decision.placed
        else None,
        score=dict(decision.score),
        explanation=explanation,
        error=error,
        sharing="shared" if decision.sharing == "shared" else "exclusive",
        pp=max(decision.pp, 1),
        stages=_stages(decision, snapshot) if decision.placed else None,
        fallback=decision.fallback if decision.placed else None,
        binding=binding,
        launch=engine,
        estimate=_estimate(decision),
        dtype=request.dtype if request is not None and decision.placed else None,
    )


def ledger_key(request: PlaceRequest) -> AssumeKey:
    """The (tenant, request id) the ledger knows this placement by."""
    return request.tenant, f"{LEDGER_REQUEST_PREFIX}{request.request_id}"


def placement_request_id(ledger_request_id: str) -> str | None:
    """Placement's request id of a ledger request id, or None when the allocation is not placement's."""
    if ledger_request_id.startswith(LEDGER_REQUEST_PREFIX):
        return ledger_request_id[len(LEDGER_REQUEST_PREFIX) :]
    return None


def body_hash(request: PlaceRequest) -> str:
    """What a request asks, hashed: a reused request id with another body is a conflict. The contract
    version is left out (``1`` and ``"1.0"`` ask the same)."""
    return hashlib.sha256(request.model_dump_json(exclude={"version"}).encode()).hexdigest()


def commit_held(commit: CommitRequest) -> dict[str, int]:
    """Bytes per accelerator a commit reserves (what the view assumes while it is in flight)."""
    return {
        s.accelerator_id: s.weights_bytes + s.kv_bytes + s.activation_bytes + s.workspace_bytes for s in commit.shares
    }


def held_bytes(snapshot: FleetSnapshot, decision: Decision) -> dict[str, int]:
    """Bytes per accelerator the commit of ``decision`` reserves (what the view assumes meanwhile)."""
    return {acc: share.total for acc, share in reservation(snapshot, decision).items()}


def crossing(decision: Decision) -> Crossing | None:
    """(cluster, bytes/s) of TP traffic the decision sends across NVLink domains, if any."""
    if decision.cross_domain_bytes_per_s > 0 and decision.cluster is not None:
        return decision.cluster, decision.cross_domain_bytes_per_s
    return None


def to_commit(request: PlaceRequest, decision: Decision, snapshot: FleetSnapshot, *, lease_s: int) -> CommitRequest:
    """The ledger commit of a placed decision, with the reserved bytes it was decided on (``expected``):
    if they changed and the commit no longer fits, the ledger answers ``conflict`` (so two concurrent
    placements never land on one GPU the view showed idle). Every pipeline stage's accelerators are
    in the one commit: all stages or none. ``sharing`` and the cross-domain traffic travel with it."""
    shares = reservation(snapshot, decision)
    if decision.tpu is not None:
        expected = dict.fromkeys(shares, 0)  # a slice is only decided on free chips
    else:
        expected = {acc: snapshot.capacity[acc].reserved for acc in shares}
    tenant, request_id = ledger_key(request)
    return CommitRequest(
        request_id=request_id,
        tenant=tenant,
        kind="replica",
        sharing="shared" if decision.sharing == "shared" else "exclusive",
        cross_domain_bytes_per_s=round(decision.cross_domain_bytes_per_s),
        preemptible=request.preemptible,
        lease_s=lease_s,
        shares=[
            ShareIn(
                accelerator_id=acc,
                weights_bytes=share.weights,
                kv_bytes=share.kv,
                activation_bytes=share.activation,
                workspace_bytes=share.workspace,
            )
            for acc, share in shares.items()
        ],
        expected=expected,
    )
