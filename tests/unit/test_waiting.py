"""The test suite's wait helper: polls until true, returns the value, fails with the last value seen."""

from __future__ import annotations

import asyncio
import itertools
import re

import pytest

from tests.waiting import wait_for, wait_for_sync


def test_sync_and_async_conditions_return_their_first_truthy_value() -> None:
    counter = itertools.count()
    assert wait_for_sync(lambda: next(counter) >= 3 and "ready", 5, interval_s=0.001) == "ready"

    calls = itertools.count()

    async def condition() -> list[int]:
        return [1] if next(calls) >= 2 else []

    assert asyncio.run(wait_for(condition, 5, interval_s=0.001)) == [1]
    assert asyncio.run(wait_for(lambda: 7, 5)) == 7


def test_the_deadline_fails_with_what_was_awaited_and_the_last_value() -> None:
    with pytest.raises(AssertionError, match=re.escape("rows applied not met within 0.01s; last value: []")):
        wait_for_sync(list, 0.01, interval_s=0.001, what="rows applied")
    with pytest.raises(AssertionError, match=re.escape("condition not met within 0.01s; last value: 0")):
        asyncio.run(wait_for(lambda: 0, 0.01, interval_s=0.001))
