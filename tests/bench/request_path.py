"""Benchmark: the request path over NATS, open loop: `route.select` (routing only) and `placement.admit`
(a KV hold committed in the ledger per request).

    python -m tests.bench.request_path [--rate 500] [--seconds 10] [--replicas 32]

Topology, the ledger, placement and the router run as processes on a fleet of two regions (us-west-1,
us-east-1; 16 H100 nodes each). Replicas of llama3.1-8b are placed through `placement.place`, and a
simulated engine per replica reports its status every 200 ms (as `hetsched engine-sim` does). Each
admitted request is released 1 s later with `placement.release`, as a gateway does when its message is
done (the releases load the stack too; they are not timed).
`route.select` asks for 1,000 sessions of 50 tenants entering in either region. Prints p50/p99 and the
outcomes of each; asserts nothing about time.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
from pathlib import Path
from typing import Any

from hetsched.engine_sim import EngineLoad, publish_engine_status
from shared.contracts.subjects import Rpc
from tests.bench.ledger_harness import LedgerHarness
from tests.bench.loadgen import open_loop
from tests.bench.placement_e2e import placement_ready
from tests.bench.placement_soak import cpu_s

REGIONS = ("us-west-1", "us-east-1")
HOLD_S = 1.0
"""How long a gateway holds an admission before releasing it (its message's generation), untimed."""
NODES_PER_REGION = 16


def fleet() -> dict[str, Any]:
    return {
        "regions": [
            {
                "name": region,
                "clusters": [
                    {
                        "name": "c1",
                        "racks": [
                            {
                                "name": "r1",
                                "nodes": [
                                    {
                                        "name": f"{region}-h100-{{i:02d}}",
                                        "count": NODES_PER_REGION,
                                        "sku": "H100-SXM-80GB",
                                        "gpus": 8,
                                        "topology": "nvswitch-8",
                                    }
                                ],
                            }
                        ],
                    }
                ],
            }
            for region in REGIONS
        ]
    }


def cpu_seconds(h: LedgerHarness) -> dict[str, float]:
    """CPU seconds each service process has used so far."""
    used = {name: cpu_s(proc.pid) for name, proc in h.procs.items()}
    return {name: seconds for name, seconds in used.items() if seconds is not None}


async def _main(args: argparse.Namespace) -> None:
    from tests.servers import find_servers

    with tempfile.TemporaryDirectory() as tmp:
        servers = await find_servers(Path(tmp))
        try:
            async with LedgerHarness(
                servers,
                Path(tmp),
                fleet=fleet(),
                services=("placement", "cross_region_router"),
                # The replicas are "platform"'s, a shared pool that serves the 50 tenants.
                service_env={"HETSCHED_ADMIT_SHARED_OWNERS": "platform"},
                want_accelerators=len(REGIONS) * NODES_PER_REGION * 8,
            ) as h:
                await placement_ready(h)
                replicas: list[tuple[str, str]] = []
                for i in range(args.replicas):
                    placed = await h.call(
                        Rpc.PLACEMENT_PLACE,
                        {
                            "request_id": f"replica-{i}",
                            "tenant": "platform",
                            "model": "llama3.1-8b",
                            "context_tokens": 8192,
                            "concurrency": 16,
                            "region": REGIONS[i % 2],
                            "tp": 1,
                        },
                        timeout=30,
                    )
                    assert placed["status"] == "placed", placed
                    replicas.append((placed["allocation_id"], placed["placements"][0]["node"]))
                js = h.nc.jetstream()
                rng = random.Random(0)
                load = EngineLoad(queue_depth=0, kv_used=0.1, jitter=0)

                async def engines() -> None:
                    while True:
                        for allocation_id, node in replicas:
                            status = load.status(replica_id=allocation_id, node=node, rng=rng)
                            await publish_engine_status(js, h.subjects, status)
                        await asyncio.sleep(0.2)

                reporting = asyncio.create_task(engines())
                await asyncio.sleep(1.5)  # placement and the router have heard of the replicas

                releasing: set[asyncio.Task[Any]] = set()

                async def release_later(allocation_id: str, tenant: str) -> None:
                    await asyncio.sleep(HOLD_S)  # the engine generates; then the gateway releases the KV
                    await h.call(Rpc.PLACEMENT_RELEASE, {"allocation_id": allocation_id, "tenant": tenant}, timeout=30)

                async def admit(i: int) -> str:
                    tenant = f"t{i % 50}"
                    reply = await h.call(
                        Rpc.PLACEMENT_ADMIT,
                        {
                            "request_id": f"adm-{i}",
                            "tenant": tenant,
                            "model": "llama3.1-8b",
                            "input_tokens": 1000,
                            "output_tokens": 256,
                            "region": REGIONS[i % 2],
                            "lease_s": 60,
                        },
                        timeout=30,
                    )
                    if reply.get("status") == "admitted":
                        task = asyncio.create_task(release_later(reply["allocation_id"], tenant))
                        releasing.add(task)
                        task.add_done_callback(releasing.discard)
                    return str(reply.get("status")) + (f":{reply['error']['code']}" if reply.get("error") else "")

                async def route(i: int) -> str:
                    return await route_session(i, rng.randrange(1000))

                async def route_session(i: int, session: int) -> str:
                    reply = await h.call(
                        Rpc.ROUTE_SELECT,
                        {
                            "request_id": f"rt-{i}",
                            "tenant": f"t{session % 50}",
                            "session_id": f"s{session}",
                            "origin_region": REGIONS[session % 2],
                            "model": "llama3.1-8b",
                            "input_tokens": 1000,
                            "output_tokens": 256,
                            "admit": False,
                        },
                        timeout=30,
                    )
                    return f"{reply.get('status')}:{reply.get('region') or (reply.get('error') or {}).get('code')}"

                # Steady state: every session has been routed once (its region is pinned and written), as in a
                # service that has run for a while; the timed run then writes only switches and traffic.
                for first in range(0, 1000, 100):
                    await asyncio.gather(*(route_session(-10_000 - s, s) for s in range(first, first + 100)))
                before = cpu_seconds(h)
                await asyncio.sleep(5)
                after = cpu_seconds(h)
                used = ", ".join(f"{k} {after[k] - before[k]:.1f}" for k in sorted(after))
                print(f"idle 5 s (engines reporting): CPU-s {used}")
                for name, one in (("route.select", route), ("placement.admit", admit)):
                    before = cpu_seconds(h)
                    print(await open_loop(name, args.rate, args.seconds, one, warm_up=50))
                    await asyncio.gather(*releasing)  # the last admissions' releases (untimed)
                    after = cpu_seconds(h)
                    print("  CPU-s during it: " + ", ".join(f"{k} {after[k] - before[k]:.1f}" for k in sorted(after)))
                reporting.cancel()
        finally:
            servers.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", type=float, default=500)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--replicas", type=int, default=32)
    asyncio.run(_main(parser.parse_args()))
