"""Persistence of the topology schema: profiles in, fleet views out. State + events share a transaction."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete, func, select, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession

from services.topology_discovery.tables import AcceleratorRow, DomainRow, NodeRow, RackRow, SourceRow, TpuPodRow
from shared.contracts.envelope import new_event
from shared.contracts.fleet import (
    AcceleratorView,
    DomainView,
    FleetGetReply,
    NodeView,
    RackView,
    TpuPodView,
)
from shared.contracts.subjects import Context, Subjects
from shared.domain.fleet import Domain, Fleet, NodeProfile, fleet_domains, profile_from_dict, profile_to_dict
from shared.domain.hardware import Sku
from shared.infra.outbox import enqueue

SCHEMA = "topology"
SOURCE = "topology-discovery"


async def stored_fingerprints(session: AsyncSession, *, source: str | None = None) -> dict[str, str]:
    query = select(NodeRow.name, NodeRow.fingerprint)  # type: ignore[call-overload]
    if source is not None:
        query = query.where(NodeRow.source == source)
    return {name: fp for name, fp in (await session.execute(query)).all()}


async def stored_profiles(session: AsyncSession) -> list[NodeProfile]:
    rows = (await session.execute(select(NodeRow.profile))).scalars().all()  # type: ignore[call-overload]
    return [profile_from_dict(row) for row in rows]


async def emit(
    session: AsyncSession,
    *,
    subjects: Subjects,
    context: Context,
    event: str,
    payload: dict[str, Any],
    correlation_id: str | None = None,
) -> None:
    envelope = new_event(
        type=f"{context.value}.{event}",
        source=SOURCE,
        payload=payload,
        occurred_at=datetime.now(UTC),
        correlation_id=correlation_id,
    )
    await enqueue(session=session, schema=SCHEMA, subject=subjects.event(context, event), event=envelope)


def _node_values(node: NodeProfile) -> dict[str, Any]:
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
        "profile": profile_to_dict(node),
        "state": "up",
        "updated_at": datetime.now(UTC),
    }


async def upsert_nodes(session: AsyncSession, nodes: Sequence[NodeProfile]) -> None:
    """Write profiles and their accelerators (replacing what a node had before)."""
    if not nodes:
        return
    table = NodeRow.__table__  # type: ignore[attr-defined]
    for chunk_start in range(0, len(nodes), 500):
        chunk = nodes[chunk_start : chunk_start + 500]
        stmt = insert(table).values([_node_values(n) for n in chunk])
        stmt = stmt.on_conflict_do_update(
            index_elements=[table.c.name],
            set_={
                c: stmt.excluded[c]
                for c in (
                    "region",
                    "cluster",
                    "rack",
                    "sku",
                    "source",
                    "kind",
                    "gpus",
                    "hbm_bytes",
                    "fingerprint",
                    "profile",
                    "updated_at",
                )
            },
        )
        await session.execute(stmt)
    names = [n.name for n in nodes]
    await session.execute(delete(AcceleratorRow).where(AcceleratorRow.node.in_(names)))  # type: ignore[attr-defined]
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
    acc_table = AcceleratorRow.__table__  # type: ignore[attr-defined]
    for start in range(0, len(rows), 2000):
        await session.execute(insert(acc_table).values(rows[start : start + 2000]))


async def delete_nodes(session: AsyncSession, names: Iterable[str]) -> None:
    names = list(names)
    if names:
        await session.execute(delete(NodeRow).where(NodeRow.name.in_(names)))  # type: ignore[attr-defined]


async def rebuild_domains(session: AsyncSession) -> tuple[Domain, ...]:
    """Recompute every NVLink domain from the stored profiles (multi-node ones span nodes)."""
    domains = fleet_domains(await stored_profiles(session))
    await session.execute(delete(DomainRow))
    table = DomainRow.__table__  # type: ignore[attr-defined]
    rows = [
        {"id": d.id, "kind": d.kind, "members": list(d.members), "cliques": [list(c) for c in d.cliques]}
        for d in domains
    ]
    for start in range(0, len(rows), 2000):
        await session.execute(insert(table).values(rows[start : start + 2000]))
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
    return domains


async def replace_static(session: AsyncSession, fleet: Fleet) -> None:
    """Racks and TPU pods as the inventory describes them."""
    await session.execute(delete(RackRow))
    await session.execute(delete(TpuPodRow))
    if fleet.racks:
        await session.execute(
            insert(RackRow.__table__).values(  # type: ignore[attr-defined]
                [
                    {"region": r.region, "cluster": r.cluster, "name": r.name, "power_kw": r.power_kw}
                    for r in fleet.racks
                ]
            )
        )
    if fleet.tpu_pods:
        await session.execute(
            insert(TpuPodRow.__table__).values(  # type: ignore[attr-defined]
                [
                    {
                        "name": p.name,
                        "region": p.region,
                        "cluster": p.cluster,
                        "type": p.type.value,
                        "shape": list(p.shape),
                    }
                    for p in fleet.tpu_pods
                ]
            )
        )


async def source_fingerprint(session: AsyncSession, name: str) -> str | None:
    row = await session.get(SourceRow, name)
    return row.fingerprint if row else None


async def record_source(session: AsyncSession, name: str, fingerprint: str) -> None:
    table = SourceRow.__table__  # type: ignore[attr-defined]
    stmt = insert(table).values(name=name, fingerprint=fingerprint, loaded_at=datetime.now(UTC))
    await session.execute(
        stmt.on_conflict_do_update(
            index_elements=[table.c.name],
            set_={"fingerprint": stmt.excluded.fingerprint, "loaded_at": stmt.excluded.loaded_at},
        )
    )


async def set_state(session: AsyncSession, node: str, state: str) -> NodeRow | None:
    await session.execute(update(NodeRow).where(NodeRow.name == node).values(state=state))  # type: ignore[arg-type]
    return await session.get(NodeRow, node)


async def accelerator_ids(session: AsyncSession, node: str) -> list[str]:
    query = select(AcceleratorRow.id).where(AcceleratorRow.node == node).order_by(AcceleratorRow.index)  # type: ignore[call-overload]
    return list((await session.execute(query)).scalars().all())


async def fleet_view(
    session: AsyncSession,
    *,
    region: str | None,
    skus: dict[str, Sku],
    after: str | None = None,
    limit: int | None = None,
) -> FleetGetReply:
    """The fleet from the tables alone (no rescan): nodes, accelerators, domains, racks, TPU pods.

    Nodes come in name order; with ``limit`` a page holds at most that many nodes after ``after``
    and ``next_cursor`` names the last one when more follow. Domains come with the page whose
    accelerators they hold; TPU pods and racks with the first page.
    """
    node_q = select(
        NodeRow.name,
        NodeRow.region,
        NodeRow.cluster,
        NodeRow.rack,
        NodeRow.sku,
        NodeRow.kind,  # type: ignore[call-overload]
        NodeRow.state,
        NodeRow.source,
    ).order_by(NodeRow.name)
    count_q = select(func.count()).select_from(NodeRow)
    if region:
        node_q = node_q.where(NodeRow.region == region)
        count_q = count_q.where(NodeRow.region == region)  # type: ignore[arg-type]
    if after:
        node_q = node_q.where(NodeRow.name > after)
    if limit:
        node_q = node_q.limit(limit + 1)
    nodes = list((await session.execute(node_q)).all())
    more = bool(limit) and len(nodes) > (limit or 0)
    nodes = nodes[:limit] if limit else nodes
    total = int((await session.execute(count_q)).scalar_one())
    acc_q = (
        select(
            AcceleratorRow.id,
            AcceleratorRow.node,
            AcceleratorRow.index,
            AcceleratorRow.hbm_bytes,  # type: ignore[call-overload]
            AcceleratorRow.domain,
        )
        .where(AcceleratorRow.node.in_([n.name for n in nodes]))  # type: ignore[attr-defined]
        .order_by(AcceleratorRow.node, AcceleratorRow.index)
    )
    # Reserved bytes are the ledger's: read (never written) from its schema, one query per page.
    reserved = {
        r.id: r.reserved
        for r in await session.execute(
            text("SELECT id, reserved FROM ledger.accelerators WHERE node = ANY(:nodes)"),
            {"nodes": [n.name for n in nodes]},
        )
    }
    by_node: dict[str, list[AcceleratorView]] = {}
    for acc_id, node, index, hbm, domain in (await session.execute(acc_q)).all():
        by_node.setdefault(node, []).append(
            AcceleratorView(id=acc_id, index=index, hbm_total=hbm, hbm_reserved=reserved.get(acc_id, 0), domain=domain)
        )
    node_views = [
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
        )
        for n in nodes
    ]
    page_domains = {a.domain for v in node_views for a in v.accelerators if a.domain}
    domains = [
        DomainView(id=d.id, kind=d.kind, members=d.members, cliques=d.cliques)
        for d in (
            await session.execute(select(DomainRow).where(DomainRow.id.in_(page_domains)).order_by(DomainRow.id))  # type: ignore[attr-defined]
        )
        .scalars()
        .all()
    ]
    if after:  # pods and racks travel with the first page only
        return FleetGetReply(
            nodes=node_views,
            domains=domains,
            total_nodes=total,
            next_cursor=node_views[-1].name if more and node_views else None,
        )
    pod_q = select(TpuPodRow).order_by(TpuPodRow.name)
    pods = []
    for pod in (await session.execute(pod_q)).scalars().all():
        if region and pod.region != region:
            continue
        chips = 1
        for axis in pod.shape:
            chips *= axis
        sku = skus.get(f"TPU-{pod.type.upper()}")
        pods.append(
            TpuPodView(
                name=pod.name,
                region=pod.region,
                type=pod.type,
                shape=pod.shape,
                chips=chips,
                hbm_per_chip=sku.hbm_bytes if sku else None,
            )
        )
    racks = [
        RackView(region=r.region, cluster=r.cluster, name=r.name, power_kw=r.power_kw)
        for r in (await session.execute(select(RackRow))).scalars().all()
        if not region or r.region == region
    ]
    return FleetGetReply(
        nodes=node_views,
        domains=domains,
        tpu_pods=pods,
        racks=racks,
        total_nodes=total,
        next_cursor=node_views[-1].name if more and node_views else None,
    )
