"""OpenAI-compatible requests as the gateway reads them, and errors in OpenAI's shape. Pure: no IO.

The gateway reads only what routing and admission need (the model, an estimate of the prompt's tokens,
the output it may produce, whether it streams, the hetsched hints); the body goes to the engine as the
client sent it, but for the model, which becomes the catalog model of the replica admission chose.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Api = Literal["chat.completions", "completions"]
Hint = Literal["auto", "transformer", "ssm", "moe"]

MAX_TOKENS = 2_000_000
"""The most tokens one request may ask to generate (admission's own limit, ``MAX_ADMIT_TOKENS``)."""

MESSAGE_OVERHEAD_TOKENS = 4
"""Tokens a chat template adds per message (role markers), as OpenAI's cookbook counts them."""

HEADER_SESSION = ("x-session-id", "x-hetsched-session")
HEADER_REGION = "x-hetsched-region"
HEADER_TTFT = "x-hetsched-slo-ttft-ms"
HEADER_TPOT = "x-hetsched-slo-tpot-ms"
HEADER_HINT = "x-hetsched-engine-hint"
HINTS: tuple[str, ...] = ("auto", "transformer", "ssm", "moe")


class BadRequest(ValueError):
    """The request cannot be served as sent: ``param`` names the field (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class Ask:
    """What the gateway learned from one request."""

    api: Api
    model: str
    input_tokens: int
    output_tokens: int
    stream: bool
    include_usage: bool  # the client asked for the usage chunk of a stream
    session_id: str | None
    origin_region: str | None
    ttft_ms: float | None
    tpot_ms: float | None
    hint: Hint


def error_body(message: str, *, type: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def estimate_tokens(chars: int, chars_per_token: float) -> int:
    return max(1, math.ceil(chars / chars_per_token))


def _text_chars(content: object, param: str) -> int:
    """Characters of a message's content: a string, or a list of parts whose `text` parts count."""
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        total = 0
        for part in content:
            if not isinstance(part, Mapping):
                raise BadRequest("each content part must be an object", param)
            text = part.get("text")
            if isinstance(text, str):
                total += len(text)
        return total
    raise BadRequest("content must be a string or a list of parts", param)


def _prompt_chars(api: Api, body: Mapping[str, Any]) -> tuple[int, int]:
    """(characters, extra tokens) of the prompt."""
    if api == "chat.completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise BadRequest("messages must be a non-empty list", "messages")
        chars = 0
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
                raise BadRequest("each message must be an object with a role", f"messages[{i}]")
            chars += _text_chars(message.get("content"), f"messages[{i}].content")
        return chars, MESSAGE_OVERHEAD_TOKENS * len(messages)
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return len(prompt), 0
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return sum(len(p) for p in prompt), 0
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return -len(prompt), 0  # token ids: counted exactly (negative: tokens, not characters)
    raise BadRequest("prompt must be a string, a list of strings or a list of token ids", "prompt")


def _positive(value: object, param: str, *, limit: float = MAX_TOKENS) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= limit:
        raise BadRequest(f"{param} must be a number above 0 and at most {limit:g}", param)
    return float(value)


def _header_number(headers: Mapping[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        raise BadRequest(f"header {name} must be a number of milliseconds", name) from None
    if not 0 < value < 3_600_000 or math.isnan(value):
        raise BadRequest(f"header {name} must be above 0 and under an hour", name)
    return value


def parse_ask(
    api: Api,
    body: object,
    headers: Mapping[str, str],
    *,
    chars_per_token: float,
    default_output_tokens: int,
) -> Ask:
    """The ``Ask`` of one request (``headers`` with lower-case names); ``BadRequest`` when it is not one.

    Hints come from headers or the body's ``metadata`` (``session_id``, ``slo_ttft_ms``, ``slo_tpot_ms``,
    ``engine_hint``, ``region``), headers first."""
    if not isinstance(body, Mapping):
        raise BadRequest("the body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model.strip():
        raise BadRequest("model is required", "model")
    chars, extra = _prompt_chars(api, body)
    input_tokens = -chars if chars < 0 else estimate_tokens(chars, chars_per_token) + extra
    raw_max = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _positive(raw_max, "max_tokens")
    if max_tokens is not None and max_tokens != int(max_tokens):
        raise BadRequest("max_tokens must be a whole number", "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream must be true or false", "stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise BadRequest("stream_options must be an object", "stream_options")
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, Mapping):
        raise BadRequest("metadata must be an object", "metadata")
    meta: Mapping[str, Any] = metadata or {}
    session = next((headers[h] for h in HEADER_SESSION if headers.get(h)), None) or meta.get("session_id")
    if session is not None and (not isinstance(session, str) or not 0 < len(session) <= 200):
        raise BadRequest("the session id must be a string of at most 200 characters", "session_id")
    hint = headers.get(HEADER_HINT) or meta.get("engine_hint") or "auto"
    if hint not in HINTS:
        raise BadRequest(f"the engine hint must be one of {', '.join(HINTS)}", "engine_hint")
    region = headers.get(HEADER_REGION) or meta.get("region")
    if region is not None and not isinstance(region, str):
        raise BadRequest("region must be a string", "region")
    ttft = _header_number(headers, HEADER_TTFT)
    if ttft is None:
        ttft = _positive(meta.get("slo_ttft_ms"), "metadata.slo_ttft_ms", limit=3_600_000)
    tpot = _header_number(headers, HEADER_TPOT)
    if tpot is None:
        tpot = _positive(meta.get("slo_tpot_ms"), "metadata.slo_tpot_ms", limit=3_600_000)
    if input_tokens > MAX_TOKENS:
        raise BadRequest(f"the prompt is about {input_tokens} tokens: at most {MAX_TOKENS}", "messages")
    return Ask(
        api=api,
        model=model,
        input_tokens=input_tokens,
        output_tokens=int(max_tokens) if max_tokens is not None else default_output_tokens,
        stream=stream,
        include_usage=bool(options and options.get("include_usage")),
        session_id=session,
        origin_region=region,
        ttft_ms=ttft,
        tpot_ms=tpot,
        hint=hint,  # type: ignore[arg-type]  # checked against HINTS above
    )


def upstream_body(body: Mapping[str, Any], *, model: str, stream: bool) -> dict[str, Any]:
    """The body the engine gets: the client's, with the served catalog model, without hetsched's metadata,
    and (streamed) asking for the usage chunk, which the gateway needs for billing."""
    out = {k: v for k, v in body.items() if k != "metadata"}
    out["model"] = model
    if stream:
        options = dict(body.get("stream_options") or {})
        options["include_usage"] = True
        out["stream_options"] = options
    return out
