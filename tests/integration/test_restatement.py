"""Streams folded from their first sequence outlive their max age (issue 23 row 7, docs/RETENTION.md).

Placement rebuilds its reservation book from RESERVATION, and its throttled nodes from REBALANCE, by
folding each from the first sequence at every start. With a max age on those streams (the probe: no stream
had one), a reservation or a throttle older than it would vanish from the fold; so their owners restate
what is live every quarter of the max age. Here both streams keep events 4 s: the reservation filler and
the rebalancer run as processes, a reservation is created and a node throttled, their first events age
out of the streams, and a fold of what the streams still hold (placement's own fold for reservations)
still has both.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import nats
import pytest
import pytest_asyncio
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from hetsched.stack import wait_healthy
from shared.contracts.envelope import new_event
from shared.contracts.permissions import AGENT, EVENT_PUBLISHERS
from shared.contracts.reservation import ReservationEvent
from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context, Rpc, Subjects
from shared.contracts.topology import GPU_TELEMETRY, GpuSample, GpuTelemetryEvent, NodeProfileEvent
from shared.domain.fleet import Accelerator, NodeProfile
from shared.domain.reservations import ReservationBook
from shared.domain.topology import pcie_only
from shared.infra.profiles import profile_to_payload
from shared.infra.reservations import reservation_of
from shared.infra.settings import Settings
from tests.conftest import ServiceProcesses
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")

MAX_AGE_S = 4.0  # restated every second
NODE = "rs-l40s-01"
L40S = "L40S-48GB"
GPU_BYTES = 48 * 1024**3


@dataclass
class Bus:
    nc: Client
    settings: Settings
    subjects: Subjects

    def stream(self, context: Context) -> str:
        return stream_name(context, stream_prefix=self.settings.kit.stream_prefix)

    async def request(self, rpc: Rpc, body: dict[str, Any]) -> dict[str, Any]:
        reply = await self.nc.request(self.subjects.rpc(rpc), json.dumps(body).encode(), timeout=10)
        answer: dict[str, Any] = json.loads(reply.data)
        return answer

    async def publish(self, context: Context, name: str, payload: dict[str, Any], *, node: str | None = None) -> None:
        envelope = new_event(
            type=f"{context.value}.{name}",
            source=AGENT if context is Context.TELEMETRY else EVENT_PUBLISHERS[context],
            occurred_at=datetime.now(UTC),
            payload=payload,
        )
        await self.nc.jetstream().publish(
            self.subjects.event(context, name, node=node),
            envelope.model_dump_json().encode(),
            headers={"Nats-Msg-Id": str(envelope.event_id)},
        )

    async def events(self, context: Context) -> list[dict[str, Any]]:
        """What the stream holds now, from its first sequence, each event with its stream sequence (``_seq``)."""
        js = self.nc.jetstream()
        info = await js.stream_info(self.stream(context))
        out: list[dict[str, Any]] = []
        for sequence in range(max(info.state.first_seq, 1), info.state.last_seq + 1):  # 0: an empty stream
            try:
                raw = await js.get_msg(self.stream(context), sequence)
            except NotFoundError:  # aged out meanwhile
                continue
            event: dict[str, Any] = json.loads(raw.data or b"{}")
            event["_seq"] = sequence
            out.append(event)
        return out

    async def first_sequence(self, context: Context) -> int:
        return int((await self.nc.jetstream().stream_info(self.stream(context))).state.first_seq)


def _profile() -> dict[str, Any]:
    profile = NodeProfile(
        name=NODE,
        region="us-west-1",
        cluster="c-rs",
        rack="r-rs",
        sku=L40S,
        accelerators=tuple(Accelerator(index=i, sku=L40S, hbm_bytes=GPU_BYTES) for i in range(8)),
        links=pcie_only(8),
        source="nvml",
    )
    event = NodeProfileEvent(
        node=NODE, region="us-west-1", kind="pcie", fingerprint="rs", profile=profile_to_payload(profile)
    )
    return event.model_dump(mode="json")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def bus(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Bus]:
    run = uuid.uuid4().hex[:8]
    own = settings.updated(kit={"subject_prefix": f"rs{run}", "stream_prefix": f"RS{run.upper()}_"})
    procs = ServiceProcesses(own, tmp_path_factory.mktemp("restatement"))
    short = {
        "HETSCHED_STREAM_RESERVATION_MAX_AGE_S": str(MAX_AGE_S),
        "HETSCHED_STREAM_REBALANCE_MAX_AGE_S": str(MAX_AGE_S),
    }
    nc = await nats.connect(own.kit.nats_url or "")
    try:
        procs.start("reservation_filler", **short)
        procs.start(
            "rebalancer",
            **short,
            HETSCHED_REBALANCE_PCIE_WINDOW_S="0.5",
            HETSCHED_REBALANCE_TICK_S="0.2",
            HETSCHED_REBALANCE_DRIFT_RATIO="100",  # synthetic HBM figures: no drift plans
        )
        subjects = Subjects(own.kit.subject_prefix)
        health = await wait_healthy(
            nats_url=own.kit.nats_url or "", subjects=subjects, deadline_s=60, only={"reservation_filler", "rebalancer"}
        )
        assert all(h["status"] == "ok" for h in health.values()), health
        state = Bus(nc=nc, settings=own, subjects=subjects)
        await state.publish(Context.TOPOLOGY, "node_profiled", _profile())
        yield state
    finally:
        procs.stop_all()
        with contextlib.suppress(Exception):  # this module's streams only (its own prefix)
            js = nc.jetstream()
            for info in await js.streams_info():
                if info.config.name and info.config.name.startswith(own.kit.stream_prefix):
                    await js.delete_stream(info.config.name)
        await nc.close()


async def test_a_reservation_older_than_the_streams_max_age_is_still_in_the_fold(bus: Bus) -> None:
    body = {"tenant": "acme", "policy": "hard", "accelerators": [f"{NODE}/gpu0", f"{NODE}/gpu1"]}

    async def created() -> dict[str, Any] | None:  # once the filler has the node (TOPOLOGY is asynchronous)
        reply = await bus.request(Rpc.RESERVATION_CREATE, body)
        return reply if reply.get("status") != "rejected" else None

    reservation_id = (await wait_for(created, 30, interval_s=0.2, what="reservation.create on the new node"))[
        "reservation_id"
    ]

    async def first_event() -> int | None:
        for event in await bus.events(Context.RESERVATION):
            if event["type"] == "reservation.created" and event["payload"]["reservation_id"] == reservation_id:
                return int(event["_seq"])
        return None

    created_at = await wait_for(first_event, 15, interval_s=0.2, what="the created event in RESERVATION")

    async def aged_out() -> bool:
        return await bus.first_sequence(Context.RESERVATION) > created_at

    await wait_for(aged_out, 30, interval_s=0.5, what="the created event aged out of RESERVATION")
    book = ReservationBook()  # placement's fold, over what the stream still holds
    for event in await bus.events(Context.RESERVATION):
        book.apply(reservation_of(ReservationEvent.model_validate(event["payload"]).reservation))
    held = book.get(reservation_id)
    assert held is not None and held.active, sorted(book.reservations)
    assert book.right(f"{NODE}/gpu1") is not None


async def test_a_throttle_older_than_the_streams_max_age_is_still_in_the_fold(bus: Bus) -> None:
    link = 2.0e9 * 16  # L40S: PCIe Gen4 x16, one direction (about 32 GB/s)
    sample = GpuTelemetryEvent(
        node=NODE,
        gpus=[
            GpuSample(
                index=i,
                memory_used_bytes=GPU_BYTES // 10,
                memory_free_bytes=GPU_BYTES - GPU_BYTES // 10,
                pcie_rx_bytes_per_s=0.9 * link,
                pcie_tx_bytes_per_s=0.0,
            )
            for i in range(8)
        ],
    ).model_dump(mode="json")

    async def keep_reporting() -> None:  # a silent node's targets go stale: the agent keeps sampling
        while True:
            await bus.publish(Context.TELEMETRY, GPU_TELEMETRY, sample, node=NODE)
            await asyncio.sleep(0.2)

    reporter = asyncio.create_task(keep_reporting())
    try:

        async def started() -> int | None:
            for event in await bus.events(Context.REBALANCE):
                payload = event["payload"]
                if event["type"] == "rebalance.throttle_started" and payload["node"] == NODE:
                    return int(event["_seq"])
            return None

        first = await wait_for(started, 30, interval_s=0.2, what="the PCIe detector throttles the node")

        async def aged_out() -> bool:
            return await bus.first_sequence(Context.REBALANCE) > first

        await wait_for(aged_out, 30, interval_s=0.5, what="throttle_started aged out of REBALANCE")
        throttled: set[str] = set()  # placement's fold of throttles, over what the stream still holds
        restated = False
        for event in await bus.events(Context.REBALANCE):
            name, payload = event["type"].rsplit(".", 1)[-1], event["payload"]
            if name == "throttle_started":
                throttled.add(payload["node"])
                restated = restated or payload.get("restated", False)
            elif name == "throttle_ended":
                throttled.discard(payload["node"])
        assert NODE in throttled and restated
    finally:
        reporter.cancel()
