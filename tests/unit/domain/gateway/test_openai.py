"""What the gateway reads from an OpenAI request (``shared.domain.gateway.openai``)."""

from __future__ import annotations

import pytest

from shared.domain.gateway.openai import BadRequest, parse_ask, upstream_body


def ask(body: object, headers: dict[str, str] | None = None, api: str = "chat.completions"):  # type: ignore[no-untyped-def]
    return parse_ask(api, body, headers or {}, chars_per_token=4.0, default_output_tokens=256)  # type: ignore[arg-type]


def test_a_chat_request_is_estimated_from_its_messages_and_takes_hints_from_headers_first() -> None:
    body = {
        "model": "chat-long",
        "messages": [
            {"role": "system", "content": "x" * 40},
            {"role": "user", "content": [{"type": "text", "text": "y" * 80}]},
        ],
        "max_tokens": 32,
        "stream": True,
        "metadata": {"session_id": "from-body", "slo_ttft_ms": 300, "engine_hint": "ssm"},
    }
    parsed = ask(body, {"x-session-id": "from-header", "x-hetsched-slo-ttft-ms": "150"})
    assert parsed.input_tokens == 120 // 4 + 2 * 4  # characters / 4, plus each message's template tokens
    assert parsed.output_tokens == 32 and parsed.stream and not parsed.include_usage
    assert parsed.session_id == "from-header" and parsed.ttft_ms == 150 and parsed.hint == "ssm"


def test_a_completion_counts_token_ids_exactly_and_defaults_its_output() -> None:
    parsed = ask({"model": "llama3-8b", "prompt": [1, 2, 3, 4, 5]}, api="completions")
    assert parsed.input_tokens == 5 and parsed.output_tokens == 256 and not parsed.stream


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([], None),
        ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"content": "hi"}]}, "messages[0]"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2.5}, "max_tokens"),
        ({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"}, "stream"),
        (
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "metadata": {"engine_hint": "gpu"}},
            "engine_hint",
        ),
    ],
)
def test_what_is_not_a_request_is_refused_naming_the_field(body: object, param: str | None) -> None:
    with pytest.raises(BadRequest) as refused:
        ask(body)
    assert refused.value.param == param


def test_a_bad_slo_header_is_refused() -> None:
    with pytest.raises(BadRequest, match="x-hetsched-slo-ttft-ms"):
        ask({"model": "m", "messages": [{"role": "user", "content": "hi"}]}, {"x-hetsched-slo-ttft-ms": "soon"})


def test_the_engine_gets_the_served_model_and_the_usage_chunk_without_hetsched_metadata() -> None:
    body = {"model": "chat-long", "messages": [], "stream": True, "metadata": {"session_id": "s"}}
    out = upstream_body(body, model="mamba2-2.7b", stream=True)
    assert out["model"] == "mamba2-2.7b" and "metadata" not in out
    assert out["stream_options"] == {"include_usage": True}
    assert body["model"] == "chat-long"  # the client's body is not changed
