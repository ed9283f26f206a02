"""A simulated inference engine: reports one replica's status (TELEMETRY `engine_status`) the way an engine's
sidecar would, so the request path runs end to end without GPUs (`hetsched engine-sim --replica ID`).

The figures follow a small load model: queue depth and KV use track the load the caller sets, TTFT grows
with the queue (each waiting request adds one prefill: ``latency_p50 = base + per_queued x queue``), p99 is
a multiple of p50. Defaults are orders of magnitude of a vLLM server of an 8B model on one H100 at
moderate load (TTFT p50 ~ 100 ms, a queue of a few requests). ``--unhealthy`` reports a failed health
check; stopping the process makes the replica stale (it leaves rotation after ``HETSCHED_ENGINE_STALE_S``).

Admission takes a replica's reports only from the node it was placed on, so the command reports for the
node the ledger holds the replica on and refuses another (a report there would change nothing).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from nats.js import JetStreamContext

from shared.contracts.envelope import new_event
from shared.contracts.permissions import AGENT
from shared.contracts.subjects import Context, Subjects
from shared.contracts.topology import EngineStatusEvent, TelemetryEventName
from shared.infra.clock import Clock, system_clock
from shared.infra.outbox import msg_id_headers


@dataclass(frozen=True)
class EngineLoad:
    """What the simulated engine carries: queue depth, KV in use (a fraction), latency model, health."""

    kv_total_bytes: int = 40 * 2**30
    kv_used: float = 0.4
    queue_depth: int = 2
    base_latency_ms: float = 80.0
    per_queued_ms: float = 12.0
    p99_factor: float = 2.5
    healthy: bool = True
    jitter: float = 0.1  # +- this fraction on every figure (0: exact)

    def status(self, *, replica_id: str, node: str, rng: random.Random) -> EngineStatusEvent:
        def wobble(value: float) -> float:
            return value * (1 + rng.uniform(-self.jitter, self.jitter)) if self.jitter else value

        queue = max(0, round(wobble(self.queue_depth)))
        p50 = wobble(self.base_latency_ms + self.per_queued_ms * queue)
        used = min(self.kv_total_bytes, max(0, int(wobble(self.kv_used) * self.kv_total_bytes)))
        return EngineStatusEvent(
            replica_id=replica_id,
            node=node,
            queue_depth=queue,
            kv_used_bytes=used,
            kv_total_bytes=self.kv_total_bytes,
            latency_p50_ms=round(p50, 2),
            latency_p99_ms=round(p50 * self.p99_factor, 2),
            slo_violations=0,
            healthy=self.healthy,
        )


async def publish_engine_status(
    jetstream: JetStreamContext, subjects: Subjects, status: EngineStatusEvent, *, clock: Clock = system_clock
) -> None:
    """One report on `<prefix>.events.telemetry.engine_status.<node>`, as the node's agent publishes it."""
    event = new_event(
        type=f"{Context.TELEMETRY.value}.{TelemetryEventName.ENGINE_STATUS.value}",
        source=AGENT,
        payload=status.model_dump(mode="json"),
        occurred_at=clock(),
    )
    await jetstream.publish(
        subjects.event(Context.TELEMETRY, TelemetryEventName.ENGINE_STATUS, node=status.node),
        event.model_dump_json().encode(),
        headers=msg_id_headers(str(event.event_id)),
    )


async def run_engine(
    jetstream: JetStreamContext,
    subjects: Subjects,
    *,
    replica_id: str,
    node: str,
    load: EngineLoad,
    interval_s: float,
    count: int = 0,
    seed: int = 0,
    on_report: Callable[[int, EngineStatusEvent], None] | None = None,
) -> int:
    """Report every ``interval_s``; ``count`` reports then stop (0: until cancelled). How many were sent;
    ``on_report`` hears each report once it is published (its number, from 1, and the report)."""
    rng = random.Random(seed)
    sent = 0
    while count == 0 or sent < count:
        status = load.status(replica_id=replica_id, node=node, rng=rng)
        await publish_engine_status(jetstream, subjects, status)
        sent += 1
        if on_report is not None:
            on_report(sent, status)
        if count and sent >= count:
            break
        await asyncio.sleep(interval_s)
    return sent


def describe(number: int, status: EngineStatusEvent) -> str:
    """One report in one line: ``report 3: queue 2, KV 41% of 40.0 GB, TTFT p50 104 ms / p99 260 ms, healthy``."""
    used = status.kv_used_bytes / status.kv_total_bytes if status.kv_total_bytes else 0.0
    return (
        f"report {number}: queue {status.queue_depth}, KV {used:.0%} of {status.kv_total_bytes / 1e9:.1f} GB, "
        f"TTFT p50 {status.latency_p50_ms:.0f} ms / p99 {status.latency_p99_ms:.0f} ms, "
        f"{'healthy' if status.healthy else 'UNHEALTHY'}"
    )


def replica_nodes(accelerators: Iterable[tuple[str, Iterable[str]]], replica_id: str) -> list[str]:
    """The nodes (or TPU pods) whose accelerators hold ``replica_id``, from the ledger's view (each
    accelerator's node and allocation ids), sorted."""
    return sorted({node for node, allocations in accelerators if replica_id in allocations})
