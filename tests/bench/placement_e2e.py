"""Benchmark: `placement.place` end to end over NATS (decision + ledger commit), open loop.

    python -m tests.bench.placement_e2e [--rate 200] [--seconds 10] [--nodes 1024]

The fleet (1,024 synthetic nodes by default) is large enough that the timed placements do not fill it,
so nothing is released during the run. Prints p50/p99 of `place`; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

from shared.contracts.subjects import Rpc
from shared.domain.synthetic import synthetic_inventory
from tests.bench.ledger_harness import LedgerHarness
from tests.bench.loadgen import open_loop

MIX = [("llama3-8b", "bf16", 8192, 16), ("llama3-70b", "fp8", 8192, 16), ("mixtral-8x7b", "bf16", 8192, 8)]


async def run(h: LedgerHarness, *, rate: float, seconds: float) -> str:
    rng = random.Random(200)

    async def one(i: int) -> str:
        model, dtype, context, concurrency = rng.choice(MIX)
        body: dict[str, Any] = {
            "request_id": f"e2e-{i}",
            "tenant": "bench",
            "model": model,
            "dtype": dtype,
            "context_tokens": context,
            "concurrency": concurrency,
            "backend": "gpu",
        }
        reply = await h.call(Rpc.PLACEMENT_PLACE, body, timeout=30)
        status = str(reply.get("status", "?"))
        return f"rejected:{(reply.get('error') or {}).get('code')}" if status == "rejected" else status

    return await open_loop("placement.place", rate, seconds, one)


class Caller(Protocol):
    """What placement_ready needs of a benchmark's client: a request with a JSON body and reply."""

    async def call(self, rpc: Rpc, body: dict[str, Any], *, timeout: float = ...) -> dict[str, Any]: ...


async def placement_ready(h: Caller, deadline_s: float = 120) -> None:
    """Placement has synced its view (health check `view` ok) and can place on the fleet."""
    probe = {"request_id": "probe", "tenant": "bench", "model": "llama3-8b", "context_tokens": 4096}
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            health = await h.call(Rpc.PLACEMENT_HEALTH, {}, timeout=2)
            if health.get("checks", {}).get("view") == "ok":
                if (await h.call(Rpc.PLACEMENT_EXPLAIN, probe, timeout=10)).get("status") == "placed":
                    return
        except Exception:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError("placement never became ready")


def bench_fleet(nodes: int = 1024) -> tuple[dict[str, Any], int]:
    """The benchmark's fleet (seeded synthetic inventory, GPUs only) and how many GPUs it has."""
    fleet = synthetic_inventory(nodes=nodes, rng=random.Random(7), tpu_pods=0)
    gpus = sum(x["gpus"] for r in fleet["regions"] for c in r["clusters"] for n in c["racks"] for x in n["nodes"])
    return fleet, gpus


async def _main(args: argparse.Namespace) -> None:
    from tests.servers import find_servers

    fleet, gpus = bench_fleet(args.nodes)
    with tempfile.TemporaryDirectory() as tmp:
        servers = await find_servers(Path(tmp))
        try:
            async with LedgerHarness(
                servers, Path(tmp), fleet=fleet, services=("placement",), want_accelerators=gpus
            ) as h:
                await placement_ready(h)
                print(await run(h, rate=args.rate, seconds=args.seconds))
        finally:
            servers.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=200)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--nodes", type=int, default=1024)
    asyncio.run(_main(parser.parse_args()))
