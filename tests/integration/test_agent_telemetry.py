"""An agent publishes GPU telemetry to the TELEMETRY stream (real JetStream), one event per interval."""

from __future__ import annotations

import asyncio

import pytest

from services.topology_discovery.agent import Agent
from services.topology_discovery.app import AGENT
from shared.contracts.streams import stream_name
from shared.contracts.subjects import Context, Subjects
from shared.contracts.topology import GPU_TELEMETRY, GpuSample
from shared.domain.fleet import NodeProfile
from shared.infra.service import build_app
from shared.infra.settings import Settings
from tests.jetstream import read_all

pytestmark = pytest.mark.asyncio(loop_scope="session")


class SampledNode:
    """A provider whose GPUs report fixed samples (the profile is not needed here)."""

    name = "fake"

    def profile(self) -> NodeProfile:
        raise NotImplementedError

    def telemetry(self) -> list[GpuSample]:
        return [GpuSample(index=i, memory_used_bytes=(i + 1) * 2**30, utilization_pct=50.0) for i in range(2)]


async def test_agent_publishes_gpu_telemetry(settings: Settings) -> None:
    tuned = settings.model_copy(update={"telemetry_interval_s": 0.1, "topology_node": "tele-01"})
    app, runtime = build_app(AGENT, tuned, database=False)
    async with app:
        agent = Agent(runtime, SampledNode())
        task = asyncio.create_task(agent.telemetry_loop())
        await asyncio.sleep(0.55)
        task.cancel()
        assert runtime.js is not None
        found = await read_all(
            runtime.js,
            stream=stream_name(Context.TELEMETRY, stream_prefix=settings.stream_prefix),
            subject=Subjects(settings.subject_prefix).event(Context.TELEMETRY, GPU_TELEMETRY),
        )
    mine = [e for e in found if e["payload"]["node"] == "tele-01"]
    assert 2 <= len(mine) <= 8  # one per 0.1 s over ~0.55 s (loose: a loaded CI machine runs late)
    assert mine[0]["type"] == "telemetry.gpu" and mine[0]["payload"]["gpus"][1]["memory_used_bytes"] == 2 * 2**30
    assert len({e["event_id"] for e in mine}) == len(mine)
