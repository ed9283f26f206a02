"""Read-your-writes for reservations (issue 23 row 11): placement asks the RESERVATION stream's end once
per batch of placements, and never answers a caller with a lookup that started before it arrived."""

from __future__ import annotations

import asyncio

from services.placement.readmodel import StreamTail


class Stream:
    """The stream's last sequence; each lookup waits until the test lets it answer."""

    def __init__(self) -> None:
        self.last = 10
        self.lookups = 0
        self.gates: list[asyncio.Event] = []

    async def ask(self) -> int:
        self.lookups += 1
        gate = asyncio.Event()
        self.gates.append(gate)
        seen = self.last  # what the server holds when the lookup reaches it
        await gate.wait()
        return seen


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_concurrent_callers_share_one_lookup() -> None:
    stream = Stream()
    tail = StreamTail(stream.ask)
    callers = [asyncio.ensure_future(tail.after_now()) for _ in range(20)]
    await settle()
    assert stream.lookups == 1
    stream.gates[0].set()
    assert await asyncio.gather(*callers) == [10] * 20
    assert stream.lookups == 1


async def test_a_caller_that_arrives_during_a_lookup_waits_for_the_next_one() -> None:
    stream = Stream()
    tail = StreamTail(stream.ask)
    early = asyncio.ensure_future(tail.after_now())
    await settle()
    stream.last = 11  # a reservation answered `created` after the first lookup read the stream
    late = [asyncio.ensure_future(tail.after_now()) for _ in range(5)]
    await settle()
    assert stream.lookups == 1  # the late ones wait for it to end
    stream.gates[0].set()
    assert await early == 10
    await settle()
    assert stream.lookups == 2  # then share one more
    stream.gates[1].set()
    assert await asyncio.gather(*late) == [11] * 5


async def test_a_caller_after_a_finished_lookup_asks_again_and_a_failed_lookup_is_its_callers_error() -> None:
    stream = Stream()
    tail = StreamTail(stream.ask)
    first = asyncio.ensure_future(tail.after_now())
    await settle()
    stream.gates[0].set()
    assert await first == 10
    stream.last = 12
    second = asyncio.ensure_future(tail.after_now())
    await settle()
    assert stream.lookups == 2
    stream.gates[1].set()
    assert await second == 12

    async def broken() -> int:
        raise TimeoutError("no answer from $JS.API.STREAM.INFO")

    failing = StreamTail(broken)
    try:
        await failing.after_now()
    except TimeoutError:
        pass
    else:
        raise AssertionError("the lookup's error reaches its caller")
