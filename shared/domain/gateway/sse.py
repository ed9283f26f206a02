"""Reading an engine's server-sent events as they pass through the gateway. Pure: no IO.

The gateway looks at each ``data:`` line only as far as it must: whether it carries a token (the first
one ends the failover window and is the TTFT), whether it is the usage chunk (what billing needs; the
gateway asked for it, and hides it from a client that did not), and ``[DONE]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = b"data: [DONE]"


@dataclass(frozen=True, slots=True)
class Chunk:
    token: bool  # it carries generated text
    usage: dict[str, Any] | None  # the usage chunk's counts
    usage_only: bool  # a chunk with no choices, only usage (hidden from a client that did not ask)
    done: bool


NOTHING = Chunk(token=False, usage=None, usage_only=False, done=False)


def split_events(data: bytes) -> tuple[bytes, bytes]:
    """(the whole events in ``data``, each ending with its blank line; what follows the last of them)."""
    end = data.rfind(b"\n\n")
    if end < 0:
        return b"", data
    return data[: end + 2], data[end + 2 :]


def read_line(line: bytes) -> Chunk:
    """What one line of an SSE stream holds (blank lines, comments and unparsable data hold nothing)."""
    if not line.startswith(b"data:"):
        return NOTHING
    data = line[5:].strip()
    if data == b"[DONE]":
        return Chunk(token=False, usage=None, usage_only=False, done=True)
    try:
        chunk = json.loads(data)
    except ValueError:
        return NOTHING
    if not isinstance(chunk, dict):
        return NOTHING
    choices = chunk.get("choices") or []
    token = any(_has_text(c) for c in choices if isinstance(c, dict))
    usage = chunk.get("usage")
    usage = usage if isinstance(usage, dict) else None
    return Chunk(token=token, usage=usage, usage_only=usage is not None and not choices, done=False)


def _has_text(choice: dict[str, Any]) -> bool:
    delta = choice.get("delta")
    if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls") or delta.get("reasoning_content")):
        return True
    return bool(choice.get("text"))


def usage_counts(usage: dict[str, Any] | None) -> tuple[int, int]:
    """(prompt, completion) tokens of an OpenAI usage object; (0, 0) when absent or malformed."""
    if not usage:
        return 0, 0
    prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (
        prompt if isinstance(prompt, int) and prompt >= 0 else 0,
        completion if isinstance(completion, int) and completion >= 0 else 0,
    )
