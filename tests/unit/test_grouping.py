"""``Grouped``: calls that come while one is under way go together in the next; a group that fails is
applied again item by item, so one bad item fails only its own caller."""

from __future__ import annotations

import asyncio

import pytest

from shared.infra.grouping import Grouped


async def test_calls_that_come_meanwhile_go_together_each_answered_in_order() -> None:
    calls: list[list[int]] = []

    async def apply(items: list[int]) -> list[int]:
        calls.append(items)
        await asyncio.sleep(0.01)
        return [item * 10 for item in items]

    grouped: Grouped[int, int] = Grouped(apply, max_group=4)
    results = await asyncio.gather(*(grouped.submit(i) for i in range(9)))
    assert results == [i * 10 for i in range(9)]
    assert all(len(group) <= 4 for group in calls) and len(calls) < 9
    assert sorted(item for group in calls for item in group) == list(range(9))
    calls.clear()
    assert await grouped.submit(7) == 70 and calls == [[7]]  # alone: sent at once, in a group of its own


async def test_a_failing_group_is_applied_item_by_item_and_only_the_bad_item_fails() -> None:
    async def apply(items: list[int]) -> list[int]:
        await asyncio.sleep(0)
        if 3 in items:
            raise ValueError("three")
        return items

    grouped: Grouped[int, int] = Grouped(apply)
    results = await asyncio.gather(*(grouped.submit(i) for i in range(6)), return_exceptions=True)
    assert [r for i, r in enumerate(results) if i != 3] == [0, 1, 2, 4, 5]
    assert isinstance(results[3], ValueError)
    with pytest.raises(ValueError):
        await grouped.submit(3)
