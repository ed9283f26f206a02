"""Topology providers: each turns one source of truth about a node into the same ``NodeProfile``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from shared.contracts.topology import GpuSample
from shared.domain.fleet import Accelerator, NodeProfile
from shared.domain.topology import LinkMatrix


@dataclass(frozen=True, slots=True)
class NodePlace:
    """Where the agent's node sits (NVML cannot know it): from settings."""

    name: str
    region: str
    cluster: str
    rack: str

    def profile(self, accelerators: Sequence[Accelerator], links: LinkMatrix, *, source: str) -> NodeProfile:
        """The node's profile: its SKU is its GPUs' one, or ``mixed``."""
        skus = {a.sku for a in accelerators}
        return NodeProfile(
            name=self.name,
            region=self.region,
            cluster=self.cluster,
            rack=self.rack,
            sku=skus.pop() if len(skus) == 1 else "mixed",
            accelerators=tuple(accelerators),
            links=links,
            source=source,
        )


class ProviderError(RuntimeError):
    """The provider could not produce a profile; ``line`` is set when a tool's output did not parse."""

    def __init__(self, message: str, *, line: int | None = None) -> None:
        super().__init__(message)
        self.line = line


class TopologyProvider(Protocol):
    name: str

    def profile(self) -> NodeProfile:
        """A fresh profile of the node, or ProviderError."""

    def telemetry(self) -> list[GpuSample]:
        """One sample per GPU (fields the source cannot tell are None)."""
