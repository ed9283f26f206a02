"""Group commit, the one algorithm behind the unit of work's ``run_grouped``, placement's admission holds
and the ledger's commit batching: calls that arrive while earlier ones are under way go together in the
next group (one RPC, one transaction for many), each still answered on its own."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

In = TypeVar("In")
Out = TypeVar("Out")


class Grouped(Generic[In, Out]):
    """Feeds ``apply`` (many items in, one result per item out, in order) with what was submitted.

    Items queue; a lane takes up to ``max_group`` of them at a time, on at most ``lanes`` concurrent lanes
    (a lane lives while there is work for it: the first item goes at once). A group of one, and each item
    of a group whose ``apply`` raised, runs through ``alone`` (default: ``apply`` of that item), so one bad
    item cannot fail the others: its exception reaches its own caller only. An item whose caller was
    cancelled before its turn is skipped. ``fresh_context``: lanes start in an empty context, as if started
    with the service, so no submitter's context variables (deadline, trace) reach the others' items.

    ``spacing_s``: a group starts at least this long after the one before it. Where each group costs far more
    than its items (a transaction), a fast ``apply`` at a steady rate would otherwise run nearly every item
    alone; spaced, the items of that time go together, each waiting at most ``spacing_s`` more. An item
    that comes after a quiet spell longer than that goes at once.
    """

    def __init__(
        self,
        apply: Callable[[list[In]], Awaitable[list[Out]]],
        *,
        alone: Callable[[In], Awaitable[Out]] | None = None,
        max_group: int = 256,
        lanes: int = 1,
        fresh_context: bool = False,
        spacing_s: float = 0.0,
    ) -> None:
        self._apply = apply
        self._spacing = spacing_s
        self._next_start = 0.0  # loop time before which no group starts (spacing)
        self._alone = alone or self._apply_one
        self._max = max_group
        self._lanes = lanes
        self._fresh = fresh_context
        self._running = 0
        self._queue: list[tuple[In, asyncio.Future[Out]]] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self.groups = 0  # groups applied (a group of one included)
        self.items = 0  # items in them

    async def submit(self, item: In) -> Out:
        """``item``'s result, or the exception applying it raised; grouped with the items submitted meanwhile."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Out] = loop.create_future()
        self._queue.append((item, future))
        if self._running < self._lanes:
            self._running += 1
            context = contextvars.Context() if self._fresh else None
            task = loop.create_task(self._lane(), context=context)
            self._tasks.add(task)  # held until done: the loop keeps only weak references to tasks
            task.add_done_callback(self._tasks.discard)
        return await future

    async def stop(self) -> None:
        """Cancel the lanes running now (a service stopping); items they held are left unanswered."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _lane(self) -> None:
        try:
            while self._queue:
                if self._spacing > 0:
                    loop = asyncio.get_running_loop()
                    # A time, not an event: another lane that starts a group meanwhile moves it on.
                    while (wait := self._next_start - loop.time()) > 0:  # noqa: ASYNC110
                        await asyncio.sleep(wait)
                    self._next_start = loop.time() + self._spacing
                    if not self._queue:  # another lane took them meanwhile
                        break
                group, self._queue = self._queue[: self._max], self._queue[self._max :]
                live = [(item, future) for item, future in group if not future.cancelled()]
                if live:
                    self.groups += 1
                    self.items += len(live)
                    await self._run(live)
        finally:
            self._running -= 1

    async def _run(self, group: list[tuple[In, asyncio.Future[Out]]]) -> None:
        if len(group) > 1:
            try:
                results = await self._apply([item for item, _ in group])
            except Exception:  # the group failed as a whole: each item runs alone and meets its own outcome
                pass
            else:
                for (_, future), result in zip(group, results, strict=True):
                    if not future.done():
                        future.set_result(result)
                return
        for item, future in group:
            if future.cancelled():  # its caller left while the group ran
                continue
            try:
                result = await self._alone(item)
            except Exception as exc:  # handed to its caller
                if not future.done():
                    future.set_exception(exc)
            else:
                if not future.done():
                    future.set_result(result)

    async def _apply_one(self, item: In) -> Out:
        (result,) = await self._apply([item])
        return result
