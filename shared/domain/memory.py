"""The memory model (DESIGN §3): bytes a replica of a model needs on each accelerator of its TP group.

Every size is an exact integer number of bytes. Sub-byte dtypes (int4 / fp4, half a byte per element) are
rounded up once per tensor family, never per element.

Formulas (elements; multiply by ``dtype_bytes``):

* weights = params (every expert counts unless the spec says experts are offloaded; then active_params)
* GQA / MHA KV = 2 x kv_heads x head_dim x batch x sum over attention layers of the tokens each holds,
  where a sliding-window layer holds min(seq_len, window) tokens and a global layer seq_len
* MLA KV (DeepSeek-V2/V3) = (kv_lora_rank + qk_rope_head_dim) x attention_layers x seq_len x batch
* SSM state (Mamba-2, vLLM's cache layout) = ssm_layers x batch x
  (d_inner x d_state  +  (d_inner + 2 x n_groups x d_state) x (conv_kernel - 1));
  the first term is the SSM state (heads x headdim x d_state), the second the causal-conv window over the
  x, B and C channels. Mamba-1 is the same with n_groups = 0. Independent of sequence length.

Under tensor parallelism of degree tp (the fullest rank is what must fit):

* weights: ceil(weights / tp)
* GQA KV: each rank holds ceil(kv_heads / tp) kv heads, so with kv_heads < tp every rank holds one head and
  the KV is replicated (tp=16 costs each GPU what tp=8 does for 8 kv heads)
* MLA KV: the latent is shared by all heads and cannot be split by head; every rank holds all of it
  (vLLM and SGLang replicate it under TP)
* SSM state: split by SSM heads, ceil(heads / tp) per rank; B and C groups ceil(n_groups / tp) per rank,
  replicated when n_groups < tp
* activation: see ``activation_peak_bytes``; workspace: a fixed reserve per accelerator
"""

from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Final

# The dtype vocabulary lives in dtypes; re-exported here for the memory model's callers.
from shared.domain.dtypes import DTYPE_BYTES as DTYPE_BYTES
from shared.domain.dtypes import compute_dtype as compute_dtype
from shared.domain.dtypes import dtype_bytes as dtype_bytes
from shared.domain.models import ModelSpec

GIB: Final = 1024**3

DEFAULT_CEILING: Final = 0.92
"""Share of an accelerator's HBM the ledger lets allocations use (DESIGN §3); the rest absorbs
fragmentation and allocator slack (vLLM's --gpu-memory-utilization defaults to 0.9 for the same reason)."""

DEFAULT_WORKSPACE_BYTES: Final = GIB
"""Reserve per accelerator for the CUDA context, cuBLAS/NCCL workspaces and CUDA graphs: a planning figure."""

DEFAULT_TOKENS_IN_FLIGHT: Final = 8192
"""Tokens one engine step processes at most (chunked prefill budget, vLLM's max_num_batched_tokens order)."""

ACTIVATION_HIDDEN_BUFFERS: Final = 4
"""Hidden-size buffers live per token at the peak: residual, normed input, attention out, MLP out."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _bytes(elements: int, dtype: str) -> int:
    per_element = Fraction(dtype_bytes(dtype))  # exact: every width is a power of two
    return _ceil_div(elements * per_element.numerator, per_element.denominator)


def _check(**values: int) -> None:
    for name, value in values.items():
        minimum = 1 if name == "tp" else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")


def weight_bytes(spec: ModelSpec, dtype: str) -> int:
    """Resident weights of the whole replica: params x bytes(dtype), all experts included.

    With ``experts_offloaded`` only ``active_params`` stay resident (the dense part plus the experts one
    token uses; the rest live in host memory).
    """
    params = spec.active_params if spec.experts_offloaded else spec.params
    return _bytes(params, dtype)


def kv_cache_bytes(spec: ModelSpec, *, seq_len: int, batch: int, kv_dtype: str, tp: int = 1) -> int:
    """Attention KV cache for ``batch`` sequences of ``seq_len`` tokens, as held by the fullest of ``tp`` ranks.

    ``tp=1`` is the whole cache. SSM layers contribute nothing here (see ``ssm_state_bytes``).
    """
    _check(seq_len=seq_len, batch=batch, tp=tp)
    if spec.attention_layers == 0:
        return 0
    window_layers = spec.sliding_window_layers
    window_tokens = min(seq_len, spec.sliding_window) if spec.sliding_window is not None else seq_len
    tokens_x_layers = (spec.attention_layers - window_layers) * seq_len + window_layers * window_tokens
    if spec.mla is not None:
        per_token = spec.mla.kv_lora_rank + spec.mla.qk_rope_head_dim  # replicated on every rank
    else:
        per_token = 2 * _ceil_div(spec.kv_heads, tp) * spec.head_dim
    return _bytes(per_token * tokens_x_layers * batch, kv_dtype)


def ssm_state_bytes(spec: ModelSpec, *, batch: int, dtype: str, tp: int = 1) -> int:
    """Recurrent state of the SSM layers for ``batch`` sequences, as held by the fullest of ``tp`` ranks.

    Per layer and sequence: ``heads_r x headdim x d_state`` (SSM state) plus
    ``(heads_r x headdim + 2 x groups_r x d_state) x (conv_kernel - 1)`` (conv window over x, B, C), with
    ``heads_r = ceil(heads / tp)`` and ``groups_r = ceil(n_groups / tp)``. At tp=1 that is
    ``d_inner x d_state + (d_inner + 2 x n_groups x d_state) x (conv_kernel - 1)``. No sequence length in it.
    """
    _check(batch=batch, tp=tp)
    ssm = spec.ssm
    if ssm is None or spec.ssm_layers == 0:
        return 0
    channels = _ceil_div(ssm.heads, tp) * ssm.head_dim
    groups = _ceil_div(ssm.n_groups, tp)
    state = channels * ssm.d_state
    conv = (channels + 2 * groups * ssm.d_state) * (ssm.conv_kernel - 1)
    return _bytes(spec.ssm_layers * (state + conv) * batch, dtype)


def cache_bytes(spec: ModelSpec, *, seq_len: int, batch: int, kv_dtype: str, state_dtype: str, tp: int = 1) -> int:
    """Everything that grows with the number of sequences: attention KV plus SSM state, per rank."""
    return kv_cache_bytes(spec, seq_len=seq_len, batch=batch, kv_dtype=kv_dtype, tp=tp) + ssm_state_bytes(
        spec, batch=batch, dtype=state_dtype, tp=tp
    )


def activation_peak_bytes(spec: ModelSpec, *, tokens_in_flight: int, tp: int, dtype: str) -> int:
    """An ESTIMATE of the transient activation peak of one engine step on one of ``tp`` ranks.

    Per token: ``ACTIVATION_HIDDEN_BUFFERS`` hidden-size buffers (replicated on every rank) plus the
    widest TP-sharded projection output of any layer, divided by tp: the QKV projection
    ``(heads + 2 x kv_heads) x head_dim``, the gate+up MLP output ``2 x intermediate`` times the experts a
    token visits (``experts_per_token + shared_experts`` for MoE), or the Mamba in-projection
    ``2 x d_inner + 2 x n_groups x d_state + ssm heads``. Buffers are reused layer to layer, so the peak is
    one layer's. Logits, attention scores (flash kernels keep them on chip) and allocator slack are left
    to the workspace reserve. Calibrate against an engine's profiler before trusting the last 10%.
    """
    _check(tokens_in_flight=tokens_in_flight, tp=tp)
    widths = [0]
    if spec.attention_layers:
        widths.append((spec.heads + 2 * spec.kv_heads) * spec.head_dim)
    if spec.intermediate:
        widths.append(2 * spec.intermediate * max(1, spec.experts_per_token + spec.shared_experts))
    if spec.ssm is not None:
        ssm = spec.ssm
        widths.append(2 * ssm.d_inner + 2 * ssm.n_groups * ssm.d_state + ssm.heads)
    per_token = ACTIVATION_HIDDEN_BUFFERS * spec.hidden + _ceil_div(max(widths), tp)
    return _bytes(per_token * tokens_in_flight, dtype)


@dataclass(frozen=True, slots=True)
class MemoryShare:
    """Bytes one accelerator of a replica holds. ``kv`` is the per-sequence cache: attention KV + SSM state."""

    weights: int
    kv: int
    activation: int
    workspace: int
    total: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "total", self.weights + self.kv + self.activation + self.workspace)


def per_accelerator_share(
    spec: ModelSpec,
    *,
    tp: int,
    dtype: str,
    kv_dtype: str,
    context_tokens: int,
    concurrency: int,
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    tokens_in_flight: int | None = None,
    state_dtype: str | None = None,
) -> MemoryShare:
    """What each of the ``tp`` accelerators of one replica must hold (the fullest rank).

    ``concurrency`` sequences of up to ``context_tokens`` tokens sit in the KV pool. ``tokens_in_flight``
    defaults to min(``DEFAULT_TOKENS_IN_FLIGHT``, concurrency x context_tokens); activations and the SSM
    state (``state_dtype``) default to ``compute_dtype(dtype)``, as vLLM's "auto" cache dtype does.
    """
    _check(tp=tp, context_tokens=context_tokens, concurrency=concurrency, workspace_bytes=workspace_bytes)
    if tokens_in_flight is None:
        tokens_in_flight = min(DEFAULT_TOKENS_IN_FLIGHT, concurrency * context_tokens)
    activation_dtype = compute_dtype(dtype)
    return MemoryShare(
        weights=_ceil_div(weight_bytes(spec, dtype), tp),
        kv=cache_bytes(
            spec,
            seq_len=context_tokens,
            batch=concurrency,
            kv_dtype=kv_dtype,
            state_dtype=state_dtype or activation_dtype,
            tp=tp,
        ),
        activation=activation_peak_bytes(spec, tokens_in_flight=tokens_in_flight, tp=tp, dtype=activation_dtype),
        workspace=workspace_bytes,
    )


def usable_hbm(hbm_bytes: int, ceiling: float = DEFAULT_CEILING) -> int:
    """HBM the ledger may allocate on one accelerator: floor(hbm_bytes x ceiling)."""
    _check(hbm_bytes=hbm_bytes)
    if not 0 < ceiling <= 1:
        raise ValueError(f"ceiling: expected a fraction in (0, 1], got {ceiling!r}")
    # The decimal the operator wrote (0.92), not its binary approximation, so boundaries are exact.
    exact = Fraction(ceiling).limit_denominator(1_000_000)
    return hbm_bytes * exact.numerator // exact.denominator


def fits(share: MemoryShare, hbm_bytes: int, ceiling: float = DEFAULT_CEILING) -> bool:
    """Whether ``share`` fits in one accelerator of ``hbm_bytes`` under the utilisation ceiling."""
    return share.total <= usable_hbm(hbm_bytes, ceiling)


def shortfall_bytes(share: MemoryShare, hbm_bytes: int, ceiling: float = DEFAULT_CEILING) -> int:
    """Bytes per accelerator by which ``share`` misses (0 when it fits): "HBM short by 3.2 GB per GPU"."""
    return max(0, share.total - usable_hbm(hbm_bytes, ceiling))


def max_concurrency(
    spec: ModelSpec,
    *,
    tp: int,
    dtype: str,
    kv_dtype: str,
    context_tokens: int,
    hbm_bytes: int,
    ceiling: float = DEFAULT_CEILING,
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
    tokens_in_flight: int | None = None,
    state_dtype: str | None = None,
) -> int:
    """The KV pool size in sequences of ``context_tokens``: the largest concurrency whose share still fits.

    0 when even the weights, activation and workspace alone do not fit (or only they do).
    """

    def share(concurrency: int) -> MemoryShare:
        return per_accelerator_share(
            spec,
            tp=tp,
            dtype=dtype,
            kv_dtype=kv_dtype,
            context_tokens=context_tokens,
            concurrency=concurrency,
            workspace_bytes=workspace_bytes,
            tokens_in_flight=tokens_in_flight,
            state_dtype=state_dtype,
        )

    _check(context_tokens=context_tokens)
    if context_tokens == 0:
        raise ValueError("context_tokens: expected an integer >= 1, got 0")
    limit = usable_hbm(hbm_bytes, ceiling)
    if share(0).total > limit:
        return 0
    # The total grows by at least a byte a sequence, so no more than `limit` sequences fit: gallop, bisect.
    fitting, failing = 0, 1
    while failing <= limit and share(failing).total <= limit:
        fitting, failing = failing, failing * 2
    while failing - fitting > 1:
        middle = (fitting + failing) // 2
        if share(middle).total <= limit:
            fitting = middle
        else:
            failing = middle
    return fitting
