"""Dead letters: events a consumer gave up on, parked in the DEADLETTER stream for an operator.

A consumer dead-letters an event that is not an envelope or whose payload is off its contract at
once (redelivering it cannot help), and an event whose handler keeps failing after
``HETSCHED_EVENT_MAX_DELIVERIES`` deliveries. The dead letter is the original message body on
``<prefix>.deadletter.<context>.<durable>`` with headers naming the error and where it came from;
``replay`` publishes it again on its original subject (consumers that applied it already skip it:
their inbox knows its event id).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from nats import errors as nats_errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext

ERROR = "Hetsched-Error"
ORIGINAL_SUBJECT = "Hetsched-Original-Subject"
ORIGINAL_STREAM = "Hetsched-Original-Stream"
ORIGINAL_SEQUENCE = "Hetsched-Original-Sequence"
CONSUMER = "Hetsched-Consumer"
DELIVERIES = "Hetsched-Deliveries"
TRUNCATED = "Hetsched-Body-Dropped"
ERROR_MAX = 500


class UnappliableEvent(Exception):
    """A message no redelivery can apply (not an envelope, a payload off its contract): dead-letter it now."""


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One parked event, as ``hetsched deadletter list`` shows it."""

    sequence: int
    subject: str
    original_subject: str
    original_sequence: str
    consumer: str
    deliveries: str
    error: str
    body: bytes


def _header_value(text: str) -> str:
    # NATS headers are one line each.
    return " ".join(text.split())[:ERROR_MAX]


def redelivery_delay_s(failures: int, *, base_s: float, max_s: float) -> float:
    """Backoff before the next delivery of an event that failed ``failures`` times: doubles, capped."""
    return float(min(max_s, base_s * 2 ** max(0, failures - 1)))


async def dead_letter(
    js: JetStreamContext, *, subject: str, message: Msg, consumer: str, error: str, deliveries: int
) -> None:
    """Publish ``message`` to the DEADLETTER stream (``subject``) with headers saying why and whence.

    The dead letter's ``Nats-Msg-Id`` is the consumer and the original stream sequence, so a retry
    after a crash between this publish and the original's ack adds no second copy. A body too large
    to carry with the headers is dropped (the original sequence still finds it in its own stream).
    """
    meta = message.metadata
    headers = {
        "Nats-Msg-Id": f"{consumer}:{meta.stream}:{meta.sequence.stream}",
        ERROR: _header_value(error),
        ORIGINAL_SUBJECT: message.subject,
        ORIGINAL_STREAM: meta.stream,
        ORIGINAL_SEQUENCE: str(meta.sequence.stream),
        CONSUMER: consumer,
        DELIVERIES: str(deliveries),
    }
    try:
        await js.publish(subject, message.data, headers=headers)
    except nats_errors.MaxPayloadError:
        await js.publish(subject, b"", headers={**headers, TRUNCATED: "true"})


async def list_dead_letters(js: JetStreamContext, *, stream: str, limit: int = 100) -> list[DeadLetter]:
    """The oldest ``limit`` dead letters still in ``stream`` (read without a consumer)."""
    info = await js.stream_info(stream)
    found: list[DeadLetter] = []
    sequence = info.state.first_seq
    while sequence and sequence <= info.state.last_seq and len(found) < limit:
        try:
            raw = await js.get_msg(stream, sequence)
        except Exception:  # deleted (replayed) or aged out: skip the gap
            sequence += 1
            continue
        headers = raw.headers or {}
        found.append(
            DeadLetter(
                sequence=sequence,
                subject=raw.subject or "",
                original_subject=headers.get(ORIGINAL_SUBJECT, ""),
                original_sequence=headers.get(ORIGINAL_SEQUENCE, ""),
                consumer=headers.get(CONSUMER, ""),
                deliveries=headers.get(DELIVERIES, ""),
                error=headers.get(ERROR, ""),
                body=raw.data or b"",
            )
        )
        sequence += 1
    return found


async def replay(js: JetStreamContext, *, stream: str, sequence: int) -> str:
    """Publish dead letter ``sequence`` again on its original subject, then delete it; returns that subject.

    A fresh ``Nats-Msg-Id`` keeps JetStream's duplicate window from dropping the replay.
    """
    raw = await js.get_msg(stream, sequence)
    original = str((raw.headers or {}).get(ORIGINAL_SUBJECT) or "")
    if not original:
        raise ValueError(f"message {sequence} of {stream} is not a dead letter")
    await js.publish(original, raw.data or b"", headers={"Nats-Msg-Id": f"replay:{uuid.uuid4()}"})
    await js.delete_msg(stream, sequence)
    return original
