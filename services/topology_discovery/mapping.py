"""Contract <-> domain for topology: event payloads from profiles, the fleet.get page from stored rows,
and the reserved bytes an allocation event carries."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from services.topology_discovery.store import FleetPage
from shared.contracts.fleet import (
    AcceleratorView,
    DomainView,
    FleetDescribeReply,
    FleetGetReply,
    NodeView,
    RackView,
    TpuPodView,
)
from shared.contracts.ledger import AllocationEvent
from shared.contracts.topology import NodeDomainPayload, NodeProfileEvent, NodeProfilePayload, TpuPodEvent
from shared.domain.fleet import AcceleratorId, Domain, NodeProfile, TpuPod
from shared.domain.hardware import Sku
from shared.domain.placement.types import tpu_sku_name
from shared.infra.profiles import profile_to_payload


def domains_by_node(domains: Iterable[Domain]) -> dict[str, list[Domain]]:
    """Each node's NVLink domains (a multi-node domain is listed under every node it spans)."""
    by_node: dict[str, list[Domain]] = {}
    for domain in domains:
        for host in dict.fromkeys(AcceleratorId.parse(m).host for m in domain.members):
            by_node.setdefault(host, []).append(domain)
    return by_node


def profile_event(node: NodeProfile, domains: Sequence[Domain], previous: str | None) -> NodeProfileEvent:
    """Payload of `node_profiled` (``previous`` None) or `node_changed`; ``domains`` are the node's own."""
    return NodeProfileEvent(
        node=node.name,
        region=node.region,
        kind=node.topology.kind.value,
        fingerprint=node.fingerprint(),
        previous_fingerprint=previous,
        profile=profile_to_payload(node),
        domains=[NodeDomainPayload(id=d.id, kind=d.kind, members=list(d.members)) for d in domains],
    )


def tpu_pod_event(pod: TpuPod, skus: Mapping[str, Sku]) -> TpuPodEvent:
    sku = tpu_sku_name(pod.type)
    return TpuPodEvent(
        pod=pod.name,
        region=pod.region,
        type=pod.type.value,
        shape=list(pod.shape),
        sku=sku,
        hbm_per_chip=skus[sku].hbm_bytes if sku in skus else 0,
    )


def fleet_reply(page: FleetPage, skus: Mapping[str, Sku]) -> FleetGetReply:
    """The `fleet.get` page; ``next_cursor`` names the page's last node when more follow."""
    by_node: dict[str, list[AcceleratorView]] = {}
    for a in page.accelerators:
        by_node.setdefault(a.node, []).append(
            AcceleratorView(
                id=a.id,
                index=a.index,
                hbm_total_bytes=a.hbm_bytes,
                hbm_reserved_bytes=a.reserved_bytes,
                domain=a.domain,
            )
        )
    nodes = [
        NodeView(
            name=n.name,
            region=n.region,
            cluster=n.cluster,
            rack=n.rack,
            sku=n.sku,
            kind=n.kind,
            state=n.state,
            source=n.source,
            accelerators=by_node.get(n.name, []),
            profile=n.profile,
        )
        for n in page.nodes
    ]
    return FleetGetReply(
        nodes=nodes,
        domains=[
            DomainView(id=d.id, kind=d.kind, members=list(d.members), cliques=[list(c) for c in d.cliques])
            for d in page.domains
        ],
        tpu_pods=[_pod_view(p, skus) for p in page.tpu_pods],
        racks=[RackView(region=r.region, cluster=r.cluster, name=r.name, power_kw=r.power_kw) for r in page.racks],
        total_nodes=page.total_nodes,
        next_cursor=nodes[-1].name if page.more and nodes else None,
    )


def _pod_view(pod: TpuPod, skus: Mapping[str, Sku]) -> TpuPodView:
    sku = skus.get(tpu_sku_name(pod.type))
    return TpuPodView(
        name=pod.name,
        region=pod.region,
        type=pod.type.value,
        shape=list(pod.shape),
        chips=pod.chips,
        hbm_per_chip=sku.hbm_bytes if sku else None,
        cluster=pod.cluster,
    )


def describe_reply(page: FleetPage, profile: NodeProfilePayload, skus: Mapping[str, Sku]) -> FleetDescribeReply:
    """`fleet.describe` from a one-node page and the node's stored profile."""
    view = fleet_reply(page, skus)
    return FleetDescribeReply(node=view.nodes[0], profile=profile.model_dump(mode="json"), domains=view.domains)


def counted_shares(payload: AllocationEvent) -> dict[str, int]:
    """The bytes an allocation holds per accelerator, as far as they count against HBM (a `request`
    allocation lives in its replica's KV pool and moves nothing)."""
    shares: dict[str, int] = {}
    if payload.counts_against_hbm:
        for share in payload.shares:
            shares[share.accelerator_id] = shares.get(share.accelerator_id, 0) + share.total_bytes
    return shares
