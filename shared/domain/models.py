"""Model specs: the architecture numbers the memory model and placement reason with (DESIGN §2).

A catalog document (``shared/catalog/models.yaml`` or a user's file) is parsed here, purely; reading
the file is the caller's job.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from shared.domain.dtypes import DTYPE_BYTES
from shared.domain.hardware import CatalogError

BACKENDS: frozenset[str] = frozenset({"gpu", "tpu"})


class Architecture(StrEnum):
    TRANSFORMER = "transformer"
    MOE = "moe"
    SSM = "ssm"
    HYBRID = "hybrid"


class Attention(StrEnum):
    """How attention layers cache keys and values.

    ``gqa`` covers multi-head (kv_heads == heads), grouped-query and multi-query (kv_heads == 1) attention:
    every layer caches a key and a value per kv head. ``mla`` (DeepSeek multi-head latent attention) caches
    one compressed latent plus a decoupled RoPE key per token and layer, shared by all heads.
    """

    GQA = "gqa"
    MLA = "mla"


@dataclass(frozen=True, slots=True)
class MlaSpec:
    """The per-token latent a multi-head latent attention layer caches: ``kv_lora_rank + qk_rope_head_dim``."""

    kv_lora_rank: int
    qk_rope_head_dim: int


@dataclass(frozen=True, slots=True)
class SsmSpec:
    """Recurrent state dimensions of one Mamba layer.

    Mamba-2: ``heads`` = d_inner / headdim SSM heads, ``n_groups`` groups of B and C projections.
    Mamba-1 has neither: write ``n_groups: 0`` and ``heads = d_inner`` (every channel is its own head of
    width 1), which makes the same formulas exact for it.
    """

    d_inner: int
    d_state: int
    conv_kernel: int
    n_groups: int
    heads: int

    @property
    def head_dim(self) -> int:
        return self.d_inner // self.heads


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """One servable model. Counts are the published configuration's; ``params`` counts every expert.

    ``intermediate`` is the MLP width of one dense MLP or, for MoE, of one expert. ``attention_layers`` is
    the number of layers with attention (all of them unless hybrid; none for a pure SSM); the others are
    SSM layers. ``sliding_window_layers`` of the attention layers attend to at most ``sliding_window``
    tokens. ``experts_offloaded`` means only the active experts' worth of weights stay resident.
    """

    name: str
    architecture: Architecture
    params: int
    active_params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    attention_layers: int
    attention: Attention
    mla: MlaSpec | None
    sliding_window: int | None
    sliding_window_layers: int
    ssm: SsmSpec | None
    experts: int
    experts_per_token: int
    shared_experts: int
    experts_offloaded: bool
    dtype: str
    kv_dtype: str
    max_context: int
    backends: frozenset[str]
    source: str
    checkpoints: tuple[tuple[str, str], ...] = ()
    """(weights dtype, checkpoint) pairs: the pre-quantised (or other-dtype) checkpoint the engines load
    for a placement in that dtype; the catalog's ``checkpoints`` mapping, in its order."""

    @property
    def ssm_layers(self) -> int:
        return self.layers - self.attention_layers if self.ssm is not None else 0

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def supports(self, backend: str) -> bool:
        """Whether a built artifact exists for ``backend`` (``gpu`` / ``tpu``)."""
        return backend in self.backends

    def checkpoint_for(self, dtype: str) -> str | None:
        """The checkpoint the catalog lists for weights in ``dtype``, or None."""
        return dict(self.checkpoints).get(dtype)


_FIELDS = frozenset(
    {
        "architecture",
        "params",
        "active_params",
        "layers",
        "hidden",
        "heads",
        "kv_heads",
        "head_dim",
        "intermediate",
        "vocab",
        "attention_layers",
        "attention",
        "mla",
        "sliding_window",
        "sliding_window_layers",
        "ssm",
        "experts",
        "experts_per_token",
        "shared_experts",
        "experts_offloaded",
        "dtype",
        "kv_dtype",
        "max_context",
        "backends",
        "source",
        "checkpoints",
    }
)
_SSM_FIELDS = frozenset({"d_inner", "d_state", "conv_kernel", "n_groups", "heads"})
_MLA_FIELDS = frozenset({"kv_lora_rank", "qk_rope_head_dim"})


def _int(entry: Mapping[str, Any], key: str, where: str, *, minimum: int = 1, default: int | None = None) -> int:
    value = entry.get(key)
    if value is None and default is not None:
        return default
    # YAML reads 70.6e+9 as a float; an integral float is still a count.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum >= 1 else "a non-negative integer"
        raise CatalogError(f"{where}.{key}: expected {kind}, got {value!r}")
    return value


def _choice(entry: Mapping[str, Any], key: str, where: str, allowed: frozenset[str], default: str | None = None) -> str:
    value = entry.get(key, default)
    if not isinstance(value, str) or value not in allowed:
        raise CatalogError(f"{where}.{key}: expected one of {', '.join(sorted(allowed))}, got {value!r}")
    return value


def _mapping(value: Any, where: str, fields: frozenset[str]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise CatalogError(f"{where}: expected a mapping")
    for key in value:
        if key not in fields:
            raise CatalogError(f"{where}.{key}: unknown field")
    return value


def _parse_ssm(value: Any, where: str) -> SsmSpec:
    entry = _mapping(value, where, _SSM_FIELDS)
    d_inner = _int(entry, "d_inner", where)
    heads = _int(entry, "heads", where, default=d_inner)
    if d_inner % heads:
        raise CatalogError(f"{where}.heads: expected a divisor of d_inner ({d_inner}), got {heads}")
    return SsmSpec(
        d_inner=d_inner,
        d_state=_int(entry, "d_state", where),
        conv_kernel=_int(entry, "conv_kernel", where),
        n_groups=_int(entry, "n_groups", where, minimum=0),
        heads=heads,
    )


def _parse_mla(value: Any, where: str) -> MlaSpec:
    entry = _mapping(value, where, _MLA_FIELDS)
    return MlaSpec(
        kv_lora_rank=_int(entry, "kv_lora_rank", where),
        qk_rope_head_dim=_int(entry, "qk_rope_head_dim", where),
    )


# A Hugging Face repo id ("org/name") or an absolute local path: what both engines take as the model.
_CHECKPOINT = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+|/\S+")


def _checkpoints(entry: Mapping[str, Any], where: str) -> tuple[tuple[str, str], ...]:
    """``checkpoints``: weights dtype -> checkpoint (a Hugging Face repo id or an absolute path)."""
    value = entry.get("checkpoints")
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise CatalogError(f"{where}.checkpoints: expected a mapping of weights dtype to checkpoint")
    pairs: list[tuple[str, str]] = []
    for dtype, checkpoint in value.items():
        if dtype not in DTYPE_BYTES:
            raise CatalogError(f"{where}.checkpoints.{dtype}: expected a dtype among {', '.join(sorted(DTYPE_BYTES))}")
        if not isinstance(checkpoint, str) or not _CHECKPOINT.fullmatch(checkpoint):
            raise CatalogError(
                f"{where}.checkpoints.{dtype}: expected a Hugging Face repo id (org/name) or an absolute path, "
                f"got {checkpoint!r}"
            )
        pairs.append((dtype, checkpoint))
    return tuple(pairs)


def _backends(entry: Mapping[str, Any], where: str) -> frozenset[str]:
    value = entry.get("backends")
    if not isinstance(value, list | tuple) or not value or not all(isinstance(b, str) for b in value):
        raise CatalogError(f"{where}.backends: expected a non-empty list drawn from gpu, tpu, got {value!r}")
    unknown = sorted(set(value) - BACKENDS)
    if unknown:
        raise CatalogError(f"{where}.backends: expected a subset of gpu, tpu, got unknown {', '.join(unknown)}")
    return frozenset(value)


def parse_model(name: str, entry: Any, *, where: str | None = None) -> ModelSpec:
    """One model from its catalog entry; raises CatalogError naming the offending field."""
    where = where or f"models.{name}"
    entry = _mapping(entry, where, _FIELDS)
    architecture = Architecture(_choice(entry, "architecture", where, frozenset(Architecture)))
    layers = _int(entry, "layers", where)

    ssm = _parse_ssm(entry["ssm"], f"{where}.ssm") if entry.get("ssm") is not None else None
    has_ssm = architecture in (Architecture.SSM, Architecture.HYBRID)
    if has_ssm and ssm is None:
        raise CatalogError(f"{where}.ssm: required for architecture {architecture}")
    if not has_ssm and ssm is not None:
        raise CatalogError(f"{where}.ssm: only ssm and hybrid architectures have SSM layers")

    if architecture is Architecture.SSM:
        attention_layers = _int(entry, "attention_layers", where, minimum=0, default=0)
        if attention_layers:
            raise CatalogError(f"{where}.attention_layers: a pure ssm model has none, got {attention_layers}")
    elif architecture is Architecture.HYBRID:
        attention_layers = _int(entry, "attention_layers", where)
        if attention_layers >= layers:
            raise CatalogError(f"{where}.attention_layers: a hybrid needs fewer than layers ({layers})")
    else:
        attention_layers = _int(entry, "attention_layers", where, default=layers)
        if attention_layers != layers:
            raise CatalogError(f"{where}.attention_layers: expected layers ({layers}) for {architecture}")

    # A model without attention layers has no heads to speak of; 0 then means "none".
    has_attention = attention_layers > 0
    head_minimum = 1 if has_attention else 0
    heads = _int(entry, "heads", where, minimum=head_minimum, default=None if has_attention else 0)
    kv_heads = _int(entry, "kv_heads", where, minimum=head_minimum, default=None if has_attention else 0)
    head_dim = _int(entry, "head_dim", where, minimum=head_minimum, default=None if has_attention else 0)
    if has_attention and heads % kv_heads:
        raise CatalogError(f"{where}.kv_heads: expected a divisor of heads ({heads}), got {kv_heads}")

    attention = Attention(_choice(entry, "attention", where, frozenset(Attention), default=Attention.GQA))
    mla = _parse_mla(entry["mla"], f"{where}.mla") if entry.get("mla") is not None else None
    if (attention is Attention.MLA) != (mla is not None):
        raise CatalogError(f"{where}.mla: required with attention mla and only with it")

    sliding_window: int | None = None
    sliding_window_layers = 0
    if entry.get("sliding_window") is not None:
        sliding_window = _int(entry, "sliding_window", where)
        sliding_window_layers = _int(entry, "sliding_window_layers", where, default=attention_layers)
        if sliding_window_layers > attention_layers:
            raise CatalogError(
                f"{where}.sliding_window_layers: expected at most attention_layers ({attention_layers}), "
                f"got {sliding_window_layers}"
            )
    elif entry.get("sliding_window_layers"):
        raise CatalogError(f"{where}.sliding_window_layers: given without sliding_window")

    experts = _int(entry, "experts", where, minimum=0, default=0)
    experts_per_token = _int(entry, "experts_per_token", where, minimum=0, default=0)
    shared_experts = _int(entry, "shared_experts", where, minimum=0, default=0)
    if architecture is Architecture.MOE and experts < 2:
        raise CatalogError(f"{where}.experts: expected at least 2 for moe, got {experts}")
    if architecture in (Architecture.TRANSFORMER, Architecture.SSM) and experts:
        raise CatalogError(f"{where}.experts: {architecture} models have no experts; use moe or hybrid")
    if experts and not 1 <= experts_per_token <= experts:
        raise CatalogError(f"{where}.experts_per_token: expected 1..{experts}, got {experts_per_token}")
    if not experts and (experts_per_token or shared_experts):
        raise CatalogError(f"{where}.experts: experts_per_token / shared_experts given without experts")
    offloaded = entry.get("experts_offloaded", False)
    if not isinstance(offloaded, bool) or (offloaded and not experts):
        raise CatalogError(f"{where}.experts_offloaded: expected a boolean, true only with experts")

    params = _int(entry, "params", where)
    active_params = _int(entry, "active_params", where, default=None if experts else params)
    if active_params > params:
        raise CatalogError(f"{where}.active_params: expected at most params ({params}), got {active_params}")

    intermediate = _int(entry, "intermediate", where, minimum=0 if architecture is Architecture.SSM else 1)
    source = entry.get("source", "")
    if not isinstance(source, str):
        raise CatalogError(f"{where}.source: expected a string")

    return ModelSpec(
        name=name,
        architecture=architecture,
        params=params,
        active_params=active_params,
        layers=layers,
        hidden=_int(entry, "hidden", where),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=intermediate,
        vocab=_int(entry, "vocab", where),
        attention_layers=attention_layers,
        attention=attention,
        mla=mla,
        sliding_window=sliding_window,
        sliding_window_layers=sliding_window_layers,
        ssm=ssm,
        experts=experts,
        experts_per_token=experts_per_token,
        shared_experts=shared_experts,
        experts_offloaded=offloaded,
        dtype=_choice(entry, "dtype", where, frozenset(DTYPE_BYTES)),
        kv_dtype=_choice(entry, "kv_dtype", where, frozenset(DTYPE_BYTES)),
        max_context=_int(entry, "max_context", where),
        backends=_backends(entry, where),
        source=source,
        checkpoints=_checkpoints(entry, where),
    )


def parse_model_catalog(data: Mapping[str, Any]) -> dict[str, ModelSpec]:
    """Models from a catalog document (``{"models": {NAME: {...}}}``); raises CatalogError naming the field."""
    if not isinstance(data, Mapping):
        raise CatalogError("catalog: expected a mapping at the top level")
    entries = data.get("models")
    if not isinstance(entries, Mapping):
        raise CatalogError("catalog: expected a mapping under `models`")
    models: dict[str, ModelSpec] = {}
    for name, entry in entries.items():
        if not isinstance(name, str) or not name:
            raise CatalogError(f"models.{name!r}: expected a non-empty name")
        models[name] = parse_model(name, entry)
    return models


def merge_model_catalogs(base: Mapping[str, ModelSpec], override: Mapping[str, ModelSpec]) -> dict[str, ModelSpec]:
    """A user's catalog adds models and replaces same-named ones whole."""
    return {**base, **override}
