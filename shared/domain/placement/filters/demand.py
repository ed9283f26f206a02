"""PreFilter ``demand``: validate the request and derive what it needs (DESIGN §4 "prefilter").

* the model from the catalog (``unknown_model``), dtypes defaulting to the spec's;
* bad values are ``invalid_request``: tokens or concurrency below 1, a typical shape longer than the
  context, a context beyond the model's maximum, a TP degree that is not a power of two or does not
  divide the model's heads, an unknown dtype or backend, a non-positive SLO, a backend the model has
  no artifact for, a region the fleet has no node or pod in; SKUs in the allow-list must be in the catalog
  (``unknown_sku``); an unknown name's refusal lists the known ones, closest first;
* the TP degrees to try (the request's, else 1, 2, 4, 8, 16 where the attention and SSM heads divide
  evenly) and ``memory.per_accelerator_share`` at each;
* for each TPU type in the fleet, the smallest legal slice holding the replica: at least
  ceil(total bytes / usable bytes per chip) chips, then the first legal shape whose per-chip share fits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Final

from shared.domain.memory import DEFAULT_WORKSPACE_BYTES, DTYPE_BYTES, MemoryShare, per_accelerator_share
from shared.domain.models import ModelSpec
from shared.domain.names import ECHO, LISTED, unknown_name
from shared.domain.placement.framework import (
    DEMAND,
    GB,
    Code,
    CycleState,
    Demand,
    Status,
    TpuDemand,
    typed_config,
)
from shared.domain.placement.types import FALLBACKS, FleetSnapshot, PlacementRequest
from shared.domain.topology.tpu import TpuType, all_legal_shapes

NAME: Final = "demand"
TP_DEGREES: Final = (1, 2, 4, 8, 16)
BACKENDS: Final = ("gpu", "tpu", "any")
SHARING: Final = ("exclusive", "shared")
MAX_PP: Final = 8


@dataclass(frozen=True, slots=True)
class DemandConfig:
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES


def fleet_regions(snapshot: FleetSnapshot) -> frozenset[str]:
    """The regions of the fleet's nodes and TPU pods, lost ones included: the regions a placement can name."""
    return (
        snapshot.known_regions
        | {node.region for node in snapshot.nodes.values()}
        | {pod.pod.region for pod in snapshot.tpu_pods.values()}
    )


def _invalid(message: str) -> Status:
    return Status(Code.INVALID_REQUEST, plugin=NAME, message=message)


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def tp_fits_heads(model: ModelSpec, tp: int) -> str | None:
    """Why ``tp`` cannot shard ``model``'s heads evenly, or None when it can. KV heads fewer than
    ``tp`` are fine (they are replicated, and the memory model charges for it)."""
    if tp == 1:
        return None
    if model.heads and model.heads % tp:
        return f"{model.name}'s {model.heads} attention heads do not split over TP={tp}"
    if model.ssm is not None and model.ssm.heads % tp:
        return f"{model.name}'s {model.ssm.heads} SSM heads do not split over TP={tp}"
    return None


class DemandPreFilter:
    name: Final = NAME

    def __init__(self, config: DemandConfig) -> None:
        self.config = config

    def prefilter(self, state: CycleState, snapshot: FleetSnapshot, request: PlacementRequest) -> Status:
        model = snapshot.models.get(request.model)
        if model is None:
            return Status(
                Code.UNKNOWN_MODEL, plugin=NAME, message=unknown_name("model", request.model, snapshot.models)
            )
        problem = self._validate(snapshot, request, model)
        if problem is not None:
            return problem
        dtype = request.dtype or model.dtype
        kv_dtype = request.kv_dtype or model.kv_dtype
        requested = {"gpu", "tpu"} if request.backend == "any" else {request.backend}
        if request.sharing == "shared" or (request.pp or 1) > 1:
            requested &= {"gpu"}  # shared replicas and pipeline stages are GPU placements
        backends = frozenset(model.backends & requested)
        if not backends:
            return _invalid(
                f"{model.name} has no {request.backend} artifact (built for: {', '.join(sorted(model.backends))})"
            )

        def share(tp: int) -> MemoryShare:
            return gpu_share(
                model, tp, dtype, kv_dtype, request.context_tokens, request.concurrency, self.config.workspace_bytes
            )

        notes: list[str] = []
        gpu_shares: dict[int, MemoryShare] = {}
        if "gpu" in backends:
            degrees = (1,) if request.sharing == "shared" else TP_DEGREES
            for tp in (request.tp,) if request.tp is not None else degrees:
                reason = tp_fits_heads(model, tp)
                if reason is None:
                    gpu_shares[tp] = share(tp)
                else:
                    notes.append(f"TP={tp} not considered: {reason}")
        tpu: dict[tuple[TpuType, int], TpuDemand] = {}
        if "tpu" in backends:
            for pod in snapshot.tpu_pods.values():
                key = (pod.pod.type, pod.usable_per_chip)
                if key not in tpu:
                    tpu[key] = _tpu_demand(key[0], key[1], request.tp, share)
        levels = sorted(set(gpu_shares) | {d.chips for d in tpu.values() if d.chips is not None})
        context = request.context_tokens
        # Without a typical shape, assume half the context is prompt and half is output.
        input_tokens = request.input_tokens or max(1, context - (request.output_tokens or context // 2))
        output_tokens = request.output_tokens or max(1, context - input_tokens)
        state.write(
            DEMAND,
            Demand(
                request=request,
                model=model,
                dtype=dtype,
                kv_dtype=kv_dtype,
                backends=backends,
                skus=frozenset(request.skus) if request.skus is not None else None,
                input_tokens=input_tokens,
                output_tokens=output_tokens,
                shape_given=request.input_tokens is not None and request.output_tokens is not None,
                gpu_shares=gpu_shares,
                tpu=tpu,
                levels=tuple(levels),
                notes=tuple(notes),
            ),
        )
        return Status(plugin=NAME)

    def _validate(self, snapshot: FleetSnapshot, request: PlacementRequest, model: ModelSpec) -> Status | None:
        if request.backend not in BACKENDS:
            return _invalid(f"backend {request.backend!r} is not one of {', '.join(BACKENDS)}")
        if request.sharing not in SHARING:
            return _invalid(f"sharing {request.sharing!r} is not one of {', '.join(SHARING)}")
        if request.sharing == "shared" and ((request.tp or 1) > 1 or (request.pp or 1) > 1):
            return _invalid("sharing `shared` is for single-GPU replicas (TP=1, no pipeline stages)")
        if request.sharing == "shared" and request.backend == "tpu":
            return _invalid("sharing `shared` is for GPUs: a TPU replica takes a whole slice")
        unknown = [f for f in request.fallbacks or () if f not in FALLBACKS]
        if unknown:
            return _invalid(f"unknown fallback {unknown[0]!r}; known: {', '.join(FALLBACKS)}")
        if request.pp is not None:
            if not _is_count(request.pp) or request.pp & (request.pp - 1) or request.pp > MAX_PP:
                return _invalid(f"pp must be a power of two from 1 to {MAX_PP}, got {request.pp!r}")
            if request.pp > 1 and request.backend == "tpu":
                return _invalid("pipeline stages (pp > 1) are for GPUs; a TPU replica takes one whole slice")
        for label, dtype in (("dtype", request.dtype), ("kv_dtype", request.kv_dtype)):
            if dtype is not None and dtype not in DTYPE_BYTES:
                return _invalid(f"{label} {dtype!r} is not one of {', '.join(DTYPE_BYTES)}")
        for label, count in (("context_tokens", request.context_tokens), ("concurrency", request.concurrency)):
            if not _is_count(count):
                return _invalid(f"{label} must be an integer >= 1, got {count!r}")
        for label, optional in (("input_tokens", request.input_tokens), ("output_tokens", request.output_tokens)):
            if optional is not None and not _is_count(optional):
                return _invalid(f"{label} must be an integer >= 1, got {optional!r}")
        shape = (request.input_tokens or 0) + (request.output_tokens or 0)
        if shape > request.context_tokens:
            return _invalid(f"input + output tokens ({shape}) exceed context_tokens ({request.context_tokens})")
        if request.context_tokens > model.max_context:
            return _invalid(
                f"context_tokens {request.context_tokens} exceed {model.name}'s maximum context {model.max_context}"
            )
        if request.tp is not None:
            if not _is_count(request.tp) or request.tp & (request.tp - 1):
                return _invalid(f"tp must be a power of two >= 1, got {request.tp!r}")
            if request.backend != "tpu" and (reason := tp_fits_heads(model, request.tp)) is not None:
                return _invalid(reason)
        if request.skus is not None:
            unknown = sorted(set(request.skus) - set(snapshot.skus))
            if unknown:
                head = f"unknown SKU {', '.join(repr(u[:ECHO]) for u in unknown[:LISTED])}"
                return Status(
                    Code.UNKNOWN_SKU, plugin=NAME, message=unknown_name("SKU", unknown[0], snapshot.skus, prefix=head)
                )
        if request.region is not None and request.region not in snapshot.known_regions:
            regions = fleet_regions(snapshot)
            if regions and request.region not in regions:  # an empty fleet (not synced yet) knows no region
                return _invalid(unknown_name("region", request.region, regions))
        if request.slo is not None:
            for label, value in (
                ("ttft_ms", request.slo.ttft_ms),
                ("tpot_ms", request.slo.tpot_ms),
                ("p99_ms", request.slo.p99_ms),
            ):
                if value is not None and not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                    return _invalid(f"slo.{label} must be a positive number, got {value!r}")
        return None


@lru_cache(maxsize=4096)
def gpu_share(
    model: ModelSpec, tp: int, dtype: str, kv_dtype: str, context_tokens: int, concurrency: int, workspace_bytes: int
) -> MemoryShare:
    """``memory.per_accelerator_share`` at ``tp`` with these figures (the prefilter's per-GPU share)."""
    # Pure and asked again for every request of the same shape: memoised.
    return per_accelerator_share(
        model,
        tp=tp,
        dtype=dtype,
        kv_dtype=kv_dtype,
        context_tokens=context_tokens,
        concurrency=concurrency,
        workspace_bytes=workspace_bytes,
    )


def _tpu_demand(
    tpu_type: TpuType, usable_per_chip: int, tp: int | None, share: Callable[[int], MemoryShare]
) -> TpuDemand:
    # A replica over c chips holds at least its tp=1 total / c per chip (every part shrinks at most
    # linearly with c), so fewer chips than this cannot hold it.
    fewest = max(1, math.ceil(share(1).total / usable_per_chip))
    largest: tuple[int, ...] = ()
    for shape in all_legal_shapes(tpu_type):
        chips = math.prod(shape)
        largest = shape
        if chips < fewest or (tp is not None and chips != tp):
            continue
        per_chip = share(chips)
        if per_chip.total <= usable_per_chip:
            return TpuDemand(chips=chips, shape=shape, share=per_chip)
    if tp is not None:
        return TpuDemand(None, None, None, f"no legal {tpu_type.value} slice of {tp} chips holds the replica")
    need = share(math.prod(largest)).total
    return TpuDemand(
        None,
        None,
        None,
        f"needs more than the largest {tpu_type.value} slice ({'x'.join(map(str, largest))}: "
        f"{need / GB:.1f} GB per chip > {usable_per_chip / GB:.1f} GB usable)",
    )


def factory(config: Mapping[str, object] | None = None) -> DemandPreFilter:
    return DemandPreFilter(typed_config(DemandConfig, NAME, config or {}))
