"""The one trust check of an event read off the bus, for durable consumers (``bus.consume``) and followers
(``follow.Follower``) alike: an envelope, of the stream's context, from that context's only publisher, a
payload that matches its contract, and (a node-scoped event) naming the node of the subject it came on."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from pydantic import ValidationError

from shared.contracts.base import ECHO_MAX, echo
from shared.contracts.envelope import EventEnvelope
from shared.contracts.permissions import EVENT_PUBLISHERS, NODE_SCOPED_EVENTS
from shared.contracts.registry import EVENTS
from shared.contracts.subjects import Context, names_scope
from shared.infra.deadletter import UnappliableEvent

PART_MAX = 200  # one part of an error message (a validator's own words)


def summarise(error: ValidationError) -> str:
    """A validation error in one line: the first few fields and what is wrong with each."""
    parts = []
    for item in error.errors()[:5]:
        where = ".".join(str(p) for p in item["loc"])[:ECHO_MAX] or "body"
        parts.append(f"field '{where}': {item['msg'][:PART_MAX]}")
    return "; ".join(parts)


class EventReader:
    """Opens one context's events: ``envelope`` checks what every event must be, ``payload`` what one of a
    name this reader handles must carry. Both raise ``UnappliableEvent`` (no redelivery can fix it)."""

    def __init__(self, context: Context, *, publisher: str | None = None) -> None:
        self.context = context
        self.publisher = publisher or EVENT_PUBLISHERS[context]
        self._scoped: Collection[str] = frozenset(NODE_SCOPED_EVENTS.get(context, ()))

    def envelope(self, raw: bytes) -> tuple[EventEnvelope, str]:
        """The envelope and the event's name (``allocation_committed``)."""
        try:
            event = EventEnvelope.model_validate_json(raw)
        except ValidationError as exc:
            raise UnappliableEvent(f"not an event envelope: {summarise(exc)}") from None
        kind, _, name = event.type.rpartition(".")
        if kind != self.context.value:
            raise UnappliableEvent(f"a {echo(event.type)} event does not belong to the {self.context.value} stream")
        if event.source != self.publisher:
            raise UnappliableEvent(
                f"{self.context.value} events come from {self.publisher}, not from {echo(event.source)}"
            )
        return event, name

    def payload(self, event: EventEnvelope, name: str, subject: str | None) -> Any:
        """The payload as its contract model (a dict for an event with no contract), checked against the
        subject it came on when the event is a node's own report."""
        model = EVENTS.get((self.context, name))
        try:
            payload = model.model_validate(event.payload) if model is not None else event.payload
        except ValidationError as exc:
            raise UnappliableEvent(f"{event.type} payload does not match its contract: {summarise(exc)}") from None
        if name in self._scoped and subject is not None:
            node = getattr(payload, "node", None)
            if not isinstance(node, str) or not names_scope(subject, node):
                raise UnappliableEvent(f"{event.type} names node {echo(node)} but came on {echo(subject)}")
        return payload
