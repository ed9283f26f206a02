"""An agent publishes GPU telemetry to the TELEMETRY stream (real JetStream), one event per interval."""

from __future__ import annotations

import dataclasses

import nats
import pytest

from services.topology_discovery.app import AGENT, wire_agent
from services.topology_discovery.providers import ProviderError
from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context, Subjects
from shared.contracts.topology import GPU_TELEMETRY, GpuSample
from shared.domain.fleet import NodeProfile
from shared.infra.service import build_app
from shared.infra.settings import Settings
from tests.jetstream import read_all
from tests.waiting import wait_for

pytestmark = pytest.mark.asyncio(loop_scope="session")


class SampledNode:
    """A provider whose GPUs report fixed samples (the profile is not needed here)."""

    name = "fake"

    def __init__(self) -> None:
        self.sampled = 0

    def profile(self) -> NodeProfile:
        raise ProviderError("no profile in this test")

    def telemetry(self) -> list[GpuSample]:
        self.sampled += 1
        return [GpuSample(index=i, memory_used_bytes=(i + 1) * 2**30, utilization_pct=50.0) for i in range(2)]


async def test_agent_publishes_gpu_telemetry(settings: Settings) -> None:
    tuned = settings.updated(topology={"telemetry_interval_s": 0.1, "node": "tele-01"})
    provider = SampledNode()
    # The agent as deployed, with a fake provider and only its telemetry loop running.
    definition = dataclasses.replace(
        AGENT,
        wire=lambda runtime: wire_agent(runtime, provider=provider),
        loops=tuple(loop for loop in AGENT.loops if loop.name == "topology-telemetry"),
    )
    app, _runtime = build_app(definition, tuned, database=False)
    async with app:
        # A third sample is taken only after the second one was published.
        await wait_for(lambda: provider.sampled >= 3, 20, what="three telemetry samples taken")
    nc = await nats.connect(settings.kit.nats_url or "")  # the agent has stopped: the stream holds what it published
    try:
        found = await read_all(
            nc.jetstream(),
            stream=stream_name(Context.TELEMETRY, stream_prefix=settings.kit.stream_prefix),
            subject=Subjects(settings.kit.subject_prefix).event(Context.TELEMETRY, GPU_TELEMETRY, node="tele-01"),
        )
    finally:
        await nc.close()
    mine = [e for e in found if e["payload"]["node"] == "tele-01"]
    assert len(mine) >= 2
    assert mine[0]["type"] == "telemetry.gpu" and mine[0]["payload"]["gpus"][1]["memory_used_bytes"] == 2 * 2**30
    assert len({e["event_id"] for e in mine}) == len(mine)
    assert all(e["_msg_id"] == e["event_id"] for e in mine)  # Nats-Msg-Id = event id
