"""Node profiles between the domain and the wire: the contract (``NodeProfilePayload``) owns the
shape; these two functions are the only place that maps it."""

from __future__ import annotations

from shared.contracts.topology import AcceleratorProfile, FabricInfoPayload, NodeProfilePayload
from shared.domain.fleet import Accelerator, NodeProfile
from shared.domain.topology import FabricState, GpuFabricInfo, LinkMatrix

# Per-GPU fields that the domain and the wire name alike (the fabric is mapped on its own).
_ACCELERATOR_FIELDS = tuple(f for f in AcceleratorProfile.model_fields if f != "fabric")


def _fabric_payload(fabric: GpuFabricInfo | None) -> FabricInfoPayload | None:
    if fabric is None:
        return None
    return FabricInfoPayload(
        cluster_uuid=fabric.cluster_uuid,
        clique_id=fabric.clique_id,
        state=fabric.state.value,
        status_ok=fabric.status_ok,
    )


def _fabric_domain(fabric: FabricInfoPayload | None) -> GpuFabricInfo | None:
    if fabric is None:
        return None
    return GpuFabricInfo(
        cluster_uuid=fabric.cluster_uuid,
        clique_id=fabric.clique_id,
        state=FabricState(fabric.state),
        status_ok=fabric.status_ok,
    )


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
                **{name: getattr(a, name) for name in _ACCELERATOR_FIELDS}, fabric=_fabric_payload(a.fabric)
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
            Accelerator(**{name: getattr(a, name) for name in _ACCELERATOR_FIELDS}, fabric=_fabric_domain(a.fabric))
            for a in payload.accelerators
        ),
    )
