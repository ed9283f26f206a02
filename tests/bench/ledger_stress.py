"""Stress: concurrent clients commit and release over the real bus while a checker runs the invariant
query; optionally the ledger is killed with SIGKILL mid-run and restarted.

    python -m tests.bench.ledger_stress [--clients 8] [--ops 1000] [--kill]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from shared.contracts.ledger import AllocationEvent
from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context, Rpc
from shared.domain.ledger import ALLOCATION_EVENTS, replay_reserved
from tests.bench.ledger_harness import INVARIANT_SQL, LedgerHarness
from tests.jetstream import read_all

GB = 10**9


def allocation_events(envelopes: list[dict[str, Any]]) -> list[tuple[str, AllocationEvent]]:
    """The LEDGER stream's allocation events as (name, typed payload), in stream order, for the fold."""
    named = ((str(e["type"]).rsplit(".", 1)[-1], e["payload"]) for e in envelopes)
    return [(name, AllocationEvent.model_validate(payload)) for name, payload in named if name in ALLOCATION_EVENTS]


@dataclass
class StressResult:
    ops: int = 0
    commits_acked: int = 0
    releases_acked: int = 0
    refused: int = 0
    retries: int = 0
    checks: int = 0
    violations: int = 0
    kills: int = 0
    elapsed_s: float = 0.0
    live: set[str] = field(default_factory=set)
    released: set[str] = field(default_factory=set)
    problems: list[str] = field(default_factory=list)

    def report(self) -> str:
        return (
            f"{self.ops} ops in {self.elapsed_s:.1f} s ({self.ops / self.elapsed_s:.0f} ops/s): "
            f"{self.commits_acked} commits, {self.releases_acked} releases, {self.refused} refused (full), "
            f"{self.retries} retried after a timeout, {self.kills} SIGKILL(s) of the ledger; "
            f"invariant checked {self.checks} times, {self.violations} violation(s); "
            f"problems: {self.problems or 'none'}"
        )


async def _retrying(h: LedgerHarness, rpc: Rpc, body: dict[str, Any], result: StressResult) -> dict[str, Any]:
    """Send until answered: a timeout (ledger down) resends the same body, so the same request id."""
    deadline = time.monotonic() + 120
    while True:
        try:
            return await h.call(rpc, body, timeout=3)
        except Exception:
            result.retries += 1
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def _client(h: LedgerHarness, n: int, ops: int, seed: int, result: StressResult) -> None:
    rng = random.Random(seed)
    mine: list[str] = []
    for i in range(ops):
        if mine and rng.random() < 0.45:
            allocation = mine.pop(rng.randrange(len(mine)))
            reply = await _retrying(h, Rpc.LEDGER_RELEASE, {"allocation_id": allocation, "tenant": f"t{n}"}, result)
            if reply.get("status") != "released":
                result.problems.append(f"release of {allocation}: {reply}")
            result.releases_acked += 1
            result.live.discard(allocation)
            result.released.add(allocation)
        else:
            accs = rng.sample(h.accelerators, rng.choice((1, 1, 2, 4, 8)))
            body = {
                "request_id": f"c{n}-{i}",
                "tenant": f"t{n}",
                # Shared replicas: many per GPU, so the stress is on the byte invariant (over-commit),
                # not on exclusivity refusals.
                "sharing": "shared",
                "shares": [{"accelerator_id": a, "weights_bytes": rng.randint(1, 12) * GB} for a in accs],
            }
            reply = await _retrying(h, Rpc.LEDGER_COMMIT, body, result)
            if reply.get("status") == "committed":
                result.commits_acked += 1
                mine.append(reply["allocation_id"])
                result.live.add(reply["allocation_id"])
            elif reply.get("error", {}).get("code") == "no_capacity":
                result.refused += 1
            else:
                result.problems.append(f"commit {body['request_id']}: {reply}")
        result.ops += 1


async def _checker(h: LedgerHarness, stop: asyncio.Event, result: StressResult) -> None:
    while not stop.is_set():
        try:
            conn = await h.db()
        except Exception:
            await asyncio.sleep(0.1)
            continue
        try:
            while not stop.is_set():
                result.violations += int(await conn.fetchval(INVARIANT_SQL))
                result.checks += 1
                await asyncio.sleep(0.01)
        finally:
            await conn.close()


async def _killer(h: LedgerHarness, result: StressResult, total_ops: int) -> None:
    while result.ops < total_ops * 0.4:
        await asyncio.sleep(0.05)
    h.kill("capacity_ledger")
    result.kills += 1
    await asyncio.sleep(1.0)
    h.start("capacity_ledger")
    await h.wait_ledger_healthy()


async def verify(h: LedgerHarness, result: StressResult) -> None:
    await h.outbox_drained()
    conn = await h.db()
    try:
        result.violations += int(await conn.fetchval(INVARIANT_SQL))
        active = {r["id"] for r in await conn.fetch("SELECT id FROM ledger.allocations WHERE state = 'active'")}
        all_rows = await conn.fetch("SELECT id, state FROM ledger.allocations")
        tables = {r["id"]: r["reserved"] for r in await conn.fetch("SELECT id, reserved FROM ledger.accelerators")}
        outbox = await conn.fetchval("SELECT count(*) FROM ledger.outbox")
    finally:
        await conn.close()
    if active != result.live:
        result.problems.append(
            f"active allocations differ: {len(active - result.live)} unknown, "
            f"{len(result.live - active)} acknowledged but missing"
        )
    missing = (result.live | result.released) - {r["id"] for r in all_rows}
    if missing:
        result.problems.append(f"{len(missing)} acknowledged allocations lost")
    events = await read_all(
        h.nc.jetstream(),
        stream=stream_name(Context.LEDGER, stream_prefix=h.servers.stream_prefix),
        subject=f"{h.servers.subject_prefix}.events.ledger.>",
    )
    ids = Counter(e["event_id"] for e in events)
    if any(n > 1 for n in ids.values()):
        result.problems.append("duplicate event ids in JetStream")
    if len(ids) != outbox:
        result.problems.append(f"{outbox} outbox rows but {len(ids)} events in JetStream")
    committed = Counter(e["payload"]["allocation_id"] for e in events if e["type"] == "ledger.allocation_committed")
    released = Counter(e["payload"]["allocation_id"] for e in events if e["type"] == "ledger.allocation_released")
    if set(committed) != {r["id"] for r in all_rows} or any(n != 1 for n in committed.values()):
        result.problems.append("not exactly one allocation_committed event per allocation")
    if set(released) != {r["id"] for r in all_rows if r["state"] == "released"} or any(
        n != 1 for n in released.values()
    ):
        result.problems.append("not exactly one allocation_released event per released allocation")
    rebuilt = replay_reserved(allocation_events(events))
    if rebuilt != {k: v for k, v in tables.items() if v}:
        result.problems.append("replay of the LEDGER stream differs from the tables")


async def stress(
    h: LedgerHarness, *, clients: int = 8, ops: int = 1000, kill: bool = False, seed: int = 7
) -> StressResult:
    result = StressResult()
    stop = asyncio.Event()
    checker = asyncio.create_task(_checker(h, stop, result))
    started = time.monotonic()
    tasks = [_client(h, n, ops, seed * 1000 + n, result) for n in range(clients)]
    if kill:
        tasks.append(_killer(h, result, clients * ops))
    await asyncio.gather(*tasks)
    result.elapsed_s = time.monotonic() - started
    stop.set()
    await checker
    await verify(h, result)
    return result


async def _main(args: argparse.Namespace) -> None:
    from tests.servers import find_servers

    with tempfile.TemporaryDirectory() as tmp:
        servers = await find_servers(Path(tmp))
        try:
            async with LedgerHarness(servers, Path(tmp)) as h:
                result = await stress(h, clients=args.clients, ops=args.ops, kill=args.kill)
            print(result.report())
        finally:
            servers.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--ops", type=int, default=1000)
    parser.add_argument("--kill", action="store_true")
    asyncio.run(_main(parser.parse_args()))
