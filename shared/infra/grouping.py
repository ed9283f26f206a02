"""Group calls: calls that arrive while earlier ones are under way go together in the next call (one
RPC, one transaction for many), each still answered on its own."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

In = TypeVar("In")
Out = TypeVar("Out")


class Grouped(Generic[In, Out]):
    """Feeds ``apply`` (many items in, one result per item out, in order) with what was submitted.

    The first item goes at once; items that come while ``in_flight`` groups are under way wait for the
    next group (at most ``max_group`` items). A group whose ``apply`` raises is applied again item by
    item, so one bad item cannot fail the others; an item that raises alone gets the exception.
    """

    def __init__(
        self, apply: Callable[[list[In]], Awaitable[list[Out]]], *, max_group: int = 256, in_flight: int = 1
    ) -> None:
        self._apply = apply
        self._max = max_group
        self._in_flight = in_flight
        self._running = 0
        self._pending: list[tuple[In, asyncio.Future[Out]]] = []
        self.groups = 0

    async def submit(self, item: In) -> Out:
        future: asyncio.Future[Out] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._running < self._in_flight:
            self._running += 1
            asyncio.get_running_loop().create_task(self._send())
        return await future

    async def _send(self) -> None:
        try:
            while self._pending:
                group, self._pending = self._pending[: self._max], self._pending[self._max :]
                self.groups += 1
                try:
                    results = await self._apply([item for item, _ in group])
                except Exception:
                    for item, future in group:
                        await self._alone(item, future)
                    continue
                for (_, future), result in zip(group, results, strict=True):
                    if not future.done():
                        future.set_result(result)
        finally:
            self._running -= 1

    async def _alone(self, item: In, future: asyncio.Future[Out]) -> None:
        try:
            (result,) = await self._apply([item])
        except Exception as exc:
            if not future.done():
                future.set_exception(exc)
            return
        if not future.done():
            future.set_result(result)
