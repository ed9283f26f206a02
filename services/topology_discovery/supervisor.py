"""The node agent's engine supervisor (docs/ENGINES.md, "The supervisor"): it runs the engines of the replica
parts placement assigns to its node. A thin adapter over ``shared.domain.supervision``.

Every ``reconcile_s`` it asks ``placement.assignments`` (on its node's subject) what the node runs, probes
each engine's ``/health``, and carries out what ``plan`` says: start an engine (from its launcher, with the
binding's devices and CPU set, on a free port), restart a crashed one after a backoff, stop one whose part
is gone (released, expired) or whose preemption deadline nears (SIGTERM, SIGKILL after the grace). Each rank's
state goes out as ``replica_state`` at each change and again every ``status_s``, with ``engine_status`` from
its ``/metrics``; placement renews a replica's lease while its ranks report, so a node whose agent dies lets
its leases lapse.

Placement unreachable: nothing is stopped (the last answer stands). The engines are tied to the agent: they
get SIGKILL when the agent dies (``PR_SET_PDEATHSIG``), so no engine outlives the agent that reports it.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from nats.js import JetStreamContext

from services.topology_discovery.launchers import EngineCommand, LaunchError, LaunchSettings, engine_command
from shared.contracts.base import Rejected
from shared.contracts.engines import Assignment, AssignmentsReply, AssignmentsRequest, ReplicaStateEvent
from shared.contracts.envelope import new_event
from shared.contracts.subjects import Context, Rpc, Subjects
from shared.contracts.topology import EngineStatusEvent, TelemetryEventName
from shared.domain import supervision
from shared.domain.engines.exposition import Exposition, UnreadableExposition, parse_exposition
from shared.domain.engines.figures import UnrecognizedEngine, engine_figures, kv_capacity_tokens
from shared.domain.engines.status import engine_status_fields
from shared.domain.memory import kv_cache_bytes
from shared.domain.models import ModelSpec
from shared.domain.supervision import ALIVE, Forget, Kill, Phase, Policy, Run, Start, Stop, Wanted
from shared.infra.catalog import load_models
from shared.infra.clock import Clock
from shared.infra.outbox import msg_id_headers
from shared.infra.rpc import RpcClient, RpcError
from shared.infra.settings import AgentSettings

SOURCE = "topology-agent"
PROBE_TIMEOUT_S = 2.0
PR_SET_PDEATHSIG = 1


@dataclass
class Engine:
    """One replica part's engine process on this node."""

    assignment: Assignment
    port: int
    run: Run
    process: asyncio.subprocess.Process | None = None
    published: tuple[Any, ...] | None = None
    waiter: asyncio.Task[None] | None = field(default=None, repr=False)
    scraped: Exposition | None = None  # the last /metrics, for figures over the window since
    scraped_at: float | None = None  # monotonic seconds
    running_requests: int = 0  # in its running batch, at its last ``/metrics``


def policy_of(settings: AgentSettings) -> Policy:
    return Policy(
        stop_grace_s=settings.stop_grace_s,
        max_crashes=settings.max_crashes,
        backoff_s=settings.restart_backoff_s,
        backoff_max_s=max(settings.restart_backoff_max_s, settings.restart_backoff_s),
    )


def _child_setup(cpus: frozenset[int] | None) -> Callable[[], None]:
    """Run in the child before exec: die with the agent, and keep to the binding's CPUs (those of them
    this machine has; none: no pinning)."""

    def setup() -> None:
        with contextlib.suppress(Exception):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if cpus:
            present = cpus & os.sched_getaffinity(0)
            if present:
                os.sched_setaffinity(0, present)

    return setup


class Supervisor:
    def __init__(
        self,
        *,
        node: str,
        rpc: RpcClient,
        jetstream: Callable[[], JetStreamContext],
        subjects: Subjects,
        clock: Clock,
        settings: AgentSettings,
        log_dir: Path,
        log: logging.Logger,
        models: Mapping[str, ModelSpec] | None = None,
    ) -> None:
        self.node = node
        self._rpc = rpc
        self._jetstream = jetstream
        self._subjects = subjects
        self._clock = clock
        self._settings = settings
        self._policy = policy_of(settings)
        self._launch = LaunchSettings(
            engine=settings.engine,
            host=settings.bind_host,
            command_template=settings.engine_command,
            sim_speedup=settings.sim_speedup,
        )
        self._advertise = settings.advertise_host or socket.getfqdn()
        self._log_dir = log_dir
        self._log = log
        self.engines: dict[str, Engine] = {}
        self.wanted: dict[str, Assignment] | None = None  # None until placement first answered
        self._problem: str | None = None  # why placement did not answer the last question
        self._session: aiohttp.ClientSession | None = None
        self._models = models if models is not None else load_models()

    # -- the loops ----------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """Whether this agent runs engines at all (``HETSCHED_AGENT_ENGINE`` other than ``none``)."""
        return self._settings.engine != "none"

    async def reconcile_loop(self) -> None:
        if not self.enabled:
            return
        while True:
            try:
                await self.reconcile_once()
            except Exception:  # one bad pass must not end supervision
                self._log.exception("engine reconcile pass failed")
            await asyncio.sleep(self._settings.reconcile_s)

    async def status_loop(self) -> None:
        if not self.enabled:
            return
        while True:
            await asyncio.sleep(self._settings.status_s)
            try:
                await self.report_all()
            except Exception:
                self._log.exception("engine status pass failed")

    async def reconcile_once(self) -> None:
        """Ask what the node runs, probe what runs, act, and report what changed."""
        assigned = await self._assignments()
        if assigned is not None:
            self.wanted = {a.replica_id: a for a in assigned.assignments}
        if self.wanted is None:
            return  # placement never answered: start nothing, stop nothing
        now = self._clock()
        await asyncio.gather(*(self._probe(engine) for engine in self.engines.values() if engine.run.phase in ALIVE))
        wanted = {rid: Wanted(rid, draining=a.draining, stop_by=a.stop_by) for rid, a in self.wanted.items()}
        for rid, engine in self.engines.items():
            engine.run = supervision.marked(engine.run, wanted.get(rid))
        runs = {rid: engine.run for rid, engine in self.engines.items()}
        for action in supervision.plan(wanted, runs, now, self._policy):
            await self._act(action)
        await self._report_changes()

    async def stop_all(self) -> None:
        """The agent stops: every engine gets SIGTERM, and SIGKILL after the grace."""
        alive = [e for e in self.engines.values() if e.process is not None and e.process.returncode is None]
        for engine in alive:
            _signal(engine, signal.SIGTERM)
        deadline = asyncio.get_running_loop().time() + self._policy.stop_grace_s
        for engine in alive:
            assert engine.process is not None
            left = max(0.0, deadline - asyncio.get_running_loop().time())
            try:
                await asyncio.wait_for(engine.process.wait(), left)
            except TimeoutError:
                _signal(engine, signal.SIGKILL)
        if self._session is not None:
            await self._session.close()

    # -- asking and acting ------------------------------------------------------------------------

    async def _assignments(self) -> AssignmentsReply | None:
        try:
            reply = await self._rpc.ask(
                Rpc.PLACEMENT_ASSIGNMENTS, AssignmentsRequest(node=self.node), AssignmentsReply, scope=self.node
            )
        except RpcError as exc:
            self._unanswered(f"placement did not answer: {exc}")
            return None
        if isinstance(reply, Rejected):
            self._unanswered(f"placement refused: {reply.error.message}")
            return None
        if self._problem is not None:
            self._log.info("placement answers again", extra={"after": self._problem})
            self._problem = None
        return reply

    def _unanswered(self, problem: str) -> None:
        """Logged once per problem (not at every pass): what runs keeps running meanwhile."""
        if problem != self._problem:
            self._log.warning(
                "placement did not say what this node runs; keeping the engines as they are", extra={"error": problem}
            )
        self._problem = problem

    async def _act(self, action: supervision.Action) -> None:
        if isinstance(action, Start):
            assert self.wanted is not None
            await self._start(self.wanted[action.replica_id])
        elif isinstance(action, Stop):
            engine = self.engines[action.replica_id]
            engine.run = supervision.stopping(engine.run, action)
            self._log.info("stopping engine", extra={"replica": action.replica_id, "reason": action.reason})
            _signal(engine, signal.SIGTERM)
        elif isinstance(action, Kill):
            engine = self.engines[action.replica_id]
            self._log.warning("engine outlived its grace: SIGKILL", extra={"replica": action.replica_id})
            _signal(engine, signal.SIGKILL)
        elif isinstance(action, Forget):
            self.engines.pop(action.replica_id, None)

    async def _start(self, assignment: Assignment) -> None:
        rid = assignment.replica_id
        before = self.engines.get(rid)
        port = before.port if before is not None else self._free_port()
        now = self._clock()
        try:
            command = engine_command(assignment, port=port, settings=self._launch)
            process = await self._spawn(rid, command)
        except (LaunchError, OSError) as exc:
            run = supervision.launch_failed(
                rid, f"cannot start the engine: {exc}", now, before=before.run if before is not None else None
            )
            self.engines[rid] = Engine(assignment=assignment, port=port, run=run)
            self._log.error("engine cannot start", extra={"replica": rid, "error": str(exc)})
            return
        run = supervision.started(rid, process.pid, now, before=before.run if before is not None else None)
        engine = Engine(assignment=assignment, port=port, run=run, process=process)
        engine.published = before.published if before is not None else None
        engine.waiter = asyncio.create_task(self._wait(engine, process), name=f"engine-{rid}")
        self.engines[rid] = engine
        self._log.info(
            "engine started",
            extra={"replica": rid, "pid": process.pid, "port": port, "argv": " ".join(command.argv)[:500]},
        )

    async def _spawn(self, rid: str, command: EngineCommand) -> asyncio.subprocess.Process:
        self._log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self._log_dir / f"{rid}.log"
        env = {**os.environ, **command.env}
        with log_path.open("ab") as out:
            process = await asyncio.create_subprocess_exec(
                *command.argv,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,  # its workers are signalled with it (the process group)
                preexec_fn=_child_setup(command.cpus),
            )
        return process

    async def _wait(self, engine: Engine, process: asyncio.subprocess.Process) -> None:
        code = await process.wait()
        current = self.engines.get(engine.run.replica_id)
        if current is None or current.process is not process:
            return
        current.run = supervision.exited(current.run, code, self._clock(), self._policy)
        current.process = None
        self._log.warning(
            "engine exited", extra={"replica": engine.run.replica_id, "code": code, "state": current.run.state}
        )
        await self._report_changes()

    def _free_port(self) -> int:
        taken = {engine.port for engine in self.engines.values()}
        for port in range(self._settings.port_min, self._settings.port_max + 1):
            if port in taken:
                continue
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                try:
                    probe.bind((self._probe_host(), port))
                except OSError:
                    continue
            return port
        raise LaunchError(f"no free port in {self._settings.port_min}-{self._settings.port_max}")

    def _probe_host(self) -> str:
        host = self._settings.bind_host
        return "127.0.0.1" if host in ("0.0.0.0", "", "::") else host

    async def _probe(self, engine: Engine) -> None:
        """Ask the head rank's ``/health``; a rank that serves no HTTP (not the head) is ready while its
        process lives (the head's readiness says the group formed)."""
        if engine.assignment.rank > 0:
            status: int | None = 200 if engine.process is not None and engine.process.returncode is None else None
        else:
            status, _body = await self._get(engine, "/health")
        engine.run = supervision.probed(engine.run, status, self._clock(), self._policy)

    async def _get(self, engine: Engine, path: str) -> tuple[int | None, str | None]:
        """``GET path`` on the engine: its status and body (None, None: nothing answered)."""
        try:
            async with self._http().get(self._local_url(engine, path)) as response:
                return response.status, await response.text(errors="replace")
        except (aiohttp.ClientError, TimeoutError, OSError):
            return None, None

    def _local_url(self, engine: Engine, path: str) -> str:
        return f"http://{self._probe_host()}:{engine.port}{path}"

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S))
        return self._session

    # -- reporting -------------------------------------------------------------------------------

    def endpoint(self, engine: Engine) -> str | None:
        if engine.assignment.rank > 0 or engine.run.phase not in (Phase.LOADING, Phase.READY):
            return None
        return f"http://{self._advertise}:{engine.port}"

    def state_event(self, engine: Engine) -> ReplicaStateEvent:
        run, assignment = engine.run, engine.assignment
        return ReplicaStateEvent(
            replica_id=run.replica_id,
            node=self.node,
            state=run.state,
            rank=assignment.rank,
            ranks=assignment.ranks,
            engine=self._settings.engine,
            endpoint=self.endpoint(engine),
            pid=run.pid,
            restarts=run.restarts,
            reason=run.reason,
        )

    async def _report_changes(self) -> None:
        for engine in list(self.engines.values()):
            event = self.state_event(engine)
            key = (event.state, event.endpoint, event.pid, event.restarts, event.reason)
            if key != engine.published:
                await self._publish_state(engine, event, key)

    async def report_all(self) -> None:
        """Every rank's state again (a late reader learns it; placement renews leases on it), and each
        serving engine's status from its ``/metrics``."""
        for engine in list(self.engines.values()):
            event = self.state_event(engine)
            await self._publish_state(
                engine, event, (event.state, event.endpoint, event.pid, event.restarts, event.reason)
            )
            if engine.run.phase is Phase.READY and engine.assignment.rank == 0:
                status, text = await self._get(engine, "/metrics")
                if status == 200 and text is not None:
                    await self._publish_status(engine, text)

    def status_event(self, engine: Engine, text: str) -> EngineStatusEvent | None:
        """The engine's status from one scrape of its ``/metrics`` (vLLM's or SGLang's names), its latency
        and token figures over the window since the previous scrape; None when the text is no engine's."""
        now_s = time.monotonic()
        try:
            exposition = parse_exposition(text)
            elapsed = now_s - engine.scraped_at if engine.scraped_at is not None else None
            figures = engine_figures(exposition, engine.scraped, elapsed_s=elapsed)
        except (UnreadableExposition, UnrecognizedEngine) as exc:
            self._log.warning(
                "engine metrics not understood", extra={"replica": engine.run.replica_id, "error": str(exc)}
            )
            return None
        engine.scraped, engine.scraped_at = exposition, now_s
        fields = engine_status_fields(
            figures,
            replica_id=engine.run.replica_id,
            node=self.node,
            kv_total_bytes=self._kv_bytes(engine.assignment, kv_capacity_tokens(exposition)),
            healthy=engine.run.phase is Phase.READY,
        )
        return EngineStatusEvent.model_validate(fields)

    def _kv_bytes(self, assignment: Assignment, tokens: int | None) -> int:
        """The KV cache's bytes: the tokens the engine says it holds times the model's KV bytes per token
        (fp8 when the launch asks for an fp8 cache, else 16-bit); 0 when either is unknown."""
        spec = self._models.get(assignment.model)
        if not tokens or spec is None:
            return 0
        args = assignment.launch.vllm if assignment.launch is not None else []
        flag = args[args.index("--kv-cache-dtype") + 1] if "--kv-cache-dtype" in args[:-1] else "auto"
        kv_dtype = "fp8" if flag.startswith("fp8") else "bf16"
        return tokens * kv_cache_bytes(spec, seq_len=1, batch=1, kv_dtype=kv_dtype)

    async def _publish_status(self, engine: Engine, text: str) -> None:
        event = self.status_event(engine, text)
        if event is None:
            return
        engine.running_requests = event.running_requests or 0
        await self._publish(TelemetryEventName.ENGINE_STATUS, event.model_dump(mode="json"))

    async def _publish_state(self, engine: Engine, event: ReplicaStateEvent, key: tuple[Any, ...]) -> None:
        if await self._publish(TelemetryEventName.REPLICA_STATE, event.model_dump(mode="json")):
            engine.published = key

    async def _publish(self, name: TelemetryEventName, payload: dict[str, Any]) -> bool:
        """One TELEMETRY event on this node's subject; False when NATS did not take it (the next pass
        publishes again)."""
        envelope = new_event(
            type=f"{Context.TELEMETRY.value}.{name.value}", source=SOURCE, payload=payload, occurred_at=self._clock()
        )
        try:
            await self._jetstream().publish(
                self._subjects.event(Context.TELEMETRY, name, node=self.node),
                envelope.model_dump_json().encode(),
                headers=msg_id_headers(str(envelope.event_id)),
            )
        except Exception as exc:
            self._log.warning("engine event not published", extra={"type": name.value, "error": str(exc)})
            return False
        return True


def _signal(engine: Engine, signum: int) -> None:
    process = engine.process
    if process is None or process.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signum)
