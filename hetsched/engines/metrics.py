"""The Prometheus metrics of a simulated engine, under vLLM's own names, labels and histogram buckets.

Names, help texts, the ``model_name`` / ``engine`` labels and the bucket boundaries follow vLLM's
`PrometheusStatLogger` (V1 engine):
https://github.com/vllm-project/vllm/blob/main/vllm/v1/metrics/loggers.py
Counters are declared without ``_total``; the exposition adds it (``vllm:prompt_tokens_total``), as
vLLM's /metrics shows. Two names vLLM 0.11 renamed are also exported, with the same values, for
dashboards written against earlier releases (vLLM <= 0.10 exported them by default):
``vllm:gpu_cache_usage_perc`` (now ``vllm:kv_cache_usage_perc``) and ``vllm:time_per_output_token_seconds``
(now ``vllm:inter_token_latency_seconds``); see
https://github.com/vllm-project/vllm/blob/a6f0308cfe806b7731ad4979c9bea6e470c35efd/vllm/v1/metrics/loggers.py
"""

from __future__ import annotations

from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from shared.domain.serving import Batcher, Step, StepResult

SOURCE_URL: Final = "https://github.com/vllm-project/vllm/blob/main/vllm/v1/metrics/loggers.py"
LABELS: Final = ("model_name", "engine")
FINISH_REASONS: Final = ("stop", "length", "abort")  # vLLM's FinishReason, as str() writes them

TTFT_BUCKETS: Final = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
TOKEN_LATENCY_BUCKETS: Final = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS: Final = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITERATION_TOKENS_BUCKETS: Final = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value``: vLLM's buckets for token counts."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > max_value:
                return tuple(buckets)
            buckets.append(value)
        exponent += 1


class EngineMetrics:
    """vLLM's metrics for one engine (``engine="0"``) of ``model_name``, in a private registry."""

    def __init__(self, *, model_name: str, max_model_len: int, engine: str = "0") -> None:
        self.registry = CollectorRegistry()
        values = (model_name, engine)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, LABELS, registry=self.registry).labels(*values)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, LABELS, registry=self.registry).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, LABELS, buckets=buckets, registry=self.registry).labels(*values)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_cache_usage = gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage. DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
        )
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=self.registry,
        )
        self.success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        token_counts = build_1_2_5_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_counts
        )
        self.request_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_counts
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS
        )
        self.max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_counts
        )
        self.n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", (1, 2, 5, 10, 20))
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TOKEN_LATENCY_BUCKETS
        )
        self.tpot_legacy = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds.DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self.queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.inference = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )

    def cache_config(self, *, num_gpu_blocks: int, block_size: int, cache_dtype: str = "auto") -> None:
        """vLLM's ``vllm:cache_config_info`` (an info gauge, value 1): the KV cache's size in its labels,
        as vLLM publishes its CacheConfig (what the node agent reads the KV capacity from)."""
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "cache_dtype", "num_gpu_blocks"],
            registry=self.registry,
        )
        info.labels(str(block_size), cache_dtype, str(num_gpu_blocks)).set(1)

    def scheduler(self, batcher: Batcher) -> None:
        """The gauges: requests running and waiting, KV use."""
        self.running.set(batcher.num_running)
        self.waiting.set(batcher.num_waiting)
        self.kv_usage.set(batcher.kv_usage)
        self.gpu_cache_usage.set(batcher.kv_usage)

    def request(self, *, max_tokens: int) -> None:
        """A request accepted: its parameters."""
        self.max_tokens.observe(max_tokens)
        self.n.observe(1)

    def step(self, step: Step, result: StepResult) -> None:
        """One engine step's counters and latencies."""
        self.prefix_queries.inc(step.prefix_queries)
        self.prefix_hits.inc(step.prefix_hits)
        self.prompt_tokens.inc(result.prompt_tokens)
        self.generation_tokens.inc(result.generation_tokens)
        self.iteration_tokens.observe(step.prompt_tokens - step.prefix_hits + len(step.decode))
        for ttft in result.time_to_first_token_s:
            self.ttft.observe(ttft)
        for itl in result.inter_token_latency_s:
            self.itl.observe(itl)
            self.tpot_legacy.observe(itl)
        for done in result.finished:
            self.success[done.finish_reason].inc()
            self.e2e.observe(done.e2e_s)
            self.queue.observe(done.queued_s)
            self.inference.observe(done.inference_s)
            self.prefill.observe(done.prefill_s)
            self.decode.observe(done.decode_s)
            self.request_prompt_tokens.observe(done.prompt_tokens)
            self.request_generation_tokens.observe(done.generation_tokens)
            self.request_tpot.observe(done.mean_time_per_output_token_s)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
