"""The simulated engine's arithmetic (shared/domain/serving.py): the profile a replica gets from the memory
and latency models, and the continuous-batching scheduler's admissions, timings and counters."""

from __future__ import annotations

from dataclasses import replace

import pytest

from shared.domain.latency import decode_step_ms, prefill_ms
from shared.domain.memory import usable_hbm
from shared.domain.placement.ladder import WEIGHT_LOAD_BYTES_PER_S
from shared.domain.serving import (
    BLOCK_CHARS,
    Batcher,
    EngineProfile,
    StepResult,
    count_prompt_tokens,
    engine_profile,
    filler_token,
    prefix_block_keys,
    text_seed,
)
from shared.infra.catalog import load_models, load_skus

MODELS = load_models()
SKUS = load_skus()
LLAMA8 = MODELS["llama3-8b"]
H100 = SKUS["H100-SXM-80GB"]


def profile(tp: int = 1, **changes: int) -> EngineProfile:
    made = engine_profile(LLAMA8, H100, tp=tp, dtype="bf16", kv_dtype="bf16")
    return replace(made, **changes) if changes else made


def run(batcher: Batcher, now: float = 0.0) -> list[StepResult]:
    """Every step until the batcher is idle."""
    results = []
    while (step := batcher.plan(now)) is not None:
        results.append(batcher.complete(step))
        now = step.end_s
    return results


# -- profile ----------------------------------------------------------------------------------


def test_load_time_is_one_accelerators_weights_over_the_load_budget() -> None:
    one, two = profile(tp=1), profile(tp=2)
    assert one.weight_bytes_per_accelerator == LLAMA8.params * 2  # bf16
    # H100 SXM's PCIe 5 x16 link (63 GB/s) is faster than the 5 GB/s budget, so the budget binds.
    assert one.load_s == pytest.approx(LLAMA8.params * 2 / WEIGHT_LOAD_BYTES_PER_S)
    assert two.load_s == pytest.approx(one.load_s / 2, rel=1e-6)


def test_kv_capacity_is_the_usable_hbm_left_after_weights_activation_and_workspace() -> None:
    one = profile()
    assert one.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # K and V x layers x kv heads x head dim x bf16
    left = usable_hbm(H100.hbm_bytes) - one.weight_bytes_per_accelerator
    assert one.kv_capacity_tokens * one.kv_bytes_per_token < left
    assert 400_000 < one.kv_capacity_tokens < left // one.kv_bytes_per_token
    # TP 2 halves the weights and the kv heads each GPU holds: more than twice the tokens fit.
    assert profile(tp=2).kv_capacity_tokens > 2 * one.kv_capacity_tokens


def test_a_model_whose_weights_do_not_fit_is_refused_at_start() -> None:
    with pytest.raises(ValueError, match="does not fit"):
        engine_profile(MODELS["llama3-70b"], SKUS["L40S-48GB"], tp=1, dtype="bf16", kv_dtype="bf16")


# -- text -------------------------------------------------------------------------------------


def test_prompt_tokens_are_characters_over_four_rounded_up() -> None:
    assert [count_prompt_tokens(t) for t in ("", "a", "abcd", "abcde", "x" * 400)] == [1, 1, 1, 2, 100]


def test_filler_is_deterministic_and_differs_by_prompt() -> None:
    a = [filler_token(text_seed("hello"), i) for i in range(8)]
    assert a == [filler_token(text_seed("hello"), i) for i in range(8)]
    assert a != [filler_token(text_seed("goodbye"), i) for i in range(8)]
    assert all(word.startswith(" ") and word.strip().isalpha() for word in a)


def test_prefix_keys_cover_whole_blocks_and_chain() -> None:
    a = prefix_block_keys("x" * (3 * BLOCK_CHARS + 5))
    b = prefix_block_keys("x" * (2 * BLOCK_CHARS) + "y" * BLOCK_CHARS)
    assert len(a) == 3 and a[:2] == b[:2] and a[2] != b[2]
    assert prefix_block_keys("x" * (BLOCK_CHARS - 1)) == ()


# -- scheduling and timing --------------------------------------------------------------------


def test_an_idle_engines_first_token_takes_one_prefill_and_each_next_one_decode_step() -> None:
    p = profile()
    batcher = Batcher(p)
    prompt = "word " * 200  # 1000 characters: 250 tokens
    batcher.submit("a", prompt=prompt, prompt_tokens=250, max_tokens=4, now_s=10.0)
    results = run(batcher, now=10.0)
    assert [len(r.tokens) for r in results] == [1, 1, 1, 1]
    (ttft,) = results[0].time_to_first_token_s
    assert ttft == pytest.approx(prefill_ms(p.shape, H100, 1, 250) / 1e3)
    itls = [itl for r in results for itl in r.inter_token_latency_s]
    assert itls[0] == pytest.approx(decode_step_ms(p.shape, H100, 1, 1, 251) / 1e3)
    assert itls == sorted(itls)  # the context grows by a token a step
    (done,) = results[-1].finished
    assert done.generation_tokens == 4 and done.finish_reason == "length" and done.queued_s == 0
    assert done.e2e_s == pytest.approx(done.queued_s + done.inference_s)
    assert done.inference_s == pytest.approx(done.prefill_s + done.decode_s)
    assert done.mean_time_per_output_token_s == pytest.approx(sum(itls) / 3)


def test_at_most_max_num_seqs_run_and_the_rest_wait_in_order() -> None:
    batcher = Batcher(profile(), max_num_seqs=2)
    for i in range(5):
        batcher.submit(f"r{i}", prompt=f"prompt {i}", prompt_tokens=3, max_tokens=2, now_s=0.0)
    step = batcher.plan(0.0)
    assert step is not None and step.prefill == ("r0", "r1")
    assert (batcher.num_running, batcher.num_waiting) == (2, 3)
    results = [batcher.complete(step), *run(batcher, step.end_s)]
    finished = [f.request_id for r in results for f in r.finished]
    assert finished == ["r0", "r1", "r2", "r3", "r4"]
    queued = {f.request_id: f.queued_s for r in results for f in r.finished}
    assert queued["r0"] == 0 and 0 < queued["r2"] < queued["r4"]
    assert (batcher.num_running, batcher.num_waiting, batcher.kv_usage) == (0, 0, 0.0)


def test_a_bigger_batch_decodes_slower() -> None:
    def itl(concurrent: int) -> float:
        batcher = Batcher(profile())
        for i in range(concurrent):
            batcher.submit(f"r{i}", prompt="p", prompt_tokens=100, max_tokens=3, now_s=0.0)
        return max(itl for r in run(batcher) for itl in r.inter_token_latency_s)

    assert itl(64) > itl(8) > itl(1)


def test_kv_capacity_holds_requests_back_and_usage_counts_tokens_held() -> None:
    batcher = Batcher(profile(kv_capacity_tokens=1000))
    for i in range(3):
        batcher.submit(f"r{i}", prompt="p", prompt_tokens=300, max_tokens=100, now_s=0.0)
    step = batcher.plan(0.0)
    assert step is not None and step.prefill == ("r0", "r1")  # a third 400-token context would need 1200
    assert batcher.num_waiting == 1
    batcher.complete(step)
    assert batcher.kv_usage == pytest.approx((301 + 301) / 1000)
    assert batcher.refusal(900, 200) is not None and batcher.refusal(900, 100) is None
    with pytest.raises(ValueError, match="KV cache"):
        batcher.submit("huge", prompt="p", prompt_tokens=900, max_tokens=101, now_s=0.0)


def test_a_request_longer_than_the_context_is_refused() -> None:
    batcher = Batcher(profile())
    assert "maximum context length is 8192" in (batcher.refusal(8000, 200) or "")


def test_max_num_batched_tokens_spreads_long_prompts_over_steps() -> None:
    batcher = Batcher(profile(), max_num_batched_tokens=1000)
    for i in range(3):
        batcher.submit(f"r{i}", prompt=f"p{i}", prompt_tokens=600, max_tokens=1, now_s=0.0)
    prefills = [step.prefill for step in iter(lambda: _step(batcher), None)]
    assert prefills == [("r0",), ("r1",), ("r2",)]


def _step(batcher: Batcher) -> object:
    step = batcher.plan(0.0)
    if step is not None:
        batcher.complete(step)
    return step


def test_a_repeated_prompt_hits_the_prefix_cache_and_prefills_faster() -> None:
    batcher = Batcher(profile())
    prompt = "The quick brown fox jumps over the lazy dog. " * 40  # 1800 characters, 28 whole blocks
    tokens = count_prompt_tokens(prompt)
    batcher.submit("first", prompt=prompt, prompt_tokens=tokens, max_tokens=1, now_s=0.0)
    first = batcher.plan(0.0)
    assert first is not None and first.prefix_hits == 0 and first.prefix_queries == tokens
    batcher.complete(first)
    batcher.submit("again", prompt=prompt, prompt_tokens=tokens, max_tokens=1, now_s=first.end_s)
    again = batcher.plan(first.end_s)
    assert again is not None and again.prefix_hits == 28 * 16
    assert again.duration_s < first.duration_s


def test_an_aborted_request_leaves_and_gets_no_more_tokens() -> None:
    batcher = Batcher(profile())
    batcher.submit("a", prompt="p", prompt_tokens=5, max_tokens=10, now_s=0.0)
    batcher.submit("b", prompt="q", prompt_tokens=5, max_tokens=2, now_s=0.0)
    step = batcher.plan(0.0)
    assert step is not None
    assert batcher.abort("a") and not batcher.abort("a")
    result = batcher.complete(step)
    assert [t.request_id for t in result.tokens] == ["b"]
    assert sum(len(r.tokens) for r in run(batcher, step.end_s)) == 1


def test_the_step_protocol_is_plan_then_complete() -> None:
    batcher = Batcher(profile())
    assert batcher.plan(0.0) is None
    batcher.submit("a", prompt="p", prompt_tokens=5, max_tokens=1, now_s=0.0)
    step = batcher.plan(0.0)
    with pytest.raises(RuntimeError):
        batcher.plan(0.0)
    assert step is not None and batcher.complete(step).finished
    with pytest.raises(ValueError, match="max_tokens"):
        batcher.submit("b", prompt="p", prompt_tokens=5, max_tokens=0, now_s=0.0)
