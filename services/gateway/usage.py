"""Usage, off the request path: each answered request is kept in memory, and every ``usage_flush_s`` one
transaction adds them to the tenants' totals (``gateway.usage``) and writes to the outbox one `usage` event
per tenant with its requests (the relay publishes them on the GATEWAY stream for billing): a few events a
second whatever the request rate. A crash loses at most the
requests of one flush interval; a Postgres outage keeps them in memory (up to ``MAX_PENDING``) until it
is back."""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from collections.abc import Awaitable, Callable
from datetime import date

from shared.contracts.gateway import MAX_USAGE_RECORDS, USAGE, UsageEvent, UsageRecord
from shared.contracts.subjects import Context
from shared.infra.uow import UnitOfWork

MAX_PENDING = 200_000
"""Requests kept while Postgres is away; past this, the oldest are dropped (and logged)."""

UsageRow = tuple[str, date, str, str]  # tenant, day, model, key_id


def batches(records: list[UsageRecord]) -> list[UsageEvent]:
    """One event per tenant (more when a tenant has over ``MAX_USAGE_RECORDS``), records in arrival order."""
    by_tenant: dict[str, list[UsageRecord]] = defaultdict(list)
    for record in records:
        by_tenant[record.tenant].append(record)
    events: list[UsageEvent] = []
    for tenant, mine in by_tenant.items():
        for start in range(0, len(mine), MAX_USAGE_RECORDS):
            part = mine[start : start + MAX_USAGE_RECORDS]
            events.append(
                UsageEvent(
                    tenant=tenant,
                    requests=part,
                    prompt_tokens=sum(r.prompt_tokens for r in part),
                    completion_tokens=sum(r.completion_tokens for r in part),
                )
            )
    return events


def totals(events: list[UsageRecord]) -> dict[UsageRow, tuple[int, int, int]]:
    """Requests, prompt and completion tokens per tenant, day, model and key."""
    out: dict[UsageRow, list[int]] = defaultdict(lambda: [0, 0, 0])
    for e in events:
        row = out[(e.tenant, e.started_at.date(), e.model, e.key_id)]
        row[0] += 1
        row[1] += e.prompt_tokens
        row[2] += e.completion_tokens
    return {k: (v[0], v[1], v[2]) for k, v in out.items()}


class UsageBook:
    def __init__(
        self,
        *,
        run: Callable[[Callable[[UnitOfWork], Awaitable[None]]], Awaitable[None]],
        add: Callable[[UnitOfWork, dict[UsageRow, tuple[int, int, int]]], Awaitable[None]],
        every_s: float,
        log: logging.Logger,
        wake_relay: Callable[[], None] = lambda: None,
    ) -> None:
        self._run = run
        self._add = add
        self._every_s = every_s
        self._log = log
        self._wake_relay = wake_relay
        self.pending: list[UsageRecord] = []
        self._lock = asyncio.Lock()

    def record(self, event: UsageRecord) -> None:
        self.pending.append(event)
        if len(self.pending) > MAX_PENDING:
            dropped = len(self.pending) - MAX_PENDING
            del self.pending[:dropped]
            self._log.error("usage dropped: Postgres has been away too long", extra={"dropped": dropped})

    async def flush(self) -> int:
        """Write what is pending; how many requests were written."""
        async with self._lock:
            batch, self.pending = self.pending, []
            if not batch:
                return 0

            async def work(uow: UnitOfWork) -> None:
                await self._add(uow, totals(batch))
                for event in batches(batch):
                    uow.emit(Context.GATEWAY, USAGE, event, tenant=event.tenant)

            try:
                await self._run(work)
            except BaseException:
                self.pending[:0] = batch  # in order, before what came meanwhile
                raise
            self._wake_relay()
            return len(batch)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._every_s)
            try:
                await self.flush()
            except Exception as exc:
                self._log.warning(
                    "usage not written yet", extra={"error": str(exc)[:200], "pending": len(self.pending)}
                )
