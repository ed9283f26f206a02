"""A simulated inference engine: an HTTP server that answers like vLLM's OpenAI-compatible server, with
the timing of the project's latency and memory models instead of a GPU.

    python -m hetsched.engines.sim_server --model llama3-8b --host 127.0.0.1 --port 8000 \\
        --tensor-parallel-size 1 --sku H100-SXM-80GB [--served-model-name NAME] [--dtype bf16] \\
        [--speedup 1] [--max-num-seqs 256] [--max-num-batched-tokens 8192] [--max-model-len N] \\
        [--gpu-memory-utilization 0.92] [--shutdown-grace-s 5]

Other vLLM flags are accepted and ignored, so a vLLM argument list runs as it is. The arithmetic (load
time, KV pool, continuous batching, prefill and decode times) lives in `shared.domain.serving`; this
module only speaks HTTP, sleeps the durations it returns (divided by ``--speedup``) and keeps the metrics.

Endpoints: ``/health`` (503 while the weights load, then 200), ``/v1/models``, ``/v1/completions``,
``/v1/chat/completions`` (``stream: true`` as server-sent events, ``stream_options.include_usage``) and
``/metrics`` (vLLM's metric names, `hetsched.engines.metrics`). SIGTERM or SIGINT: stop accepting,
let requests in flight finish for up to ``--shutdown-grace-s``, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from hetsched.engines.metrics import EngineMetrics
from shared.domain.dtypes import DTYPE_BYTES
from shared.domain.memory import DEFAULT_CEILING, DEFAULT_TOKENS_IN_FLIGHT
from shared.domain.serving import (
    DEFAULT_MAX_NUM_SEQS,
    Batcher,
    EngineProfile,
    Token,
    count_prompt_tokens,
    engine_profile,
    filler_token,
    text_seed,
)
from shared.infra.catalog import load_models, load_skus

log = logging.getLogger("hetsched.engines.sim_server")

DEFAULT_MAX_TOKENS = 16
KV_BLOCK_TOKENS = 16
"""Tokens per KV block, as vLLM's default `--block-size` (what `vllm:cache_config_info` reports)."""
# vLLM's --dtype spellings and ours; "auto" is the model's own dtype.
DTYPE_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


# ---------------------------------------------------------------------------------------------
# The engine: the batcher driven on a simulated clock


class Engine:
    """Runs `Batcher` steps: each step's modelled duration is slept divided by ``speedup``.

    The simulated clock (seconds) advances by the modelled durations while the engine is busy, and
    catches up with wall time x ``speedup`` when it is idle, so the latencies it reports are the
    model's, not the event loop's overhead magnified by the speedup."""

    def __init__(self, batcher: Batcher, metrics: EngineMetrics, *, speedup: float) -> None:
        self.batcher = batcher
        self.metrics = metrics
        self.speedup = speedup
        self._origin = time.monotonic()
        self._clock = 0.0
        self._busy = False
        self._wake = asyncio.Event()
        self._streams: dict[str, asyncio.Queue[Token]] = {}
        self._ids = itertools.count()

    def now_s(self) -> float:
        if not self._busy:
            self._clock = max(self._clock, (time.monotonic() - self._origin) * self.speedup)
        return self._clock

    def refusal(self, prompt_tokens: int, max_tokens: int) -> str | None:
        return self.batcher.refusal(prompt_tokens, max_tokens)

    @contextlib.asynccontextmanager
    async def generate(
        self, *, prompt: str, prompt_tokens: int, max_tokens: int
    ) -> AsyncIterator[asyncio.Queue[Token]]:
        """Queue a request; yields the queue its tokens arrive on. Leaving early aborts it."""
        request_id = f"req-{next(self._ids)}"
        queue: asyncio.Queue[Token] = asyncio.Queue()
        self.batcher.submit(
            request_id,
            prompt=prompt,
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens,
            now_s=self.now_s(),
        )
        self._streams[request_id] = queue
        self.metrics.request(max_tokens=max_tokens)
        self.metrics.scheduler(self.batcher)
        self._wake.set()
        try:
            yield queue
        finally:
            del self._streams[request_id]
            if self.batcher.abort(request_id):
                self.metrics.scheduler(self.batcher)

    async def run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._clock = self.now_s()
            self._busy = True
            try:
                while (step := self.batcher.plan(self._clock)) is not None:
                    self.metrics.scheduler(self.batcher)
                    await asyncio.sleep(step.duration_s / self.speedup)
                    result = self.batcher.complete(step)
                    self._clock = step.end_s
                    self.metrics.step(step, result)
                    self.metrics.scheduler(self.batcher)
                    for token in result.tokens:
                        stream = self._streams.get(token.request_id)
                        if stream is not None:
                            stream.put_nowait(token)
            finally:
                self._busy = False


# ---------------------------------------------------------------------------------------------
# OpenAI-compatible HTTP


class RequestError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 503: "ServiceUnavailableError"}


def error_response(status: int, message: str, *, param: str | None = None) -> web.Response:
    """An OpenAI-style error body: ``{"error": {"message", "type", "param", "code"}}``."""
    body = {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"), "param": param, "code": status}}
    return web.json_response(body, status=status)


@dataclass(frozen=True)
class Parsed:
    prompt: str
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        return "".join(str(p) for p in parts)
    raise RequestError(400, "message content must be a string or a list of content parts", param="messages")


def _positive_int(body: dict[str, Any], *names: str, default: int) -> int:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise RequestError(400, f"{name} must be an integer >= 1, got {value!r}", param=name)
        return value
    return default


class Server:
    def __init__(self, *, engine: Engine, profile: EngineProfile, model: str, served_model_name: str) -> None:
        self.engine = engine
        self.profile = profile
        self.model = model
        self.served = served_model_name
        self.ready = False
        self.created = int(time.time())

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors])
        app.router.add_get("/health", self.health)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            response: web.StreamResponse = await handler(request)
            return response
        except RequestError as exc:
            return error_response(exc.status, exc.message, param=exc.param)

    async def health(self, request: web.Request) -> web.Response:
        if not self.ready:
            return web.json_response({"status": "loading"}, status=503)
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.served,
            "object": "model",
            "created": self.created,
            "owned_by": "hetsched",
            "root": self.model,
            "parent": None,
            "max_model_len": self.profile.max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def metrics(self, request: web.Request) -> web.Response:
        body = self.engine.metrics.exposition()
        return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def _body(self, request: web.Request) -> dict[str, Any]:
        if not self.ready:
            raise RequestError(503, "the model is still loading")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise RequestError(400, f"the request body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the request body must be a JSON object")
        model = body.get("model", self.served)
        if model != self.served:
            raise RequestError(404, f"The model `{model}` does not exist.", param="model")
        n = body.get("n", 1)
        if n != 1:
            raise RequestError(400, f"only n=1 is supported, got n={n!r}", param="n")
        return body

    def _parsed(self, body: dict[str, Any], prompt: str, prompt_tokens: int, *names: str) -> Parsed:
        max_tokens = _positive_int(body, *names, default=DEFAULT_MAX_TOKENS)
        why = self.engine.refusal(prompt_tokens, max_tokens)
        if why is not None:
            raise RequestError(400, why)
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise RequestError(400, "stream_options must be an object", param="stream_options")
        return Parsed(prompt, prompt_tokens, max_tokens, bool(body.get("stream")), bool(options.get("include_usage")))

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            text, tokens = " ".join(str(t) for t in prompt), len(prompt)
        elif isinstance(prompt, str):
            text, tokens = prompt, count_prompt_tokens(prompt)
        else:
            raise RequestError(400, "prompt must be a string, one string in a list, or token ids", param="prompt")
        parsed = self._parsed(body, text, tokens, "max_tokens")
        return await self._serve(request, parsed, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request)
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise RequestError(400, "messages must be a non-empty list of message objects", param="messages")
        text = "".join(f"{m.get('role', 'user')}: {_content_text(m.get('content'))}\n" for m in messages)
        parsed = self._parsed(body, text, count_prompt_tokens(text), "max_completion_tokens", "max_tokens")
        return await self._serve(request, parsed, chat=True)

    async def _serve(self, request: web.Request, parsed: Parsed, *, chat: bool) -> web.StreamResponse:
        reply_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        seed = text_seed(parsed.prompt)
        usage = {
            "prompt_tokens": parsed.prompt_tokens,
            "completion_tokens": parsed.max_tokens,
            "total_tokens": parsed.prompt_tokens + parsed.max_tokens,
        }
        head = {"id": reply_id, "created": created, "model": self.served}
        generating = self.engine.generate(
            prompt=parsed.prompt, prompt_tokens=parsed.prompt_tokens, max_tokens=parsed.max_tokens
        )
        async with generating as queue:
            if not parsed.stream:
                words = [filler_token(seed, (await queue.get()).index) for _ in range(parsed.max_tokens)]
                text = "".join(words)
                if chat:
                    choice: dict[str, Any] = {
                        "index": 0,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": None,
                        "finish_reason": "length",
                    }
                else:
                    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"}
                obj = "chat.completion" if chat else "text_completion"
                return web.json_response({**head, "object": obj, "choices": [choice], "usage": usage})
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
            await response.prepare(request)
            obj = "chat.completion.chunk" if chat else "text_completion"
            extra = {"usage": None} if parsed.include_usage else {}

            async def send(payload: dict[str, Any]) -> None:
                await response.write(f"data: {json.dumps(payload)}\n\n".encode())

            if chat:
                first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
                await send({**head, "object": obj, "choices": [{**first, "finish_reason": None}], **extra})
            finished = False
            while not finished:
                token = await queue.get()
                finished = token.finished
                word = filler_token(seed, token.index)
                reason = "length" if finished else None
                if chat:
                    choice = {"index": 0, "delta": {"content": word}, "logprobs": None, "finish_reason": reason}
                else:
                    choice = {"index": 0, "text": word, "logprobs": None, "finish_reason": reason}
                await send({**head, "object": obj, "choices": [choice], **extra})
            if parsed.include_usage:
                await send({**head, "object": obj, "choices": [], "usage": usage})
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response


# ---------------------------------------------------------------------------------------------
# Command line


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hetsched.engines.sim_server",
        description="A simulated vLLM-compatible inference engine (timing from hetsched's latency model).",
        allow_abbrev=False,
    )
    p.add_argument("--model", required=True, help="catalog model name (shared/catalog/models.yaml)")
    p.add_argument("--served-model-name", default=None, help="the name clients ask for (default: --model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--sku", required=True, help="catalog SKU name (shared/catalog/skus.yaml)")
    p.add_argument("--dtype", default="auto", help="weight dtype: auto (the model's), bf16, fp16, fp8, ...")
    p.add_argument("--kv-cache-dtype", default="auto", help="KV cache dtype: auto (the model's), bf16, fp8, ...")
    p.add_argument("--speedup", type=float, default=1.0, help="divide every modelled wait by this")
    p.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS)
    p.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_TOKENS_IN_FLIGHT)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_CEILING)
    p.add_argument("--shutdown-grace-s", type=float, default=5.0, help="wall seconds in-flight requests get")
    return p


def _dtype(value: str, default: str) -> str:
    name = DTYPE_ALIASES.get(value.lower(), value.lower())
    if name == "auto":
        return default
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {value!r}; expected auto, {', '.join(DTYPE_BYTES)} or a vLLM spelling")
    return name


def build(args: argparse.Namespace) -> tuple[Server, Engine]:
    models, skus = load_models(), load_skus()
    if args.model not in models:
        raise ValueError(f"unknown model {args.model!r}; the catalog has {', '.join(sorted(models))}")
    if args.sku not in skus:
        raise ValueError(f"unknown SKU {args.sku!r}; the catalog has {', '.join(sorted(skus))}")
    if args.speedup <= 0:
        raise ValueError(f"--speedup must be > 0, got {args.speedup}")
    spec = models[args.model]
    profile = engine_profile(
        spec,
        skus[args.sku],
        tp=args.tensor_parallel_size,
        dtype=_dtype(args.dtype, spec.dtype),
        kv_dtype=_dtype(args.kv_cache_dtype, spec.kv_dtype),
        ceiling=args.gpu_memory_utilization,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
    )
    served = args.served_model_name or args.model
    batcher = Batcher(profile, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    metrics = EngineMetrics(model_name=served, max_model_len=profile.max_model_len)
    metrics.cache_config(num_gpu_blocks=profile.kv_capacity_tokens // KV_BLOCK_TOKENS, block_size=KV_BLOCK_TOKENS)
    engine = Engine(batcher, metrics, speedup=args.speedup)
    return Server(engine=engine, profile=profile, model=args.model, served_model_name=served), engine


async def serve(args: argparse.Namespace) -> int:
    """Load, serve until SIGTERM or SIGINT, drain; 0, or 1 when the engine loop failed."""
    server, engine = build(args)
    profile = server.profile
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(server.app(), shutdown_timeout=args.shutdown_grace_s, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    engine_task = asyncio.create_task(engine.run(), name="sim-engine")

    def engine_ended(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("sim engine loop failed: %r; stopping", task.exception())
            stop.set()

    engine_task.add_done_callback(engine_ended)
    log.info(
        "sim engine loading: model=%s sku=%s tp=%d weights=%.2f GB per accelerator load_s=%.2f "
        "(modelled; %.3f s at speedup %g) CUDA_VISIBLE_DEVICES=%s",
        args.model,
        args.sku,
        args.tensor_parallel_size,
        profile.weight_bytes_per_accelerator / 1e9,
        profile.load_s,
        profile.load_s / args.speedup,
        args.speedup,
        os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"),
    )
    loading = asyncio.create_task(asyncio.sleep(profile.load_s / args.speedup))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({loading, stopping}, return_when=asyncio.FIRST_COMPLETED)
    if not stop.is_set():
        server.ready = True
        log.info(
            "sim engine ready on http://%s:%d served_model_name=%s kv_capacity_tokens=%d max_num_seqs=%d",
            args.host,
            args.port,
            server.served,
            profile.kv_capacity_tokens,
            args.max_num_seqs,
        )
        await stopping
    loading.cancel()
    log.info("sim engine stopping: %d running, %d waiting", engine.batcher.num_running, engine.batcher.num_waiting)
    await site.stop()  # no new connections
    await runner.cleanup()  # in-flight requests get shutdown_timeout to finish
    failed = engine_task.done() and not engine_task.cancelled() and engine_task.exception() is not None
    engine_task.cancel()
    with contextlib.suppress(BaseException):
        await engine_task
    log.info("sim engine stopped")
    return 1 if failed else 0


def main(argv: Sequence[str] | None = None) -> int:
    args, unknown = parser().parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if unknown:
        log.info("ignoring engine flags the simulator does not model: %s", " ".join(unknown))
    try:
        return asyncio.run(serve(args))
    except (ValueError, OSError) as exc:
        print(f"sim_server: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
