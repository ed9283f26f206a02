"""Waiting in tests: poll for the condition with a deadline, never a fixed sleep.

    seen = await wait_for(lambda: counts(), 10, what="both events applied")   # sync or async condition
    wait_for_sync(lambda: proc.poll() is not None, 30)                         # from sync code

Both return the condition's first truthy value, and on the deadline raise AssertionError with the
last value seen, so a failure says what was still missing.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar, overload

T = TypeVar("T")

INTERVAL_S = 0.05


@overload
async def wait_for(
    condition: Callable[[], Awaitable[T]], timeout_s: float, *, interval_s: float = ..., what: str = ...
) -> T: ...


@overload
async def wait_for(condition: Callable[[], T], timeout_s: float, *, interval_s: float = ..., what: str = ...) -> T: ...


async def wait_for(
    condition: Callable[[], Any], timeout_s: float, *, interval_s: float = INTERVAL_S, what: str = ""
) -> Any:
    """Await ``condition()`` (called again every ``interval_s``) until it is truthy; its value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what or 'condition'} not met within {timeout_s}s; last value: {value!r}")
        await asyncio.sleep(interval_s)


def wait_for_sync(condition: Callable[[], T], timeout_s: float, *, interval_s: float = INTERVAL_S, what: str = "") -> T:
    """`wait_for` for synchronous code (a subprocess, a file)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{what or 'condition'} not met within {timeout_s}s; last value: {value!r}")
        time.sleep(interval_s)
