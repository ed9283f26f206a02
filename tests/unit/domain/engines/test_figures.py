"""EngineFigures from the vLLM and SGLang fixtures (tests/fixtures/engines, see its README): each
expected number is worked out by hand from the fixture lines quoted beside it."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from shared.contracts.topology import EngineStatusEvent
from shared.domain.engines import (
    EngineKind,
    Exposition,
    UnrecognizedEngine,
    detect_engine,
    engine_figures,
    engine_status_fields,
    histogram_quantile,
    parse_exposition,
)

FIXTURES = Path(__file__).resolve().parents[3] / "fixtures" / "engines"
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def scrape(name: str) -> Exposition:
    exposition = parse_exposition((FIXTURES / name).read_text())
    assert exposition.skipped_lines == 0
    return exposition


def test_the_engine_is_told_by_its_metric_prefix() -> None:
    assert detect_engine(scrape("vllm.prom")) is EngineKind.VLLM
    assert detect_engine(scrape("sglang.prom")) is EngineKind.SGLANG
    assert detect_engine(parse_exposition("python_info 1\n")) is None
    with pytest.raises(UnrecognizedEngine):
        engine_figures(parse_exposition("python_info 1\n"))


def test_vllm_first_scrape_reads_gauges_and_the_cumulative_histograms() -> None:
    figures = engine_figures(scrape("vllm.prom"))
    assert figures.engine is EngineKind.VLLM
    assert figures.model == MODEL
    assert figures.running == 7 + 5  # engine="0" and engine="1" (data parallel) are summed
    assert figures.waiting == 2 + 1
    assert figures.kv_usage == pytest.approx((0.42 + 0.38) / 2)  # a fraction: the engines' mean
    # TTFT, both engines: le=0.08 -> 2*40=80, le=0.1 -> 2*80=160, +Inf -> 200. p50: rank 100 lies in
    # (0.08, 0.1], 20 of its 80: 0.08 + 0.02 * 20/80 = 0.085 s. p99: rank 198 = le=0.5's 198, the top of
    # (0.25, 0.5] -> 0.5 s.
    assert figures.ttft_p50_ms == pytest.approx(85.0)
    assert figures.ttft_p99_ms == pytest.approx(500.0)
    # time_per_output_token (this release has no inter_token_latency): le=0.025 -> 4000, le=0.05 -> 9000,
    # le=0.075 -> 9800, le=0.1 -> 10000. p50: 0.025 + 0.025 * 1000/5000 = 0.030; p99: rank 9900 in
    # (0.075, 0.1]: 0.075 + 0.025 * 100/200 = 0.0875.
    assert figures.itl_p50_ms == pytest.approx(30.0)
    assert figures.itl_p99_ms == pytest.approx(87.5)
    assert figures.prefix_cache_hit_rate == pytest.approx((30000 + 20000) / (120000 + 80000))
    assert figures.preemptions == 3 + 1
    assert figures.prompt_tokens_per_s is None  # a rate needs two scrapes
    assert figures.generation_tokens_per_s is None
    assert figures.window_s is None


def test_vllm_window_between_two_scrapes() -> None:
    figures = engine_figures(scrape("vllm.2.prom"), scrape("vllm.prom"), elapsed_s=10.0)
    assert (figures.running, figures.waiting) == (9 + 6, 0 + 1)
    assert figures.kv_usage == pytest.approx((0.55 + 0.45) / 2)
    # TTFT observed in the window (second minus first scrape, both engines): le=0.08 10, 0.1 20, 0.25 60,
    # 0.5 90, 0.75 98, 1.0 100. p50: rank 50 in (0.1, 0.25]: 0.1 + 0.15 * 30/40 = 0.2125 s. p99: rank 99
    # in (0.75, 1.0]: 0.75 + 0.25 * 1/2 = 0.875 s.
    assert figures.ttft_p50_ms == pytest.approx(212.5)
    assert figures.ttft_p99_ms == pytest.approx(875.0)
    # TPOT in the window: le=0.025 1000, 0.05 3000, 0.075 4500, 0.1 4900, 0.15 5000.
    # p50: 0.025 + 0.025 * 1500/2000 = 0.04375; p99: 0.1 + 0.05 * 50/100 = 0.125.
    assert figures.itl_p50_ms == pytest.approx(43.75)
    assert figures.itl_p99_ms == pytest.approx(125.0)
    # prompt_tokens_total 250000+150000 -> 268000+162000 in 10 s; generation 90000+60000 -> 95000+63500.
    assert figures.prompt_tokens_per_s == pytest.approx(30000 / 10)
    assert figures.generation_tokens_per_s == pytest.approx(8500 / 10)
    # prefix_cache_hits 50000 -> 62600, queries 200000 -> 230000.
    assert figures.prefix_cache_hit_rate == pytest.approx(12600 / 30000)
    assert figures.preemptions == (5 - 3) + (1 - 1)
    assert figures.window_s == 10.0
    assert not figures.restarted


def test_sglang_first_scrape() -> None:
    figures = engine_figures(scrape("sglang.prom"))
    assert figures.engine is EngineKind.SGLANG
    assert figures.model == MODEL
    assert (figures.running, figures.waiting) == (24, 6)
    assert figures.kv_usage == pytest.approx(0.61)  # sglang:token_usage
    # TTFT: le=0.2 400, 0.4 800, 0.6 950, 0.8 990, 1.0 1000. p50: 0.2 + 0.2 * 100/400 = 0.25;
    # p99: rank 990 = le=0.8's count -> 0.8.
    assert figures.ttft_p50_ms == pytest.approx(250.0)
    assert figures.ttft_p99_ms == pytest.approx(800.0)
    # inter_token_latency: le=0.015 200000, 0.02 800000, 0.025 1500000, 0.03 1800000.
    # p50: 0.02 + 0.005 * 100000/700000; p99: rank 1782000 -> 0.025 + 0.005 * 282000/300000 = 0.0297.
    assert figures.itl_p50_ms == pytest.approx((0.02 + 0.005 * 100000 / 700000) * 1000)
    assert figures.itl_p99_ms == pytest.approx(29.7)
    assert figures.prefix_cache_hit_rate == pytest.approx(1.3e6 / 5.2e6)  # cached_tokens / prompt_tokens
    assert figures.preemptions == 5  # num_retracted_requests_total


def test_sglang_window_between_two_scrapes() -> None:
    figures = engine_figures(scrape("sglang.2.prom"), scrape("sglang.prom"), elapsed_s=10.0)
    assert (figures.running, figures.waiting) == (20, 2)
    assert figures.kv_usage == pytest.approx(0.58)
    # TTFT in the window: le=0.2 20, 0.4 60, 0.6 120, 0.8 170, 1.0 190, 2.0 200.
    # p50: 0.4 + 0.2 * 40/60; p99: rank 198 in (1, 2]: 1 + 1 * 8/10 = 1.8.
    assert figures.ttft_p50_ms == pytest.approx((0.4 + 0.2 * 40 / 60) * 1000)
    assert figures.ttft_p99_ms == pytest.approx(1800.0)
    # ITL in the window: le=0.02 1000, 0.025 4000, 0.03 7000, 0.035 8500, 0.04 9000.
    # p50: 0.025 + 0.005 * 500/3000; p99: rank 8910 -> 0.035 + 0.005 * 410/500 = 0.0391.
    assert figures.itl_p50_ms == pytest.approx((0.025 + 0.005 * 500 / 3000) * 1000)
    assert figures.itl_p99_ms == pytest.approx(39.1)
    assert figures.prompt_tokens_per_s == pytest.approx((5.236e6 - 5.2e6) / 10)
    assert figures.generation_tokens_per_s == pytest.approx((1.809e6 - 1.8e6) / 10)
    assert figures.prefix_cache_hit_rate == pytest.approx((1.3126e6 - 1.3e6) / (5.236e6 - 5.2e6))
    assert figures.preemptions == 6 - 5


def test_vllm_and_sglang_give_the_same_engine_status_shape() -> None:
    shapes = []
    for name in ("vllm", "sglang"):
        figures = engine_figures(scrape(f"{name}.2.prom"), scrape(f"{name}.prom"), elapsed_s=10.0)
        fields = engine_status_fields(
            figures, replica_id="al-7", node="dgx-1", kv_total_bytes=40_000_000_000, healthy=True
        )
        event = EngineStatusEvent.model_validate(fields)
        assert event.engine == name
        assert None not in (event.running_requests, event.kv_usage, event.itl_p50_ms, event.itl_p99_ms)
        assert None not in (event.prompt_tokens_per_s, event.generation_tokens_per_s)
        assert None not in (event.prefix_cache_hit_rate, event.preemptions)
        shapes.append(set(fields))
    assert shapes[0] == shapes[1]


def test_status_fields_map_waiting_kv_bytes_and_ttft() -> None:
    figures = engine_figures(scrape("vllm.2.prom"), scrape("vllm.prom"), elapsed_s=10.0)
    fields = engine_status_fields(figures, replica_id="al-7", node="dgx-1", kv_total_bytes=40_000_000_000)
    assert fields["queue_depth"] == 1
    assert fields["running_requests"] == 15
    assert fields["kv_used_bytes"] == 20_000_000_000  # mean usage 0.5 of 40 GB
    assert fields["latency_p50_ms"] == pytest.approx(212.5)
    assert fields["latency_p99_ms"] == pytest.approx(875.0)
    assert fields["healthy"] is True


def test_an_idle_window_reports_no_latency_and_zero_rates() -> None:
    first = scrape("vllm.prom")
    figures = engine_figures(first, first, elapsed_s=10.0)
    assert figures.ttft_p50_ms is None and figures.itl_p99_ms is None  # nothing observed: not "0 ms"
    assert figures.prompt_tokens_per_s == 0.0
    assert figures.prefix_cache_hit_rate is None  # no queries in the window
    assert figures.preemptions == 0
    fields = engine_status_fields(figures, replica_id="al-7", node="dgx-1", kv_total_bytes=1)
    assert fields["latency_p50_ms"] == 0.0 and fields["itl_p50_ms"] is None
    EngineStatusEvent.model_validate(fields)


def test_a_counter_that_went_backwards_is_a_restart_and_counts_from_zero() -> None:
    before = parse_exposition(
        'vllm:prompt_tokens_total{model_name="m",engine="0"} 50000\n'
        'vllm:num_preemptions_total{model_name="m",engine="0"} 9\n'
        'vllm:time_to_first_token_seconds_bucket{model_name="m",engine="0",le="0.1"} 900\n'
        'vllm:time_to_first_token_seconds_bucket{model_name="m",engine="0",le="1.0"} 1000\n'
        'vllm:time_to_first_token_seconds_bucket{model_name="m",engine="0",le="+Inf"} 1000\n'
    )
    after = parse_exposition(
        'vllm:prompt_tokens_total{model_name="m",engine="0"} 1200\n'
        'vllm:num_preemptions_total{model_name="m",engine="0"} 0\n'
        'vllm:time_to_first_token_seconds_bucket{model_name="m",engine="0",le="0.1"} 0\n'
        'vllm:time_to_first_token_seconds_bucket{model_name="m",engine="0",le="1.0"} 4\n'
        'vllm:time_to_first_token_seconds_bucket{model_name="m",engine="0",le="+Inf"} 4\n'
    )
    figures = engine_figures(after, before, elapsed_s=5.0)
    assert figures.restarted
    assert figures.prompt_tokens_per_s == pytest.approx(1200 / 5)  # not (1200 - 50000) / 5
    assert figures.preemptions == 0
    # The histogram restarted too: its 4 new observations all lie in (0.1, 1.0]: p50 = 0.1 + 0.9 * 2/4.
    assert figures.ttft_p50_ms == pytest.approx(550.0)


def test_one_engine_restarting_leaves_the_others_window_alone() -> None:
    before = parse_exposition(
        'vllm:generation_tokens_total{model_name="m",engine="0"} 1000\n'
        'vllm:generation_tokens_total{model_name="m",engine="1"} 5000\n'
    )
    after = parse_exposition(
        'vllm:generation_tokens_total{model_name="m",engine="0"} 1600\n'
        'vllm:generation_tokens_total{model_name="m",engine="1"} 300\n'
    )
    figures = engine_figures(after, before, elapsed_s=2.0)
    assert figures.generation_tokens_per_s == pytest.approx((600 + 300) / 2)
    assert figures.restarted


def test_the_model_filter_keeps_one_models_series() -> None:
    text = (
        'vllm:num_requests_running{model_name="a",engine="0"} 3\n'
        'vllm:num_requests_running{model_name="b",engine="0"} 4\n'
        'vllm:kv_cache_usage_perc{model_name="a",engine="0"} 0.2\n'
        'vllm:kv_cache_usage_perc{model_name="b",engine="0"} 0.6\n'
    )
    assert engine_figures(parse_exposition(text), model="a").running == 3
    assert engine_figures(parse_exposition(text), model="b").kv_usage == pytest.approx(0.6)
    both = engine_figures(parse_exposition(text))
    assert both.running == 7
    assert both.model is None  # two models: none to name
    assert engine_figures(parse_exposition(text), model="c").running is None


def test_older_vllm_names_are_read_when_the_newer_are_absent() -> None:
    text = (
        'vllm:gpu_cache_usage_perc{model_name="m"} 0.3\n'
        'vllm:gpu_prefix_cache_hit_rate{model_name="m"} 0.6\n'
        'vllm:time_per_output_token_seconds_bucket{le="0.05",model_name="m"} 10\n'
        'vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 10\n'
    )
    figures = engine_figures(parse_exposition(text))
    assert figures.kv_usage == pytest.approx(0.3)
    assert figures.prefix_cache_hit_rate == pytest.approx(0.6)
    assert figures.itl_p50_ms == pytest.approx(25.0)  # 10 observations in [0, 0.05]: half way
    unknown = parse_exposition('vllm:gpu_prefix_cache_hit_rate{model_name="m"} -1\n')
    assert engine_figures(unknown).prefix_cache_hit_rate is None  # v0 wrote -1 for "not measured"


def test_newer_vllm_inter_token_latency_is_preferred_to_the_deprecated_tpot() -> None:
    text = (
        'vllm:time_per_output_token_seconds_bucket{le="0.05",model_name="m"} 10\n'
        'vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="m"} 10\n'
        'vllm:inter_token_latency_seconds_bucket{le="0.01",model_name="m"} 0\n'
        'vllm:inter_token_latency_seconds_bucket{le="0.025",model_name="m"} 10\n'
        'vllm:inter_token_latency_seconds_bucket{le="+Inf",model_name="m"} 10\n'
    )
    assert engine_figures(parse_exposition(text)).itl_p50_ms == pytest.approx(17.5)  # 0.01 + 0.015/2


def test_sglang_tensor_parallel_ranks_are_read_once_data_parallel_ranks_summed() -> None:
    text = "".join(
        f'sglang:num_running_reqs{{dp_rank="{dp}",model_name="m",pp_rank="0",tp_rank="{tp}"}} {value}\n'
        for dp, tp, value in [(0, 0, 5), (0, 1, 5), (1, 2, 7), (1, 3, 7)]
    )
    assert engine_figures(parse_exposition(text)).running == 5 + 7


def test_rates_come_from_sample_timestamps_when_no_elapsed_time_is_given() -> None:
    before = parse_exposition('sglang:prompt_tokens_total{model_name="m"} 100 1700000000000\n')
    after = parse_exposition('sglang:prompt_tokens_total{model_name="m"} 400 1700000002000\n')
    assert engine_figures(after, before).prompt_tokens_per_s == pytest.approx(300 / 2)
    untimed = parse_exposition('sglang:prompt_tokens_total{model_name="m"} 400\n')
    assert engine_figures(untimed, before).prompt_tokens_per_s is None


def test_nan_samples_are_no_data() -> None:
    text = 'sglang:token_usage{model_name="m"} NaN\nsglang:num_queue_reqs{model_name="m"} 2\n'
    figures = engine_figures(parse_exposition(text))
    assert figures.kv_usage is None
    assert figures.waiting == 2


@pytest.mark.parametrize(
    ("q", "buckets", "expected"),
    [
        (0.5, {0.1: 1, 0.5: 3, math.inf: 4}, 0.3),  # rank 2 in (0.1, 0.5]: 0.1 + 0.4 * 1/2
        (0.5, {1.0: 2, math.inf: 2}, 0.5),  # the first bucket starts at 0
        (0.99, {1.0: 1, math.inf: 100}, 1.0),  # rank in +Inf: the highest finite bound
        (0.5, {-1.0: 3, math.inf: 4}, -1.0),  # a first bound <= 0 is returned as is
        (0.5, {1.0: 5, 2.0: 4, math.inf: 10}, 1.0),  # a count that fell is read as not falling
        (0.5, {1.0: 0, math.inf: 0}, None),  # no observations
        (0.5, {1.0: 3}, None),  # no +Inf bucket
        (0.5, {math.inf: 3}, None),  # fewer than two buckets
        (1.5, {1.0: 1, math.inf: 1}, None),  # not a quantile
    ],
)
def test_histogram_quantile_follows_prometheus(q: float, buckets: dict[float, float], expected: float | None) -> None:
    found = histogram_quantile(q, buckets)
    assert found == (None if expected is None else pytest.approx(expected))
