"""The recent placements the console shows: the PLACEMENT stream's last decisions (`placement_decided`,
`placement_rejected`) with their explanations, and which replicas were released since, followed live with
a JetStream ordered consumer (in memory, no acknowledgements, restarted by the client on a gap)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict, deque
from typing import Any

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy
from pydantic import ValidationError

from shared.contracts.envelope import EventEnvelope
from shared.contracts.permissions import EVENT_PUBLISHERS
from shared.contracts.placement import (
    PLACEMENT_DECIDED,
    PLACEMENT_REJECTED,
    PLACEMENT_RELEASED,
    PlacementEvent,
    PlacementReleasedEvent,
)
from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context, Subjects

log = logging.getLogger("hetsched.console")

RECENT = 50  # decisions kept for the page
BACKLOG = 2_000  # events read back from the stream at start (released ones included)
KNOWN_MAX = 10_000  # allocations remembered (tenant, model) to label what the ledger shows
RETRY_S = 1.0


def decision_row(sequence: int, name: str, envelope: EventEnvelope, event: PlacementEvent) -> dict[str, Any]:
    """One decision as the page lists it: the outcome, where, and the explanation."""
    reply = event.reply
    return {
        "sequence": sequence,
        "event": name,
        "occurred_at": envelope.occurred_at.isoformat(),
        "request_id": event.request_id,
        "tenant": event.tenant,
        "model": event.model,
        "status": reply.status,
        "allocation_id": reply.allocation_id,
        "backend": reply.backend,
        "region": reply.region,
        "cluster": reply.cluster,
        "sku": reply.sku,
        "tp": reply.tp,
        "pp": reply.pp,
        "sharing": reply.sharing,
        "placements": [p.model_dump(mode="json") for p in reply.placements],
        "tpu_slice": reply.tpu_slice.model_dump(mode="json") if reply.tpu_slice else None,
        "score": reply.score,
        "explanation": reply.explanation,
        "fallback": reply.fallback,
        "error": reply.error.model_dump(mode="json") if reply.error else None,
        "decision_ms": event.decision_ms,
        "attempts": event.attempts,
        "released": None,
    }


class PlacementFeed:
    """The last ``RECENT`` decisions, newest first, and the allocations they made (for labels)."""

    def __init__(self, *, recent: int = RECENT, backlog: int = BACKLOG) -> None:
        self._recent: deque[dict[str, Any]] = deque(maxlen=recent)
        self._backlog = backlog
        self._known: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._task: asyncio.Task[None] | None = None
        self._subscription: Any = None
        self.problem = "not started"

    # -- what the page reads ---------------------------------------------------------------------

    def placements(self) -> list[dict[str, Any]]:
        """Newest first, each with ``released`` (the reason) once its replica has ended."""
        rows = []
        for row in reversed(self._recent):
            known = self._known.get(row["allocation_id"] or "")
            rows.append({**row, "released": known.get("released") if known else None})
        return rows

    def allocations(self) -> dict[str, dict[str, Any]]:
        """Allocation id -> who placed it and what (tenant, model, TP, SKU), for the allocations seen."""
        return {k: dict(v) for k, v in self._known.items()}

    def labels(self, allocation_ids: list[str]) -> dict[str, dict[str, Any]]:
        """Who placed these allocations and what, for those seen (no copy of the rest)."""
        return {a: dict(self._known[a]) for a in allocation_ids if a in self._known}

    # -- what the stream feeds -------------------------------------------------------------------

    def apply(self, sequence: int, subject: str, data: bytes) -> None:
        """Fold one PLACEMENT event; anything else (malformed, from another publisher) is skipped."""
        try:
            envelope = EventEnvelope.model_validate_json(data)
        except ValidationError:
            log.warning("console: skipping a malformed placement event at %s", sequence)
            return
        if envelope.source != EVENT_PUBLISHERS[Context.PLACEMENT]:
            return
        name = subject.rsplit(".", 1)[-1]
        try:
            if name in (PLACEMENT_DECIDED, PLACEMENT_REJECTED):
                event = PlacementEvent.model_validate(envelope.payload)
                row = decision_row(sequence, name, envelope, event)
                self._recent.append(row)
                if row["allocation_id"] and row["status"] == "placed":
                    self._remember(
                        row["allocation_id"],
                        {k: row[k] for k in ("tenant", "model", "tp", "sku", "backend", "request_id")},
                    )
            elif name == PLACEMENT_RELEASED:
                released = PlacementReleasedEvent.model_validate(envelope.payload)
                known = self._known.get(released.allocation_id)
                if known is not None:
                    known["released"] = released.reason
        except ValidationError:
            log.warning("console: skipping a placement event it cannot read at %s", sequence)

    def _remember(self, allocation_id: str, fields: dict[str, Any]) -> None:
        self._known[allocation_id] = {**fields, "released": None}
        self._known.move_to_end(allocation_id)
        while len(self._known) > KNOWN_MAX:
            self._known.popitem(last=False)

    async def _on_message(self, msg: Msg) -> None:
        self.apply(msg.metadata.sequence.stream, msg.subject, msg.data)

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self, js: JetStreamContext, subjects: Subjects, *, stream_prefix: str) -> None:
        """Follow the stream from ``backlog`` events back; retried until the stream exists."""
        self._task = asyncio.create_task(
            self._follow(js, subjects, stream_name(Context.PLACEMENT, stream_prefix=stream_prefix))
        )

    async def _follow(self, js: JetStreamContext, subjects: Subjects, stream: str) -> None:
        while self._subscription is None:
            try:
                state = (await js.stream_info(stream)).state
                first = max(state.first_seq, state.last_seq - self._backlog + 1, 1)
                config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=first)
                self._subscription = await js.subscribe(
                    subjects.events_of(Context.PLACEMENT),
                    stream=stream,
                    cb=self._on_message,
                    ordered_consumer=True,
                    config=config,
                )
                self.problem = ""
            except Exception as exc:
                self.problem = f"{stream}: {type(exc).__name__} {exc}"[:300]
                await asyncio.sleep(RETRY_S)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._subscription is not None:
            with contextlib.suppress(Exception):
                await self._subscription.unsubscribe()
