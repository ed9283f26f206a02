"""Small builders for admission's rule tests: the shipped catalog, replicas, asks."""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from shared.domain.admission import AdmitAsk, Engine, ReplicaStatus, engine_of
from shared.domain.models import ModelSpec, parse_model_catalog

CATALOG = Path(__file__).resolve().parents[4] / "shared" / "catalog"
GIB = 1024**3
NOW_MS = 1_000_000.0


@cache
def models() -> dict[str, ModelSpec]:
    return parse_model_catalog(yaml.safe_load((CATALOG / "models.yaml").read_text()))


def groups_doc() -> Any:
    return yaml.safe_load((CATALOG / "model_groups.yaml").read_text())


# One model per engine, each with a max_context of at least 32K.
MODEL_OF = {
    Engine.TRANSFORMER: "llama3.1-8b",
    Engine.SSM: "mamba2-2.7b",
    Engine.MOE: "mixtral-8x7b",
    Engine.HYBRID: "jamba-v0.1",
}


def replica(
    replica_id: str,
    engine: Engine = Engine.TRANSFORMER,
    *,
    model: str | None = None,
    p50_ms: float = 50.0,
    queue: int = 0,
    kv_used_gib: float = 0,
    kv_total_gib: float = 40,
    held_gib: float = 0,
    age_ms: float | None = 1000.0,
    healthy: bool = True,
    tp: int = 1,
    **extra: Any,
) -> ReplicaStatus:
    """A fresh, healthy, idle replica of the engine's model with a 40 GiB KV pool; ``age_ms`` None: never
    reported."""
    name = model or MODEL_OF[engine]
    status = ReplicaStatus(
        replica_id=replica_id,
        model=name,
        engine=engine_of(models()[name]) if name in models() else engine,
        node=f"node-{replica_id}",
        region="eu-west",
        tp=tp,
        healthy=healthy,
        queue_depth=queue,
        kv_used_bytes=int(kv_used_gib * GIB),
        kv_total_bytes=int(kv_total_gib * GIB),
        latency_p50_ms=p50_ms,
        latency_p99_ms=p50_ms * 3,
        reported_at_ms=None if age_ms is None else NOW_MS - age_ms,
        held_bytes=int(held_gib * GIB),
    )
    return replace(status, **extra) if extra else status


def ask(
    input_tokens: int = 1000, output_tokens: int = 200, ttft_ms: float | None = None, hint: str = "auto"
) -> AdmitAsk:
    return AdmitAsk(input_tokens=input_tokens, output_tokens=output_tokens, ttft_ms=ttft_ms, hint=hint)


def ids(selection: Any) -> list[str]:
    return [c.replica.replica_id for c in selection.order]
