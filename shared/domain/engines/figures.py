"""What an engine's `/metrics` says about its load, read the same way for vLLM and SGLang.

`engine_figures(current, previous)` turns one scrape (and optionally the one before it) into
`EngineFigures`: gauges from the current scrape, and counters and latency histograms over the window
between the two scrapes (over everything since the engine started when there is no previous scrape).
Quantiles are estimated the way Prometheus' `histogram_quantile` does. The metric names and where each
comes from are in docs/ENGINE_METRICS.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from shared.domain.engines.exposition import Exposition, Labels, Sample

__all__ = [
    "ENGINE_METRICS",
    "EngineFigures",
    "EngineKind",
    "EngineMetricNames",
    "UnrecognizedEngine",
    "detect_engine",
    "engine_figures",
    "histogram_quantile",
]


class EngineKind(StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"


class UnrecognizedEngine(ValueError):
    """The scrape has no metric of an engine this module reads (no `vllm:` or `sglang:` sample)."""


@dataclass(frozen=True, slots=True)
class EngineMetricNames:
    """The sample names one engine kind publishes; where a tuple lists several, the first present wins
    (newer name first, the name older releases used after it)."""

    running: str
    waiting: str
    kv_usage: tuple[str, ...]
    ttft: str
    itl: tuple[str, ...]
    prompt_tokens: str
    generation_tokens: str
    prefix_hits: tuple[str, ...]
    prefix_queries: tuple[str, ...]
    prefix_hit_rate_gauge: str
    preemptions: str
    rank_labels: tuple[str, ...] = ()
    """Labels whose series repeat one batch's figures (SGLang's tensor/pipeline ranks): of series that
    differ only in these, the lowest rank is read."""


ENGINE_METRICS: Mapping[EngineKind, EngineMetricNames] = {
    EngineKind.VLLM: EngineMetricNames(
        running="vllm:num_requests_running",
        waiting="vllm:num_requests_waiting",
        kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        ttft="vllm:time_to_first_token_seconds",
        itl=("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
        prompt_tokens="vllm:prompt_tokens_total",
        generation_tokens="vllm:generation_tokens_total",
        prefix_hits=("vllm:prefix_cache_hits_total", "vllm:gpu_prefix_cache_hits_total"),
        prefix_queries=("vllm:prefix_cache_queries_total", "vllm:gpu_prefix_cache_queries_total"),
        prefix_hit_rate_gauge="vllm:gpu_prefix_cache_hit_rate",
        preemptions="vllm:num_preemptions_total",
    ),
    EngineKind.SGLANG: EngineMetricNames(
        running="sglang:num_running_reqs",
        waiting="sglang:num_queue_reqs",
        kv_usage=("sglang:token_usage",),
        ttft="sglang:time_to_first_token_seconds",
        itl=("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
        prompt_tokens="sglang:prompt_tokens_total",
        generation_tokens="sglang:generation_tokens_total",
        # Cached prompt tokens over prompt tokens: the share of prefill served from the radix cache.
        prefix_hits=("sglang:cached_tokens_total",),
        prefix_queries=("sglang:prompt_tokens_total",),
        prefix_hit_rate_gauge="sglang:cache_hit_rate",
        preemptions="sglang:num_retracted_requests_total",
        rank_labels=("tp_rank", "pp_rank", "moe_ep_rank"),
    ),
}


@dataclass(frozen=True, slots=True)
class EngineFigures:
    """One engine's load, from one scrape or two. `None` is "the engine does not say" (a metric it does
    not publish, or a window in which nothing was observed), never zero.

    Gauges (`running`, `waiting`, `kv_usage`) are the current scrape's. The rest cover `window_s`, the
    time between the two scrapes; on a first scrape (no previous one) the latency quantiles, hit rate and
    preemptions cover everything since the engine started, and the rates are `None`. `restarted` says a
    counter went backwards, so the current scrape was read as starting from zero."""

    engine: EngineKind
    model: str | None
    running: int | None
    waiting: int | None
    kv_usage: float | None
    ttft_p50_ms: float | None
    ttft_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p99_ms: float | None
    prompt_tokens_per_s: float | None
    generation_tokens_per_s: float | None
    prefix_cache_hit_rate: float | None
    preemptions: int | None
    window_s: float | None
    restarted: bool = False


def detect_engine(exposition: Exposition) -> EngineKind | None:
    """The engine whose metric prefix (`vllm:`, `sglang:`) most samples carry; None if neither."""
    counts = {kind: 0 for kind in EngineKind}
    for sample in exposition.samples:
        for kind in EngineKind:
            if sample.name.startswith(f"{kind.value}:"):
                counts[kind] += 1
    kind, count = max(counts.items(), key=lambda item: item[1])
    return kind if count else None


def engine_figures(
    current: Exposition,
    previous: Exposition | None = None,
    *,
    model: str | None = None,
    elapsed_s: float | None = None,
) -> EngineFigures:
    """Read `current` (and the window since `previous`) into `EngineFigures`.

    `model` keeps only series whose `model_name` label is that model; without it every series counts.
    Series of one kind are summed (vLLM's data-parallel `engine` label sets, SGLang's `dp_rank`), except
    the KV usage fraction, which is their mean. `elapsed_s` is the time between the two scrapes; when it
    is not given it is read from the samples' timestamps if both scrapes carry them, else the rates are
    `None`. A previous scrape of another engine kind is ignored. Raises `UnrecognizedEngine` when
    `current` has no vLLM or SGLang metric."""
    kind = detect_engine(current)
    if kind is None:
        raise UnrecognizedEngine("no vllm: or sglang: metric in the scrape")
    if previous is not None and detect_engine(previous) is not kind:
        previous = None
    names = ENGINE_METRICS[kind]
    now = _Series(current, model, names.rank_labels)
    before = _Series(previous, model, names.rank_labels) if previous is not None else None
    window = _window_seconds(current, previous, elapsed_s)
    resets: list[bool] = []

    def delta(name: str) -> float | None:
        found = _counter_delta(now.values(name), before.values(name) if before else None)
        if found is None:
            return None
        value, reset = found
        resets.append(reset)
        return value

    def quantiles(name: str) -> tuple[float | None, float | None]:
        buckets, reset = _window_buckets(now.buckets(name), before.buckets(name) if before else None)
        resets.append(reset)
        return _ms(histogram_quantile(0.5, buckets)), _ms(histogram_quantile(0.99, buckets))

    itl_name = _first_present(now, names.itl, suffix="_bucket")
    ttft = quantiles(names.ttft)
    itl = quantiles(itl_name) if itl_name else (None, None)
    prompt = delta(names.prompt_tokens)
    generation = delta(names.generation_tokens)
    preemptions = delta(names.preemptions)
    return EngineFigures(
        engine=kind,
        model=model if model is not None else now.only_model(),
        running=_whole(_total(now.values(names.running))),
        waiting=_whole(_total(now.values(names.waiting))),
        kv_usage=_fraction(_mean(now.values(_first_present(now, names.kv_usage) or ""))),
        ttft_p50_ms=ttft[0],
        ttft_p99_ms=ttft[1],
        itl_p50_ms=itl[0],
        itl_p99_ms=itl[1],
        prompt_tokens_per_s=_rate(prompt, window, before),
        generation_tokens_per_s=_rate(generation, window, before),
        prefix_cache_hit_rate=_prefix_hit_rate(now, names, delta),
        preemptions=_whole(preemptions),
        window_s=window if before is not None else None,
        restarted=any(resets),
    )


def histogram_quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """The q-quantile (0 <= q <= 1) of a histogram given as cumulative counts by upper bound (`le`),
    by linear interpolation inside the bucket the rank falls in, as Prometheus' `histogram_quantile`:
    the first bucket starts at 0 (unless its bound is <= 0), a rank in the `+Inf` bucket reads as the
    highest finite bound. None without a `+Inf` bucket, with fewer than two buckets, or no observations."""
    bounds = sorted(le for le in buckets if not math.isnan(le))
    if len(bounds) < 2 or bounds[-1] != math.inf or not 0 <= q <= 1:
        return None
    counts: list[float] = []
    for le in bounds:  # cumulative counts never fall; a scrape caught mid-update can say otherwise
        counts.append(max(buckets[le], counts[-1] if counts else 0.0))
    observations = counts[-1]
    if not observations > 0:
        return None
    rank = q * observations
    index = next((i for i, count in enumerate(counts[:-1]) if count >= rank), len(counts) - 1)
    if index == len(counts) - 1:
        return bounds[-2]
    if index == 0 and bounds[0] <= 0:
        return bounds[0]
    start = 0.0 if index == 0 else bounds[index - 1]
    below = 0.0 if index == 0 else counts[index - 1]
    inside = counts[index] - below
    if inside <= 0:
        return start
    return start + (bounds[index] - start) * (rank - below) / inside


class _Series:
    """One scrape's samples of one model, with repeated ranks dropped."""

    def __init__(self, exposition: Exposition, model: str | None, rank_labels: tuple[str, ...]) -> None:
        samples = [
            s
            for s in exposition.samples
            if not math.isnan(s.value) and (model is None or s.label("model_name") == model)
        ]
        self._samples = _lowest_ranks(samples, rank_labels)
        self._models = {s.label("model_name") for s in self._samples if s.label("model_name") is not None}

    def has(self, name: str) -> bool:
        return any(s.name == name for s in self._samples)

    def values(self, name: str) -> dict[Labels, float]:
        return {s.labels: s.value for s in self._samples if s.name == name}

    def buckets(self, name: str) -> dict[Labels, dict[float, float]]:
        """`<name>_bucket` samples as {labels without `le`: {upper bound: cumulative count}}."""
        series: dict[Labels, dict[float, float]] = {}
        for s in self._samples:
            le = s.label("le")
            if s.name != f"{name}_bucket" or le is None:
                continue
            try:
                bound = float(le)
            except ValueError:
                continue
            series.setdefault(tuple(p for p in s.labels if p[0] != "le"), {})[bound] = s.value
        return series

    def only_model(self) -> str | None:
        return next(iter(self._models)) if len(self._models) == 1 else None


def _lowest_ranks(samples: list[Sample], rank_labels: tuple[str, ...]) -> list[Sample]:
    if not rank_labels:
        return samples
    chosen: dict[tuple[str, Labels], tuple[tuple[float, ...], Sample]] = {}
    for s in samples:
        rest = tuple(p for p in s.labels if p[0] not in rank_labels)
        rank = tuple(_as_rank(s.label(label)) for label in rank_labels)
        key = (s.name, rest)
        if key not in chosen or rank < chosen[key][0]:
            chosen[key] = (rank, s)
    return [s for _, s in chosen.values()]


def _as_rank(value: str | None) -> float:
    if value is None:
        return -1.0
    try:
        return float(value)
    except ValueError:
        return math.inf


def _first_present(series: _Series, names: Iterable[str], *, suffix: str = "") -> str | None:
    return next((name for name in names if series.has(name + suffix)), None)


def _counter_delta(now: dict[Labels, float], before: dict[Labels, float] | None) -> tuple[float, bool] | None:
    """Sum of each series' increase; a series that fell restarted, so its whole value is the increase.
    Without a previous scrape, the cumulative total."""
    if not now:
        return None
    if before is None:
        return sum(now.values()), False
    total, reset = 0.0, False
    for labels, value in now.items():
        old = before.get(labels, 0.0)
        if value < old:
            total, reset = total + value, True
        else:
            total += value - old
    return total, reset


def _window_buckets(
    now: dict[Labels, dict[float, float]], before: dict[Labels, dict[float, float]] | None
) -> tuple[dict[float, float], bool]:
    """Bucket counts observed in the window, summed over series by upper bound. A series whose count
    fell (the engine restarted) contributes its current counts whole."""
    summed: dict[float, float] = {}
    reset = False
    for labels, buckets in now.items():
        old = (before or {}).get(labels, {})
        if any(buckets.get(le, 0.0) < count for le, count in old.items()):
            old, reset = {}, True
        for le, count in buckets.items():
            summed[le] = summed.get(le, 0.0) + count - old.get(le, 0.0)
    return summed, reset


def _window_seconds(current: Exposition, previous: Exposition | None, elapsed_s: float | None) -> float | None:
    if previous is None:
        return None
    if elapsed_s is not None:
        return float(elapsed_s) if elapsed_s > 0 else None
    now, before = _latest_timestamp(current), _latest_timestamp(previous)
    if now is None or before is None or now <= before:
        return None
    return (now - before) / 1000


def _latest_timestamp(exposition: Exposition) -> int | None:
    return max((s.timestamp_ms for s in exposition.samples if s.timestamp_ms is not None), default=None)


def _prefix_hit_rate(now: _Series, names: EngineMetricNames, delta: Callable[[str], float | None]) -> float | None:
    hits_name = _first_present(now, names.prefix_hits)
    queries_name = _first_present(now, names.prefix_queries)
    if hits_name and queries_name:
        hits, queries = delta(hits_name), delta(queries_name)
        if hits is not None and queries:
            return _fraction(hits / queries)
        return None
    return _fraction(_mean(now.values(names.prefix_hit_rate_gauge)))  # older releases: a gauge, -1 for "none"


def _total(values: dict[Labels, float]) -> float | None:
    return sum(values.values()) if values else None


def _mean(values: dict[Labels, float]) -> float | None:
    return sum(values.values()) / len(values) if values else None


def _whole(value: float | None) -> int | None:
    return None if value is None or not math.isfinite(value) or value < 0 else round(value)


def _fraction(value: float | None) -> float | None:
    if value is None or not math.isfinite(value) or value < 0:
        return None
    return min(value, 1.0)


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None or not math.isfinite(seconds) else seconds * 1000


def _rate(increase: float | None, window: float | None, before: _Series | None) -> float | None:
    if increase is None or window is None or before is None:
        return None
    return increase / window


VLLM_CACHE_INFO = "vllm:cache_config_info"
SGLANG_KV_TOKENS = "sglang:max_total_num_tokens"


def kv_capacity_tokens(exposition: Exposition) -> int | None:
    """Tokens the engine's KV cache holds: vLLM's ``vllm:cache_config_info`` labels (``num_gpu_blocks`` x
    ``block_size``, summed over its engines), SGLang's ``sglang:max_total_num_tokens`` (its lowest rank, summed
    over data-parallel ranks); None when the scrape says neither."""
    total = 0
    found = False
    for sample in exposition.samples:
        if sample.name == VLLM_CACHE_INFO:
            try:
                blocks, size = int(sample.label("num_gpu_blocks") or ""), int(sample.label("block_size") or "")
            except ValueError:
                continue
            total, found = total + blocks * size, True
    if found:
        return total
    sglang = _lowest_ranks(
        [s for s in exposition.samples if s.name == SGLANG_KV_TOKENS], ENGINE_METRICS[EngineKind.SGLANG].rank_labels
    )
    values = [s.value for s in sglang if math.isfinite(s.value) and s.value >= 0]
    return int(sum(values)) if values else None
