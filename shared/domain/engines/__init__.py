"""Reading inference engines' own metrics: a Prometheus text-format reader, and the figures an
`engine_status` event carries, read alike from vLLM and SGLang (docs/ENGINE_METRICS.md)."""

from shared.domain.engines.exposition import Exposition, Sample, UnreadableExposition, parse_exposition
from shared.domain.engines.figures import (
    ENGINE_METRICS,
    EngineFigures,
    EngineKind,
    EngineMetricNames,
    UnrecognizedEngine,
    detect_engine,
    engine_figures,
    histogram_quantile,
)
from shared.domain.engines.status import engine_status_fields

__all__ = [
    "ENGINE_METRICS",
    "EngineFigures",
    "EngineKind",
    "EngineMetricNames",
    "Exposition",
    "Sample",
    "UnreadableExposition",
    "UnrecognizedEngine",
    "detect_engine",
    "engine_figures",
    "engine_status_fields",
    "histogram_quantile",
    "parse_exposition",
]
