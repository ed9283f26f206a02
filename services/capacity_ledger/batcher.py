"""Group commit: commits that arrive while a transaction is running are applied together in the next
one. Each commit keeps its own all-or-nothing outcome; the batch only shares the transaction (one WAL
flush, fewer round trips), which is what lets one ledger sustain thousands of commits a second."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from shared.contracts.ledger import CommitReply, CommitRequest
from shared.infra import deadline, tracing
from shared.infra.grouping import Grouped


class ApplyBatch(Protocol):
    """Applies commits in one transaction; ``deadlines``: each commit's caller's deadline (epoch ms)."""

    async def __call__(
        self, requests: Sequence[CommitRequest], *, deadlines: Sequence[float | None] | None = None
    ) -> list[CommitReply]: ...


# A queued commit: the request, its caller's deadline (epoch ms) and trace (a traceparent).
_Item = tuple[CommitRequest, float | None, str | None]


class CommitBatcher:
    """Feeds ``apply`` (given at ``start``) with up to ``max_batch`` queued commits at a time, on at most
    ``lanes`` concurrent transactions: the kit's group commit (``shared.infra.grouping.Grouped``).

    If a batch fails as a whole (an unexpected database error), each of its commits is applied alone,
    so one bad commit cannot take others down with it. Each commit carries its caller's deadline and
    trace (the lanes run outside the request's task, in a context of their own): the events a commit
    causes continue the trace of its request (``shared.infra.tracing.serving``).
    """

    def __init__(self, *, max_batch: int = 256, lanes: int = 2) -> None:
        self._max = max_batch
        self._lanes = lanes
        self._grouped: Grouped[_Item, CommitReply] | None = None

    @property
    def batches(self) -> int:
        """Transactions of commits applied so far (one commit alone included)."""
        return self._grouped.groups if self._grouped is not None else 0

    @property
    def commits(self) -> int:
        return self._grouped.items if self._grouped is not None else 0

    def start(self, apply: ApplyBatch) -> None:
        async def together(items: list[_Item]) -> list[CommitReply]:
            with tracing.serving({request.request_id: trace for request, _until, trace in items}):
                return await apply([item[0] for item in items], deadlines=[item[1] for item in items])

        async def alone(item: _Item) -> CommitReply:
            request, until, trace = item
            with tracing.serving({request.request_id: trace}):
                (reply,) = await apply([request], deadlines=[until])
            return reply

        self._grouped = Grouped(together, alone=alone, max_group=self._max, lanes=self._lanes, fresh_context=True)

    async def stop(self) -> None:
        if self._grouped is not None:
            await self._grouped.stop()

    async def submit(self, request: CommitRequest) -> CommitReply:
        if self._grouped is None:
            raise RuntimeError("the commit batcher has not been started")
        return await self._grouped.submit((request, deadline.current(), tracing.traceparent()))
