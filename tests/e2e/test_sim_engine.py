"""The simulated engine as a client meets it: `python -m hetsched.engines.sim_server` started the way a
supervisor starts vLLM (with vLLM flags it ignores), /health 503 while the weights load and 200 after,
completions and a streamed chat completion through the official `openai` client, queueing beyond
``--max-num-seqs`` and the token counters on /metrics under vLLM's names, and SIGTERM: the request in
flight finishes, the process exits 0 and the port refuses connections."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from openai import NotFoundError, OpenAI
from prometheus_client.parser import text_string_to_metric_families

from tests.waiting import wait_for_sync

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
MODEL = "llama3-70b"  # 14 s of modelled weight load on H100 at TP 2: 0.7 s at the speedup, long enough to see 503
SERVED = "team/llama-70b"
SPEEDUP = 20
MAX_NUM_SEQS = 2
START_TIMEOUT_S = 60.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as reply:
            return int(reply.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None  # not listening yet


@dataclass
class Engine:
    proc: subprocess.Popen[str]
    port: int
    health_seen: list[int]

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> OpenAI:
        return OpenAI(base_url=f"{self.base}/v1", api_key="unused", max_retries=0, timeout=30)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        with urllib.request.urlopen(f"{self.base}/metrics", timeout=5) as reply:
            text = reply.read().decode()
        return {
            (sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
        }

    def value(self, name: str, **labels: str) -> float:
        key = (name, tuple(sorted({"model_name": SERVED, "engine": "0", **labels}.items())))
        return self.metrics()[key]


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": "2,3"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hetsched.engines.sim_server",
            "--model",
            MODEL,
            "--served-model-name",
            SERVED,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--tensor-parallel-size",
            "2",
            "--sku",
            "H100-SXM-80GB",
            "--dtype",
            "bfloat16",
            "--speedup",
            str(SPEEDUP),
            "--max-num-seqs",
            str(MAX_NUM_SEQS),
            "--trust-remote-code",  # vLLM flags the simulator ignores
            "--enable-prefix-caching",
            "--swap-space",
            "4",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen: list[int] = []

    def healthy() -> bool:
        if proc.poll() is not None:
            raise AssertionError(
                f"the engine exited with {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}"
            )
        status = _status(f"http://127.0.0.1:{port}/health")
        if status is not None and (not seen or seen[-1] != status):
            seen.append(status)
        return status == 200

    try:
        wait_for_sync(healthy, START_TIMEOUT_S, interval_s=0.01, what="/health 200")
        yield Engine(proc, port, seen)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout:
            proc.stdout.close()


def test_health_is_503_while_loading_then_200(engine: Engine) -> None:
    assert engine.health_seen == [503, 200]


def test_models_lists_the_served_name(engine: Engine) -> None:
    models = engine.client().models.list()
    assert [m.id for m in models.data] == [SERVED]


def test_a_completion_has_the_openai_shape_and_deterministic_text(engine: Engine) -> None:
    client = engine.client()
    prompt = "Write a haiku about schedulers."  # 31 characters: 8 prompt tokens
    first = client.completions.create(model=SERVED, prompt=prompt, max_tokens=7)
    again = client.completions.create(model=SERVED, prompt=prompt, max_tokens=7)
    assert first.object == "text_completion" and first.model == SERVED and first.id.startswith("cmpl-")
    assert len(first.choices) == 1 and first.choices[0].finish_reason == "length"
    assert len(first.choices[0].text.split()) == 7
    assert first.choices[0].text == again.choices[0].text
    assert first.usage is not None
    assert (first.usage.prompt_tokens, first.usage.completion_tokens, first.usage.total_tokens) == (8, 7, 15)
    default = client.completions.create(model=SERVED, prompt=prompt)
    assert default.usage is not None and default.usage.completion_tokens == 16


def test_a_streamed_chat_completion_arrives_token_by_token_with_usage(engine: Engine) -> None:
    stream = engine.client().chat.completions.create(
        model=SERVED,
        messages=[{"role": "user", "content": "Say something."}],
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    words = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(words) == 12
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert all(c.object == "chat.completion.chunk" and c.model == SERVED for c in chunks)
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None and usage.completion_tokens == 12


def test_errors_have_the_openai_shape(engine: Engine) -> None:
    client = engine.client()
    with pytest.raises(NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi")
    request = urllib.request.Request(f"{engine.base}/v1/completions", data=b"{not json", method="POST")
    with pytest.raises(urllib.error.HTTPError) as bad:
        urllib.request.urlopen(request, timeout=5)
    assert bad.value.code == 400 and b'"error"' in bad.value.read()
    request = urllib.request.Request(f"{engine.base}/v1/completions", data=b'{"prompt": "hi", "n": 2}', method="POST")
    with pytest.raises(urllib.error.HTTPError) as two:
        urllib.request.urlopen(request, timeout=5)
    assert two.value.code == 400 and b"n=1" in two.value.read()


def test_requests_beyond_max_num_seqs_wait_and_the_counters_grow(engine: Engine) -> None:
    before_prompt = engine.value("vllm:prompt_tokens_total")
    before_generated = engine.value("vllm:generation_tokens_total")
    before_done = engine.value("vllm:request_success_total", finished_reason="length")
    client = engine.client()
    requests = 6
    gauges: list[tuple[float, float]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            gauges.append((engine.value("vllm:num_requests_running"), engine.value("vllm:num_requests_waiting")))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with ThreadPoolExecutor(requests) as pool:
            replies = list(
                pool.map(
                    lambda i: client.completions.create(model=SERVED, prompt=f"request number {i:07d}", max_tokens=150),
                    range(requests),
                )
            )
    finally:
        stop.set()
        watcher.join()
    assert all(r.usage is not None and r.usage.completion_tokens == 150 for r in replies)
    assert max(running for running, _ in gauges) == MAX_NUM_SEQS  # never more than --max-num-seqs
    assert max(waiting for _, waiting in gauges) >= 1  # the rest queued
    assert engine.value("vllm:prompt_tokens_total") - before_prompt == requests * 6  # 22 characters: 6 tokens
    assert engine.value("vllm:generation_tokens_total") - before_generated == requests * 150
    assert engine.value("vllm:request_success_total", finished_reason="length") - before_done == requests
    assert engine.value("vllm:num_requests_running") == 0 and engine.value("vllm:num_requests_waiting") == 0
    assert engine.value("vllm:kv_cache_usage_perc") == 0
    # Latencies are the model's (simulated seconds), not the event loop's: a 70B decode step on H100 at
    # TP 2 is tens of milliseconds, and the queued requests waited for whole requests ahead of them.
    itl_count = engine.value("vllm:inter_token_latency_seconds_count")
    itl_mean = engine.value("vllm:inter_token_latency_seconds_sum") / itl_count
    assert 0.01 < itl_mean < 0.2, itl_mean
    assert engine.value("vllm:inter_token_latency_seconds_bucket", le="0.01") == 0
    assert engine.value("vllm:time_to_first_token_seconds_count") >= requests
    assert engine.value("vllm:request_queue_time_seconds_sum") > 1.0  # four requests waited ~150 steps or more
    assert engine.value("vllm:e2e_request_latency_seconds_count") >= requests
    assert engine.value("vllm:prefix_cache_queries_total") >= engine.value("vllm:prefix_cache_hits_total") >= 0


def test_sigterm_finishes_the_request_in_flight_exits_and_frees_the_port(engine: Engine) -> None:
    stream = engine.client().completions.create(model=SERVED, prompt="a long answer", max_tokens=300, stream=True)
    chunks = iter(stream)
    first = next(chunks)
    engine.proc.send_signal(signal.SIGTERM)
    rest = list(chunks)
    assert len([first, *rest]) == 300 and rest[-1].choices[0].finish_reason == "length"
    assert engine.proc.wait(timeout=15) == 0
    output = engine.proc.stdout.read() if engine.proc.stdout else ""
    assert "sim engine ready on" in output and "CUDA_VISIBLE_DEVICES=2,3" in output
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", engine.port), timeout=2):
        pass
