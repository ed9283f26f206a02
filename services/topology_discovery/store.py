"""The topology schema's repository: SQL only, over topology's own tables, domain values in and out.

No rules and no events here (the handlers decide and emit through the unit of work); every method
takes the open session and its other inputs by keyword.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import delete, func, select, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from services.topology_discovery.tables import (
    AcceleratorRow,
    DomainRow,
    NodeRow,
    RackRow,
    ReservedRow,
    SourceRow,
    TpuPodRow,
)
from shared.contracts.topology import NodeProfilePayload
from shared.domain.fleet import Domain, NodeProfile, Rack, TpuPod
from shared.domain.liveness import Liveness
from shared.domain.topology.tpu import TpuType
from shared.infra.profiles import profile_from_payload, profile_to_payload

NODES = NodeRow.__table__  # type: ignore[attr-defined]
ACCELERATORS = AcceleratorRow.__table__  # type: ignore[attr-defined]
DOMAINS = DomainRow.__table__  # type: ignore[attr-defined]
RACKS = RackRow.__table__  # type: ignore[attr-defined]
TPU_PODS = TpuPodRow.__table__  # type: ignore[attr-defined]
SOURCES = SourceRow.__table__  # type: ignore[attr-defined]
RESERVED = ReservedRow.__table__  # type: ignore[attr-defined]

_NODE_COLUMNS = ("region", "cluster", "rack", "sku", "source", "kind", "gpus", "hbm_bytes", "fingerprint", "profile")


@dataclass(frozen=True, slots=True)
class StoredNode:
    """What a report or an inventory load compares against."""

    name: str
    region: str
    source: str
    fingerprint: str
    state: Liveness


@dataclass(frozen=True, slots=True)
class NodeRecord:
    name: str
    region: str
    cluster: str
    rack: str
    sku: str
    kind: str
    state: str
    source: str
    profile: NodeProfilePayload | None = None  # only when a page is read with its profiles


@dataclass(frozen=True, slots=True)
class AcceleratorRecord:
    id: str
    node: str
    index: int
    hbm_bytes: int
    domain: str | None
    reserved_bytes: int


@dataclass(frozen=True, slots=True)
class FleetPage:
    """One page of the stored fleet: nodes in name order with their accelerators and domains; pods and
    racks only on the first page."""

    nodes: list[NodeRecord]
    accelerators: list[AcceleratorRecord]
    domains: list[Domain]
    tpu_pods: list[TpuPod]
    racks: list[Rack]
    total_nodes: int
    more: bool


class TopologyStore:
    """Stateless: one instance serves every unit of work (tests hand in a fake)."""

    async def nodes(self, *, session: AsyncSession) -> dict[str, StoredNode]:
        rows = await session.execute(
            select(NODES.c.name, NODES.c.region, NODES.c.source, NODES.c.fingerprint, NODES.c.state)
        )
        return {r.name: StoredNode(r.name, r.region, r.source, r.fingerprint, Liveness(r.state)) for r in rows}

    async def node(self, *, session: AsyncSession, name: str) -> StoredNode | None:
        row = (
            await session.execute(
                select(NODES.c.name, NODES.c.region, NODES.c.source, NODES.c.fingerprint, NODES.c.state).where(
                    NODES.c.name == name
                )
            )
        ).first()
        return StoredNode(row.name, row.region, row.source, row.fingerprint, Liveness(row.state)) if row else None

    async def profiles(self, *, session: AsyncSession) -> list[NodeProfile]:
        rows = (await session.execute(select(NODES.c.profile))).scalars().all()
        return [profile_from_payload(NodeProfilePayload.model_validate(row)) for row in rows]

    async def node_profile(self, *, session: AsyncSession, name: str) -> NodeProfilePayload | None:
        row = (await session.execute(select(NODES.c.profile).where(NODES.c.name == name))).scalar_one_or_none()
        return NodeProfilePayload.model_validate(row) if row is not None else None

    async def upsert_nodes(self, *, session: AsyncSession, nodes: Sequence[NodeProfile], now: datetime) -> None:
        """Write profiles and their accelerators (replacing what a node had before); a node's liveness stays."""
        if not nodes:
            return
        for start in range(0, len(nodes), 500):
            stmt = insert(NODES).values([_node_values(n, now) for n in nodes[start : start + 500]])
            stmt = stmt.on_conflict_do_update(
                index_elements=[NODES.c.name],
                set_={c: stmt.excluded[c] for c in (*_NODE_COLUMNS, "updated_at")},
            )
            await session.execute(stmt)
        await session.execute(delete(ACCELERATORS).where(ACCELERATORS.c.node.in_([n.name for n in nodes])))
        rows = [
            {
                "id": node.accelerator_id(a.index),
                "node": node.name,
                "index": a.index,
                "sku": a.sku,
                "hbm_bytes": a.hbm_bytes,
                "uuid": a.uuid,
                "pci_bus_id": a.pci_bus_id,
                "numa_node": a.numa_node,
            }
            for node in nodes
            for a in node.accelerators
        ]
        for start in range(0, len(rows), 2000):
            await session.execute(insert(ACCELERATORS).values(rows[start : start + 2000]))

    async def delete_nodes(self, *, session: AsyncSession, names: Iterable[str]) -> None:
        names = list(names)
        if names:
            await session.execute(delete(NODES).where(NODES.c.name.in_(names)))

    async def replace_domains(self, *, session: AsyncSession, domains: Sequence[Domain]) -> None:
        """Store every NVLink domain and point each accelerator at its own."""
        await session.execute(delete(DOMAINS))
        rows = [
            {"id": d.id, "kind": d.kind, "members": list(d.members), "cliques": [list(c) for c in d.cliques]}
            for d in domains
        ]
        for start in range(0, len(rows), 2000):
            await session.execute(insert(DOMAINS).values(rows[start : start + 2000]))
        pairs = [(member, d.id) for d in domains for member in d.members]
        if pairs:
            # One statement for every accelerator whose domain changed.
            await session.execute(
                text(
                    "UPDATE topology.accelerators a SET domain = v.domain "
                    "FROM (SELECT unnest(CAST(:ids AS text[])) AS id, unnest(CAST(:doms AS text[])) AS domain) v "
                    "WHERE a.id = v.id AND a.domain IS DISTINCT FROM v.domain"
                ),
                {"ids": [p[0] for p in pairs], "doms": [p[1] for p in pairs]},
            )

    async def replace_static(self, *, session: AsyncSession, racks: Sequence[Rack], tpu_pods: Sequence[TpuPod]) -> None:
        """Racks and TPU pods as the inventory describes them."""
        await session.execute(delete(RACKS))
        await session.execute(delete(TPU_PODS))
        if racks:
            await session.execute(
                insert(RACKS).values(
                    [{"region": r.region, "cluster": r.cluster, "name": r.name, "power_kw": r.power_kw} for r in racks]
                )
            )
        if tpu_pods:
            await session.execute(
                insert(TPU_PODS).values(
                    [
                        {
                            "name": p.name,
                            "region": p.region,
                            "cluster": p.cluster,
                            "type": p.type.value,
                            "shape": list(p.shape),
                        }
                        for p in tpu_pods
                    ]
                )
            )

    async def source_fingerprint(self, *, session: AsyncSession, name: str) -> str | None:
        row = await session.execute(select(SOURCES.c.fingerprint).where(SOURCES.c.name == name))
        return row.scalar_one_or_none()

    async def record_source(self, *, session: AsyncSession, name: str, fingerprint: str, now: datetime) -> None:
        stmt = insert(SOURCES).values(name=name, fingerprint=fingerprint, loaded_at=now)
        await session.execute(
            stmt.on_conflict_do_update(
                index_elements=[SOURCES.c.name],
                set_={"fingerprint": stmt.excluded.fingerprint, "loaded_at": stmt.excluded.loaded_at},
            )
        )

    async def set_liveness(self, *, session: AsyncSession, node: str, expected: Liveness, to: Liveness) -> str | None:
        """Flip a node's state when it is ``expected``; its region, or None when another instance already
        flipped it or the node is gone."""
        result = await session.execute(
            update(NODES)
            .where(NODES.c.name == node, NODES.c.state == expected.value)
            .values(state=to.value)
            .returning(NODES.c.region)
        )
        region: str | None = result.scalar_one_or_none()
        return region

    async def accelerator_ids(self, *, session: AsyncSession, nodes: Sequence[str]) -> dict[str, list[str]]:
        """Each node's accelerator ids, in index order."""
        rows = await session.execute(
            select(ACCELERATORS.c.node, ACCELERATORS.c.id)
            .where(ACCELERATORS.c.node.in_(list(nodes)))
            .order_by(ACCELERATORS.c.node, ACCELERATORS.c.index)
        )
        ids: dict[str, list[str]] = {name: [] for name in nodes}
        for node, acc_id in rows:
            ids[node].append(acc_id)
        return ids

    async def reserve_shares(self, *, session: AsyncSession, allocation_id: str, shares: Mapping[str, int]) -> None:
        """A committed allocation's shares, each added to its accelerator's reserved bytes once; a share
        whose release was seen first (an ended row) adds nothing."""
        if not shares:
            return
        await session.execute(
            text(
                "WITH v AS (SELECT unnest(CAST(:ids AS text[])) AS id, unnest(CAST(:bytes AS bigint[])) AS b), "
                "added AS (INSERT INTO topology.reserved_shares (allocation_id, accelerator_id, reserved_bytes, ended) "
                "  SELECT :allocation, v.id, v.b, false FROM v ORDER BY v.id "
                "  ON CONFLICT (allocation_id, accelerator_id) DO NOTHING RETURNING accelerator_id, reserved_bytes) "
                "INSERT INTO topology.reserved (accelerator_id, reserved_bytes) "
                "SELECT accelerator_id, reserved_bytes FROM added ORDER BY accelerator_id "
                "ON CONFLICT (accelerator_id) DO UPDATE "
                "SET reserved_bytes = topology.reserved.reserved_bytes + excluded.reserved_bytes"
            ),
            {"allocation": allocation_id, "ids": list(shares), "bytes": list(shares.values())},
        )

    async def release_shares(self, *, session: AsyncSession, allocation_id: str, shares: Mapping[str, int]) -> None:
        """An ended allocation's shares, each taken off once; a share not committed yet is recorded as
        ended so that its late commit adds nothing."""
        if not shares:
            return
        # One statement: a concurrent commit of the same share is waited for and then updated, never missed.
        # xmax = 0 marks a row this statement inserted (an early release) rather than ended.
        await session.execute(
            text(
                "WITH v AS (SELECT unnest(CAST(:ids AS text[])) AS id, unnest(CAST(:bytes AS bigint[])) AS b), "
                "ended AS (INSERT INTO topology.reserved_shares AS s "
                "  (allocation_id, accelerator_id, reserved_bytes, ended) "
                "  SELECT :allocation, v.id, v.b, true FROM v ORDER BY v.id "
                "  ON CONFLICT (allocation_id, accelerator_id) DO UPDATE SET ended = true WHERE s.ended = false "
                "  RETURNING s.accelerator_id, s.reserved_bytes, (s.xmax = 0) AS inserted) "
                "UPDATE topology.reserved r SET reserved_bytes = r.reserved_bytes - ended.reserved_bytes "
                "FROM ended WHERE r.accelerator_id = ended.accelerator_id AND NOT ended.inserted"
            ),
            {"allocation": allocation_id, "ids": list(shares), "bytes": list(shares.values())},
        )

    async def fleet_page(
        self,
        *,
        session: AsyncSession,
        region: str | None = None,
        node: str | None = None,
        after: str | None = None,
        limit: int | None = None,
        profiles: bool = False,
    ) -> FleetPage:
        """Nodes in name order (at most ``limit`` after ``after``; or only ``node``), with their stored
        profiles when asked, their accelerators with reserved bytes, the domains those accelerators are
        in; TPU pods and racks on the first page of a fleet-wide or regional read."""
        node_q = select(
            NODES.c.name,
            NODES.c.region,
            NODES.c.cluster,
            NODES.c.rack,
            NODES.c.sku,
            NODES.c.kind,
            NODES.c.state,
            NODES.c.source,
            *((NODES.c.profile,) if profiles else ()),
        ).order_by(NODES.c.name)
        count_q = select(func.count()).select_from(NODES)
        if region:
            node_q = node_q.where(NODES.c.region == region)
            count_q = count_q.where(NODES.c.region == region)
        if node is not None:
            node_q = node_q.where(NODES.c.name == node)
            count_q = count_q.where(NODES.c.name == node)
        if after:
            node_q = node_q.where(NODES.c.name > after)
        if limit:
            node_q = node_q.limit(limit + 1)
        rows = list((await session.execute(node_q)).all())
        more = bool(limit) and len(rows) > (limit or 0)
        nodes = [
            NodeRecord(
                name=r.name,
                region=r.region,
                cluster=r.cluster,
                rack=r.rack,
                sku=r.sku,
                kind=r.kind,
                state=r.state,
                source=r.source,
                profile=NodeProfilePayload.model_validate(r.profile) if profiles else None,
            )
            for r in (rows[:limit] if limit else rows)
        ]
        total = int((await session.execute(count_q)).scalar_one())
        acc_q = (
            select(
                ACCELERATORS.c.id,
                ACCELERATORS.c.node,
                ACCELERATORS.c.index,
                ACCELERATORS.c.hbm_bytes,
                ACCELERATORS.c.domain,
                func.coalesce(RESERVED.c.reserved_bytes, 0),
            )
            .select_from(ACCELERATORS.outerjoin(RESERVED, RESERVED.c.accelerator_id == ACCELERATORS.c.id))
            .where(ACCELERATORS.c.node.in_([n.name for n in nodes]))
            .order_by(ACCELERATORS.c.node, ACCELERATORS.c.index)
        )
        accelerators = [AcceleratorRecord(*r) for r in (await session.execute(acc_q)).all()]
        page_domains = {a.domain for a in accelerators if a.domain}
        domains = [
            Domain(id=r.id, kind=r.kind, members=tuple(r.members), cliques=tuple(tuple(c) for c in r.cliques))
            for r in await session.execute(select(DOMAINS).where(DOMAINS.c.id.in_(page_domains)).order_by(DOMAINS.c.id))
        ]
        first_page = not after and node is None
        pods: list[TpuPod] = []
        racks: list[Rack] = []
        if first_page:  # pods and racks travel with the first page only
            pod_q = select(TPU_PODS).order_by(TPU_PODS.c.name)
            rack_q = select(RACKS).order_by(RACKS.c.region, RACKS.c.cluster, RACKS.c.name)
            if region:
                pod_q = pod_q.where(TPU_PODS.c.region == region)
                rack_q = rack_q.where(RACKS.c.region == region)
            pods = [
                TpuPod(name=p.name, region=p.region, type=TpuType(p.type), shape=tuple(p.shape), cluster=p.cluster)
                for p in await session.execute(pod_q)
            ]
            racks = [
                Rack(name=r.name, region=r.region, cluster=r.cluster, power_kw=r.power_kw)
                for r in await session.execute(rack_q)
            ]
        return FleetPage(
            nodes=nodes,
            accelerators=accelerators,
            domains=domains,
            tpu_pods=pods,
            racks=racks,
            total_nodes=total,
            more=more,
        )


def _node_values(node: NodeProfile, now: datetime) -> dict[str, Any]:
    return {
        "name": node.name,
        "region": node.region,
        "cluster": node.cluster,
        "rack": node.rack,
        "sku": node.sku,
        "source": node.source,
        "kind": node.topology.kind.value,
        "gpus": len(node.accelerators),
        "hbm_bytes": node.hbm_bytes,
        "fingerprint": node.fingerprint(),
        "profile": profile_to_payload(node).model_dump(mode="json"),
        "state": Liveness.UP.value,
        "updated_at": now,
    }
