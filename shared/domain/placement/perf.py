"""Throughput and latency of a demand on a SKU at a TP degree, for the SLO filter and the cost and
energy scores. Uses the calibrated latency model (``shared.domain.latency``); a SKU family without a
calibration falls back to a bandwidth proxy (decode reads the weights and the KV once per step)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Final

from shared.domain.hardware import Sku
from shared.domain.latency import ModelShape, calibration_for, decode_step_ms, prefill_ms
from shared.domain.memory import dtype_bytes, kv_cache_bytes
from shared.domain.models import ModelSpec
from shared.domain.placement.framework import CycleState, Demand, StateKey


@dataclass(frozen=True, slots=True)
class Perf:
    """Milliseconds to the first token and per output token, and decode tokens per second of the
    replica holding ``concurrency`` sequences; ``calibrated`` is False for the bandwidth proxy.

    ``served_tokens_per_s`` is what the replica gets through, prompt and output tokens together (what
    ``$/M tokens`` counts), at ``requests_per_s``: ``concurrency`` requests in flight, each for
    ``ttft + (output - 1) x tpot``, and no faster than one prefill at a time (prefill is
    compute-bound: long prompts bind before the KV slots do)."""

    ttft_ms: float
    tpot_ms: float
    tokens_per_s: float
    calibrated: bool
    requests_per_s: float
    served_tokens_per_s: float


_PROXY_MFU: Final = 0.5  # prefill share of peak flops assumed where no calibration exists
_PERF: Final[StateKey[dict[tuple[str, int], Perf]]] = StateKey("perf")


def model_shape(spec: ModelSpec, dtype: str, kv_dtype: str) -> ModelShape:
    return ModelShape(
        name=spec.name,
        params=float(spec.params),
        active_params=float(spec.active_params),
        kv_bytes_per_token=float(kv_cache_bytes(spec, seq_len=1, batch=1, kv_dtype=kv_dtype)),
        bytes_per_param=dtype_bytes(dtype),
    )


def perf(state: CycleState, demand: Demand, sku: Sku, tp: int) -> Perf:
    """The estimate for (``sku``, ``tp``), looked up once per decision.

    TTFT: one prompt of ``input_tokens`` prefilled alone. TPOT: one decode step of the whole KV pool
    (``concurrency`` sequences) at the mean context ``input + output / 2``.
    """
    cache = state.get(_PERF)
    if cache is None:
        cache = {}
        state.write(_PERF, cache)
    key = (sku.name, tp)
    found = cache.get(key)
    if found is None:
        found = cache[key] = perf_of(demand, sku, tp)
    return found


@lru_cache(maxsize=8192)
def estimate(
    spec: ModelSpec, dtype: str, kv_dtype: str, batch: int, input_tokens: int, output_tokens: int, sku: Sku, tp: int
) -> Perf:
    """``Perf`` of a replica: pure, and asked again by every request of the same shape, so memoised."""
    shape = model_shape(spec, dtype, kv_dtype)
    context = input_tokens + output_tokens / 2
    try:
        calibration_for(sku)
        ttft = prefill_ms(shape, sku, tp, input_tokens)
        tpot = decode_step_ms(shape, sku, tp, batch, context)
        calibrated = True
    except ValueError:  # no calibration for this family (or no datasheet speed): the bandwidth proxy
        bandwidth = max(sku.memory_bandwidth_bytes_per_s, 1.0)
        step_bytes = shape.weight_bytes_read(batch) + batch * context * shape.kv_bytes_per_token
        tpot = step_bytes / tp / bandwidth * 1e3
        flops = max(sku.bf16_tflops * 1e12 * _PROXY_MFU, 1.0)
        ttft = 2.0 * shape.active_params * input_tokens / tp / flops * 1e3
        calibrated = False
    e2e = ttft + (output_tokens - 1) * tpot
    requests_per_s = min(batch / max(e2e, 1e-9), 1.0 / max(ttft, 1e-9)) * 1e3
    return Perf(
        ttft_ms=ttft,
        tpot_ms=tpot,
        tokens_per_s=batch * 1e3 / max(tpot, 1e-9),
        calibrated=calibrated,
        requests_per_s=requests_per_s,
        served_tokens_per_s=requests_per_s * (input_tokens + output_tokens),
    )


def perf_of(demand: Demand, sku: Sku, tp: int) -> Perf:
    """``estimate`` for a demand's model, dtypes and request shape on ``sku`` at ``tp``."""
    return estimate(
        demand.model,
        demand.dtype,
        demand.kv_dtype,
        demand.request.concurrency,
        demand.input_tokens,
        demand.output_tokens,
        sku,
        tp,
    )
