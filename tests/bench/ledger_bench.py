"""Benchmark of `ledger.commit` over NATS (measures and prints, asserts nothing).

    python -m tests.bench.ledger_bench [--commits 4000] [--rate 500] [--seconds 10]

1. closed loop, one commit per request (the ledger groups concurrent ones into transactions);
2. closed loop with `ledger.commit_batch` (100 commits per request, one transaction each);
3. open loop at a fixed rate (default 500 commits/s): latency p50/p99.
The client runs on the same machine (2 cores here) and competes with the ledger, NATS and Postgres.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from shared.contracts.subjects import Rpc
from tests.bench import loadgen
from tests.bench.ledger_harness import LedgerHarness


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def _commit(h: LedgerHarness, tag: str, i: int) -> dict[str, Any]:
    return {
        "request_id": f"{tag}-{i}",
        "tenant": "bench",
        "shares": [{"accelerator_id": h.accelerators[i % len(h.accelerators)], "weights_bytes": 1_000_000}],
    }


async def closed_loop(h: LedgerHarness, commits: int, concurrency: int) -> str:
    latencies: list[float] = []
    queue = iter(range(commits))

    async def worker() -> None:
        for i in queue:
            started = time.perf_counter()
            reply = await h.call(Rpc.LEDGER_COMMIT, _commit(h, "closed", i), timeout=30)
            latencies.append((time.perf_counter() - started) * 1000)
            assert reply["status"] == "committed", reply

    started = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    elapsed = time.perf_counter() - started
    return (
        f"one commit per request, {concurrency} in flight: {commits / elapsed:,.0f} commits/s; "
        f"latency p50 {statistics.median(latencies):.1f} ms, p99 {_pct(latencies, 0.99):.1f} ms"
    )


async def batched(h: LedgerHarness, commits: int, per_request: int, concurrency: int) -> str:
    batches = iter(range(0, commits, per_request))

    async def worker() -> None:
        for start in batches:
            body = {"commits": [_commit(h, "batch", i) for i in range(start, start + per_request)]}
            reply = await h.call(Rpc.LEDGER_COMMIT_BATCH, body, timeout=60)
            assert all(r["status"] == "committed" for r in reply.get("results", [reply])), reply

    started = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(concurrency)])
    elapsed = time.perf_counter() - started
    return (
        f"{per_request} commits per request and transaction, {concurrency} in flight: "
        f"{commits / elapsed:,.0f} commits/s"
    )


async def open_loop(h: LedgerHarness, rate: float, seconds: float) -> str:
    async def one(i: int) -> str:
        reply = await h.call(Rpc.LEDGER_COMMIT, _commit(h, "open", i), timeout=30)
        assert reply["status"] == "committed", reply
        return str(reply["status"])

    return await loadgen.open_loop("ledger.commit", rate, seconds, one, warm_up=0)


async def run(h: LedgerHarness, *, commits: int, rate: float, seconds: float) -> list[str]:
    await closed_loop(h, 300, 8)  # warm up connections and caches
    return [
        await closed_loop(h, commits, 64),
        await batched(h, commits * 2, 100, 4),
        await open_loop(h, rate, seconds),
    ]


async def _main(args: argparse.Namespace) -> None:
    from tests.servers import find_servers

    with tempfile.TemporaryDirectory() as tmp:
        servers = await find_servers(Path(tmp))
        try:
            async with LedgerHarness(servers, Path(tmp)) as h:
                for line in await run(h, commits=args.commits, rate=args.rate, seconds=args.seconds):
                    print(line)
        finally:
            servers.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commits", type=int, default=4000)
    parser.add_argument("--rate", type=float, default=500)
    parser.add_argument("--seconds", type=float, default=10)
    asyncio.run(_main(parser.parse_args()))
