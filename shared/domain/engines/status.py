"""The fields of an `engine_status` event (shared.contracts.topology.EngineStatusEvent) from
`EngineFigures`: the node agent adds who it is and what it knows of the replica, and publishes."""

from __future__ import annotations

from shared.domain.engines.figures import EngineFigures

__all__ = ["LATENCY_CAP_MS", "engine_status_fields"]

LATENCY_CAP_MS = 3_600_000.0
"""The event's bound on a latency; a histogram's highest finite bucket can lie past it."""


def engine_status_fields(
    figures: EngineFigures, *, replica_id: str, node: str, kv_total_bytes: int, healthy: bool = True
) -> dict[str, object]:
    """The event's fields. `queue_depth` is the waiting requests, `kv_used_bytes` the KV usage fraction
    of `kv_total_bytes`, and `latency_p50_ms`/`latency_p99_ms` the TTFT quantiles. The event requires
    those four: a figure the engine did not give reads 0 there (an idle window has no TTFT), while every
    optional field stays None."""
    kv_usage = figures.kv_usage
    return {
        "replica_id": replica_id,
        "node": node,
        "queue_depth": figures.waiting or 0,
        "kv_used_bytes": round((kv_usage or 0.0) * kv_total_bytes),
        "kv_total_bytes": kv_total_bytes,
        "latency_p50_ms": _capped(figures.ttft_p50_ms) or 0.0,
        "latency_p99_ms": _capped(figures.ttft_p99_ms) or 0.0,
        "healthy": healthy,
        "engine": figures.engine.value,
        "running_requests": figures.running,
        "kv_usage": kv_usage,
        "itl_p50_ms": _capped(figures.itl_p50_ms),
        "itl_p99_ms": _capped(figures.itl_p99_ms),
        "prompt_tokens_per_s": figures.prompt_tokens_per_s,
        "generation_tokens_per_s": figures.generation_tokens_per_s,
        "prefix_cache_hit_rate": figures.prefix_cache_hit_rate,
        "preemptions": figures.preemptions,
    }


def _capped(ms: float | None) -> float | None:
    return None if ms is None else min(ms, LATENCY_CAP_MS)
