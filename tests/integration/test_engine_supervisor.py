"""The node agent's engine supervisor on real NATS, running real engine processes (a `custom` engine: the
tiny HTTP server of tests/engines). A stand-in for placement answers `placement.assignments` on the node's
subject with what the test assigns; the supervisor's `replica_state` events are read off the bus.

Assigned -> the engine starts with the binding's devices in its environment -> starting, loading, ready
with an endpoint; SIGKILL -> restarted and ready again; killed again and again -> failed; unassigned ->
SIGTERM, the process is gone and the port refuses; a preemption deadline -> stopped by it; placement
silent -> nothing is stopped."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.topology_discovery.supervisor import Supervisor
from shared.contracts.engines import Assignment, AssignmentsReply, ReplicaStateEvent
from shared.contracts.placement import NodeBinding
from shared.contracts.subjects import Context, Rpc, Subjects
from shared.contracts.topology import TelemetryEventName
from shared.infra.bus import ensure_streams
from shared.infra.clock import system_clock
from shared.infra.retention import stream_specs_for
from shared.infra.rpc import RpcClient
from shared.infra.settings import AgentSettings, Settings
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

TINY = Path(__file__).resolve().parents[1] / "engines" / "tiny_engine.py"


class Bench:
    """A supervisor for one node, the assignments the test gives it, and what it published."""

    def __init__(self, nc: Client, settings: Settings, tmp: Path) -> None:
        self.nc = nc
        self.node = f"sup-{uuid.uuid4().hex[:8]}"
        self.subjects = Subjects(settings.kit.subject_prefix)
        self.assigned: list[Assignment] = []
        self.answering = True
        self.events: list[ReplicaStateEvent] = []
        self.tmp = tmp
        self.settings = settings
        self.supervisor: Supervisor | None = None
        self.rpc: RpcClient | None = None
        self._subs: list[Any] = []

    async def start(self, **agent: Any) -> Supervisor:
        async def answer(msg: Msg) -> None:
            if self.answering:
                await msg.respond(
                    AssignmentsReply(node=self.node, assignments=self.assigned).model_dump_json().encode()
                )

        async def seen(msg: Msg) -> None:
            self.events.append(ReplicaStateEvent.model_validate(json.loads(msg.data)["payload"]))

        self._subs.append(
            await self.nc.subscribe(self.subjects.scoped(Rpc.PLACEMENT_ASSIGNMENTS, self.node), cb=answer)
        )
        subject = self.subjects.event(Context.TELEMETRY, TelemetryEventName.REPLICA_STATE, node=self.node)
        self._subs.append(await self.nc.subscribe(subject, cb=seen))
        self.rpc = await RpcClient.connect(self.settings.kit.nats_url or "", self.subjects, timeout_s=2)
        env_file = f"{self.tmp}/{{replica_id}}.json"
        template = f"{sys.executable} {TINY} --host {{host}} --port {{port}} --load-s 0.6 --env-file {env_file}"
        options: dict[str, Any] = {
            "engine": "custom",
            "engine_command": template,
            "bind_host": "127.0.0.1",
            "advertise_host": "127.0.0.1",
            "stop_grace_s": 3.0,
            "max_crashes": 3,
            "restart_backoff_s": 0.2,
            "reconcile_s": 0.2,
            "status_s": 0.5,
            "port_min": 18100,
            "port_max": 18999,
        } | agent
        self.supervisor = Supervisor(
            node=self.node,
            rpc=self.rpc,
            jetstream=self.nc.jetstream,
            subjects=self.subjects,
            clock=system_clock,
            settings=AgentSettings(**options),
            log_dir=self.tmp / "logs",
            log=__import__("logging").getLogger("test-supervisor"),
        )
        return self.supervisor

    def assign(self, replica_id: str, **extra: Any) -> Assignment:
        assignment = Assignment(
            replica_id=replica_id,
            tenant="acme",
            model="llama3-8b",
            dtype="bf16",
            tp=2,
            head_node=self.node,
            binding=NodeBinding(node=self.node, cuda_visible_devices="3,1", tp_rank_order=[3, 1], cpu_set="0"),
            **extra,
        )
        self.assigned = [a for a in self.assigned if a.replica_id != replica_id] + [assignment]
        return assignment

    def unassign(self, replica_id: str) -> None:
        self.assigned = [a for a in self.assigned if a.replica_id != replica_id]

    def states(self, replica_id: str) -> list[str]:
        return [e.state for e in self.events if e.replica_id == replica_id]

    def last(self, replica_id: str) -> ReplicaStateEvent | None:
        mine = [e for e in self.events if e.replica_id == replica_id]
        return mine[-1] if mine else None

    async def close(self) -> None:
        for sub in self._subs:
            await sub.unsubscribe()
        if self.supervisor is not None:
            await self.supervisor.stop_all()
        if self.rpc is not None:
            await self.rpc.close()


@pytest_asyncio.fixture(loop_scope="session")
async def bench(settings: Settings, tmp_path: Path) -> AsyncIterator[Bench]:
    nc = await nats.connect(settings.kit.nats_url or "")
    await ensure_streams(nc.jetstream(), stream_specs_for(settings))
    made = Bench(nc, settings, tmp_path)
    loop: asyncio.Task[None] | None = None

    async def run(**agent: Any) -> Supervisor:
        nonlocal loop
        supervisor = await made.start(**agent)
        loop = asyncio.create_task(_both(supervisor))
        return supervisor

    made.run = run  # type: ignore[attr-defined]
    try:
        yield made
    finally:
        if loop is not None:
            loop.cancel()
        await made.close()
        await nc.close()


async def _both(supervisor: Supervisor) -> None:
    await asyncio.gather(supervisor.reconcile_loop(), supervisor.status_loop())


def refuses(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) != 0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped) counts as gone.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


async def test_an_assigned_part_starts_becomes_ready_and_stops_when_released(bench: Bench) -> None:
    supervisor = await bench.run()  # type: ignore[attr-defined]
    bench.assign("al-ready")
    ready = await wait_for(
        lambda: (e := bench.last("al-ready")) is not None and e.state == "ready" and e, 20, what="the engine ready"
    )
    assert ready.endpoint is not None and ready.endpoint.startswith("http://127.0.0.1:")
    assert ready.pid is not None and ready.engine == "custom" and ready.rank == 0 and ready.ranks == 1
    seen = bench.states("al-ready")
    assert seen[0] == "starting" and "ready" in seen
    assert seen.index("starting") < seen.index("ready")
    # The binding reached the engine: its devices in rank order and the replica it runs for.
    started = json.loads((bench.tmp / "al-ready.json").read_text())
    assert started["CUDA_VISIBLE_DEVICES"] == "3,1" and started["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert started["HETSCHED_REPLICA_ID"] == "al-ready" and started["HETSCHED_NODE"] == bench.node
    assert started["cpus"] == [0] or 0 not in os.sched_getaffinity(0)  # pinned to the binding's CPU set
    port = supervisor.engines["al-ready"].port
    assert not refuses(port)
    # Republished while it stays (what placement renews the lease on).
    count = len(bench.states("al-ready"))
    await wait_for(lambda: len(bench.states("al-ready")) >= count + 2, 5, what="the state republished")

    bench.unassign("al-ready")  # released
    await wait_for(lambda: bench.last("al-ready").state == "stopped", 10, what="the engine stopped")  # type: ignore[union-attr]
    assert not alive(ready.pid) and refuses(port)
    await wait_for(lambda: "al-ready" not in supervisor.engines, 5, what="the part forgotten")


async def test_a_killed_engine_restarts_and_one_that_keeps_crashing_fails(bench: Bench) -> None:
    supervisor = await bench.run()  # type: ignore[attr-defined]
    bench.assign("al-crash")
    first = await wait_for(
        lambda: (e := bench.last("al-crash")) is not None and e.state == "ready" and e, 20, what="the engine ready"
    )
    assert first.pid is not None
    os.kill(first.pid, signal.SIGKILL)
    again = await wait_for(
        lambda: (e := bench.last("al-crash")) is not None and e.state == "ready" and e.pid != first.pid and e,
        20,
        what="the engine restarted and ready",
    )
    assert again.restarts == 1 and "starting" in bench.states("al-crash")[bench.states("al-crash").index("ready") + 1 :]
    # Two more crashes in a row (it is not left ready long enough to forget the first): failed.
    killed = {first.pid}
    for _ in range(2):

        def running() -> int | None:
            run = supervisor.engines["al-crash"].run
            return run.pid if run.pid not in killed and run.state in ("starting", "loading", "ready") else None

        pid = await wait_for(running, 20, what="the engine started again")
        killed.add(pid)
        os.kill(pid, signal.SIGKILL)
    failed = await wait_for(
        lambda: (e := bench.last("al-crash")) is not None and e.state == "failed" and e, 20, what="failed"
    )
    assert failed.reason is not None and "3 crashes in a row" in failed.reason and failed.endpoint is None
    await asyncio.sleep(1)
    assert supervisor.engines["al-crash"].run.state == "failed"  # no restart after failed
    bench.unassign("al-crash")
    await wait_for(lambda: "al-crash" not in supervisor.engines, 5, what="the failed part forgotten")


async def test_a_preempted_part_is_stopped_by_its_deadline_and_silence_stops_nothing(bench: Bench) -> None:
    supervisor = await bench.run(stop_grace_s=30.0)  # type: ignore[attr-defined]
    bench.assign("al-spot")
    bench.assign("al-stays")
    ready = await wait_for(lambda: (e := bench.last("al-spot")) is not None and e.state == "ready" and e, 20)
    await wait_for(lambda: (e := bench.last("al-stays")) is not None and e.state == "ready", 20)
    deadline = system_clock() + timedelta(seconds=2)
    bench.assign("al-spot", stop_by=deadline)
    await wait_for(lambda: bench.last("al-spot").state == "stopped", 15, what="stopped")  # type: ignore[union-attr]
    assert system_clock() < deadline + timedelta(seconds=1.5)  # gone by the deadline (one reconcile pass late)
    assert ready.pid is not None and not alive(ready.pid)
    # Placement stops answering: what runs keeps running.
    bench.answering = False
    await asyncio.sleep(1.5)
    assert supervisor.engines["al-stays"].run.state == "ready"
    stays = supervisor.engines["al-stays"].run.pid
    assert stays is not None and alive(stays)
