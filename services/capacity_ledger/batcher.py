"""Group commit: commits that arrive while a transaction is running are applied together in the next
one. Each commit keeps its own all-or-nothing outcome; the batch only shares the transaction (one WAL
flush, fewer round trips), which is what lets one ledger sustain thousands of commits a second."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Protocol

from shared.contracts.ledger import CommitReply, CommitRequest
from shared.domain.ledger import Access
from shared.infra import deadline


class ApplyBatch(Protocol):
    """Applies commits in one transaction; ``deadlines``: each commit's caller's deadline (epoch ms)."""

    async def __call__(
        self, requests: Sequence[CommitRequest], *, deadlines: Sequence[float | None] | None = None
    ) -> list[CommitReply]: ...


class CommitBatcher:
    """Feeds ``apply`` (given at ``start``) with up to ``max_batch`` queued commits at a time, from
    ``lanes`` concurrent loops.

    If a batch fails as a whole (an unexpected database error), each of its commits is retried alone,
    so one bad commit cannot take others down with it. Each commit carries its caller's deadline
    (the lanes run outside the request's task, so the context variable does not reach them).
    """

    def __init__(self, *, max_batch: int = 256, lanes: int = 2) -> None:
        self._apply: ApplyBatch | None = None
        self._max = max_batch
        self._lanes = lanes
        self._queue: asyncio.Queue[tuple[CommitRequest, asyncio.Future[CommitReply], float | None]] = asyncio.Queue()
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
        await self._queue.put((request, future, deadline.current()))
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
            try:
                replies = await apply([item[0] for item in items], deadlines=[item[2] for item in items])
            except Exception:
                replies = None
            if replies is not None:
                for (_, future, _until), reply in zip(items, replies, strict=True):
                    if not future.done():
                        future.set_result(reply)
                continue
            for request, future, until in items:
                try:
                    (reply,) = await apply([request], deadlines=[until])
                    if not future.done():
                        future.set_result(reply)
                except Exception as exc:
                    if not future.done():
                        future.set_exception(exc)


class ApplyEnds(Protocol):
    """Ends allocations in one transaction: ``(allocation id, tenant)`` pairs in, one access each out."""

    async def __call__(self, items: Sequence[tuple[str, str | None]]) -> list[Access]: ...


class EndBatcher:
    """Group end: releases that arrive while one transaction of them runs are applied together in the
    next (a request's KV hold is released per inference request, thousands a second on a busy fleet).
    The first goes at once; a batch that fails as a whole is retried one by one."""

    def __init__(self, apply: ApplyEnds, *, max_batch: int = 256) -> None:
        self._apply = apply
        self._max = max_batch
        self._pending: list[tuple[str, str | None, asyncio.Future[Access]]] = []
        self._running = False
        self.batches = 0

    async def submit(self, allocation_id: str, tenant: str | None) -> Access:
        future: asyncio.Future[Access] = asyncio.get_running_loop().create_future()
        self._pending.append((allocation_id, tenant, future))
        if not self._running:
            self._running = True
            asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        try:
            while self._pending:
                batch, self._pending = self._pending[: self._max], self._pending[self._max :]
                self.batches += 1
                try:
                    accesses = await self._apply([(allocation_id, tenant) for allocation_id, tenant, _ in batch])
                except Exception:
                    accesses = None
                if accesses is not None:
                    for (_, _, future), access in zip(batch, accesses, strict=True):
                        if not future.done():
                            future.set_result(access)
                    continue
                for allocation_id, tenant, future in batch:
                    try:
                        (access,) = await self._apply([(allocation_id, tenant)])
                        if not future.done():
                            future.set_result(access)
                    except Exception as exc:
                        if not future.done():
                            future.set_exception(exc)
        finally:
            self._running = False
