"""Reading an engine's SSE lines (``shared.domain.gateway.sse``)."""

from __future__ import annotations

from shared.domain.gateway.sse import read_line, split_events, usage_counts


def test_a_token_a_usage_chunk_and_the_end() -> None:
    token = read_line(b'data: {"choices": [{"index": 0, "delta": {"content": "Hi"}}], "usage": null}\n')
    assert token.token and token.usage is None and not token.done
    role = read_line(b'data: {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}\n')
    assert not role.token
    text = read_line(b'data: {"choices": [{"index": 0, "text": "Hi"}]}\n')
    assert text.token
    usage = read_line(b'data: {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3}}\n')
    assert usage.usage_only and usage_counts(usage.usage) == (7, 3)
    assert read_line(b"data: [DONE]\n").done


def test_what_is_not_data_holds_nothing() -> None:
    for line in (b"\n", b": keep-alive\n", b"data: {not json\n", b"data: [1, 2]\n", b"event: x\n"):
        chunk = read_line(line)
        assert not chunk.token and chunk.usage is None and not chunk.done
    assert usage_counts({"prompt_tokens": -1, "completion_tokens": "3"}) == (0, 0)


def test_whole_events_are_split_from_a_partial_one() -> None:
    assert split_events(b'data: {"a": 1}\n\ndata: {"b"') == (b'data: {"a": 1}\n\n', b'data: {"b"')
    assert split_events(b"data: [DO") == (b"", b"data: [DO")
    assert split_events(b"data: 1\n\ndata: 2\n\n") == (b"data: 1\n\ndata: 2\n\n", b"")
