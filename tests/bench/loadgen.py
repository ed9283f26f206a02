"""Open-loop load for the wire benchmarks: requests started on a fixed schedule whatever the answers do
(a closed loop would slow down with the service and hide its queueing), timed from send to answer."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable


async def open_loop(
    name: str, rate: float, seconds: float, one: Callable[[int], Awaitable[str]], *, warm_up: int = 20
) -> str:
    """``one(i)`` (returning its outcome) ``rate`` times a second for ``seconds``, after ``warm_up``
    untimed calls (connections, caches); one line: achieved rate, outcomes, p50 and p99 in ms."""
    latencies: list[float] = []
    outcomes: dict[str, int] = {}

    async def timed(i: int) -> None:
        started = time.perf_counter()
        outcome = await one(i)
        latencies.append((time.perf_counter() - started) * 1000)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    await asyncio.gather(*[timed(-1 - i) for i in range(warm_up)])
    latencies.clear()
    outcomes.clear()
    tasks: list[asyncio.Task[None]] = []
    begin = time.perf_counter()
    total = int(rate * seconds)
    for i in range(total):
        delay = begin + i / rate - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(timed(i)))
    await asyncio.gather(*tasks)
    achieved = total / (time.perf_counter() - begin)
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
    return (
        f"{name} over NATS at {rate:.0f}/s for {seconds:.0f} s (achieved {achieved:.0f}/s, {outcomes}): "
        f"p50 {statistics.median(latencies):.2f} ms, p99 {p99:.2f} ms"
    )
