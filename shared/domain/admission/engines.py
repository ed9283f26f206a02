"""Engines and what admission knows of one replica: its engine, its load, its KV, its latency.

A replica runs the engine of its model's architecture. A request's peak KV on a replica is what the
memory model says one sequence of ``input + output`` tokens holds on the fullest of its ``tp`` ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import lru_cache

from shared.domain.memory import cache_bytes, compute_dtype
from shared.domain.models import Architecture, ModelSpec


class Engine(StrEnum):
    TRANSFORMER = "transformer"
    SSM = "ssm"
    MOE = "moe"
    HYBRID = "hybrid"


_ENGINE_OF = {
    Architecture.TRANSFORMER: Engine.TRANSFORMER,
    Architecture.SSM: Engine.SSM,
    Architecture.MOE: Engine.MOE,
    Architecture.HYBRID: Engine.HYBRID,
}


def engine_of(spec: ModelSpec) -> Engine:
    """The engine that serves ``spec``: one per architecture (a hybrid with experts is still hybrid)."""
    return _ENGINE_OF[spec.architecture]


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """What admission knows of one replica, from its last report plus what admission itself holds.

    ``reported_at_ms`` None: the replica never reported, so it is never a candidate. ``held_bytes``: KV
    held by admissions not yet reflected in the engine's report (``kv_used_bytes``).
    """

    replica_id: str
    model: str
    engine: Engine
    node: str
    region: str | None
    tp: int
    healthy: bool
    queue_depth: int
    kv_used_bytes: int
    kv_total_bytes: int
    latency_p50_ms: float
    latency_p99_ms: float
    reported_at_ms: float | None
    held_bytes: int = 0

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"{self.replica_id}: tp: expected >= 1, got {self.tp}")
        # One comparison on the path every admission takes; which figure is wrong only when one is.
        if min(self.queue_depth, self.kv_used_bytes, self.kv_total_bytes, self.held_bytes) < 0:
            for name in ("queue_depth", "kv_used_bytes", "kv_total_bytes", "held_bytes"):
                if getattr(self, name) < 0:
                    raise ValueError(f"{self.replica_id}: {name}: expected >= 0, got {getattr(self, name)}")

    @property
    def kv_use(self) -> float:
        """Share of the KV pool in use, admission's holds included (1.0 for a replica without a pool)."""
        if self.kv_total_bytes == 0:
            return 1.0
        return (self.kv_used_bytes + self.held_bytes) / self.kv_total_bytes

    @property
    def kv_free_bytes(self) -> int:
        return max(0, self.kv_total_bytes - self.kv_used_bytes - self.held_bytes)


def request_kv_bytes(spec: ModelSpec, *, input_tokens: int, output_tokens: int, tp: int) -> int:
    """Peak KV one request holds on each of a replica's ``tp`` ranks (the fullest rank).

    Attention KV for ``input + output`` tokens in ``spec.kv_dtype`` (transformer, MoE, the attention layers
    of a hybrid) plus the SSM state (SSM, the Mamba layers of a hybrid) in the dtype the memory model gives
    it by default, ``compute_dtype(spec.dtype)``; the state does not grow with the sequence.
    """
    for name, value in (("input_tokens", input_tokens), ("output_tokens", output_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name}: expected an integer >= 0, got {value!r}")
    return _sequence_bytes(spec, input_tokens + output_tokens, tp)


@lru_cache(maxsize=4096)
def _sequence_bytes(spec: ModelSpec, seq_len: int, tp: int) -> int:
    """One sequence's cache on the fullest rank; remembered, since requests of a model repeat a few sizes
    (admission asks for every request)."""
    return cache_bytes(
        spec, seq_len=seq_len, batch=1, kv_dtype=spec.kv_dtype, state_dtype=compute_dtype(spec.dtype), tp=tp
    )
