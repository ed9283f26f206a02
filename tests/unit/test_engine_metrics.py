"""The simulated engine's /metrics (hetsched/engines/metrics.py): vLLM's names, labels and buckets, and
values that follow the batcher's steps."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from hetsched.engines.metrics import REQUEST_LATENCY_BUCKETS, TTFT_BUCKETS, EngineMetrics, build_1_2_5_buckets
from shared.domain.serving import Batcher, engine_profile
from shared.infra.catalog import load_models, load_skus

LABELS = {"model_name": "served", "engine": "0"}


def samples(metrics: EngineMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.exposition().decode())
        for s in family.samples
    }


def value(found: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    return found[(name, tuple(sorted({**LABELS, **labels}.items())))]


def test_token_count_buckets_are_vllms_1_2_5_series() -> None:
    assert build_1_2_5_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert build_1_2_5_buckets(8192)[-1] == 5000


def test_the_metrics_follow_the_batchers_steps_under_vllms_names() -> None:
    spec = load_models()["llama3-8b"]
    profile = engine_profile(spec, load_skus()["H100-SXM-80GB"], tp=1, dtype="bf16", kv_dtype="bf16")
    batcher = Batcher(profile, max_num_seqs=1)
    metrics = EngineMetrics(model_name="served", max_model_len=profile.max_model_len)
    for i in range(3):
        batcher.submit(f"r{i}", prompt="x" * 40, prompt_tokens=10, max_tokens=4, now_s=0.0)
        metrics.request(max_tokens=4)
    metrics.scheduler(batcher)
    first = samples(metrics)
    assert value(first, "vllm:num_requests_waiting") == 3 and value(first, "vllm:num_requests_running") == 0
    now = 0.0
    while (step := batcher.plan(now)) is not None:
        metrics.scheduler(batcher)
        if step.prefill == ("r1",):
            middle = samples(metrics)
        metrics.step(step, batcher.complete(step))
        now = step.end_s
    metrics.scheduler(batcher)
    assert value(middle, "vllm:num_requests_running") == 1 and value(middle, "vllm:num_requests_waiting") == 1
    assert 0 < value(middle, "vllm:kv_cache_usage_perc") == value(middle, "vllm:gpu_cache_usage_perc")
    last = samples(metrics)
    assert value(last, "vllm:prompt_tokens_total") == 30
    assert value(last, "vllm:generation_tokens_total") == 12
    assert value(last, "vllm:request_success_total", finished_reason="length") == 3
    assert value(last, "vllm:request_success_total", finished_reason="stop") == 0
    assert value(last, "vllm:prefix_cache_queries_total") == 30
    assert value(last, "vllm:num_preemptions_total") == 0
    assert value(last, "vllm:time_to_first_token_seconds_count") == 3
    assert value(last, "vllm:inter_token_latency_seconds_count") == 9
    assert value(last, "vllm:time_per_output_token_seconds_count") == 9
    assert value(last, "vllm:e2e_request_latency_seconds_sum") > value(last, "vllm:request_queue_time_seconds_sum") > 0
    ttft_bounds = [k[1] for k in last if k[0] == "vllm:time_to_first_token_seconds_bucket"]
    assert [float(dict(labels)["le"]) for labels in ttft_bounds][:-1] == list(TTFT_BUCKETS)
    e2e_bounds = [k[1] for k in last if k[0] == "vllm:e2e_request_latency_seconds_bucket"]
    assert [float(dict(labels)["le"]) for labels in e2e_bounds][:-1] == list(REQUEST_LATENCY_BUCKETS)
    assert value(last, "vllm:num_requests_running") == 0 and value(last, "vllm:kv_cache_usage_perc") == 0
