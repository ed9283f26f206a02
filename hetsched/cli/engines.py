"""`hetsched engine-sim`: a simulated engine that reports one replica's status, so the request path runs
without GPUs."""

from __future__ import annotations

from typing import Annotated

import typer

from hetsched.cli import common
from hetsched.cli.common import DataDirOption, bad_input, endpoints, refusal, say, settings_of
from shared.contracts.base import Rejected
from shared.contracts.subjects import Subjects
from shared.contracts.topology import EngineStatusEvent
from shared.infra.rpc import RpcClient

app = typer.Typer()


def _holders(data_dir: DataDirOption, replica: str, node: str | None) -> list[str]:
    """The nodes (TPU pods) the ledger holds ``replica`` on: when ``node`` holds it, that one alone (one
    node's page); else all of them (the whole ledger, to say where it is). A refusal exits 1."""

    async def work(client: RpcClient) -> list[str] | Rejected:
        from hetsched.engine_sim import replica_nodes

        if node is not None:
            page = await client.ledger_snapshot(node=node)
            if isinstance(page, Rejected):
                return page
            if replica_nodes(((a.node, a.allocations) for a in page.accelerators), replica):
                return [node]
        snapshot = await client.ledger_snapshot()
        if isinstance(snapshot, Rejected):
            return snapshot
        return replica_nodes(((a.node, a.allocations) for a in snapshot.accelerators), replica)

    found = common.with_rpc(data_dir, "the ledger", work)
    if isinstance(found, Rejected):
        refusal(found, False)
    assert isinstance(found, list)
    return found


@app.command("engine-sim")
def engine_sim(
    replica: Annotated[str, typer.Option("--replica", help="The replica's allocation id (placement.place's).")],
    node: Annotated[
        str | None,
        typer.Option(help="Node the replica runs on (its first stage's); default: its node in the ledger."),
    ] = None,
    interval_s: Annotated[float, typer.Option(help="Seconds between reports.")] = 2.0,
    count: Annotated[int, typer.Option(help="Reports to send, then stop (0: until interrupted).")] = 0,
    queue_depth: Annotated[int, typer.Option(help="Requests waiting in the engine.")] = 2,
    kv_used: Annotated[float, typer.Option(help="KV in use, as a fraction of its total.")] = 0.4,
    kv_total_gb: Annotated[float, typer.Option(help="KV capacity (GB).")] = 40.0,
    latency_ms: Annotated[float, typer.Option(help="TTFT p50 with an empty queue.")] = 80.0,
    unhealthy: Annotated[bool, typer.Option(help="Report a failed health check.")] = False,
    data_dir: DataDirOption = None,
) -> None:
    """A simulated engine: reports one replica's status so `placement.admit` can be run without GPUs. It
    reports for the node the ledger holds the replica on (admission ignores another node's reports) and
    prints one line per report."""
    from hetsched.engine_sim import EngineLoad, describe, run_engine

    for problem, bad in (
        ("--interval-s must be > 0", not interval_s > 0),
        ("--count must be >= 0", count < 0),
        ("--queue-depth must be >= 0", queue_depth < 0),
        ("--kv-used must be a fraction from 0 to 1", not 0 <= kv_used <= 1),
        ("--kv-total-gb must be > 0", not kv_total_gb > 0),
        ("--latency-ms must be > 0", not latency_ms > 0),
    ):
        if bad:
            bad_input(problem)
    holders = _holders(data_dir, replica, node)
    if not holders:
        bad_input(
            f"replica {replica!r} holds no accelerator in the ledger: it is not placed, or was released or expired "
            "(the allocation id that `hetsched place` printed)"
        )
    if node is None:
        if len(holders) > 1:
            bad_input(f"replica {replica} spans nodes {', '.join(holders)}: pass --node (its first stage's node)")
        node = holders[0]
    elif node not in holders:
        bad_input(
            f"replica {replica} is not placed on {node!r} (admission ignores reports from another node): "
            f"it is on {', '.join(holders)}"
        )
    where: str = node
    load = EngineLoad(
        kv_total_bytes=int(kv_total_gb * 1e9),
        kv_used=kv_used,
        queue_depth=queue_depth,
        base_latency_ms=latency_ms,
        healthy=not unhealthy,
    )
    sent = [0]

    def reported(number: int, status: EngineStatusEvent) -> None:
        sent[0] = number
        say(describe(number, status))

    async def work(client: RpcClient) -> int:
        subjects = Subjects(endpoints(settings_of(data_dir))[2])
        return await run_engine(
            client.nc.jetstream(),
            subjects,
            replica_id=replica,
            node=where,
            load=load,
            interval_s=interval_s,
            count=count,
            on_report=reported,
        )

    until = f"{count} report(s)" if count else "until interrupted (Ctrl-C)"
    say(f"engine-sim: reporting replica {replica} on {where} every {interval_s:g} s, {until}")
    try:
        common.with_rpc(data_dir, "the TELEMETRY stream", work)
    except KeyboardInterrupt:
        pass  # the reports sent are said below
    say(f"{sent[0]} engine status report(s) sent for {replica} on {where}")
