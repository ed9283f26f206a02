"""The model catalog: every shipped entry parses, matches its cited config, and bad entries name the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from shared.domain.hardware import CatalogError
from shared.domain.models import (
    Architecture,
    Attention,
    ModelSpec,
    merge_model_catalogs,
    parse_model,
    parse_model_catalog,
)

CATALOG = Path(__file__).resolve().parents[3] / "shared" / "catalog" / "models.yaml"


def catalog() -> dict[str, ModelSpec]:
    return parse_model_catalog(yaml.safe_load(CATALOG.read_text()))


def entry(**overrides: Any) -> dict[str, Any]:
    """A valid dense transformer entry (llama3-8b's shapes) with ``overrides`` applied; None deletes a key."""
    base: dict[str, Any] = {
        "architecture": "transformer",
        "params": 8_030_261_248,
        "layers": 32,
        "hidden": 4096,
        "heads": 32,
        "kv_heads": 8,
        "head_dim": 128,
        "intermediate": 14336,
        "vocab": 128256,
        "dtype": "bf16",
        "kv_dtype": "bf16",
        "max_context": 8192,
        "backends": ["gpu"],
        "source": "test",
    }
    base.update(overrides)
    return {key: value for key, value in base.items() if value is not None}


def test_every_shipped_model_parses_and_cites_a_source() -> None:
    models = catalog()
    api_names = {
        "llama3-8b",
        "llama3-70b",
        "llama3-405b",
        "mixtral-8x7b",
        "mixtral-8x22b",
        "deepseek-v3",
        "mamba2-2.7b",
    }
    assert api_names <= set(models)
    assert {spec.architecture for spec in models.values()} == set(Architecture)
    for name, spec in models.items():
        assert spec.name == name
        assert "config.json" in spec.source, name
        assert spec.active_params <= spec.params


def test_backends_mark_tpu_artifacts_and_models_without_them() -> None:
    models = catalog()
    for name in ("llama3-8b", "llama3-70b", "gemma2-9b", "gemma2-27b"):
        assert models[name].supports("tpu") and models[name].supports("gpu"), name
    without_tpu = {name for name, spec in models.items() if not spec.supports("tpu")}
    assert {"llama3-405b", "deepseek-v3", "mamba2-2.7b", "jamba-v0.1"} <= without_tpu


@pytest.mark.parametrize(
    ("model", "figures"),
    [
        # meta-llama/Meta-Llama-3-8B config.json
        ("llama3-8b", {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8, "head_dim": 128, "max_context": 8192}),
        # meta-llama/Meta-Llama-3-70B config.json
        ("llama3-70b", {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8, "intermediate": 28672}),
        # meta-llama/Llama-3.1-405B config.json: 3.1's 131072-token context
        ("llama3-405b", {"layers": 126, "hidden": 16384, "heads": 128, "kv_heads": 8, "max_context": 131072}),
        ("llama3.1-70b", {"layers": 80, "kv_heads": 8, "max_context": 131072}),
        # mistralai/Mistral-7B-v0.1: sliding window 4096 on every layer
        ("mistral-7b-v0.1", {"sliding_window": 4096, "sliding_window_layers": 32, "max_context": 32768}),
        # google/gemma-2-9b: local/global alternate, head_dim 256
        ("gemma2-9b", {"layers": 42, "head_dim": 256, "sliding_window": 4096, "sliding_window_layers": 21}),
        # mistralai/Mixtral-8x7B-v0.1: 8 experts, top-2, no sliding window in v0.1
        ("mixtral-8x7b", {"experts": 8, "experts_per_token": 2, "sliding_window": None, "max_context": 32768}),
        ("mixtral-8x22b", {"layers": 56, "hidden": 6144, "heads": 48, "experts": 8, "max_context": 65536}),
        # deepseek-ai/DeepSeek-V3: 256 routed + 1 shared, 8 active, MLA
        ("deepseek-v3", {"layers": 61, "hidden": 7168, "experts": 256, "shared_experts": 1, "experts_per_token": 8}),
        # state-spaces/mamba2-2.7b: no attention at all
        ("mamba2-2.7b", {"layers": 64, "hidden": 2560, "attention_layers": 0, "heads": 0}),
        # ai21labs/Jamba-v0.1: 1 attention layer in 8, MoE 16 experts top-2
        ("jamba-v0.1", {"layers": 32, "attention_layers": 4, "experts": 16, "experts_per_token": 2}),
    ],
)
def test_key_figures_match_the_cited_configs(model: str, figures: dict[str, Any]) -> None:
    spec = catalog()[model]
    assert {key: getattr(spec, key) for key in figures} == figures


def test_published_parameter_totals() -> None:
    models = catalog()
    # (model, published total, published active), in billions, as the model cards round them
    published = [
        ("llama3-70b", 70.6, 70.6),
        ("mixtral-8x7b", 46.7, 12.9),
        ("mixtral-8x22b", 140.6, 39.2),
        ("deepseek-v3", 671.0, 37.6),  # paper: 671B / 37B
        ("mamba2-2.7b", 2.7, 2.7),
        ("jamba-v0.1", 51.6, 12.1),  # card: 52B / 12B
    ]
    for name, total, active in published:
        assert round(models[name].params / 1e9, 1) == total, name
        assert round(models[name].active_params / 1e9, 1) == active, name


def _dense_params(spec: ModelSpec, *, tied: bool, norms_per_layer: int) -> int:
    """A llama/gemma decoder's tensor shapes: q, k, v, o + gated MLP + norms, embedding (+ head), final norm."""
    attention = 2 * spec.hidden * spec.heads * spec.head_dim + 2 * spec.hidden * spec.kv_heads * spec.head_dim
    mlp = 3 * spec.hidden * spec.intermediate * max(1, spec.experts)
    router = spec.hidden * spec.experts
    per_layer = attention + mlp + router + norms_per_layer * spec.hidden
    return spec.layers * per_layer + (1 if tied else 2) * spec.vocab * spec.hidden + spec.hidden


@pytest.mark.parametrize(
    ("model", "tied", "norms"),
    [
        ("llama3-8b", False, 2),
        ("llama3-70b", False, 2),
        ("llama3-405b", False, 2),
        ("mistral-7b-v0.1", False, 2),
        ("gemma2-9b", True, 4),
        ("gemma2-27b", True, 4),
        ("mixtral-8x7b", False, 2),
        ("mixtral-8x22b", False, 2),
    ],
)
def test_params_follow_from_the_architecture_numbers(model: str, tied: bool, norms: int) -> None:
    # Recomputing the count from layers/hidden/heads/... catches a mistyped shape as well as a mistyped total.
    spec = catalog()[model]
    assert spec.params == _dense_params(spec, tied=tied, norms_per_layer=norms)


def test_deepseek_uses_latent_attention_and_mamba_has_ssm_dims() -> None:
    models = catalog()
    deepseek = models["deepseek-v3"]
    assert deepseek.attention is Attention.MLA and deepseek.mla is not None
    assert (deepseek.mla.kv_lora_rank, deepseek.mla.qk_rope_head_dim) == (512, 64)
    mamba = models["mamba2-2.7b"].ssm
    assert mamba is not None
    # d_inner = expand 2 x d_model 2560; 80 heads of headdim 64
    assert (mamba.d_inner, mamba.d_state, mamba.conv_kernel, mamba.n_groups, mamba.heads) == (5120, 128, 4, 1, 80)
    assert mamba.head_dim == 64
    jamba = models["jamba-v0.1"]
    assert jamba.ssm is not None and jamba.ssm.n_groups == 0 and jamba.ssm_layers == 28


def test_defaults_fill_in_what_a_dense_entry_leaves_out() -> None:
    spec = parse_model("m", entry())
    assert spec.attention_layers == 32 and spec.active_params == spec.params
    assert spec.attention is Attention.GQA and spec.sliding_window is None and spec.sliding_window_layers == 0
    assert spec.backends == frozenset({"gpu"}) and not spec.is_moe and spec.ssm_layers == 0
    assert parse_model("m", entry(sliding_window=4096)).sliding_window_layers == 32


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"kv_heads": 0}, r"^models\.m\.kv_heads: expected a positive integer"),
        ({"kv_heads": 7}, r"^models\.m\.kv_heads: expected a divisor of heads \(32\), got 7"),
        ({"kv_heads": True}, r"^models\.m\.kv_heads: expected a positive integer"),
        ({"layers": 2.5}, r"^models\.m\.layers: expected a positive integer"),
        ({"hidden": None}, r"^models\.m\.hidden: expected a positive integer, got None"),
        ({"architecture": "rnn"}, r"^models\.m\.architecture: expected one of hybrid, moe, ssm, transformer"),
        ({"backends": ["gpu", "npu"]}, r"^models\.m\.backends: expected a subset of gpu, tpu, got unknown npu"),
        ({"backends": []}, r"^models\.m\.backends: expected a non-empty list"),
        ({"dtype": "fp6"}, r"^models\.m\.dtype: expected one of"),
        ({"kv_dtype": None}, r"^models\.m\.kv_dtype: expected one of"),
        ({"kv_head": 8}, r"^models\.m\.kv_head: unknown field"),
        ({"attention_layers": 30}, r"^models\.m\.attention_layers: expected layers \(32\)"),
        ({"experts": 8, "experts_per_token": 2}, r"^models\.m\.experts: transformer models have no experts"),
        ({"architecture": "moe"}, r"^models\.m\.experts: expected at least 2 for moe"),
        (
            {"architecture": "moe", "experts": 8, "experts_per_token": 9},
            r"^models\.m\.experts_per_token: expected 1\.\.8",
        ),
        ({"architecture": "moe", "experts": 8, "experts_per_token": 2}, r"^models\.m\.active_params: expected"),
        ({"active_params": 9_000_000_000}, r"^models\.m\.active_params: expected at most params"),
        ({"architecture": "ssm"}, r"^models\.m\.ssm: required for architecture ssm"),
        ({"attention": "mla"}, r"^models\.m\.mla: required with attention mla"),
        ({"mla": {"kv_lora_rank": 512, "qk_rope_head_dim": 64}}, r"^models\.m\.mla: required with attention mla"),
        ({"sliding_window": 0}, r"^models\.m\.sliding_window: expected a positive integer"),
        ({"sliding_window": 4096, "sliding_window_layers": 33}, r"^models\.m\.sliding_window_layers: expected at most"),
        ({"sliding_window_layers": 3}, r"^models\.m\.sliding_window_layers: given without sliding_window"),
        ({"experts_offloaded": True}, r"^models\.m\.experts_offloaded: expected a boolean, true only with experts"),
        ({"source": 3}, r"^models\.m\.source: expected a string"),
        ({"checkpoints": ["org/m-awq"]}, r"^models\.m\.checkpoints: expected a mapping of weights dtype"),
        ({"checkpoints": {"int3": "org/m"}}, r"^models\.m\.checkpoints\.int3: expected a dtype among"),
        ({"checkpoints": {"int4": "m-awq"}}, r"^models\.m\.checkpoints\.int4: expected a Hugging Face repo id"),
        ({"checkpoints": {"int4": None}}, r"^models\.m\.checkpoints\.int4: expected a Hugging Face repo id"),
    ],
)
def test_bad_entries_name_the_field(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(CatalogError, match=message):
        parse_model_catalog({"models": {"m": entry(**overrides)}})


SSM = {"d_inner": 5120, "d_state": 128, "conv_kernel": 4, "n_groups": 1, "heads": 80}
SSM_ENTRY = {"architecture": "ssm", "heads": None, "kv_heads": None, "head_dim": None, "intermediate": 0}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({**SSM_ENTRY, "ssm": {**SSM, "heads": 3}}, r"^models\.m\.ssm\.heads: expected a divisor of d_inner"),
        ({**SSM_ENTRY, "ssm": {**SSM, "d_state": -1}}, r"^models\.m\.ssm\.d_state: expected a positive integer"),
        ({**SSM_ENTRY, "ssm": {**SSM, "state": 1}}, r"^models\.m\.ssm\.state: unknown field"),
        ({**SSM_ENTRY, "ssm": SSM, "attention_layers": 2}, r"^models\.m\.attention_layers: a pure ssm model has none"),
        ({"ssm": SSM}, r"^models\.m\.ssm: only ssm and hybrid"),
        ({"architecture": "hybrid", "ssm": SSM}, r"^models\.m\.attention_layers: expected a positive integer"),
        ({"architecture": "hybrid", "ssm": SSM, "attention_layers": 32}, r"^models\.m\.attention_layers: a hybrid"),
    ],
)
def test_bad_ssm_and_hybrid_entries_name_the_field(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(CatalogError, match=message):
        parse_model_catalog({"models": {"m": entry(**overrides)}})


def test_a_pure_ssm_entry_needs_no_attention_numbers() -> None:
    spec = parse_model("m", entry(**SSM_ENTRY, ssm=SSM))
    assert (spec.heads, spec.kv_heads, spec.head_dim, spec.attention_layers, spec.ssm_layers) == (0, 0, 0, 0, 32)


@pytest.mark.parametrize("document", [{}, {"models": []}, {"models": {"m": [1, 2]}}, []])
def test_malformed_documents_are_catalog_errors(document: Any) -> None:
    with pytest.raises(CatalogError):
        parse_model_catalog(document)


def test_a_user_catalog_adds_and_replaces_models_whole() -> None:
    base = catalog()
    mine = parse_model_catalog({"models": {"llama3-8b": entry(max_context=4096), "my-model": entry()}})
    merged = merge_model_catalogs(base, mine)
    assert merged["llama3-8b"].max_context == 4096 and "my-model" in merged and "deepseek-v3" in merged
    assert base["llama3-8b"].max_context == 8192


def test_checkpoints_name_a_checkpoint_per_weights_dtype() -> None:
    spec = parse_model_catalog({"models": {"m": entry(checkpoints={"fp8": "org/m-FP8", "int4": "/models/m-awq"})}})["m"]
    assert spec.checkpoints == (("fp8", "org/m-FP8"), ("int4", "/models/m-awq"))
    assert spec.checkpoint_for("int4") == "/models/m-awq" and spec.checkpoint_for("fp4") is None
    assert parse_model_catalog({"models": {"m": entry()}})["m"].checkpoints == ()
    shipped = catalog()
    assert shipped["llama3.1-8b"].checkpoint_for("int4") == "UCLA-EMC/Meta-Llama-3.1-8B-AWQ-INT4"
    assert shipped["llama3-70b"].checkpoint_for("int4") is None  # none verified for the base model
