"""Agent mode: one per node. Profiles the node (NVML or nvidia-smi), reports changes to the fleet
(`topology.report`), sends heartbeats and GPU telemetry. An inventory node (provider ``none``) whose agent
runs simulated engines publishes its GPUs' simulated telemetry instead. Owns no state: a restart simply
reports again."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from services.topology_discovery.providers import NodePlace, ProviderError, TopologyProvider
from services.topology_discovery.providers.nvidia_smi import NvidiaSmiProvider
from services.topology_discovery.providers.nvml import NvmlProvider
from shared.contracts.base import Rejected
from shared.contracts.envelope import new_event
from shared.contracts.subjects import Context, Rpc, Subjects
from shared.contracts.topology import (
    GpuSample,
    GpuTelemetryEvent,
    Heartbeat,
    ProfileError,
    TelemetryEventName,
    TopologyReportReply,
    TopologyReportRequest,
)
from shared.infra.clock import Clock
from shared.infra.outbox import msg_id_headers
from shared.infra.profiles import profile_to_payload
from shared.infra.rpc import RpcClient, RpcError
from shared.infra.settings import Settings

SOURCE = "topology-agent"


def node_name(settings: Settings) -> str:
    return settings.topology.node or socket.gethostname()


def make_provider(settings: Settings) -> TopologyProvider | None:
    """The node's profiler; None with provider ``none`` (an inventory node: its agent only runs engines)."""
    place = NodePlace(
        name=node_name(settings),
        region=settings.kit.region,
        cluster=settings.topology.cluster,
        rack=settings.topology.rack,
    )
    if settings.topology.provider == "none":
        return None
    if settings.topology.provider == "nvidia-smi":
        return NvidiaSmiProvider(
            place=place,
            topo_file=settings.topology.smi_topo_file,
            query_file=settings.topology.smi_query_file,
            sku_override=settings.topology.sku,
        )
    return NvmlProvider(place=place, sku_override=settings.topology.sku)


@dataclass(frozen=True, slots=True)
class AgentIntervals:
    scan_s: float
    heartbeat_s: float
    telemetry_s: float

    @staticmethod
    def from_settings(settings: Settings) -> AgentIntervals:
        return AgentIntervals(
            scan_s=settings.topology.scan_s,
            heartbeat_s=settings.topology.heartbeat_s,
            telemetry_s=settings.topology.telemetry_interval_s,
        )


class Agent:
    def __init__(
        self,
        *,
        node: str,
        provider: TopologyProvider | None,
        rpc: RpcClient,
        nats: Callable[[], NatsClient],
        jetstream: Callable[[], JetStreamContext],
        subjects: Subjects,
        clock: Clock,
        intervals: AgentIntervals,
        log: logging.Logger,
        simulated: Callable[[], list[GpuSample]] | None = None,
        runs_engines: bool = False,
    ) -> None:
        self.node = node
        self._runs_engines = runs_engines  # its samples say so: the fleet waits for its engines' lifecycle
        self.provider = provider
        self._simulated = simulated  # without a provider: the simulated engines' GPUs (docs/ENGINES.md)
        self._rpc = rpc
        self._nats = nats
        self._jetstream = jetstream
        self._subjects = subjects
        self._clock = clock
        self._intervals = intervals
        self._log = log
        self.reported: str | None = None  # fingerprint the fleet acknowledged
        self.last_error: str | None = None

    async def _report(self, request: TopologyReportRequest) -> TopologyReportReply | Rejected | None:
        try:
            # On its node's subject: an agent's credential reaches only that one (docs/SECURITY.md).
            return await self._rpc.ask(Rpc.TOPOLOGY_REPORT, request, TopologyReportReply, scope=self.node)
        except RpcError as exc:
            self._log.warning("fleet did not take the report; retrying next scan", extra={"error": str(exc)})
            return None

    async def scan_once(self) -> None:
        if self.provider is None:
            return
        try:
            profile = await asyncio.to_thread(self.provider.profile)
        except ProviderError as exc:
            message = str(exc)
            self._log.error("profiling failed; the previous profile stays", extra={"error": message, "line": exc.line})
            if message != self.last_error:
                error = ProfileError(message=message, line=exc.line, provider=self.provider.name)
                if await self._report(TopologyReportRequest(node=self.node, error=error)) is not None:
                    self.last_error = message
            return
        # After a failure it reported, a profile that parses again is reported even when unchanged: the fleet
        # then knows the node's profile is current again (its per-node profile timestamp moves on).
        fingerprint = profile.fingerprint()
        if fingerprint == self.reported and self.last_error is None:
            return
        reply = await self._report(TopologyReportRequest(node=self.node, profile=profile_to_payload(profile)))
        if isinstance(reply, TopologyReportReply) and reply.status in ("accepted", "unchanged"):
            self.reported = fingerprint
            self.last_error = None
        elif isinstance(reply, Rejected):
            self._log.error("fleet rejected the profile", extra={"error": reply.error.model_dump(mode="json")})

    async def scan_loop(self) -> None:
        if self.provider is None:  # the inventory defines the node: nothing to profile or beat for
            return
        while True:
            await self.scan_once()
            await asyncio.sleep(self._intervals.scan_s)

    async def heartbeat_loop(self) -> None:
        if self.provider is None:
            return
        while True:
            if self.reported is not None:  # beat only once the fleet knows the node
                beat = Heartbeat(node=self.node, fingerprint=self.reported)
                await self._nats().publish(self._subjects.heartbeat(self.node), beat.model_dump_json().encode())
            await asyncio.sleep(self._intervals.heartbeat_s)

    async def publish_telemetry(self) -> bool:
        """One sample of every GPU onto the TELEMETRY stream; False when there was nothing to send."""
        if self.provider is None:
            if self._simulated is None:
                return False
            samples = self._simulated()
        else:
            try:
                samples = await asyncio.to_thread(self.provider.telemetry)
            except ProviderError as exc:
                self._log.warning("telemetry failed", extra={"error": str(exc)})
                return False
        if not samples:
            return False
        event = new_event(
            type=f"{Context.TELEMETRY.value}.{TelemetryEventName.GPU.value}",
            source=SOURCE,
            payload=GpuTelemetryEvent(
                node=self.node, gpus=samples, engines=True if self._runs_engines else None
            ).model_dump(mode="json"),
            occurred_at=self._clock(),
        )
        await self._jetstream().publish(
            self._subjects.event(Context.TELEMETRY, TelemetryEventName.GPU, node=self.node),
            event.model_dump_json().encode(),
            headers=msg_id_headers(str(event.event_id)),
        )
        return True

    async def telemetry_loop(self) -> None:
        if self.provider is None and self._simulated is None:
            return
        while True:
            await asyncio.sleep(self._intervals.telemetry_s)
            await self.publish_telemetry()
