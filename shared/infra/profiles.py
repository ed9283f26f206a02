"""Node profiles between the domain and the wire: the contract (``NodeProfilePayload``) owns the
shape; these two functions are the only place that maps it."""

from __future__ import annotations

from shared.contracts.topology import AcceleratorProfile, FabricInfoPayload, NodeProfilePayload
from shared.domain.fleet import Accelerator, NodeProfile
from shared.domain.topology import FabricState, GpuFabricInfo, LinkMatrix


def profile_to_payload(node: NodeProfile) -> NodeProfilePayload:
    return NodeProfilePayload(
        name=node.name,
        region=node.region,
        cluster=node.cluster,
        rack=node.rack,
        sku=node.sku,
        source=node.source,
        links=[list(row) for row in node.links.codes()],
        numa=list(node.links.numa),
        accelerators=[
            AcceleratorProfile(
                index=a.index,
                sku=a.sku,
                hbm_bytes=a.hbm_bytes,
                uuid=a.uuid,
                pci_bus_id=a.pci_bus_id,
                numa_node=a.numa_node,
                cpu_affinity=a.cpu_affinity,
                power_limit_w=a.power_limit_w,
                pcie_gen_max=a.pcie_gen_max,
                pcie_width_max=a.pcie_width_max,
                fabric=FabricInfoPayload(
                    cluster_uuid=a.fabric.cluster_uuid,
                    clique_id=a.fabric.clique_id,
                    state=a.fabric.state.value,
                    status_ok=a.fabric.status_ok,
                )
                if a.fabric is not None
                else None,
            )
            for a in node.accelerators
        ],
    )


def profile_from_payload(payload: NodeProfilePayload) -> NodeProfile:
    """The domain profile; raises ``ValueError`` when the payload is inconsistent (matrix vs GPUs)."""
    return NodeProfile(
        name=payload.name,
        region=payload.region,
        cluster=payload.cluster,
        rack=payload.rack,
        sku=payload.sku,
        source=payload.source,
        links=LinkMatrix.from_codes(payload.links, numa=list(payload.numa) or None),
        accelerators=tuple(
            Accelerator(
                index=a.index,
                sku=a.sku,
                hbm_bytes=a.hbm_bytes,
                uuid=a.uuid,
                pci_bus_id=a.pci_bus_id,
                numa_node=a.numa_node,
                cpu_affinity=a.cpu_affinity,
                power_limit_w=a.power_limit_w,
                pcie_gen_max=a.pcie_gen_max,
                pcie_width_max=a.pcie_width_max,
                fabric=GpuFabricInfo(
                    cluster_uuid=a.fabric.cluster_uuid,
                    clique_id=a.fabric.clique_id,
                    state=FabricState(a.fabric.state),
                    status_ok=a.fabric.status_ok,
                )
                if a.fabric is not None
                else None,
            )
            for a in payload.accelerators
        ),
    )
