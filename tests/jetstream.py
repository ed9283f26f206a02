"""Reading a stream back in tests, with an ephemeral consumer (nothing is left behind)."""

from __future__ import annotations

import json
from typing import Any

from nats.js import JetStreamContext


async def read_all(js: JetStreamContext, *, stream: str, subject: str) -> list[dict[str, Any]]:
    """Every message on ``subject`` in ``stream`` as parsed JSON, with its Nats-Msg-Id under ``_msg_id``."""
    sub = await js.pull_subscribe(subject, stream=stream)
    out: list[dict[str, Any]] = []
    try:
        while True:
            try:
                msgs = await sub.fetch(256, timeout=0.5)
            except TimeoutError:
                break
            for msg in msgs:
                body = json.loads(msg.data)
                body["_msg_id"] = (msg.headers or {}).get("Nats-Msg-Id")
                out.append(body)
                await msg.ack()
    finally:
        await sub.unsubscribe()
    return out
