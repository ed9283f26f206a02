"""Agent mode: one per node. Profiles the node (NVML or nvidia-smi), reports changes to the fleet,
sends heartbeats and GPU telemetry. Owns no state: a restart simply reports again."""

from __future__ import annotations

import asyncio
import json
import socket
import uuid
from datetime import UTC, datetime

from services.topology_discovery.providers import NodePlace, ProviderError, TopologyProvider
from services.topology_discovery.providers.nvidia_smi import NvidiaSmiProvider
from services.topology_discovery.providers.nvml import NvmlProvider
from shared.contracts.envelope import new_event
from shared.contracts.subjects import Context, Rpc
from shared.contracts.topology import GPU_TELEMETRY, GpuTelemetryEvent, Heartbeat, ProfileError, TopologyReportRequest
from shared.domain.fleet import profile_to_dict
from shared.infra.service import Runtime
from shared.infra.settings import Settings


def make_provider(settings: Settings) -> TopologyProvider:
    place = NodePlace(
        name=settings.topology_node or socket.gethostname(),
        region=settings.region,
        cluster=settings.topology_cluster,
        rack=settings.topology_rack,
    )
    if settings.topology_provider == "nvidia-smi":
        return NvidiaSmiProvider(
            place=place,
            topo_file=settings.topology_smi_topo_file,
            query_file=settings.topology_smi_query_file,
            sku_override=settings.topology_sku,
        )
    return NvmlProvider(place=place, sku_override=settings.topology_sku)


class Agent:
    def __init__(self, runtime: Runtime, provider: TopologyProvider) -> None:
        self.runtime = runtime
        self.provider = provider
        self.node = runtime.settings.topology_node or socket.gethostname()
        self.reported: str | None = None  # fingerprint the fleet acknowledged
        self.last_error: str | None = None

    async def _request(self, body: TopologyReportRequest) -> dict[str, object] | None:
        assert self.runtime.nc is not None
        try:
            msg = await self.runtime.nc.request(
                self.runtime.subjects.rpc(Rpc.TOPOLOGY_REPORT), body.model_dump_json().encode(), timeout=10
            )
        except Exception as exc:
            self.runtime.log.warning("fleet did not take the report; retrying next scan", extra={"error": repr(exc)})
            return None
        reply: dict[str, object] = json.loads(msg.data)
        return reply

    async def scan_once(self) -> None:
        try:
            profile = await asyncio.to_thread(self.provider.profile)
        except ProviderError as exc:
            message = str(exc)
            self.runtime.log.error(
                "profiling failed; the previous profile stays", extra={"error": message, "line": exc.line}
            )
            if message != self.last_error:
                error = ProfileError(message=message, line=exc.line, provider=self.provider.name)
                if await self._request(TopologyReportRequest(node=self.node, error=error)) is not None:
                    self.last_error = message
            return
        self.last_error = None
        fingerprint = profile.fingerprint()
        if fingerprint == self.reported:
            return
        reply = await self._request(TopologyReportRequest(node=self.node, profile=profile_to_dict(profile)))
        if reply and reply.get("status") in ("accepted", "unchanged"):
            self.reported = fingerprint
        elif reply:
            self.runtime.log.error("fleet rejected the profile", extra={"reply": reply})

    async def scan_loop(self) -> None:
        while True:
            await self.scan_once()
            await asyncio.sleep(self.runtime.settings.topology_scan_s)

    async def heartbeat_loop(self) -> None:
        assert self.runtime.nc is not None
        while True:
            if self.reported is not None:  # beat only once the fleet knows the node
                beat = Heartbeat(node=self.node, fingerprint=self.reported)
                await self.runtime.nc.publish(self.runtime.subjects.heartbeat(), beat.model_dump_json().encode())
            await asyncio.sleep(self.runtime.settings.topology_heartbeat_s)

    async def telemetry_loop(self) -> None:
        assert self.runtime.js is not None
        subject = self.runtime.subjects.event(Context.TELEMETRY, GPU_TELEMETRY)
        while True:
            await asyncio.sleep(self.runtime.settings.telemetry_interval_s)
            try:
                samples = await asyncio.to_thread(self.provider.telemetry)
            except ProviderError as exc:
                self.runtime.log.warning("telemetry failed", extra={"error": str(exc)})
                continue
            if not samples:
                continue
            event = new_event(
                type=f"telemetry.{GPU_TELEMETRY}",
                source="topology-agent",
                payload=GpuTelemetryEvent(node=self.node, gpus=samples).model_dump(mode="json"),
                occurred_at=datetime.now(UTC),
                event_id=uuid.uuid4(),
            )
            await self.runtime.js.publish(
                subject, event.model_dump_json().encode(), headers={"Nats-Msg-Id": str(event.event_id)}
            )


async def start_agent(runtime: Runtime) -> None:
    agent = Agent(runtime, make_provider(runtime.settings))
    runtime.spawn(agent.scan_loop(), name="topology-scan")
    runtime.spawn(agent.heartbeat_loop(), name="topology-heartbeat")
    runtime.spawn(agent.telemetry_loop(), name="topology-telemetry")
