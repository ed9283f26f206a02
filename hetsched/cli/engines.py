"""`hetsched engine-sim`: a simulated engine that reports one replica's status, so the request path runs
without GPUs."""

from __future__ import annotations

from typing import Annotated

import typer

from hetsched.cli import common
from hetsched.cli.common import DataDirOption, console, endpoints, settings_of
from shared.contracts.subjects import Subjects
from shared.infra.rpc import RpcClient

app = typer.Typer()


@app.command("engine-sim")
def engine_sim(
    replica: Annotated[str, typer.Option("--replica", help="The replica's allocation id (placement.place's).")],
    node: Annotated[str, typer.Option(help="Node the replica runs on (its first node).")],
    interval_s: Annotated[float, typer.Option(help="Seconds between reports.")] = 2.0,
    count: Annotated[int, typer.Option(help="Reports to send, then stop (0: until interrupted).")] = 0,
    queue_depth: Annotated[int, typer.Option(help="Requests waiting in the engine.")] = 2,
    kv_used: Annotated[float, typer.Option(help="KV in use, as a fraction of its total.")] = 0.4,
    kv_total_gb: Annotated[float, typer.Option(help="KV capacity (GB).")] = 40.0,
    latency_ms: Annotated[float, typer.Option(help="TTFT p50 with an empty queue.")] = 80.0,
    unhealthy: Annotated[bool, typer.Option(help="Report a failed health check.")] = False,
    data_dir: DataDirOption = None,
) -> None:
    """A simulated engine: reports one replica's status so `placement.admit` can be run without GPUs."""
    from hetsched.engine_sim import EngineLoad, run_engine

    load = EngineLoad(
        kv_total_bytes=int(kv_total_gb * 1e9),
        kv_used=kv_used,
        queue_depth=queue_depth,
        base_latency_ms=latency_ms,
        healthy=not unhealthy,
    )

    async def work(client: RpcClient) -> int:
        subjects = Subjects(endpoints(settings_of(data_dir))[2])
        return await run_engine(
            client.nc.jetstream(),
            subjects,
            replica_id=replica,
            node=node,
            load=load,
            interval_s=interval_s,
            count=count,
        )

    sent = common.with_rpc(data_dir, "the TELEMETRY stream", work)
    console.print(f"{sent} engine status report(s) sent for {replica} on {node}")
