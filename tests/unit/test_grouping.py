"""``Grouped``, the kit's group commit: calls that come while one is under way go together in the next, on
at most ``lanes`` at once; a group that fails is applied again item by item, so one bad item fails only
its own caller; a caller that left before its turn is skipped."""

from __future__ import annotations

import asyncio
import contextvars
import itertools

import pytest

from shared.infra.grouping import Grouped


class Gate:
    """An ``apply`` that records each group and holds it until ``release`` is set."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.release = asyncio.Event()

    async def apply(self, items: list[int]) -> list[int]:
        self.calls.append(items)
        await self.release.wait()
        return items


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
    assert (grouped.groups, grouped.items) == (len(calls), 9)
    calls.clear()
    assert await grouped.submit(7) == 70 and calls == [[7]]  # alone: sent at once, in a group of its own


async def test_items_submitted_while_a_group_runs_form_the_next_group() -> None:
    gate = Gate()
    calls, release = gate.calls, gate.release

    grouped: Grouped[int, int] = Grouped(gate.apply, max_group=100)
    first = asyncio.ensure_future(grouped.submit(0))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert calls == [[0]]  # the first went at once
    later = [asyncio.ensure_future(grouped.submit(i)) for i in range(1, 6)]
    await asyncio.sleep(0)
    release.set()
    assert await asyncio.gather(first, *later) == list(range(6))
    assert calls == [[0], [1, 2, 3, 4, 5]]  # those that came meanwhile, together


async def test_at_most_lanes_groups_run_at_once() -> None:
    running = 0
    most = 0

    async def apply(items: list[int]) -> list[int]:
        nonlocal running, most
        running += 1
        most = max(most, running)
        await asyncio.sleep(0.005)
        running -= 1
        return items

    grouped: Grouped[int, int] = Grouped(apply, max_group=2, lanes=3)
    results = await asyncio.gather(*(grouped.submit(i) for i in range(40)))
    assert results == list(range(40))
    assert most == 3  # three lanes ran together, never a fourth
    assert grouped.groups == 20  # each group as full as max_group allows


async def test_a_failing_group_is_applied_item_by_item_and_only_the_bad_item_fails() -> None:
    calls: list[list[int]] = []

    async def apply(items: list[int]) -> list[int]:
        calls.append(items)
        await asyncio.sleep(0)
        if 3 in items:
            raise ValueError("three")
        return items

    grouped: Grouped[int, int] = Grouped(apply)
    results = await asyncio.gather(*(grouped.submit(i) for i in range(6)), return_exceptions=True)
    assert [r for i, r in enumerate(results) if i != 3] == [0, 1, 2, 4, 5]
    assert isinstance(results[3], ValueError)
    assert calls == [[0, 1, 2, 3, 4, 5], [0], [1], [2], [3], [4], [5]]  # the group, then each alone
    calls.clear()
    with pytest.raises(ValueError):
        await grouped.submit(3)
    assert calls == [[3]]  # a group of one is already alone: applied once


async def test_each_caller_gets_its_own_exception_from_alone() -> None:
    async def apply(items: list[str]) -> list[str]:
        raise RuntimeError("the group's transaction failed")

    async def alone(item: str) -> str:
        await asyncio.sleep(0)
        if item.startswith("bad"):
            raise KeyError(item)
        return item.upper()

    grouped: Grouped[str, str] = Grouped(apply, alone=alone)
    results = await asyncio.gather(
        *(grouped.submit(item) for item in ("a", "bad-1", "b", "bad-2")), return_exceptions=True
    )
    assert results[0] == "A" and results[2] == "B"
    assert isinstance(results[1], KeyError) and results[1].args == ("bad-1",)
    assert isinstance(results[3], KeyError) and results[3].args == ("bad-2",)


async def test_a_cancelled_caller_is_skipped() -> None:
    gate = Gate()
    calls, release = gate.calls, gate.release

    grouped: Grouped[int, int] = Grouped(gate.apply)
    first = asyncio.ensure_future(grouped.submit(0))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    gone = asyncio.ensure_future(grouped.submit(1))
    kept = asyncio.ensure_future(grouped.submit(2))
    await asyncio.sleep(0)
    gone.cancel()
    release.set()
    assert await asyncio.gather(first, kept) == [0, 2]
    assert calls == [[0], [2]]  # item 1's caller left before its turn: never applied


async def test_a_caller_cancelled_while_its_group_failed_is_not_run_alone() -> None:
    calls: list[list[int]] = []
    started = asyncio.Event()
    release = asyncio.Event()

    async def apply(items: list[int]) -> list[int]:
        calls.append(items)
        if len(items) > 1:
            started.set()
            await release.wait()
            raise ValueError("the group failed")
        return items

    grouped: Grouped[int, int] = Grouped(apply)
    tasks = [asyncio.ensure_future(grouped.submit(i)) for i in range(3)]
    await started.wait()
    tasks[1].cancel()
    release.set()
    assert await asyncio.gather(tasks[0], tasks[2]) == [0, 2]
    assert calls == [[0, 1, 2], [0], [2]]


async def test_fresh_context_keeps_the_submitters_context_variables_from_the_lanes() -> None:
    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="none")
    seen: list[str] = []

    async def apply(items: list[int]) -> list[int]:
        seen.append(var.get())
        return items

    async def submit(grouped: Grouped[int, int]) -> int:
        var.set("caller")
        return await grouped.submit(1)

    assert await asyncio.ensure_future(submit(Grouped(apply))) == 1
    assert await asyncio.ensure_future(submit(Grouped(apply, fresh_context=True))) == 1
    assert seen == ["caller", "none"]


async def test_stop_cancels_the_running_lanes() -> None:
    async def apply(items: list[int]) -> list[int]:
        await asyncio.sleep(3600)
        return items

    grouped: Grouped[int, int] = Grouped(apply)
    waiting = asyncio.ensure_future(grouped.submit(1))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    await grouped.stop()
    assert not waiting.done()
    waiting.cancel()


async def test_spaced_groups_start_at_most_once_per_spacing_and_a_quiet_one_goes_at_once() -> None:
    calls: list[tuple[float, list[int]]] = []
    loop = asyncio.get_running_loop()

    async def apply(items: list[int]) -> list[int]:
        calls.append((loop.time(), items))
        return items

    spacing = 0.1
    grouped: Grouped[int, int] = Grouped(apply, lanes=2, spacing_s=spacing)
    started = loop.time()
    assert await grouped.submit(0) == 0  # the first goes at once
    # A steady stream well inside the spacing: each group waits for its turn and takes what came meanwhile.
    submitted = []
    for i in range(1, 11):
        submitted.append(asyncio.ensure_future(grouped.submit(i)))
        await asyncio.sleep(spacing / 5)
    assert await asyncio.gather(*submitted) == list(range(1, 11))
    starts = [at for at, _ in calls]
    assert starts[0] - started < spacing / 2
    assert all(b - a >= spacing * 0.99 for a, b in itertools.pairwise(starts))
    assert len(calls) <= 4 and sorted(i for _, items in calls for i in items) == list(range(11))
    # After a quiet spell longer than the spacing, an item goes at once.
    await asyncio.sleep(spacing * 2)
    before = loop.time()
    assert await grouped.submit(11) == 11
    assert calls[-1][0] - before < spacing / 2
