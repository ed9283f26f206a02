"""Open-loop load for the wire benchmarks: requests started on a fixed schedule whatever the answers do
(a closed loop would slow down with the service and hide its queueing), timed from send to answer."""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field


def nearest_rank(ordered: list[float], q: float) -> float:
    """The ``q`` quantile of sorted values by nearest rank (the value at index ``int(n * q)``); NaN if empty."""
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


@dataclass
class LoadResult:
    """What one open-loop run saw: offered and achieved rates, outcomes, latencies of answered calls (ms).

    ``achieved_per_s`` is calls answered over the time from the first send to the last answer; ``send_lag_ms``
    the most a send started after its slot (a client that cannot keep the schedule shows it here)."""

    name: str
    offered_per_s: float
    seconds: float
    sent: int = 0
    achieved_per_s: float = 0.0
    send_lag_ms: float = 0.0
    outcomes: Counter[str] = field(default_factory=Counter)
    latencies_ms: list[float] = field(default_factory=list)

    def quantile(self, q: float) -> float:
        return nearest_rank(sorted(self.latencies_ms), q)

    @property
    def p50_ms(self) -> float:
        return self.quantile(0.5)

    @property
    def p99_ms(self) -> float:
        return self.quantile(0.99)

    @property
    def max_ms(self) -> float:
        return max(self.latencies_ms) if self.latencies_ms else math.nan

    def line(self) -> str:
        """One line: achieved rate, outcomes, p50 and p99 in ms (the shape every wire benchmark prints)."""
        return (
            f"{self.name} over NATS at {self.offered_per_s:.0f}/s for {self.seconds:.0f} s "
            f"(achieved {self.achieved_per_s:.0f}/s, {dict(self.outcomes)}): "
            f"p50 {statistics.median(self.latencies_ms) if self.latencies_ms else math.nan:.2f} ms, "
            f"p99 {self.p99_ms:.2f} ms"
        )


async def run_open_loop(
    name: str, rate: float, seconds: float, one: Callable[[int], Awaitable[str]], *, warm_up: int = 20
) -> LoadResult:
    """``one(i)`` (returning its outcome) ``rate`` times a second for ``seconds``, after ``warm_up``
    untimed calls (connections, caches). An outcome of ``"timeout"`` or starting with ``"error"`` counts
    without a latency: the call was not answered."""
    result = LoadResult(name=name, offered_per_s=rate, seconds=seconds)

    async def timed(i: int) -> None:
        started = time.perf_counter()
        outcome = await one(i)
        if i >= 0:
            result.outcomes[outcome] += 1
            if outcome != "timeout" and not outcome.startswith("error"):
                result.latencies_ms.append((time.perf_counter() - started) * 1000)

    await asyncio.gather(*[timed(-1 - i) for i in range(warm_up)])
    tasks: list[asyncio.Task[None]] = []
    begin = time.perf_counter()
    total = int(rate * seconds)
    for i in range(total):
        slot = begin + i / rate
        delay = slot - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        result.send_lag_ms = max(result.send_lag_ms, (time.perf_counter() - slot) * 1000)
        tasks.append(asyncio.create_task(timed(i)))
    await asyncio.gather(*tasks)
    result.sent = total
    result.achieved_per_s = total / (time.perf_counter() - begin)
    return result


async def open_loop(
    name: str, rate: float, seconds: float, one: Callable[[int], Awaitable[str]], *, warm_up: int = 20
) -> str:
    """``one(i)`` (returning its outcome) ``rate`` times a second for ``seconds``, after ``warm_up``
    untimed calls (connections, caches); one line: achieved rate, outcomes, p50 and p99 in ms."""
    return (await run_open_loop(name, rate, seconds, one, warm_up=warm_up)).line()


def positive(text: str) -> float:
    """An argparse type: a number > 0 (a rate, a duration)."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value
