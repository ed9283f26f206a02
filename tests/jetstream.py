"""Reading a stream back in tests, with an ephemeral consumer (nothing is left behind)."""

from __future__ import annotations

import json
from typing import Any

from nats.js import JetStreamContext


async def read_all(js: JetStreamContext, *, stream: str, subject: str) -> list[dict[str, Any]]:
    """Every JSON object on ``subject`` in ``stream``, with its Nats-Msg-Id under ``_msg_id``.

    Messages that are not JSON objects are left out: the run's tests share each stream, and some
    publish garbage on purpose (a consumer must survive it)."""
    # Up to the stream's last message now: other processes of the run may still be publishing to it.
    last = (await js.stream_info(stream)).state.last_seq
    sub = await js.pull_subscribe(subject, stream=stream)
    out: list[dict[str, Any]] = []
    try:
        done = False
        while not done:
            try:
                msgs = await sub.fetch(256, timeout=0.5)
            except TimeoutError:
                break
            for msg in msgs:
                await msg.ack()
                if msg.metadata.sequence.stream >= last:
                    done = True
                try:
                    body = json.loads(msg.data)
                except ValueError:
                    continue
                if isinstance(body, dict):
                    body["_msg_id"] = (msg.headers or {}).get("Nats-Msg-Id")
                    out.append(body)
    finally:
        await sub.unsubscribe()
    return out
