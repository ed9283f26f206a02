"""Fleet contracts (`hetsched.fleet.get`)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from shared.contracts.base import ID_MAX, NAME_MAX, Contract, Float, Int, Request, deprecated, unit_names
from shared.contracts.topology import NodeProfilePayload

# Byte fields once published without the `_bytes` suffix: that name is still read (deprecated), never sent.
_BYTE_ALIASES = (("hbm_total", "hbm_total_bytes"), ("hbm_reserved", "hbm_reserved_bytes"))


class FleetGetRequest(Request):
    region: str | None = Field(
        default=None, max_length=NAME_MAX, description="Only this region.", examples=["us-west-1"]
    )
    cursor: str | None = Field(
        default=None,
        max_length=ID_MAX,
        description="`next_cursor` of the previous page; absent for the first page.",
        examples=[None],
    )
    limit: Int | None = Field(
        default=None, gt=0, le=10_000, description="Most nodes per page (the server may send fewer).", examples=[256]
    )
    profiles: bool = Field(
        default=False,
        description="Also send each node's whole profile (`NodeView.profile`: link matrix, NUMA, GPUs), as "
        "`fleet.describe` does for one node: what a service building its own view of the fleet needs.",
        examples=[False],
    )


class AcceleratorView(Contract):
    id: str = Field(description="Accelerator id.", examples=["dgx-h100-01/gpu0"])
    index: Int = Field(description="GPU index on its node, as nvidia-smi numbers it.", examples=[0])
    hbm_total_bytes: Int = Field(description="HBM bytes." + deprecated("hbm_total"), examples=[85_899_345_920])
    hbm_reserved_bytes: Int = Field(
        default=0,
        description="Reserved bytes per the ledger. Eventually consistent: as fresh as the last LEDGER event the "
        "topology service applied." + deprecated("hbm_reserved"),
        examples=[0],
    )
    domain: str | None = Field(default=None, description="NVLink domain id.", examples=["dgx-h100-01/nv0"])

    @model_validator(mode="before")
    @classmethod
    def _names(cls, data: Any) -> Any:
        return unit_names(data, _BYTE_ALIASES)


class NodeView(Contract):
    name: str = Field(description="Node name.", examples=["dgx-h100-01"])
    region: str = Field(description="Region.", examples=["us-west-1"])
    cluster: str = Field(description="Cluster.", examples=["c1"])
    rack: str = Field(description="Rack.", examples=["r1"])
    sku: str = Field(description="SKU.", examples=["H100-SXM-80GB"])
    accelerators: list[AcceleratorView] = Field(default_factory=list, description="Accelerators.")
    kind: str | None = Field(default=None, description="NVLink layout of the node.", examples=["4+4"])
    state: str = Field(default="up", description="`up` or `lost` (missed heartbeats).", examples=["up"])
    source: str | None = Field(default=None, description="Where the profile came from.", examples=["inventory"])
    profile: NodeProfilePayload | None = Field(
        default=None, description="The node's whole profile; only when the request asked for `profiles`."
    )


class DomainView(Contract):
    id: str = Field(description="Domain id.", examples=["dgx-h100-01/nv0"])
    kind: str = Field(description="Domain kind.", examples=["fully_connected"])
    members: list[str] = Field(description="Accelerator ids.", examples=[["dgx-h100-01/gpu0"]])
    cliques: list[list[str]] = Field(
        default_factory=list, description="Maximal all-pairs-NVLinked groups.", examples=[[["dgx-h100-01/gpu0"]]]
    )


class RackView(Contract):
    region: str = Field(description="Region.", examples=["us-west-1"])
    cluster: str = Field(description="Cluster.", examples=["c1"])
    name: str = Field(description="Rack.", examples=["r1"])
    power_kw: Float | None = Field(default=None, description="Power budget.", examples=[24.0])


class TpuPodView(Contract):
    name: str = Field(description="Pod name.", examples=["v5e-pod-1"])
    region: str = Field(description="Region.", examples=["us-west-1"])
    type: str = Field(description="`v5e` or `v5p`.", examples=["v5e"])
    shape: list[Int] = Field(description="Chips per axis.", examples=[[16, 16]])
    chips: Int = Field(description="Chips in the pod.", examples=[256])
    hbm_per_chip: Int | None = Field(default=None, description="HBM bytes per chip.", examples=[17_179_869_184])
    cluster: str | None = Field(default=None, description="Cluster the pod sits in.", examples=["c1"])


class FleetGetReply(Contract):
    status: str = Field(default="ok", description="`ok`.", examples=["ok"])
    nodes: list[NodeView] = Field(default_factory=list, description="Nodes.")
    domains: list[DomainView] = Field(default_factory=list, description="NVLink domains.")
    tpu_pods: list[TpuPodView] = Field(default_factory=list, description="TPU pods.")
    racks: list[RackView] = Field(default_factory=list, description="Racks with power budgets.")
    total_nodes: Int = Field(default=0, description="Nodes in the fleet (or region), over all pages.", examples=[13])
    next_cursor: str | None = Field(
        default=None,
        description="Set when more nodes follow: send it as `cursor` for the next page. A large fleet does not fit "
        "one NATS message, so its nodes come in pages; TPU pods and racks come with the first page.",
        examples=[None],
    )


class FleetDescribeRequest(Request):
    node: str = Field(min_length=1, max_length=NAME_MAX, description="Node name.", examples=["dgx-h100-01"])


class FleetDescribeReply(Contract):
    status: str = Field(default="ok", description="`ok`.", examples=["ok"])
    node: NodeView = Field(description="The node.")
    profile: dict[str, Any] = Field(description="Its full profile: link matrix, NUMA, accelerators.")
    domains: list[DomainView] = Field(default_factory=list, description="Its NVLink domains.")
