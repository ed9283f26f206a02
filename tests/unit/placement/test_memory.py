"""The memory model against hand-computed vectors (the arithmetic sits next to each number) and invariants."""

from __future__ import annotations

import dataclasses
from functools import cache
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.domain.dtypes import compute_dtype, dtype_bytes
from shared.domain.memory import (
    DEFAULT_WORKSPACE_BYTES,
    MemoryShare,
    activation_peak_bytes,
    fits,
    kv_cache_bytes,
    max_concurrency,
    per_accelerator_share,
    shortfall_bytes,
    ssm_state_bytes,
    usable_hbm,
    weight_bytes,
)
from shared.domain.models import ModelSpec, parse_model_catalog

CATALOG = Path(__file__).resolve().parents[3] / "shared" / "catalog" / "models.yaml"
GIB = 1024**3
H100_HBM = 85_899_345_920  # 80 GiB, shared/catalog/skus.yaml
H200_HBM = 151_397_597_184  # 141 GiB


@cache
def _catalog() -> dict[str, ModelSpec]:
    return parse_model_catalog(yaml.safe_load(CATALOG.read_text()))


def model(name: str) -> ModelSpec:
    return _catalog()[name]


MODEL_NAMES = sorted(_catalog())


@pytest.mark.parametrize(
    ("dtype", "size"),
    [("fp32", 4), ("bf16", 2), ("fp16", 2), ("fp8", 1), ("int8", 1), ("int4", 0.5), ("fp4", 0.5)],
)
def test_dtype_bytes(dtype: str, size: float) -> None:
    assert dtype_bytes(dtype) == size


def test_unknown_dtype_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="unknown dtype 'fp6'"):
        dtype_bytes("fp6")
    with pytest.raises(ValueError):
        weight_bytes(model("llama3-8b"), "e5m2")


@pytest.mark.parametrize(
    ("name", "dtype", "expected"),
    [
        ("llama3-70b", "fp16", 141_107_412_992),  # 70,553,706,496 x 2
        ("llama3-70b", "fp8", 70_553_706_496),  # x 1
        ("llama3-70b", "int4", 35_276_853_248),  # x 0.5
        ("llama3-8b", "fp32", 32_121_044_992),  # 8,030,261,248 x 4
        # MoE: all 8 experts resident, not the 12.9e9 active: 46,702,792,704 x 2
        ("mixtral-8x7b", "bf16", 93_405_585_408),
        ("deepseek-v3", "fp8", 671_026_419_200),  # 671,026,419,200 x 1: every one of 256 experts
    ],
)
def test_weight_bytes(name: str, dtype: str, expected: int) -> None:
    assert weight_bytes(model(name), dtype) == expected


def test_offloaded_experts_leave_only_the_active_weights_resident() -> None:
    offloaded = dataclasses.replace(model("mixtral-8x7b"), experts_offloaded=True)
    assert weight_bytes(offloaded, "bf16") == 25_759_850_496  # 12,879,925,248 active x 2


def test_design_vector_llama3_70b_kv_is_10_gib() -> None:
    # 2 x 80 layers x 8 kv heads x 128 dim x 4096 tokens x 8 sequences x 2 bytes = 10,737,418,240 = 10 GiB
    assert kv_cache_bytes(model("llama3-70b"), seq_len=4096, batch=8, kv_dtype="fp16") == 10_737_418_240 == 10 * GIB


@pytest.mark.parametrize(
    ("tp", "expected"),
    [
        (1, 10_737_418_240),  # all 8 kv heads
        (2, 5_368_709_120),  # 4 heads per GPU: / 2
        (4, 2_684_354_560),  # 2 heads: / 4
        (8, 1_342_177_280),  # 1 head: / 8
        (16, 1_342_177_280),  # 8 heads cannot split 16 ways: each GPU keeps 1 head's worth, as at tp 8
        (3, 4_026_531_840),  # ceil(8 / 3) = 3 heads on the fullest GPU: 10 GiB x 3 / 8
    ],
)
def test_kv_splits_by_kv_heads_and_replicates_below_one_head(tp: int, expected: int) -> None:
    assert kv_cache_bytes(model("llama3-70b"), seq_len=4096, batch=8, kv_dtype="fp16", tp=tp) == expected


def test_sliding_window_caps_the_kv() -> None:
    mistral = model("mistral-7b-v0.1")
    # 2 x 32 layers x 8 heads x 128 x 4096 tokens x 1 x 2 bytes = 536,870,912
    assert kv_cache_bytes(mistral, seq_len=4096, batch=1, kv_dtype="bf16") == 536_870_912
    # beyond the 4096-token window nothing grows
    assert kv_cache_bytes(mistral, seq_len=32768, batch=1, kv_dtype="bf16") == 536_870_912
    # below it the window does not bite: 2 x 32 x 8 x 128 x 2048 x 2 = 268,435,456
    assert kv_cache_bytes(mistral, seq_len=2048, batch=1, kv_dtype="bf16") == 268_435_456


def test_alternating_windows_cap_only_the_local_layers() -> None:
    # gemma2-9b at 8192 tokens: per token per layer 2 x 8 heads x 256 = 4,096 elements.
    # 21 global layers x 8192 tokens + 21 local layers x 4096 tokens = 258,048 layer-tokens;
    # x 4,096 x 2 bytes = 2,113,929,216
    assert kv_cache_bytes(model("gemma2-9b"), seq_len=8192, batch=1, kv_dtype="bf16") == 2_113_929_216


def test_mla_caches_the_latent_once_per_layer_and_replicates_it_under_tp() -> None:
    deepseek = model("deepseek-v3")
    # (kv_lora_rank 512 + qk_rope_head_dim 64) x 61 layers x 4096 tokens x 1 x 2 bytes = 287,834,112
    assert kv_cache_bytes(deepseek, seq_len=4096, batch=1, kv_dtype="bf16") == 287_834_112
    # the latent is not per head: every TP rank holds all of it
    assert kv_cache_bytes(deepseek, seq_len=4096, batch=1, kv_dtype="bf16", tp=8) == 287_834_112
    # as plain MHA with 128 kv heads x 128 dim it would be 2 x 61 x 128 x 128 x 4096 x 2 = 16,374,562,816
    assert kv_cache_bytes(dataclasses.replace(deepseek, mla=None), seq_len=4096, batch=1, kv_dtype="bf16") == (
        16_374_562_816
    )


def test_ssm_state_matches_the_mamba2_formula_and_ignores_sequence_length() -> None:
    mamba = model("mamba2-2.7b")
    # per layer: d_inner 5120 x d_state 128 = 655,360 (SSM state)
    #          + (d_inner 5120 + 2 x 1 group x 128) x (conv 4 - 1) = 16,128 (conv window) = 671,488
    # 64 layers x 671,488 x 2 bytes = 85,950,464 per sequence
    assert ssm_state_bytes(mamba, batch=1, dtype="bf16") == 85_950_464
    assert ssm_state_bytes(mamba, batch=8, dtype="fp32") == 85_950_464 * 8 * 2
    # tp 8: 10 of 80 heads (640 channels) per GPU, the single B/C group replicated:
    # 64 x (640 x 128 + (640 + 256) x 3) x 2 = 64 x 84,608 x 2 = 10,829,824
    assert ssm_state_bytes(mamba, batch=1, dtype="bf16", tp=8) == 10_829_824
    assert kv_cache_bytes(mamba, seq_len=131072, batch=4, kv_dtype="bf16") == 0
    short, long = (
        per_accelerator_share(mamba, tp=1, dtype="bf16", kv_dtype="bf16", context_tokens=ctx, concurrency=4)
        for ctx in (1024, 131072)
    )
    assert short.kv == long.kv == 4 * 85_950_464


def test_hybrid_is_attention_kv_plus_ssm_state() -> None:
    jamba = model("jamba-v0.1")
    # attention: 2 x 4 attention layers x 8 kv heads x 128 x 4096 tokens x 2 bytes = 67,108,864
    assert kv_cache_bytes(jamba, seq_len=4096, batch=1, kv_dtype="bf16") == 67_108_864
    # Mamba-1 state: 28 layers x (8192 x 16 + 8192 x 3) x 2 bytes = 28 x 155,648 x 2 = 8,716,288
    assert ssm_state_bytes(jamba, batch=1, dtype="bf16") == 8_716_288
    share = per_accelerator_share(jamba, tp=1, dtype="bf16", kv_dtype="bf16", context_tokens=4096, concurrency=1)
    assert share.kv == 67_108_864 + 8_716_288


def test_sub_byte_dtypes_round_up_once() -> None:
    # llama3-8b int4 KV of one token: 2 x 32 x 8 x 128 x 0.5 = 32,768 bytes; an odd element count rounds up
    assert kv_cache_bytes(model("llama3-8b"), seq_len=1, batch=1, kv_dtype="int4") == 32_768
    odd = dataclasses.replace(model("llama3-8b"), params=3)
    assert weight_bytes(odd, "fp4") == 2  # 1.5 bytes -> 2


def test_activation_peak_is_the_documented_estimate() -> None:
    # llama3-8b, 8192 tokens, tp 1, bf16: per token 4 x 4096 hidden + max(qkv (32 + 16) x 128 = 6,144,
    # gate+up 2 x 14336 = 28,672) = 45,056 elements; x 8192 x 2 bytes = 738,197,504
    assert activation_peak_bytes(model("llama3-8b"), tokens_in_flight=8192, tp=1, dtype="bf16") == 738_197_504
    # tp 4 shards only the projection: 16,384 + 7,168 = 23,552 x 8192 x 2 = 385,875,968
    assert activation_peak_bytes(model("llama3-8b"), tokens_in_flight=8192, tp=4, dtype="bf16") == 385_875_968
    # MoE: a token visits 8 routed + 1 shared expert of 2048: 2 x 2048 x 9 = 36,864 < qkv (128 + 256) x 128 = 49,152
    # -> 4 x 7168 + 49,152 = 77,824 x 1 token x 2 bytes
    assert activation_peak_bytes(model("deepseek-v3"), tokens_in_flight=1, tp=1, dtype="bf16") == 155_648
    # SSM: in_proj 2 x 5120 + 2 x 128 + 80 = 10,576; + 4 x 2560 = 20,816 x 2 bytes
    assert activation_peak_bytes(model("mamba2-2.7b"), tokens_in_flight=1, tp=1, dtype="bf16") == 41_632


def test_quantised_weights_compute_in_16_bit() -> None:
    assert [compute_dtype(d) for d in ("fp32", "fp16", "bf16", "fp8", "int4")] == ["fp32", "fp16", "bf16"] + [
        "bf16"
    ] * 2


def test_per_accelerator_share_adds_up() -> None:
    # llama3-70b tp 4, bf16, 32 sequences of 8192 tokens
    share = per_accelerator_share(
        model("llama3-70b"), tp=4, dtype="bf16", kv_dtype="bf16", context_tokens=8192, concurrency=32
    )
    assert share.weights == 35_276_853_248  # 141,107,412,992 / 4
    assert share.kv == 21_474_836_480  # 2 x 80 x 2 heads x 128 x 8192 x 32 x 2
    assert share.activation == 8192 * (4 * 8192 + 57344 // 4) * 2 == 771_751_936  # 8192 tokens in flight
    assert share.workspace == DEFAULT_WORKSPACE_BYTES == GIB
    assert share.total == 35_276_853_248 + 21_474_836_480 + 771_751_936 + GIB == 58_597_183_488
    assert fits(share, H100_HBM)


def test_usable_hbm_is_the_ceiling_of_the_datasheet_size() -> None:
    assert usable_hbm(H100_HBM) == 79_027_398_246  # 85,899,345,920 x 0.92 = 79,027,398,246.4, floored
    assert usable_hbm(H100_HBM, 1.0) == H100_HBM
    with pytest.raises(ValueError):
        usable_hbm(H100_HBM, 1.5)


def test_llama3_70b_needs_fp8_to_fit_one_h100() -> None:
    spec = model("llama3-70b")
    fp16 = per_accelerator_share(spec, tp=1, dtype="fp16", kv_dtype="fp16", context_tokens=4096, concurrency=1)
    # weights 141,107,412,992 + KV 2 x 80 x 8 x 128 x 4096 x 2 = 1,342,177,280
    # + activation 4096 tokens x (4 x 8192 + 2 x 28672) x 2 = 738,197,504 + workspace 1,073,741,824
    assert fp16.total == 144_261_529_600
    assert not fits(fp16, H100_HBM)
    assert shortfall_bytes(fp16, H100_HBM) == 144_261_529_600 - 79_027_398_246 == 65_234_131_354
    fp8 = per_accelerator_share(spec, tp=1, dtype="fp8", kv_dtype="fp8", context_tokens=4096, concurrency=1)
    # 70,553,706,496 + 671,088,640 (fp8 KV) + 738,197,504 (bf16 activations) + 1,073,741,824
    assert fp8.total == 73_036_734_464
    assert fits(fp8, H100_HBM) and shortfall_bytes(fp8, H100_HBM) == 0


def test_shortfall_per_gpu_at_tp4() -> None:
    # llama3-405b bf16 on 4 H100s: weights 811,706,777,600 / 4 = 202,926,694,400 alone miss 79 GB by far
    share = per_accelerator_share(
        model("llama3-405b"), tp=4, dtype="bf16", kv_dtype="bf16", context_tokens=8192, concurrency=1
    )
    assert share.weights == 202_926_694_400
    assert shortfall_bytes(share, H100_HBM) == share.total - 79_027_398_246 > 120e9


def test_max_concurrency_is_the_kv_pool_beside_the_weights() -> None:
    # llama3-8b bf16 on one H100, 8192-token sequences:
    # usable 79,027,398,246 - weights 16,060,522,496 - activation 738,197,504 - workspace 1,073,741,824
    # = 61,154,936,422 left; one sequence = 2 x 32 x 8 x 128 x 8192 x 2 = 1,073,741,824 -> 56 (57 would need
    # 61,203,283,968)
    spec = model("llama3-8b")
    n = max_concurrency(spec, tp=1, dtype="bf16", kv_dtype="bf16", context_tokens=8192, hbm_bytes=H100_HBM)
    assert n == 56
    # nothing fits when the weights do not: llama3-70b bf16 on one H100
    assert (
        max_concurrency(
            model("llama3-70b"), tp=1, dtype="bf16", kv_dtype="bf16", context_tokens=8192, hbm_bytes=H100_HBM
        )
        == 0
    )


@pytest.mark.parametrize("bad", [{"tp": 0}, {"concurrency": -1}, {"context_tokens": -5}])
def test_nonsense_arguments_are_value_errors(bad: dict[str, int]) -> None:
    arguments = {"tp": 1, "context_tokens": 10, "concurrency": 1} | bad
    with pytest.raises(ValueError):
        per_accelerator_share(
            model("llama3-8b"),
            dtype="bf16",
            kv_dtype="bf16",
            tp=arguments["tp"],
            context_tokens=arguments["context_tokens"],
            concurrency=arguments["concurrency"],
        )


# --- properties ------------------------------------------------------------------------------------------

models_st = st.sampled_from(MODEL_NAMES).map(model)
dtypes_st = st.sampled_from(["fp32", "bf16", "fp8", "int4"])


@settings(max_examples=200, deadline=None)
@given(models_st, st.integers(0, 300_000), st.integers(0, 300_000), st.integers(0, 64), st.integers(0, 64), dtypes_st)
def test_kv_is_monotone_in_sequence_length_and_batch(
    spec: ModelSpec, seq_a: int, seq_b: int, batch_a: int, batch_b: int, kv_dtype: str
) -> None:
    seq_lo, seq_hi = sorted((seq_a, seq_b))
    batch_lo, batch_hi = sorted((batch_a, batch_b))
    low = kv_cache_bytes(spec, seq_len=seq_lo, batch=batch_lo, kv_dtype=kv_dtype)
    assert low <= kv_cache_bytes(spec, seq_len=seq_hi, batch=batch_lo, kv_dtype=kv_dtype)
    assert low <= kv_cache_bytes(spec, seq_len=seq_lo, batch=batch_hi, kv_dtype=kv_dtype)


@settings(max_examples=200, deadline=None)
@given(models_st, st.integers(1, 32), st.integers(1, 32), dtypes_st, st.integers(1, 65536), st.integers(0, 64))
def test_per_gpu_share_never_grows_with_tp(
    spec: ModelSpec, tp_a: int, tp_b: int, dtype: str, context: int, concurrency: int
) -> None:
    tp_lo, tp_hi = sorted((tp_a, tp_b))
    small, large = (
        per_accelerator_share(spec, tp=tp, dtype=dtype, kv_dtype=dtype, context_tokens=context, concurrency=concurrency)
        for tp in (tp_lo, tp_hi)
    )
    assert large.weights <= small.weights
    assert large.kv <= small.kv and large.activation <= small.activation and large.total <= small.total


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from([name for name in MODEL_NAMES if model(name).ssm is not None]).map(model),
    st.integers(1, 1_000_000),
    st.integers(1, 1_000_000),
    st.integers(1, 16),
    st.integers(0, 32),
)
def test_ssm_state_does_not_depend_on_sequence_length(
    spec: ModelSpec, seq_a: int, seq_b: int, tp: int, batch: int
) -> None:
    shares = [
        per_accelerator_share(spec, tp=tp, dtype="bf16", kv_dtype="bf16", context_tokens=seq, concurrency=batch)
        for seq in (seq_a, seq_b)
    ]
    attention = [kv_cache_bytes(spec, seq_len=seq, batch=batch, kv_dtype="bf16", tp=tp) for seq in (seq_a, seq_b)]
    state = ssm_state_bytes(spec, batch=batch, dtype="bf16", tp=tp)
    assert [s.kv - a for s, a in zip(shares, attention, strict=True)] == [state, state]


@settings(max_examples=50, deadline=None)
@given(
    models_st,
    st.sampled_from([1, 2, 4, 8]),
    st.sampled_from([H100_HBM, H200_HBM]),
    st.integers(1, 262_144),
)
def test_max_concurrency_is_exactly_the_last_fitting_pool(spec: ModelSpec, tp: int, hbm: int, context: int) -> None:
    def share(n: int) -> MemoryShare:
        return per_accelerator_share(
            spec, tp=tp, dtype=spec.dtype, kv_dtype=spec.kv_dtype, context_tokens=context, concurrency=n
        )

    n = max_concurrency(spec, tp=tp, dtype=spec.dtype, kv_dtype=spec.kv_dtype, context_tokens=context, hbm_bytes=hbm)
    assert not fits(share(n + 1), hbm)
    assert n == 0 or fits(share(n), hbm)
