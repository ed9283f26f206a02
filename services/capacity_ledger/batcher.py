"""Group commit: commits that arrive while a transaction is running are applied together in the next
one. Each commit keeps its own all-or-nothing outcome; the batch only shares the transaction (one WAL
flush, fewer round trips), which is what lets one ledger sustain thousands of commits a second."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from shared.contracts.ledger import CommitReply, CommitRequest
from shared.infra import deadline, tracing


class ApplyBatch(Protocol):
    """Applies commits in one transaction; ``deadlines``: each commit's caller's deadline (epoch ms)."""

    async def __call__(
        self, requests: Sequence[CommitRequest], *, deadlines: Sequence[float | None] | None = None
    ) -> list[CommitReply]: ...


# A queued commit: the request, its caller's future, deadline (epoch ms) and trace (a traceparent).
_Item = tuple[CommitRequest, asyncio.Future[CommitReply], float | None, str | None]


class CommitBatcher:
    """Feeds ``apply`` (given at ``start``) with up to ``max_batch`` queued commits at a time, from
    ``lanes`` concurrent loops.

    If a batch fails as a whole (an unexpected database error), each of its commits is retried alone,
    so one bad commit cannot take others down with it. Each commit carries its caller's deadline and
    trace (the lanes run outside the request's task, so the context variables do not reach them): the
    events a commit causes continue the trace of its request (``shared.infra.tracing.serving``).
    """

    def __init__(self, *, max_batch: int = 256, lanes: int = 2) -> None:
        self._apply: ApplyBatch | None = None
        self._max = max_batch
        self._lanes = lanes
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        self.batches = 0
        self.commits = 0

    def start(self, apply: ApplyBatch) -> None:
        self._apply = apply
        self._tasks = [asyncio.create_task(self._lane(), name=f"commit-lane-{i}") for i in range(self._lanes)]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def submit(self, request: CommitRequest) -> CommitReply:
        if self._apply is None:
            raise RuntimeError("the commit batcher has not been started")
        future: asyncio.Future[CommitReply] = asyncio.get_running_loop().create_future()
        await self._queue.put((request, future, deadline.current(), tracing.traceparent()))
        return await future

    async def _lane(self) -> None:
        apply = self._apply
        assert apply is not None  # start() set it before creating the lanes
        while True:
            items = [await self._queue.get()]
            while len(items) < self._max and not self._queue.empty():
                items.append(self._queue.get_nowait())
            self.batches += 1
            self.commits += len(items)
            with tracing.serving({item[0].request_id: item[3] for item in items}):
                await self._apply_batch(apply, items)

    @staticmethod
    async def _apply_batch(apply: ApplyBatch, items: list[_Item]) -> None:
        """``items`` in one ``apply``; each alone when that fails as a whole."""
        try:
            replies = await apply([item[0] for item in items], deadlines=[item[2] for item in items])
        except Exception:
            replies = None
        if replies is not None:
            for (_, future, _until, _trace), reply in zip(items, replies, strict=True):
                if not future.done():
                    future.set_result(reply)
            return
        for request, future, until, _trace in items:
            try:
                (reply,) = await apply([request], deadlines=[until])
                if not future.done():
                    future.set_result(reply)
            except Exception as exc:
                if not future.done():
                    future.set_exception(exc)
