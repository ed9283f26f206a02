"""engine_of follows the architecture; request_kv_bytes is the memory model's cache for one sequence."""

from __future__ import annotations

import pytest

from shared.domain.admission import Engine, engine_of, request_kv_bytes
from tests.unit.domain.admission.builders import models, replica


@pytest.mark.parametrize(
    ("model", "engine"),
    [
        ("llama3.1-8b", Engine.TRANSFORMER),
        ("llama3-70b", Engine.TRANSFORMER),
        ("mixtral-8x7b", Engine.MOE),
        ("deepseek-v3", Engine.MOE),
        ("mamba2-2.7b", Engine.SSM),
        ("jamba-v0.1", Engine.HYBRID),  # experts too, but its Mamba layers make it hybrid
    ],
)
def test_engine_of(model: str, engine: Engine) -> None:
    assert engine_of(models()[model]) is engine


def test_every_catalog_model_has_an_engine() -> None:
    assert {engine_of(spec) for spec in models().values()} == set(Engine)


@pytest.mark.parametrize(
    ("model", "input_tokens", "output_tokens", "tp", "expected"),
    [
        # llama3.1-8b: 2 (K,V) x 8 kv heads x 128 x 32 layers x 2 bytes = 128 KiB a token; 1024 tokens = 128 MiB
        ("llama3.1-8b", 1000, 24, 1, 1024 * 131_072),
        # tp=2: 4 kv heads a rank, half of it
        ("llama3.1-8b", 1000, 24, 2, 1024 * 65_536),
        # mamba2-2.7b: 64 layers x (5120 x 128 + (5120 + 2 x 1 x 128) x 3) x 2 bytes, whatever the length
        ("mamba2-2.7b", 1000, 24, 1, 64 * (5120 * 128 + 5376 * 3) * 2),
        ("mamba2-2.7b", 100_000, 24, 1, 64 * (5120 * 128 + 5376 * 3) * 2),
        # jamba-v0.1: 4 attention layers (2 x 8 x 128 x 4 x 2 = 16 KiB a token) + 28 Mamba-1 layers
        # (8192 x 16 + 8192 x 3) x 2 bytes
        ("jamba-v0.1", 1000, 24, 1, 1024 * 16_384 + 28 * (8192 * 16 + 8192 * 3) * 2),
        # mixtral-8x7b: 32 layers, 8 kv heads x 128 like llama: 128 KiB a token
        ("mixtral-8x7b", 2000, 48, 1, 2048 * 131_072),
    ],
)
def test_request_kv_bytes(model: str, input_tokens: int, output_tokens: int, tp: int, expected: int) -> None:
    spec = models()[model]
    assert request_kv_bytes(spec, input_tokens=input_tokens, output_tokens=output_tokens, tp=tp) == expected


def test_ssm_state_is_kept_in_the_compute_dtype_of_quantised_weights() -> None:
    from dataclasses import replace

    bf16 = models()["mamba2-2.7b"]
    fp8 = replace(bf16, dtype="fp8")  # fp8 weights still compute (and keep state) in bf16
    assert request_kv_bytes(fp8, input_tokens=10, output_tokens=0, tp=1) == request_kv_bytes(
        bf16, input_tokens=10, output_tokens=0, tp=1
    )


def test_negative_tokens_are_refused() -> None:
    with pytest.raises(ValueError, match="input_tokens"):
        request_kv_bytes(models()["llama3.1-8b"], input_tokens=-1, output_tokens=0, tp=1)


def test_replica_status_validates_and_reports_kv_use() -> None:
    r = replica("r", kv_used_gib=30, held_gib=4, kv_total_gib=40)
    assert r.kv_use == pytest.approx(34 / 40)
    assert r.kv_free_bytes == 6 * 1024**3
    assert replica("r", kv_total_gib=0).kv_use == 1.0
    with pytest.raises(ValueError, match="tp"):
        replica("r", tp=0)
    with pytest.raises(ValueError, match="held_bytes"):
        replica("r", held_bytes=-1)
