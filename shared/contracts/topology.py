"""Topology contracts: agent reports, heartbeats and the events of the TOPOLOGY and TELEMETRY streams."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from shared.contracts.base import Contract, ErrorBody, Request

# Event names (subject `<prefix>.events.topology.<name>`; envelope type `topology.<name>`).
NODE_PROFILED = "node_profiled"
NODE_CHANGED = "node_changed"
NODE_REMOVED = "node_removed"
NODE_LOST = "node_lost"
NODE_RECOVERED = "node_recovered"
NODE_PROFILE_FAILED = "node_profile_failed"
TPU_POD_PROFILED = "tpu_pod_profiled"
GPU_TELEMETRY = "gpu"  # on the TELEMETRY stream: `<prefix>.events.telemetry.gpu`


class ProfileError(Contract):
    """Why an agent could not profile its node; the previous profile stays in force."""

    message: str = Field(description="What went wrong.", examples=["line 5: expected 8 link cells for GPU3, found 6"])
    line: int | None = Field(default=None, description="Line of the tool output, when a parse failed.", examples=[5])
    provider: str = Field(description="Provider that failed.", examples=["nvidia-smi"])


class TopologyReportRequest(Request):
    """An agent's report about its node: a fresh profile, or the error that stopped profiling."""

    node: str = Field(min_length=1, description="Node name.", examples=["dgx-h100-01"])
    profile: dict[str, Any] | None = Field(
        default=None, description="The node profile (see `node_profiled`).", examples=[None]
    )
    error: ProfileError | None = Field(default=None, description="Set instead of `profile` when profiling failed.")

    @model_validator(mode="after")
    def _one_of(self) -> TopologyReportRequest:
        if (self.profile is None) == (self.error is None):
            raise ValueError("give exactly one of `profile` and `error`")
        return self


class TopologyReportReply(Contract):
    status: str = Field(description="`accepted`, `unchanged` or `rejected`.", examples=["accepted"])
    fingerprint: str | None = Field(default=None, description="Stored profile digest.", examples=["9f2c"])
    error: ErrorBody | None = Field(default=None, description="Null, or why.")


class Heartbeat(Contract):
    """Core-NATS heartbeat an agent sends every `HETSCHED_TOPOLOGY_HEARTBEAT_S` seconds."""

    node: str = Field(description="Node name.", examples=["dgx-h100-01"])
    fingerprint: str | None = Field(default=None, description="Digest of the profile the agent last reported.")


class NodeProfileEvent(Contract):
    """Payload of `node_profiled` / `node_changed`."""

    node: str = Field(description="Node name.", examples=["dgx-h100-01"])
    region: str = Field(description="Region.", examples=["us-west-1"])
    kind: str = Field(description="NVLink layout of the node.", examples=["fully_connected"])
    fingerprint: str = Field(description="Profile digest.", examples=["9f2c"])
    previous_fingerprint: str | None = Field(default=None, description="Digest before the change.")
    profile: dict[str, Any] = Field(description="The whole node profile.")
    domains: list[dict[str, Any]] = Field(default_factory=list, description="The node's NVLink domains.")


class NodeStateEvent(Contract):
    """Payload of `node_lost` / `node_recovered` / `node_removed`."""

    node: str = Field(description="Node name.", examples=["dgx-h100-01"])
    region: str = Field(description="Region.", examples=["us-west-1"])
    accelerators: list[str] = Field(description="Its accelerator ids.", examples=[["dgx-h100-01/gpu0"]])
    last_seen_ms_ago: float | None = Field(default=None, description="Silence before it was declared lost.")


class NodeProfileFailedEvent(Contract):
    node: str = Field(description="Node name.", examples=["dgx-h100-01"])
    error: ProfileError = Field(description="The failure; the previous profile stays in force.")


class GpuSample(Contract):
    index: int = Field(description="GPU index on the node.", examples=[0])
    memory_used_bytes: int | None = Field(default=None, description="HBM used.", examples=[1_073_741_824])
    memory_free_bytes: int | None = Field(default=None, description="HBM free.", examples=[84_825_604_096])
    utilization_pct: float | None = Field(default=None, description="GPU utilisation.", examples=[37.0])
    power_w: float | None = Field(default=None, description="Power draw.", examples=[312.5])
    pcie_tx_bytes_per_s: float | None = Field(default=None, description="PCIe TX.", examples=[1.2e9])
    pcie_rx_bytes_per_s: float | None = Field(default=None, description="PCIe RX.", examples=[0.8e9])


class GpuTelemetryEvent(Contract):
    node: str = Field(description="Node name.", examples=["dgx-h100-01"])
    gpus: list[GpuSample] = Field(description="One sample per GPU.")


class TpuPodEvent(Contract):
    """Payload of `tpu_pod_profiled`: a pod as the inventory describes it."""

    pod: str = Field(description="Pod name.", examples=["v5e-pod-1"])
    region: str = Field(description="Region.", examples=["us-west-1"])
    type: str = Field(description="`v5e` or `v5p`.", examples=["v5e"])
    shape: list[int] = Field(description="Chips per axis.", examples=[[16, 16]])
    sku: str = Field(description="Catalog SKU of its chips.", examples=["TPU-V5E"])
    hbm_per_chip: int = Field(description="HBM bytes per chip.", examples=[17_179_869_184])
