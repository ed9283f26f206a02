"""Topology contracts: agent reports, heartbeats and the events of the TOPOLOGY and TELEMETRY streams."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any

from pydantic import Field, StringConstraints, field_validator, model_validator

from shared.contracts.base import NAME_MAX, TEXT_MAX, Contract, ErrorBody, Float, Int, Request


class TopologyEventName(StrEnum):
    """Event names of the TOPOLOGY stream (subject `<prefix>.events.topology.<name>`)."""

    NODE_PROFILED = "node_profiled"
    NODE_CHANGED = "node_changed"
    NODE_REMOVED = "node_removed"
    NODE_LOST = "node_lost"
    NODE_RECOVERED = "node_recovered"
    NODE_PROFILE_FAILED = "node_profile_failed"
    TPU_POD_PROFILED = "tpu_pod_profiled"


class TelemetryEventName(StrEnum):
    """Event names of the TELEMETRY stream (`<prefix>.events.telemetry.<name>`)."""

    GPU = "gpu"
    ENGINE_STATUS = "engine_status"
    REPLICA_STATE = "replica_state"


NODE_PROFILED = TopologyEventName.NODE_PROFILED
NODE_CHANGED = TopologyEventName.NODE_CHANGED
NODE_REMOVED = TopologyEventName.NODE_REMOVED
NODE_LOST = TopologyEventName.NODE_LOST
NODE_RECOVERED = TopologyEventName.NODE_RECOVERED
NODE_PROFILE_FAILED = TopologyEventName.NODE_PROFILE_FAILED
TPU_POD_PROFILED = TopologyEventName.TPU_POD_PROFILED
GPU_TELEMETRY = TelemetryEventName.GPU
ENGINE_STATUS = TelemetryEventName.ENGINE_STATUS
REPLICA_STATE = TelemetryEventName.REPLICA_STATE

TopologyEvent = TopologyEventName  # deprecated alias (issue 24): use TopologyEventName (for one release)
TelemetryEvent = TelemetryEventName  # deprecated alias (issue 24): use TelemetryEventName (for one release)


LINK_MAX = 16  # a link code of `nvidia-smi topo -m` (`X`, `NV18`, `PXB`, `SYS`, ...)


class FabricInfoPayload(Contract):
    """A GPU's NVLink fabric membership (GH200 NVL / NVL72), from NVML's GPU fabric info."""

    cluster_uuid: str = Field(
        max_length=NAME_MAX, description="Fabric cluster UUID.", examples=["c0ffee00-0000-0000-0000-000000000001"]
    )
    clique_id: Int = Field(description="Clique within the cluster: GPUs of one clique share NVLink.", examples=[1])
    state: str = Field(
        default="completed", max_length=NAME_MAX, description="Fabric registration state.", examples=["completed"]
    )
    status_ok: bool = Field(default=True, description="Fabric status reported healthy.", examples=[True])


class AcceleratorProfile(Contract):
    """One GPU as a provider profiled it."""

    index: Int = Field(ge=0, description="GPU index on the node, as nvidia-smi numbers it.", examples=[0])
    sku: str = Field(max_length=NAME_MAX, description="Catalog SKU.", examples=["H100-SXM-80GB"])
    hbm_bytes: Int = Field(ge=0, description="HBM bytes.", examples=[85_899_345_920])
    uuid: str | None = Field(default=None, max_length=NAME_MAX, description="GPU UUID.", examples=["GPU-5f1c..."])
    pci_bus_id: str | None = Field(
        default=None, max_length=NAME_MAX, description="PCI bus id.", examples=["00000000:18:00.0"]
    )
    numa_node: Int | None = Field(default=None, description="NUMA node.", examples=[0])
    cpu_affinity: str | None = Field(
        default=None, max_length=TEXT_MAX, description="CPU set close to the GPU.", examples=["0-47"]
    )
    power_limit_w: Float | None = Field(default=None, description="Power limit.", examples=[700.0])
    pcie_gen_max: Int | None = Field(default=None, description="Max PCIe generation.", examples=[5])
    pcie_width_max: Int | None = Field(default=None, description="Max PCIe lanes.", examples=[16])
    fabric: FabricInfoPayload | None = Field(default=None, description="Multi-node NVLink fabric, if any.")


class NodeProfilePayload(Contract):
    """A node profile on the wire (agent reports, `node_profiled`, `fleet.describe`): where the node sits,
    its GPUs and the `nvidia-smi topo -m` link matrix between them."""

    name: str = Field(min_length=1, max_length=NAME_MAX, description="Node name.", examples=["dgx-h100-01"])
    region: str = Field(max_length=NAME_MAX, description="Region.", examples=["us-west-1"])
    cluster: str = Field(max_length=NAME_MAX, description="Cluster.", examples=["c1"])
    rack: str = Field(max_length=NAME_MAX, description="Rack.", examples=["r1"])
    sku: str = Field(max_length=NAME_MAX, description="SKU of its GPUs.", examples=["H100-SXM-80GB"])
    source: str = Field(
        default="inventory", max_length=NAME_MAX, description="`inventory`, `nvml` or `nvidia-smi`.", examples=["nvml"]
    )
    links: list[list[Annotated[str, StringConstraints(max_length=LINK_MAX)]]] = Field(
        description="GPU x GPU link codes (`X`, `NV18`, `PIX`, `SYS`, ...).", examples=[[["X", "NV18"], ["NV18", "X"]]]
    )
    numa: list[Int | None] = Field(default_factory=list, description="NUMA node per GPU.", examples=[[0, 0]])
    accelerators: list[AcceleratorProfile] = Field(description="GPUs, in index order.")


class ProfileError(Contract):
    """Why an agent could not profile its node; the previous profile stays in force."""

    message: str = Field(
        description="What went wrong (cut to 1,000 characters).",
        examples=["line 5: expected 8 link cells for GPU3, found 6"],
    )
    line: Int | None = Field(default=None, description="Line of the tool output, when a parse failed.", examples=[5])
    provider: str = Field(max_length=NAME_MAX, description="Provider that failed.", examples=["nvidia-smi"])

    @field_validator("message", mode="before")
    @classmethod
    def _short(cls, message: Any) -> Any:
        # free text from a tool's output: cut, not refused (the report still says what failed)
        return message[:TEXT_MAX] if isinstance(message, str) else message


class TopologyReportRequest(Request):
    """An agent's report about its node: a fresh profile, or the error that stopped profiling."""

    node: str = Field(min_length=1, max_length=NAME_MAX, description="Node name.", examples=["dgx-h100-01"])
    profile: NodeProfilePayload | None = Field(
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

    node: str = Field(max_length=NAME_MAX, description="Node name.", examples=["dgx-h100-01"])
    fingerprint: str | None = Field(
        default=None, max_length=NAME_MAX, description="Digest of the profile the agent last reported."
    )


class NodeDomainPayload(Contract):
    """One NVLink domain a node's GPUs belong to (a multi-node domain spans nodes)."""

    id: str = Field(description="Domain id.", examples=["dgx-h100-01/nv0"])
    kind: str = Field(description="Domain kind.", examples=["fully_connected"])
    members: list[str] = Field(description="Accelerator ids.", examples=[["dgx-h100-01/gpu0"]])


class NodeProfileEvent(Contract):
    """Payload of `node_profiled` / `node_changed`."""

    node: str = Field(description="Node name.", examples=["dgx-h100-01"])
    region: str = Field(description="Region.", examples=["us-west-1"])
    kind: str = Field(description="NVLink layout of the node.", examples=["fully_connected"])
    fingerprint: str = Field(description="Profile digest.", examples=["9f2c"])
    previous_fingerprint: str | None = Field(default=None, description="Digest before the change.")
    profile: NodeProfilePayload = Field(description="The whole node profile.")
    domains: list[NodeDomainPayload] = Field(default_factory=list, description="The node's NVLink domains.")


class NodeStateEvent(Contract):
    """Payload of `node_lost` / `node_recovered` / `node_removed`."""

    node: str = Field(description="Node name.", examples=["dgx-h100-01"])
    region: str = Field(description="Region.", examples=["us-west-1"])
    accelerators: list[str] = Field(description="Its accelerator ids.", examples=[["dgx-h100-01/gpu0"]])
    last_seen_ms_ago: Float | None = Field(default=None, description="Silence before it was declared lost.")


class NodeProfileFailedEvent(Contract):
    node: str = Field(description="Node name.", examples=["dgx-h100-01"])
    error: ProfileError = Field(description="The failure; the previous profile stays in force.")


class GpuSample(Contract):
    index: Int = Field(description="GPU index on the node.", examples=[0])
    memory_used_bytes: Int | None = Field(default=None, description="HBM used.", examples=[1_073_741_824])
    memory_free_bytes: Int | None = Field(default=None, description="HBM free.", examples=[84_825_604_096])
    utilization_pct: Float | None = Field(default=None, description="GPU utilisation.", examples=[37.0])
    power_w: Float | None = Field(default=None, description="Power draw.", examples=[312.5])
    pcie_tx_bytes_per_s: Float | None = Field(default=None, description="PCIe TX.", examples=[1.2e9])
    pcie_rx_bytes_per_s: Float | None = Field(default=None, description="PCIe RX.", examples=[0.8e9])


class GpuTelemetryEvent(Contract):
    node: str = Field(max_length=NAME_MAX, description="Node name.", examples=["dgx-h100-01"])
    gpus: list[GpuSample] = Field(description="One sample per GPU.")
    engines: bool | None = Field(
        default=None,
        description="The node's agent supervises its engines and reports their lifecycle (`replica_state`): a "
        "reservation no engine reports on yet is an engine starting, not drift. Null: not said.",
        examples=[True],
    )


class EngineStatusEvent(Contract):
    """Payload of `engine_status`: one replica's engine, as it reports itself (through its node's agent, on
    `<prefix>.events.telemetry.engine_status.<node>`). A replica that has not reported for
    `HETSCHED_ENGINE_STALE_S` leaves admission's rotation until it reports again."""

    replica_id: str = Field(
        min_length=1, max_length=NAME_MAX, description="The replica's allocation id.", examples=["al-7"]
    )
    node: str = Field(min_length=1, max_length=NAME_MAX, description="Node the engine runs on.", examples=["dgx-1"])
    queue_depth: Int = Field(ge=0, le=1_000_000, description="Requests waiting in the engine.", examples=[3])
    kv_used_bytes: Int = Field(ge=0, description="KV cache (or SSM state) in use.", examples=[12_000_000_000])
    kv_total_bytes: Int = Field(ge=0, description="KV cache (or SSM state) capacity.", examples=[40_000_000_000])
    latency_p50_ms: Float = Field(ge=0, le=3_600_000, description="Recent TTFT p50.", examples=[85.0])
    latency_p99_ms: Float = Field(ge=0, le=3_600_000, description="Recent TTFT p99.", examples=[240.0])
    slo_violations: Int = Field(default=0, ge=0, description="Recent requests past their SLO.", examples=[0])
    healthy: bool = Field(default=True, description="The engine's own health check.", examples=[True])
    engine: str | None = Field(
        default=None,
        max_length=NAME_MAX,
        description="The engine's kind, read from its metric names: `vllm` or `sglang`.",
        examples=["vllm"],
    )
    running_requests: Int | None = Field(
        default=None, ge=0, le=1_000_000, description="Requests in the engine's running batch.", examples=[12]
    )
    kv_usage: Float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Fraction of the KV cache in use, as the engine reports it.",
        examples=[0.3],
    )
    itl_p50_ms: Float | None = Field(
        default=None, ge=0, le=3_600_000, description="Recent inter-token latency p50.", examples=[22.5]
    )
    itl_p99_ms: Float | None = Field(
        default=None, ge=0, le=3_600_000, description="Recent inter-token latency p99.", examples=[71.0]
    )
    prompt_tokens_per_s: Float | None = Field(
        default=None,
        ge=0,
        description="Prompt (prefill) tokens processed per second since the last report.",
        examples=[3200.0],
    )
    generation_tokens_per_s: Float | None = Field(
        default=None, ge=0, description="Tokens generated per second since the last report.", examples=[850.0]
    )
    prefix_cache_hit_rate: Float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="Share of prompt tokens served from the prefix cache since the last report.",
        examples=[0.42],
    )
    preemptions: Int | None = Field(
        default=None,
        ge=0,
        description="Requests preempted (SGLang: retracted) since the last report (on the first: ever).",
        examples=[0],
    )


class TpuPodEvent(Contract):
    """Payload of `tpu_pod_profiled`: a pod as the inventory describes it."""

    pod: str = Field(description="Pod name.", examples=["v5e-pod-1"])
    region: str = Field(description="Region.", examples=["us-west-1"])
    type: str = Field(description="`v5e` or `v5p`.", examples=["v5e"])
    shape: list[Int] = Field(description="Chips per axis.", examples=[[16, 16]])
    sku: str = Field(description="Catalog SKU of its chips.", examples=["TPU-V5E"])
    hbm_per_chip: Int = Field(description="HBM bytes per chip.", examples=[17_179_869_184])
